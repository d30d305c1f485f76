#!/usr/bin/env python
"""EAGLE on llama.cpp: where the time goes (issue 31). The first 4 HumanEval prompts, 96 new tokens,
exact mode, 2 llama.cpp threads; plain decoding and EAGLE (k 2) with the same generator. One JSON
line each: tokens/s and the summed prefill, draft and target times. ``argv[1]``: torch threads."""

import json
import os
import sys
import time

import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import load_humaneval

if len(sys.argv) > 1:
    torch.set_num_threads(int(sys.argv[1]))
prompts = [p.turns[0] for p in load_humaneval()[:4]]
sampling = SamplingParams(max_new_tokens=96)
gen = SpeculativeGenerator.from_pretrained(proposer="eagle", backend="llamacpp", threads=2)
gen.generate(prompts[0], SamplingParams(max_new_tokens=8))  # warm
for speculative in (False, True):
    wall = 0.0
    tokens = 0
    times = {"prefill_time_s": 0.0, "draft_time_s": 0.0, "target_time_s": 0.0}
    for prompt in prompts:
        tic = time.perf_counter()
        result = gen.generate(prompt, sampling, speculative=speculative)
        wall += time.perf_counter() - tic
        tokens += len(result.token_ids)
        for key in times:
            times[key] += getattr(result.stats, key)
    line = {
        "omp": os.environ.get("OMP_WAIT_POLICY"),
        "torch_threads": torch.get_num_threads(),
        "speculative": speculative,
        "tok_s": round(tokens / wall, 2),
        "wall_s": round(wall, 2),
        **{key: round(value, 2) for key, value in times.items()},
    }
    print(json.dumps(line), flush=True)
