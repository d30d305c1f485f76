#!/usr/bin/env python
"""Mean acceptance length of the shipped EAGLE / Medusa drafters on llama.cpp features vs torch
features (issue 31): greedy, the first 3 HumanEval prompts and the first 3 MT-bench coding prompts'
first turns, 64 new tokens, k = 2 (the default) and the default tree."""

import json
import sys
import time

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import default_questions_path, load_humaneval, load_spec_bench

backend = sys.argv[1]
prompts = [p.turns[0] for p in load_humaneval()[:3]]
prompts += [p.turns[0] for p in load_spec_bench(default_questions_path()) if p.category == "coding"][:3]
sampling = SamplingParams(max_new_tokens=64)
for kind in ("eagle", "medusa"):
    gen = SpeculativeGenerator.from_pretrained(
        proposer=kind, backend=backend, threads=2 if backend == "llamacpp" else None
    )
    for k, tree in ((2, None), (None, "default")):
        drafts = accepted = 0
        per_pos = [0, 0, 0, 0]
        t = time.perf_counter()
        for prompt in prompts:
            r = gen.generate(prompt, sampling, num_speculative_tokens=k, tree=tree)
            drafts += r.stats.drafts
            accepted += r.stats.accepted_tokens
            for i, a in enumerate(r.stats.accepted_per_position[:4]):
                per_pos[i] += a
        print(
            json.dumps(
                {
                    "backend": backend,
                    "dtype": gen.dtype,
                    "proposer": kind,
                    "k": k,
                    "tree": tree,
                    "prompts": len(prompts),
                    "steps": drafts,
                    "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 3),
                    "accepted_at_position": [round(a / max(drafts, 1), 3) for a in per_pos],
                    "wall_s": round(time.perf_counter() - t, 1),
                }
            ),
            flush=True,
        )
