import time, torch, statistics, sys
sys.path.insert(0, "/work/main/tests")
from conftest import load_default_gguf
from specdecode.models.backends import make_batched_runner
model = load_default_gguf("target", threads=2)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 5000, (400,), generator=g)
step = torch.randint(0, 5000, (14,), generator=g)
solo = model.make_runner(4096)
batched = make_batched_runner(model, 8, 32768)
batched.add_row()
solo.forward(prompt, 1); batched.forward(0, [prompt], [1])
def t_solo():
    tic = time.perf_counter(); solo.forward(step, 14); dt = time.perf_counter() - tic; solo.truncate(400); return dt
def t_batch():
    tic = time.perf_counter(); batched.forward(0, [step], [14]); dt = time.perf_counter() - tic; batched.truncate(0, 400); return dt
def t_solo1():
    tic = time.perf_counter(); solo.forward(step[:1], 1); dt = time.perf_counter() - tic; solo.truncate(400); return dt
def t_batch1():
    tic = time.perf_counter(); batched.forward(0, [step[:1]], [1]); dt = time.perf_counter() - tic; batched.truncate(0, 400); return dt
res = {k: [] for k in ("solo", "batch", "solo1", "batch1")}
for i in range(12):
    for k, f in (("solo", t_solo), ("batch", t_batch), ("solo1", t_solo1), ("batch1", t_batch1)):
        res[k].append(f())
for k, v in res.items():
    print(k, "median ms", round(1000 * statistics.median(v[2:]), 1), "min", round(1000 * min(v), 1))
print("solo passes/ctx", solo.model.options.invariant_tokens, getattr(batched, "passes", None))
