"""Verification passes of our llama.cpp runner by width, exact mode (the reference kernels, one pass
per width on a patched build): median milliseconds of ``--reps`` passes of each width after
``--cached`` tokens, the widths interleaved. For comparing two builds of the patch (run once per
build, alternately).

    PYTHONPATH=src HF_HUB_OFFLINE=1 .venv/bin/python lab/scripts/verify_pass_widths.py --widths 1,5,9,17
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.backends import load_llamacpp
from specdecode.models.llamacpp.kernels import invariant_rows
from specdecode.models.llamacpp.model import LlamaCppOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,5,9,17")
    parser.add_argument("--cached", type=int, default=200)
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    ids = [1000 + (i * 37) % 5000 for i in range(args.cached + max(widths))]
    runner = load_llamacpp(None, "target", LlamaCppOptions(threads=2)).make_runner(n_ctx=1024)
    runner.forward(torch.tensor(ids[: args.cached]))
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(args.reps + 1):
        for w in widths:
            tic = time.perf_counter()
            runner.forward(torch.tensor(ids[args.cached : args.cached + w]), num_logits=w)
            if rep:  # the first round warms up
                times[w].append(1000 * (time.perf_counter() - tic))
            runner.truncate(args.cached)
    one = statistics.median(times[widths[0]])
    print(f"patch version {invariant_rows()}; cached {args.cached}")
    for w in widths:
        ms = statistics.median(times[w])
        print(f"width {w:3d}: {ms:7.2f} ms ({ms / one:.2f} of width {widths[0]})")


if __name__ == "__main__":
    main()
