import time, torch, statistics
from specdecode.models.backends import load_llamacpp, gguf_path
from specdecode.models.llamacpp.model import LlamaCppOptions
import llama_cpp
path = str(gguf_path(None, "target"))
ids = list(range(1000, 1200))
ours = load_llamacpp(None, "target", LlamaCppOptions(threads=2))
r = ours.make_runner(n_ctx=1024)
def t_ours(n):
    r.truncate(0); t=time.perf_counter(); r.forward(torch.tensor(ids[:n])); return time.perf_counter()-t
ll = llama_cpp.Llama(path, n_threads=2, n_threads_batch=2, n_ctx=1024, n_batch=512, verbose=False)
def t_ll(n):
    ll.reset(); ll._ctx.kv_cache_clear() if hasattr(ll._ctx,'kv_cache_clear') else None
    t=time.perf_counter(); ll.eval(ids[:n]); return time.perf_counter()-t
for n in (40, 200):
    t_ours(n); t_ll(n)
    a=[t_ours(n) for _ in range(3)]; b=[t_ll(n) for _ in range(3)]
    print(n, "ours %.3f" % statistics.median(a), "llama-cpp-python %.3f" % statistics.median(b))
def dec_ours(n):
    r.truncate(0); r.forward(torch.tensor(ids[:100])); t=time.perf_counter()
    for i in range(n): r.forward(torch.tensor([ids[100+i]]))
    return (time.perf_counter()-t)/n
def dec_ll(n):
    ll.reset(); ll.eval(ids[:100]); t=time.perf_counter()
    for i in range(n): ll.eval([ids[100+i]])
    return (time.perf_counter()-t)/n
for _ in range(2):
    print("decode ms/token ours %.2f llama-cpp-python %.2f" % (1000*dec_ours(50), 1000*dec_ll(50)))
