"""Target (or draft) pass time over M tokens for each CPU compute path (specdecode.models.torch.cpu).

Loads the model once per path (bfloat16; float32 on torch's default kernels; float32 with oneDNN
linears on the plain weights, ``float32+onednn``, or on prepacked ones for multi-token passes,
``float32+packed``, the default of specdecode.models.torch.cpu.use_onednn_linears; the dynamic int8 copy
a draft gets from ``draft_quantization="int8"``, specdecode.models.torch.quant, of the model as
``--dtype auto`` loads it, ``int8``, or with its layers left out of int8 forced to float32,
``int8+float32``), prefills a random
300-token context, then times passes over M = 1, 5, 9, 17 new tokens (rolled back after each),
the sizes interleaved round by round. ``float32+onednn`` and ``float32+packed`` share one loaded
model and are interleaved pass by pass (a side-by-side comparison on a machine that drifts), and so
are ``int8`` and ``int8+float32`` (two copies of one loaded model).
Prints the median per size and the ratio to the path's own one-token pass. A ratio near 1 at
M = 5 is what speculative decoding needs; near M it means the path multiplies row by row.

    python lab/scripts/bench_cpu_paths.py [--target DIR] [--rounds 5] [--sizes 1,5,9,17]
    python lab/scripts/bench_cpu_paths.py --role draft --paths float32+onednn,int8,int8+float32
    python lab/scripts/bench_cpu_paths.py --paths float32+onednn,float32+packed --sizes 1,2,5,9,17
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.torch.cpu import native_bf16_matmul
from specdecode.models.torch.hf_loading import load_model
from specdecode.models.torch.quant import quantize_int8
from specdecode.models.torch.runner import ModelRunner

PATHS = {
    "bfloat16": ("bfloat16", False),
    "float32": ("float32", False),
    "float32+onednn": ("float32", True),
    "float32+packed": ("float32", True),
    "int8": ("auto", True),  # then quantize_int8: down_proj in bfloat16 where native, else float32 + oneDNN
    "int8+float32": ("auto", True),  # the same, down_proj forced to float32 + oneDNN
}
SHARED = ("float32+onednn", "float32+packed")  # one model, packing switched per pass
INT8 = ("int8", "int8+float32")  # one source, a quantized copy each, interleaved


def _set_packing(model: torch.nn.Module, on: bool, saved: dict[int, object]) -> None:
    """Switch the prepacked multi-row weights of a routed model off (moving them aside) or on."""
    for module in model.modules():
        if on and id(module) in saved:
            module._specdecode_packed = saved.pop(id(module))  # type: ignore[assignment]
        elif not on and "_specdecode_packed" in vars(module):
            saved[id(module)] = vars(module).pop("_specdecode_packed")


def time_paths(
    spec: str | None, role: str, paths: list[str], sizes: list[int], rounds: int
) -> dict[str, dict[str, float]]:
    """Times ``paths`` that load alike, interleaved pass by pass (see the docstring): the oneDNN
    paths on one model (packing switched per pass), the int8 paths on a copy each."""
    dtype, onednn = PATHS[paths[0]]
    source = load_model(spec, role, dtype, onednn=onednn)
    models = {
        path: quantize_int8(source, float_dtype=torch.float32 if path == "int8+float32" else None)
        if path.startswith("int8")
        else source
        for path in paths
    }
    del source
    saved: dict[int, object] = {}
    runners = {}
    g = torch.Generator().manual_seed(0)
    context = torch.randint(100, 20_000, (300,), generator=g)  # (300,)
    prefill = {}
    for path in paths:
        runner = runners.setdefault(id(models[path]), ModelRunner(models[path]))
        if runner.length == 0:
            tic = time.perf_counter()
            runner.forward(context)
            prefill[id(models[path])] = time.perf_counter() - tic
    base = len(context)
    times: dict[tuple[str, int], list[float]] = {(p, m): [] for p in paths for m in sizes}
    for r in range(rounds + 1):  # round 0 warms up (and prepacks)
        for m in sizes:
            for path in paths:
                model, runner = models[path], runners[id(models[path])]
                _set_packing(model, path != "float32+onednn", saved)
                ids = torch.randint(100, 20_000, (m,), generator=g)  # (M,)
                tic = time.perf_counter()
                runner.forward(ids, num_logits=m)
                if r:
                    times[path, m].append(time.perf_counter() - tic)
                runner.truncate(base)
    results = {
        p: {"prefill 300": prefill[id(models[p])]} | {f"M={m}": statistics.median(times[p, m]) for m in sizes}
        for p in paths
    }
    del runners, models
    return results


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
    shared = [p for p in paths if p in SHARED]
    int8 = [p for p in paths if p in INT8]
    groups = [[p] for p in paths if p not in SHARED + INT8] + [g for g in (shared, int8) if g]
    results = {}
    for group in groups:
        results |= time_paths(args.model, args.role, group, sizes, args.rounds)
    for name in paths:
        result = results[name]
        one = result[f"M={sizes[0]}"]
        cells = [f"prefill 300: {result['prefill 300']:.1f} s"]
        cells += [f"M={m}: {1000 * result[f'M={m}']:.0f} ms ({result[f'M={m}'] / one:.2f}x)" for m in sizes]
        print(f"{name:16s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
