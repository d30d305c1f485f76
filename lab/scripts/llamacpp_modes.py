"""What exactness costs on llama.cpp: plain and speculative decoding under each runner mode, side by side.

Modes of :class:`specdecode.models.llamacpp.LlamaCppOptions` (weights repacked in all):

- ``exact``: the default: flash attention on, with ggml's CPU reference kernels for passes of at
  most 3 tokens (:mod:`specdecode.models.llamacpp.kernels`), verification in batch-invariant chunks
  of 3 with a greedy early stop: greedy output equals our plain decoding in this mode by construction;
- ``exact-fa-off``: the same chunks with flash attention off (exact mode before the reference-kernel
  switch, and where a llama.cpp build lacks it);
- ``fast``: flash attention on (llama.cpp's default), one pass per verification.

Every mode decodes the same prompts with the target alone and with the backend's default proposer
(prompt lookup after 3-token matches, k 8); the peer
``llamacpp`` (llama-cpp-python's ``Llama.generate``, flash attention on) runs in the same process,
and the runs alternate prompt by prompt (the machine's drift over minutes hits all alike).
Prints tokens/s per mode and method, the ratio to the peer, and how many outputs equal the exact
mode's plain decoding.

    .venv/bin/python lab/scripts/llamacpp_modes.py --threads 2 --prompts 6 --categories humaneval,coding
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.methods import METHODS, BenchModels, BenchSettings
from specdecode.bench.prompts import load_prompts
from specdecode.models.backends import DEFAULT_PROPOSER, load_llamacpp, load_llamacpp_tokenizer
from specdecode.models.llamacpp.model import LlamaCppOptions
from specdecode.proposers import make_proposer

MODES = {
    "exact": {"exact": True},
    "exact-fa-off": {"exact": True, "flash_attn": False},
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
    peer_run = METHODS["llamacpp"].run
    peer_run(peer, ids[0], BenchSettings(max_new_tokens=8), None)  # warm-up
    # Every run decodes every prompt; runs alternate per prompt (forward, then backward order) so
    # that the machine's drift over minutes (a virtual machine's share of the cores) hits all alike.
    runs: dict[str, Callable[[list[int]], list[int]]] = {
        "llamacpp": lambda prompt_ids: peer_run(peer, prompt_ids, settings, None).token_ids
    }
    default_name, default_options = DEFAULT_PROPOSER["llamacpp"]
    for mode, options in MODES.items():
        target = load_llamacpp(None, "target", LlamaCppOptions(threads=args.threads, **options))
        plain = SpeculativeGenerator(target, tokenizer=tokenizer)
        proposer = make_proposer(default_name, **default_options)
        lookup = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=proposer)
        plain.generate(ids[0], SamplingParams(max_new_tokens=8))  # warm-up
        for name, generator, speculative in ((f"{mode}/target", plain, False), (f"{mode}/prompt_lookup", lookup, True)):
            runs[name] = lambda prompt_ids, g=generator, s=speculative: (
                g.generate(prompt_ids, sampling, num_speculative_tokens=args.k, speculative=s).token_ids
            )
    for name in runs:
        times[name], tokens[name], outputs[name] = 0.0, 0, []
    for i, prompt_ids in enumerate(ids):
        for name in list(runs) if i % 2 == 0 else list(runs)[::-1]:
            tic = time.perf_counter()
            out = runs[name](prompt_ids)
            times[name] += time.perf_counter() - tic
            tokens[name] += len(out)
            outputs[name].append(out)
        print(f"prompt {i + 1}/{len(ids)} done", flush=True)
    base = tokens["llamacpp"] / times["llamacpp"]
    reference = outputs["exact/target"]
    print("| run | tokens/s | vs llamacpp | outputs equal to exact/target |\n| --- | --- | --- | --- |")
    for name in times:
        rate = tokens[name] / times[name]
        same = sum(a == b for a, b in zip(outputs[name], reference, strict=True))
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {same}/{len(reference)} |")


if __name__ == "__main__":
    main()
