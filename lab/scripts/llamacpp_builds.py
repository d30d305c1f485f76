"""Which llama.cpp build is fastest here: plain and speculative decoding per build, side by side.

Each build is a folder where a llama-cpp-python wheel was installed with
``pip install --no-deps --target DIR WHEEL`` (``venv`` names the one installed in the virtualenv),
optionally followed by more folders put first on ``PYTHONPATH``, comma-separated (e.g. the ``src``
of a worktree of an older commit: code and build before against code and build after).
A build runs in a child process of its own (two native libraries cannot share one process), which
decodes the same prompts with llama-cpp-python's own plain generation (the peer), specdecode's
target alone (exact mode) and specdecode's default (prompt lookup after 3-token matches, exact).
Builds alternate round by round (the machine's drift over minutes hits all alike); the table gives
tokens/s per build and method (all rounds), the ratio to the first build, and whether every build
produced the same token ids as the first.

    .venv/bin/python lab/scripts/llamacpp_builds.py --build baseline=/work/builds/baseline \\
        --build native-no-amx=venv --build portable=/work/builds/portable --rounds 2 --prompts 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("llamacpp", "target", "prompt_lookup")


def child(args: argparse.Namespace) -> None:
    """Decode every prompt with every method; print one JSON line of times, token counts and outputs."""
    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.bench.methods import METHODS as BENCH_METHODS
    from specdecode.bench.methods import BenchModels, BenchSettings
    from specdecode.bench.prompts import load_prompts
    from specdecode.models.backends import DEFAULT_PROPOSER, load_llamacpp_tokenizer
    from specdecode.models.default import packaged_gguf
    from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions, _lib
    from specdecode.proposers import make_proposer

    info = _lib().llama_print_system_info().decode(errors="replace")
    target = LlamaCppModel(packaged_gguf(None, "target"), LlamaCppOptions(threads=args.threads))
    tokenizer = load_llamacpp_tokenizer(target)
    prompts = load_prompts(None, args.categories, args.prompts)
    ids = [SpeculativeGenerator(target, tokenizer=tokenizer).encode_prompt(p.turns[0]).tolist() for p in prompts]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    peer = BenchModels(target, None, tokenizer, target.path, args.threads)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens)
    plain = SpeculativeGenerator(target, tokenizer=tokenizer)
    name, options = DEFAULT_PROPOSER["llamacpp"]
    lookup = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=make_proposer(name, **options))
    runs = {
        "llamacpp": lambda p: BENCH_METHODS["llamacpp"].run(peer, p, settings, None).token_ids,
        "target": lambda p: plain.generate(p, sampling, speculative=False).token_ids,
        "prompt_lookup": lambda p: lookup.generate(p, sampling).token_ids,
    }
    for run in runs.values():  # warm-up
        run(ids[0][:16])
    out: dict[str, dict[str, list]] = {m: {"s": [], "tokens": [], "ids": []} for m in runs}
    for i, prompt_ids in enumerate(ids):
        for method in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            tic = time.perf_counter()
            new = runs[method](prompt_ids)
            out[method]["s"].append(time.perf_counter() - tic)
            out[method]["tokens"].append(len(new))
            out[method]["ids"].append(new)
    print("RESULT " + json.dumps({"system_info": info, "runs": out}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=DIR[,SRC...]", help="repeatable")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3, help="per category")
    parser.add_argument("--categories", default="humaneval,coding")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    builds = dict(b.split("=", 1) for b in args.build)
    total: dict[str, dict[str, list[float]]] = {b: {m: [0.0, 0] for m in METHODS} for b in builds}
    outputs: dict[str, dict[str, list]] = {b: {} for b in builds}
    info: dict[str, str] = {}
    forward = [sys.executable, __file__, "--child", "--prompts", str(args.prompts), "--categories",
               args.categories, "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    for r in range(args.rounds):
        for build in list(builds) if r % 2 == 0 else list(builds)[::-1]:
            env = dict(os.environ)
            paths = [str(Path(p).resolve()) for p in builds[build].split(",") if p != "venv"]
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
            proc = subprocess.run(forward, env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{build}: the child failed (status {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
                continue
            result = json.loads(line[len("RESULT ") :])
            info[build] = result["system_info"]
            for method, run in result["runs"].items():
                total[build][method][0] += sum(run["s"])
                total[build][method][1] += sum(run["tokens"])
                outputs[build].setdefault(method, run["ids"])
            print(f"round {r + 1}: {build} done", flush=True)
    first = next(iter(builds))
    print(f"\n# {args.prompts} prompts per category ({args.categories}), {args.max_new_tokens} new tokens, "
          f"threads {args.threads}, {args.rounds} rounds")
    for build in builds:
        print(f"# {build}: {info.get(build, '?')}")
    print("\n| build | " + " | ".join(f"{m} tok/s" for m in METHODS) + " | same token ids as " + first + " |")
    print("|---" * (len(METHODS) + 2) + "|")
    for build in builds:
        cells = []
        for method in METHODS:
            s, n = total[build][method]
            rate = n / s if s else 0.0
            s0, n0 = total[first][method]
            ratio = rate / (n0 / s0) if s0 and n0 else 0.0
            cells.append(f"{rate:.1f} ({ratio:.2f}x)")
        same = all(outputs[build].get(m) == outputs[first].get(m) for m in METHODS)
        print(f"| {build} | " + " | ".join(cells) + f" | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
