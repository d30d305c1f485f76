"""Exact passes in bfloat16 on torch's CPU path: identity per width and what they cost (issue 49, item 2).

Three measurements on the default target (Qwen2.5-Coder-1.5B-Instruct, bf16, torch, CPU), each with
stock passes and exact passes (:mod:`specdecode.models.torch.exact`) side by side in one process:

- ``identity``: after a real prompt, the rows of one pass of W tokens (W = 1..33) against W
  one-token passes: how many rows are bit-identical (logits), per width;
- ``passes``: median wall-clock and process CPU seconds of a one-token pass and of passes of 2, 3,
  5, 9, 17 tokens after the prompt, and of the prompt's prefill (the two modes interleaved, so that
  load on a shared machine hits both alike; CPU time is the steadier figure there);
- ``generate``: greedy tokens per wall-clock and per CPU second of the target alone and of each
  proposer (``draft_model``, ``prompt_lookup``, ``eagle``: their default k) on the first turn of
  Spec-Bench dev prompts (chat template), the two modes back to back per prompt, and whether each
  output equals the target alone's in the same mode.

Usage::

    PYTHONPATH=src python lab/exact_bf16.py identity passes generate --prompts 6 --tokens 48

Prints one line per measurement and a JSON record at the end (``--out FILE`` writes it).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any

import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.prompts import encode_chat, load_prompts
from specdecode.load import load_models, plan_models
from specdecode.models.torch.exact import forget_exact_passes, use_exact_passes
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers import PROPOSERS

MODES = ("stock", "exact")
METHODS = ("none", "draft_model", "prompt_lookup", "eagle")


def set_mode(model: Any, mode: str) -> None:
    if mode == "exact":
        use_exact_passes(model)
    else:
        forget_exact_passes(model)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@torch.inference_mode()
def identity(model: Any, prompt: torch.Tensor, widths: range) -> dict[str, dict[int, int]]:
    cont = torch.tensor([prompt[i % len(prompt)] for i in range(max(widths))])  # plausible text, not argmax
    P = len(prompt)
    out: dict[str, dict[int, int]] = {}
    for mode in MODES:
        set_mode(model, mode)
        runner = ModelRunner(model)
        runner.forward(prompt)
        ref = [runner.forward(t.view(1))[0] for t in cont]
        out[mode] = {}
        for W in widths:
            runner.truncate(P)
            rows = runner.forward(cont[:W], num_logits=W)
            out[mode][W] = sum(bool(torch.equal(rows[i], ref[i])) for i in range(W))
        print(mode, "identical rows per width:", " ".join(f"{w}:{n}/{w}" for w, n in out[mode].items()), flush=True)
    return out


@torch.inference_mode()
def passes(model: Any, prompt: torch.Tensor, widths: tuple[int, ...], reps: int) -> dict[str, dict[int, float]]:
    P = len(prompt)
    runners = {}
    for mode in MODES:
        set_mode(model, mode)
        runners[mode] = ModelRunner(model)
        runners[mode].forward(prompt)
    times: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(reps):
        for W in widths:
            for mode in MODES:
                set_mode(model, mode)
                runner = runners[mode]
                wall, cpu = time.perf_counter(), time.process_time()
                runner.forward(prompt[:W], num_logits=W)
                times.setdefault(("wall", mode, W), []).append(time.perf_counter() - wall)
                times.setdefault(("cpu", mode, W), []).append(time.process_time() - cpu)
                runner.truncate(P)
    for _ in range(max(1, reps // 3)):  # a prompt's prefill: a fresh runner's first pass
        for mode in MODES:
            set_mode(model, mode)
            runner = ModelRunner(model)
            wall, cpu = time.perf_counter(), time.process_time()
            runner.forward(prompt)
            times.setdefault(("wall", mode, P), []).append(time.perf_counter() - wall)
            times.setdefault(("cpu", mode, P), []).append(time.process_time() - cpu)
    widths = (*widths, P)
    out = {f"{c}/{m}": {W: statistics.median(times[(c, m, W)]) for W in widths} for c in ("wall", "cpu") for m in MODES}
    for W in widths:
        line = [f"pass of {W:2d} tokens{' (prefill)' if W == P else ''}:"]
        for clock in ("wall", "cpu"):
            s, e = out[f"{clock}/stock"][W], out[f"{clock}/exact"][W]
            line.append(f"{clock} stock {s * 1e3:7.1f} ms, exact {e * 1e3:7.1f} ms ({e / s:.3f});")
        print(" ".join(line), flush=True)
    return out


def generate(loaded: Any, prompts: list[list[int]], tokens: int, methods: tuple[str, ...]) -> dict[str, Any]:
    """Per method, each prompt in both modes back to back (load on a shared machine hits both alike):
    tokens per wall-clock and per CPU second, and outputs identical to the target alone's (same mode)."""
    target, draft, tokenizer = loaded.target, loaded.draft, loaded.tokenizer
    sampling = SamplingParams(max_new_tokens=tokens)
    alone: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
    record: dict[str, Any] = {}
    for method in methods:
        proposer = None if method == "none" else PROPOSERS[method].build(PROPOSERS[method].config(), target, draft)
        totals = {mode: [0.0, 0.0, 0, 0] for mode in MODES}  # wall s, CPU s, new tokens, identical outputs
        for i, prompt in enumerate(prompts):
            for mode in MODES:
                set_mode(target, mode)
                generator = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=proposer)
                cpu = time.process_time()
                result = generator.generate(prompt, sampling, speculative=method != "none")
                total = totals[mode]
                total[0] += result.stats.wall_time_s
                total[1] += time.process_time() - cpu
                total[2] += result.stats.new_tokens
                if method == "none":
                    alone[mode].append(result.token_ids)
                total[3] += result.token_ids == alone[mode][i]
        for mode in MODES:
            wall, cpu, new, same = totals[mode]
            record[f"{mode}/{method}"] = {
                "tokens_per_s": new / wall,
                "tokens_per_cpu_s": new / cpu,
                "identical": same,
                "prompts": len(prompts),
            }
            print(f"{mode:5s} {method:13s} {new / wall:6.2f} tok/s, {new / cpu:6.2f} tok per CPU s, identical to "
                  f"the target alone: {same}/{len(prompts)}", flush=True)  # fmt: skip
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="+", choices=["identity", "passes", "generate"])
    parser.add_argument("--prompts", type=int, default=6, help="generate: Spec-Bench dev prompts (first turns)")
    parser.add_argument("--tokens", type=int, default=48, help="generate: new tokens per prompt")
    parser.add_argument("--reps", type=int, default=7, help="passes: timed passes per width and mode")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--groups",
        default="translation,summarization,qa,math_reasoning,rag,mt_bench",
        help="generate: Spec-Bench groups the prompts come from (the shortest of each, in turn)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_models(None, None, "draft_model", "torch", "bfloat16", exact=True, device="cpu")
    loaded = load_models(plan)
    per_group = max(1, -(-args.prompts // len(args.groups.split(","))))
    chosen = load_prompts(None, args.groups, per_group, shortest=True)[: args.prompts]
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in chosen]
    record: dict[str, Any] = {
        "prompt_tokens": [len(p) for p in prompts],
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "target": str(plan.target),
    }
    print(f"{record['cpu']}, {record['threads']} threads, torch {record['torch']}", flush=True)
    first = torch.tensor(prompts[0])
    if "identity" in args.what:
        record["identity"] = identity(loaded.target, first, range(1, 34))
    if "passes" in args.what:
        record["passes"] = passes(loaded.target, first, (1, 2, 3, 5, 9, 17), args.reps)
    if "generate" in args.what:
        methods = tuple(args.methods.split(","))
        record["generate"] = generate(loaded, prompts, args.tokens, methods)
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
