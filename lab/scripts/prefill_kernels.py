"""Prefills on llama.cpp's fast kernels against the patched reference kernels, and whether a reused
prefix gives the logits of a fresh prefill bit for bit on each.

Exact mode runs every pass on the reference kernels where the build carries the batch-invariance
patch (``ReferenceKernels.every_pass``), so that a cell is what one-token decoding writes whichever
pass wrote it: the condition of exact prefix caching. This times the default target's prefill of
512 and 2,048 tokens both ways (best of ``--reps``, 2 threads) and checks, both ways, a prompt of
1,500 tokens prefilled whole against the same prompt after a kept prefix (a 1,000-token prefill, 20
one-token passes, an 80-token pass), and against its first 1,499 tokens then one token.

    python lab/scripts/prefill_kernels.py fast
    python lab/scripts/prefill_kernels.py reference
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernels", choices=["fast", "reference"])
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    from specdecode.models.backends import load_llamacpp_tokenizer
    from specdecode.models.default import DEFAULT_MODELS, ensure_packaged_gguf
    from specdecode.models.llamacpp import LlamaCppModel, LlamaCppOptions
    from specdecode.models.llamacpp import kernels as K

    every_pass = args.kernels == "reference"
    original = K.reference_kernels

    def switch(lib: Any, ctx: Any, invariant_tokens: int) -> Any:
        kernels = original(lib, ctx, invariant_tokens)
        if kernels is not None:
            kernels.every_pass = every_pass
        return kernels

    K.reference_kernels = switch
    model = LlamaCppModel(ensure_packaged_gguf(DEFAULT_MODELS["target"]), LlamaCppOptions(threads=2))
    tokenizer = load_llamacpp_tokenizer(model)
    root = Path(__file__).resolve().parents[2]
    ids = tokenizer.encode((root / "src/specdecode/engine.py").read_text())[:2100]
    runner = model.make_runner(n_ctx=4096)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"{args.kernels}: {name}, llama.cpp kernels every_pass={every_pass}")
    for n in (512, 2048):
        best = float("inf")
        for _ in range(args.reps):
            runner.reset()
            tic = time.perf_counter()
            runner.forward(torch.tensor(ids[:n]))
            best = min(best, time.perf_counter() - tic)
        print(f"{args.kernels}: prefill of {n} tokens {best:.2f} s ({n / best:.0f} tokens/s)", flush=True)
    runner.reset()
    fresh = runner.forward(torch.tensor(ids[:1500]))
    runner.reset()
    runner.forward(torch.tensor(ids[:1000]))
    for i in range(1000, 1020):
        runner.forward(torch.tensor(ids[i : i + 1]))
    runner.forward(torch.tensor(ids[1020:1100]))
    cached = runner.forward(torch.tensor(ids[1100:1500]))
    print(
        f"{args.kernels}: after a kept prefix, equal to a fresh prefill: {torch.equal(cached, fresh)} "
        f"(largest difference {(cached - fresh).abs().max().item():.3g})"
    )
    runner.reset()
    runner.forward(torch.tensor(ids[:1499]))
    last = runner.forward(torch.tensor(ids[1499:1500]))
    print(
        f"{args.kernels}: 1,499 tokens then one, equal to a fresh prefill: {torch.equal(last, fresh)} "
        f"(largest difference {(last - fresh).abs().max().item():.3g})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
