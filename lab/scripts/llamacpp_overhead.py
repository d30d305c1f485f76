"""Per-token time outside ``llama_decode``: specdecode's target-alone loop against llama-cpp-python's
own ``Llama.generate`` on the same GGUF, on this machine.

Every ``llama_decode`` call (specdecode's and llama-cpp-python's alike) is timed through a wrapper;
what a generation spends beyond them, divided by its new tokens, is the per-token overhead of the
Python and C around the passes (logits copy, argmax or sampler, bookkeeping). The gap between two
consecutive one-token passes is reported too (its median is the steadiest number). Both decode
greedily without stopping at EOS (llama-cpp-python's ``generate`` never stops; specdecode's
generator is given no EOS ids), the prompts are ``lab/gpu/gpu_check.py``'s kind (random ids).

    .venv/bin/python lab/scripts/llamacpp_overhead.py [--gguf PATH] [--threads 1] [--which both|spec|lcp]

Default GGUF: the cached Qwen2.5-Coder-0.5B Q4_K_M (the target's 151,936-token vocabulary, so the
logits copy and argmax cost what they cost for the 1.5B target).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as low
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions

DEFAULT_GGUF = Path.home() / ".cache/specdecode/gguf/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
EVENTS: list[tuple[float, float, int]] = []  # (start, end, tokens) of each llama_decode
_decode = low.llama_decode


def timed_decode(ctx: Any, batch: Any) -> int:
    t0 = time.perf_counter()
    status = _decode(ctx, batch)
    EVENTS.append((t0, time.perf_counter(), int(batch.n_tokens)))
    return status


low.llama_decode = timed_decode  # llama-cpp-python's Llama calls it here,
llama_cpp.llama_decode = timed_decode  # specdecode's runner here


def make_prompts(vocab: int, length: int, count: int) -> list[list[int]]:
    """``lab/gpu/gpu_check.py``'s prompts: one random, the others a random block repeated."""
    g = torch.Generator().manual_seed(1234)
    high = min(vocab, 150000)
    prompts = [torch.randint(0, high, (length,), generator=g).tolist()]
    for i in range(1, count):
        block = torch.randint(0, high, (max(4, length // (2 + 2 * i)),), generator=g).tolist()
        prompts.append((block * (length // len(block) + 1))[:length])
    return prompts


def summarise(name: str, runs: list[tuple[float, float, int, list[tuple[float, float, int]]]]) -> None:
    tokens = sum(run[2] for run in runs)
    outside = sum((t1 - t0) - sum(b - a for a, b, _ in events) for t0, t1, _, events in runs)
    gaps = [
        b0 - a1
        for *_, events in runs
        for (_, a1, w0), (b0, _, w1) in zip(events, events[1:], strict=False)
        if w0 == 1 and w1 == 1
    ]
    one = [b - a for *_, events in runs for a, b, w in events if w == 1]
    print(
        f"{name}: {tokens} tokens; outside llama_decode {outside / tokens * 1e6:.0f} us/token (gap between "
        f"one-token passes: median {statistics.median(gaps) * 1e6:.0f} us, mean {statistics.mean(gaps) * 1e6:.0f} us); "
        f"one-token llama_decode median {statistics.median(one) * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=str(DEFAULT_GGUF))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2, help="each of the 2 prompts this many times")
    parser.add_argument("--which", choices=("both", "spec", "lcp"), default="both")
    parser.add_argument("--profile", default="", help="cProfile specdecode's runs into this file (and print)")
    args = parser.parse_args()
    prompts = make_prompts(151936, args.prompt_len, 2) * args.reps
    if args.which in ("both", "spec"):
        model = LlamaCppModel(args.gguf, LlamaCppOptions(n_ctx=2048, exact=False, threads=args.threads))
        gen = SpeculativeGenerator(model)
        gen.eos_token_ids = frozenset()  # as llama-cpp-python's generate: never stop at EOS
        gen.generate(prompts[0], SamplingParams(temperature=0, max_new_tokens=4), speculative=False)
        runs = []
        profile = cProfile.Profile() if args.profile else None
        for prompt in prompts:
            EVENTS.clear()
            if profile:
                profile.enable()
            t0 = time.perf_counter()
            out = gen.generate(prompt, SamplingParams(temperature=0, max_new_tokens=args.new_tokens), speculative=False)
            t1 = time.perf_counter()
            if profile:
                profile.disable()
            runs.append((t0, t1, len(out.token_ids), list(EVENTS)))
        summarise("specdecode", runs)
        if profile:
            profile.dump_stats(args.profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        del gen, model
    if args.which in ("both", "lcp"):
        llm = llama_cpp.Llama(
            model_path=args.gguf, n_ctx=2048, n_batch=512, verbose=False, n_gpu_layers=0,
            n_threads=args.threads, n_threads_batch=args.threads,
        )  # fmt: skip
        runs = []
        for i, prompt in enumerate([prompts[0], *prompts]):  # the first: a warm-up of 4 tokens
            EVENTS.clear()
            count = 0
            t0 = time.perf_counter()
            for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                count += 1
                if count >= (4 if i == 0 else args.new_tokens):
                    break
            t1 = time.perf_counter()
            if i:
                runs.append((t0, t1, count, list(EVENTS)))
        summarise("llama-cpp-python", runs)
        llm.close()


if __name__ == "__main__":
    main()
