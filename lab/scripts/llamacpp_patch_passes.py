"""Exact mode's verification passes on a llama.cpp build with specdecode's batch-invariance patch:
is every row of a pass of n tokens what n one-token passes give, bit for bit, and what does the
pass cost, against llama.cpp's own kernels (``--no-exact``, not invariant from 4 rows).

For each of two cached lengths, the default target decodes n new tokens once as one n-token pass
(every row's logits) and once token by token after the same prefix, and compares the rows; then
times each width (best of 3) and a one-token pass (best of 5). Exact mode with ``invariant_tokens``
64 (one pass, on ggml's reference kernels) and fast mode, in one process each.

    .venv/bin/python lab/scripts/llamacpp_patch_passes.py [--threads 2] [--sizes 2,3,4,5,8,9,16,17,33]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from specdecode.models.backends import gguf_path
from specdecode.models.llamacpp.kernels import invariant_rows
from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions


def pass_ms(runner: object, cached: int, ids: torch.Tensor, repeats: int) -> float:
    """Best of ``repeats``: ms of one pass of ``ids`` (every row's logits) after ``cached`` tokens."""
    times = []
    for _ in range(repeats):
        runner.truncate(cached)  # type: ignore[attr-defined]
        start = time.perf_counter()
        runner.forward(ids, len(ids))  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="2,3,4,5,8,9,16,17,33")
    parser.add_argument("--cached", default="40,600")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"# {platform.processor() or platform.machine()}, threads {args.threads}, patch version {invariant_rows()}")
    for exact in (True, False):
        options = LlamaCppOptions(threads=args.threads, exact=exact, invariant_tokens=64 if exact else None)
        runner = LlamaCppModel(gguf_path(None, "target"), options).make_runner(n_ctx=2048)
        label = "exact (one pass, reference kernels)" if exact else "--no-exact (llama.cpp's kernels)"
        for cached in (int(c) for c in args.cached.split(",")):
            prompt = torch.tensor([(31 * i + 7) % 5000 + 100 for i in range(cached)])
            new = torch.tensor([(17 * i + 3) % 5000 + 200 for i in range(max(sizes))])
            runner.reset()
            runner.forward(prompt, 1)
            singles = [runner.forward(new[i : i + 1], 1)[0] for i in range(max(sizes))]
            print(f"{label}, {cached} cached: 1 token {pass_ms(runner, cached, new[:1], 5):.1f} ms")
            for n in sizes:
                runner.truncate(cached)
                rows = runner.forward(new[:n], n)
                same = all(torch.equal(rows[i], singles[i]) for i in range(n))
                diff = max(float((rows[i] - singles[i]).abs().max()) for i in range(n))
                print(f"{label}, {cached} cached: {n:2d} tokens {pass_ms(runner, cached, new[:n], 3):6.1f} ms, "
                      f"bit-identical {same}, largest difference {diff:.3g}")


if __name__ == "__main__":
    main()
