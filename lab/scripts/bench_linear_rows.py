"""Is a linear layer on one row (a GEMV) slower than on two rows on this machine?

Decoding one token at a time runs every linear layer of the model on a single row. On some CPUs
the bf16 kernel PyTorch picks for one row is slower than its two-row GEMM; then computing the row
twice and keeping one is faster. This script measures, for the default target and draft:

1. every distinct linear shape of the model on 1 and on 2 rows (median of ``--reps`` calls);
2. a whole one-token decode step (``ModelRunner.forward`` of one token after a short prompt), plain
   and with every one-row linear padded to two rows (``specdecode.models.torch.one_row_linear.pad_single_rows``),
   the two arms alternating ``--rounds`` times so that drift of the machine hits both alike;
3. whether the padded step's logits equal the plain step's (max abs difference, same argmax).

Usage:
    python lab/scripts/bench_linear_rows.py [--dtype bfloat16] [--reps 50] [--rounds 10] [--steps 16]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from specdecode.models.torch.hf_loading import load_model
from specdecode.models.torch.one_row_linear import pad_single_rows
from specdecode.models.torch.runner import ModelRunner


def time_linear(weight: torch.Tensor, rows: int, reps: int) -> float:
    """Median seconds of ``F.linear`` on ``rows`` rows of the weight's dtype."""
    x = torch.randn(1, rows, weight.shape[1], dtype=weight.dtype)
    samples = []
    with torch.inference_mode():
        for _ in range(3):
            F.linear(x, weight)
        for _ in range(reps):
            tic = time.perf_counter()
            F.linear(x, weight)
            samples.append(time.perf_counter() - tic)
    return statistics.median(samples)


def decode_steps(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> tuple[float, torch.Tensor]:
    """Median seconds of a one-token step over ``steps`` greedy steps after ``prompt``; the last logits."""
    runner = ModelRunner(model)
    logits = runner.forward(prompt)
    samples = []
    for _ in range(steps):
        token = logits[-1].argmax().view(1)
        tic = time.perf_counter()
        logits = runner.forward(token)
        samples.append(time.perf_counter() - tic)
    return statistics.median(samples), logits[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=50, help="calls per linear shape and row count")
    p.add_argument("--rounds", type=int, default=10, help="alternating rounds of plain / padded decode steps")
    p.add_argument("--steps", type=int, default=16, help="decode steps per round")
    p.add_argument("--roles", default="target,draft")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}")
    for role in args.roles.split(","):
        model = load_model(None, role, args.dtype)
        shapes: dict[tuple[int, int], str] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                shapes.setdefault(tuple(module.weight.shape), name.split(".")[-1])
        print(f"\n## {role}: {type(model).__name__}, linear layers on 1 and 2 rows (median ms)")
        print("| layer | out x in | 1 row | 2 rows | 2 rows / 1 row |")
        print("|---|---|---|---|---|")
        for (out_f, in_f), name in shapes.items():
            weight = torch.randn(out_f, in_f, dtype=model.dtype)
            one, two = (time_linear(weight, r, args.reps) for r in (1, 2))
            print(f"| {name} | {out_f} x {in_f} | {one * 1e3:.3f} | {two * 1e3:.3f} | {two / one:.2f} |")
        prompt = torch.randint(0, model.config.vocab_size, (32,))
        plain, padded = [], []
        last: dict[str, torch.Tensor] = {}
        for r in range(args.rounds):
            for arm in ("plain", "padded") if r % 2 == 0 else ("padded", "plain"):
                if arm == "padded":
                    with pad_single_rows(model):
                        seconds, last[arm] = decode_steps(model, prompt, args.steps)
                    padded.append(seconds)
                else:
                    seconds, last[arm] = decode_steps(model, prompt, args.steps)
                    plain.append(seconds)
        ratios = [b / a for a, b in zip(plain, padded, strict=True)]
        diff = (last["plain"] - last["padded"]).abs().max().item()
        same = bool(last["plain"].argmax() == last["padded"].argmax())
        print(
            f"\none-token decode step, median over {args.rounds} alternating rounds of {args.steps} steps: "
            f"plain {statistics.median(plain) * 1e3:.1f} ms, padded {statistics.median(padded) * 1e3:.1f} ms, "
            f"padded / plain {statistics.median(ratios):.3f} (per round {', '.join(f'{x:.2f}' for x in ratios)}); "
            f"last logits max |diff| {diff:.3g}, same argmax {same}"
        )
        del model


if __name__ == "__main__":
    main()
