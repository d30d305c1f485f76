#!/usr/bin/env python
"""llama.cpp, exact mode, 2 threads: chains against token trees on 4 HumanEval prompts, 96 new tokens (issue 31)."""

import json
import time

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import load_humaneval

prompts = [p.turns[0] for p in load_humaneval()[:4]]
sampling = SamplingParams(max_new_tokens=96)
runs = [
    ("prompt_lookup", {"min_ngram": 3}, [(None, None), (None, "tree8"), (None, "dynamic:8")]),
    ("eagle", {}, [(2, None), (None, "default")]),
]
for name, opts, configs in runs:
    gen = SpeculativeGenerator.from_pretrained(proposer=name, backend="llamacpp", threads=2, **opts)
    gen.generate(prompts[0], SamplingParams(max_new_tokens=8))  # warm
    base_t = base_n = 0
    for p in prompts:
        t = time.perf_counter()
        r = gen.generate(p, sampling, speculative=False)
        base_t += time.perf_counter() - t
        base_n += len(r.token_ids)
    print(json.dumps({"proposer": "none", "tok_s": round(base_n / base_t, 2)}), flush=True)
    for k, tree in configs:
        tt = n = drafts = acc = passes = 0
        for p in prompts:
            t = time.perf_counter()
            r = gen.generate(p, sampling, num_speculative_tokens=k, tree=tree)
            tt += time.perf_counter() - t
            n += len(r.token_ids)
            drafts += r.stats.drafts
            acc += r.stats.accepted_tokens
        print(
            json.dumps(
                {
                    "proposer": name,
                    "k": k,
                    "tree": tree,
                    "tok_s": round(n / tt, 2),
                    "speedup": round((n / tt) / (base_n / base_t), 3),
                    "mean_acceptance_length": round(1 + acc / max(drafts, 1), 3),
                }
            ),
            flush=True,
        )
