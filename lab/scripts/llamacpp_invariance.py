"""Which pass sizes are batch-invariant on llama.cpp, and what a pass costs, on this machine.

For each n, the target decodes the same n tokens once as one n-token pass and once as n
one-token passes after the same prefill, and compares the logits of every row: the largest
absolute difference, and whether all are bit-identical. Then it times passes of 1..17 tokens with
logits of every row (what verification needs). Both with weights repacked (llama.cpp's default,
fastest) and not (``LlamaCppOptions(repack=False)``), with ``exact=False`` so that raw passes,
never split, are measured.

    .venv/bin/python lab/scripts/llamacpp_invariance.py [--threads 2] [--sizes 1,2,3,...]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from specdecode.models.backends import gguf_path
from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--sizes", default="1,2,3,4,5,6,7,8,9,12,16,17")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per size")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    path = gguf_path(None, "target")
    print(f"# {path.name}, {platform.processor() or platform.machine()}, threads {args.threads or 'all'}")
    prompt = torch.tensor([(31 * i + 7) % 5000 + 100 for i in range(40)])
    new = torch.tensor([(17 * i + 3) % 5000 + 200 for i in range(max(sizes))])
    for repack in (False, True):
        # invariant_tokens large: no splitting, raw passes
        options = LlamaCppOptions(threads=args.threads, exact=False, repack=repack)
        model = LlamaCppModel(path, options)
        runner = model.make_runner(n_ctx=512)
        runner.forward(prompt)
        base = runner.length
        singles = []
        for i in range(max(sizes)):
            singles.append(runner.forward(new[i : i + 1]))
        singles_t = torch.cat(singles)  # (max, V)
        print(f"\nweights repacked: {repack}")
        print("n  identical  max|diff|  ms/pass (all rows scored)")
        for n in sizes:
            runner.truncate(base)
            rows = runner.forward(new[:n], num_logits=n)
            diff = float((rows - singles_t[:n]).abs().max())
            times = []
            for _ in range(args.repeats):
                runner.truncate(base)
                tic = time.perf_counter()
                runner.forward(new[:n], num_logits=n)
                times.append(time.perf_counter() - tic)
            times.sort()
            print(f"{n:<3}{str(diff == 0.0):<11}{diff:<11.3g}{1000 * times[len(times) // 2]:.1f}")
        del runner, model


if __name__ == "__main__":
    main()
