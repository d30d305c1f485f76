"""Target (or draft) pass time over M tokens for each CPU compute path (specdecode.models.cpu).

Loads the model once per path (bfloat16; float32 on torch's default kernels; float32 with oneDNN
linears; the dynamic int8 copy a draft gets from ``draft_quantization="int8"``,
specdecode.models.quant), prefills a random 300-token context, then times passes over
M = 1, 5, 9, 17 new tokens (rolled back after each), the sizes interleaved round by round.
Prints the median per size and the ratio to the path's own one-token pass. A ratio near 1 at
M = 5 is what speculative decoding needs; near M it means the path multiplies row by row.

    python scripts/bench_cpu_paths.py [--target DIR] [--rounds 5] [--sizes 1,5,9,17]
    python scripts/bench_cpu_paths.py --role draft --paths float32+onednn,int8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.cpu import native_bf16_matmul
from specdecode.models.loading import load_model
from specdecode.models.quant import quantize_int8
from specdecode.models.runner import ModelRunner

PATHS = {
    "bfloat16": ("bfloat16", False),
    "float32": ("float32", False),
    "float32+onednn": ("float32", True),
    "int8": ("float32", True),  # then quantize_int8 (down_proj stays float32 + oneDNN)
}


def time_path(spec: str | None, role: str, path: str, sizes: list[int], rounds: int) -> dict[str, float]:
    dtype, onednn = PATHS[path]
    model = load_model(spec, role, dtype, onednn=onednn)
    if path == "int8":
        model = quantize_int8(model)
    runner = ModelRunner(model)
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, 20_000, (300,), generator=g)  # (300,)
    tic = time.perf_counter()
    runner.forward(context)
    out = {"prefill 300": time.perf_counter() - tic}
    base = runner.length
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for r in range(rounds + 1):  # round 0 warms up
        for m in sizes:
            ids = torch.randint(100, 20_000, (m,), generator=g)  # (M,)
            tic = time.perf_counter()
            runner.forward(ids, num_logits=m)
            if r:
                times[m].append(time.perf_counter() - tic)
            runner.truncate(base)
    out |= {f"M={m}": statistics.median(v) for m, v in times.items()}
    del runner, model
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["target", "draft"], default="target", help="which default model")
    parser.add_argument("--model", "--target", default=None, help="model folder or .gguf (default: the role's default)")
    parser.add_argument("--paths", default="bfloat16,float32,float32+onednn", help=f"comma list of {list(PATHS)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="1,5,9,17")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul {native_bf16_matmul()}, "
        f"threads {torch.get_num_threads()}"
    )
    paths = args.paths.split(",")
    if set(paths) - set(PATHS):
        parser.error(f"--paths must name some of {list(PATHS)}, got {args.paths!r}")
    print(f"{args.role}: {args.model or 'default'}")
    for name in paths:
        result = time_path(args.model, args.role, name, sizes, args.rounds)
        one = result[f"M={sizes[0]}"]
        cells = [f"prefill 300: {result['prefill 300']:.1f} s"]
        cells += [f"M={m}: {1000 * result[f'M={m}']:.0f} ms ({result[f'M={m}'] / one:.2f}x)" for m in sizes]
        print(f"{name:16s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
