"""In-process A/B on the 6 code edits with a prediction: the server's scheduler (run_once in this
thread, no HTTP) against the engine, same model object, alternating; seconds per edit."""
import time, statistics, sys
import torch
from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import load_prompts
from specdecode.models.backends import load_llamacpp, load_llamacpp_tokenizer
from specdecode.models.llamacpp.model import LlamaCppOptions
from specdecode.proposers import make_proposer
from specdecode.serve.config import ServeSettings
from specdecode.serve.request import ServeRequest
from specdecode.serve.scheduler import Scheduler

model = load_llamacpp(None, "target", LlamaCppOptions(threads=2))
tok = load_llamacpp_tokenizer(model)
edits = load_prompts(None, "code_edit", per_category=None)[:6]
opts = {"min_ngram": 3, "max_ngram": 8}
gen = SpeculativeGenerator(model, tokenizer=tok, proposer=make_proposer("prompt_lookup", target=model, **opts))
settings = ServeSettings(proposer="prompt_lookup", proposer_options=opts, speculation="adaptive", max_batch_size=8,
                         kv_budget_tokens=32768)
sched = Scheduler(model, tok, settings)
sched.start(thread=True)

def ids_of(p):
    text = tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text)

def engine(p):
    tic = time.perf_counter()
    r = gen.generate(ids_of(p), SamplingParams(max_new_tokens=384), num_speculative_tokens=16, prediction=p.prediction)
    return time.perf_counter() - tic, r.token_ids

def server(p):
    events = []
    req = ServeRequest(request_id=str(time.time()), prompt_ids=ids_of(p), sampling=SamplingParams(max_new_tokens=384),
                       speculative=True, proposer="prompt_lookup", num_speculative_tokens=16, on_event=None,
                       prediction=tok.encode(p.prediction, add_special_tokens=False))
    tic = time.perf_counter()
    import threading
    done = threading.Event()
    def on(e):
        events.append(e)
        if e.finish_reason is not None:
            done.set()
    req.on_event = on
    sched.submit(req)
    done.wait()
    return time.perf_counter() - tic, [t for e in events for t in e.token_ids]

tot = {"engine": 0.0, "server": 0.0}
for rep in range(1):
    for p in edits:
        order = (("server", server),)
        out = {}
        for name, f in order:
            dt, ids = f(p)
            tot[name] += dt
            out[name] = ids
        print(p.question_id, rep, {k: round(v, 2) for k, v in tot.items()}, len(out["server"]), flush=True)
print(tot)
