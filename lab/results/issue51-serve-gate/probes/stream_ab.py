import subprocess, sys, time, httpx, openai, os
sys.path.insert(0, "/work/main/lab/scripts")
from specdecode.bench.prompts import load_prompts
port = 38111
log = open("/tmp/mb/serve.log", "w")
proc = subprocess.Popen([sys.executable, "-m", "specdecode.commands.main", "serve", "--port", str(port), "--backend", "llamacpp",
    "--threads", "2", "--served-model-name", "bench", "--max-batch-size", "8", "--kv-budget-tokens", "32768"], stdout=log, stderr=subprocess.STDOUT)
try:
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200: break
        except Exception: pass
        time.sleep(1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=3600)
    edits = load_prompts(None, "code_edit", per_category=None)[:6]
    def run(p, stream):
        kw = dict(model="bench", messages=[{"role": "user", "content": p.turns[0]}], max_tokens=384, temperature=0,
                  extra_body={"prediction": {"type": "content", "content": p.prediction}})
        tic = time.perf_counter()
        if stream:
            n = 0
            for c in client.chat.completions.create(stream=True, **kw): n += 1
        else:
            client.chat.completions.create(**kw)
        return time.perf_counter() - tic
    run(edits[0], False)
    tot = {True: 0.0, False: 0.0}
    for rep in range(2):
        for p in edits:
            for s in ((True, False) if rep % 2 == 0 else (False, True)):
                tot[s] += run(p, s)
        print(rep, {"stream": round(tot[True], 2), "whole": round(tot[False], 2)}, flush=True)
finally:
    proc.terminate(); proc.wait(30)
