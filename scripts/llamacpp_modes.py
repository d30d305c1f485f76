"""What exactness costs on llama.cpp: plain and speculative decoding under each runner mode, side by side.

Modes of :class:`specdecode.models.llamacpp.LlamaCppOptions` (weights repacked in all):

- ``exact``: flash attention off, verification in batch-invariant chunks of 3 with a greedy early
  stop: greedy output equals our plain decoding in this mode by construction;
- ``exact+fa``: the same chunks with flash attention on: invariant only while fewer than 256
  tokens are cached (llama.cpp's one-token attention changes its summation past 512 cells);
- ``fast``: flash attention on (llama.cpp's default), one pass per verification.

Every mode decodes the same prompts with the target alone and with prompt lookup (k 8); the peer
``llamacpp`` (llama-cpp-python's ``Llama.generate``, flash attention on) runs in the same process.
Prints tokens/s per mode and method, the ratio to the peer, and how many outputs equal the exact
mode's plain decoding.

    .venv/bin/python scripts/llamacpp_modes.py --threads 2 --prompts 6 --categories humaneval,coding
"""

from __future__ import annotations

import argparse
import platform
import time

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.methods import METHODS, BenchModels, BenchSettings
from specdecode.bench.prompts import load_prompts
from specdecode.models.backends import load_llamacpp, load_llamacpp_tokenizer
from specdecode.models.llamacpp import LlamaCppOptions
from specdecode.proposers import make_proposer

MODES = {
    "exact": {"exact": True},
    "exact+fa": {"exact": True, "flash_attn": True},
    "fast": {"exact": False},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=6, help="per category")
    parser.add_argument("--categories", default="humaneval,coding")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("-k", type=int, default=8)
    args = parser.parse_args()
    prompts = load_prompts(None, args.categories, args.prompts)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    print(
        f"# {platform.processor() or platform.machine()}, threads {args.threads}, {len(prompts)} prompts, "
        f"{args.max_new_tokens} new tokens, prompt_lookup k {args.k}"
    )
    times: dict[str, float] = {}
    tokens: dict[str, int] = {}
    outputs: dict[str, list[list[int]]] = {}
    first = load_llamacpp(None, "target", LlamaCppOptions(threads=args.threads))
    tokenizer = load_llamacpp_tokenizer(first)
    ids = [SpeculativeGenerator(first, tokenizer=tokenizer).encode_prompt(p.turns[0]).tolist() for p in prompts]
    peer = BenchModels(first, None, tokenizer, first.path, args.threads)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens)
    run = METHODS["llamacpp"].run
    run(peer, ids[0], BenchSettings(max_new_tokens=8), None)  # warm-up
    times["llamacpp"], tokens["llamacpp"], outputs["llamacpp"] = 0.0, 0, []
    for prompt_ids in ids:
        out = run(peer, prompt_ids, settings, None)
        times["llamacpp"] += out.wall_time_s
        tokens["llamacpp"] += len(out.token_ids)
        outputs["llamacpp"].append(out.token_ids)
    del peer, first
    base = tokens["llamacpp"] / times["llamacpp"]
    print(f"llamacpp: {base:.1f} tokens/s", flush=True)
    for mode, options in MODES.items():
        target = load_llamacpp(None, "target", LlamaCppOptions(threads=args.threads, **options))
        plain = SpeculativeGenerator(target, tokenizer=tokenizer)
        lookup = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=make_proposer("prompt_lookup"))
        runs = {f"{mode}/target": (plain, False), f"{mode}/prompt_lookup": (lookup, True)}
        plain.generate(ids[0], SamplingParams(max_new_tokens=8))  # warm-up
        for name, (generator, speculative) in runs.items():
            times[name], tokens[name], outputs[name] = 0.0, 0, []
            for prompt_ids in ids:
                tic = time.perf_counter()
                result = generator.generate(
                    prompt_ids, sampling, num_speculative_tokens=args.k, speculative=speculative
                )
                times[name] += time.perf_counter() - tic
                tokens[name] += len(result.token_ids)
                outputs[name].append(result.token_ids)
            print(f"{name}: {tokens[name] / times[name]:.1f} tokens/s", flush=True)
        del plain, lookup, target
    reference = outputs["exact/target"]
    print("| run | tokens/s | vs llamacpp | outputs equal to exact/target |\n| --- | --- | --- | --- |")
    for name in times:
        rate = tokens[name] / times[name]
        same = sum(a == b for a, b in zip(outputs[name], reference, strict=True))
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {same}/{len(reference)} |")


if __name__ == "__main__":
    main()
