"""What prompt lookup costs per step where it drafts nothing: the same engine on the default
target (llama.cpp) with and without the proposer, alternated, the prefill run every time.

Prints, per side, medians over the rounds of: wall time, time to first token, ms per decoding
step, ms per target pass, the proposer's ms per step (``draft_time_s``), and the engine's other
work per step. ``python lab/scripts/proposer_overhead_ab.py [ROUNDS] [PROMPT]`` (default 12 rounds,
the held-out translation turn, which drafts nothing)."""

from __future__ import annotations

import statistics
import sys
import time

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer

TRANSLATION = (
    "Translate German to English: Kerry bestand allerdings darauf , dass die NSA eine Kraft des Guten "
    "sei und durch ihre Überwachungsvorgänge viele Leben gerettet worden seien ."
)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    prompt = sys.argv[2] if len(sys.argv) > 2 else TRANSLATION
    loaded = SpeculativeGenerator.from_pretrained(backend="llamacpp", proposer="prompt_lookup", threads=2)
    model = loaded.target.model  # the loaded llama.cpp model, shared by both engines
    lookup = PromptLookupProposer(PromptLookupConfig(min_ngram=3, max_ngram=8))
    sides = {
        "target alone": SpeculativeGenerator(model, tokenizer=loaded.tokenizer),
        "prompt lookup": SpeculativeGenerator(model, tokenizer=loaded.tokenizer, proposer=lookup),
    }
    sampling = SamplingParams(temperature=0, max_new_tokens=128)
    for generator in sides.values():
        generator.reuse_prompt = False  # every prefill runs, as in the bench
        generator.generate(prompt, sampling)  # warm-up
    rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in sides}
    for i in range(rounds):
        for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            tic = time.perf_counter()
            stats = sides[name].generate(prompt, sampling).stats
            wall = time.perf_counter() - tic
            steps = max(1, stats.new_tokens - 1)
            decode = wall - stats.time_to_first_token_s
            rows[name].append(
                (
                    wall,
                    stats.time_to_first_token_s,
                    decode / steps * 1e3,
                    stats.target_time_s / max(1, stats.target_forward_passes - 1) * 1e3,
                    stats.draft_time_s / steps * 1e3,
                    (decode - stats.target_time_s - stats.draft_time_s) / steps * 1e3,
                    stats.drafts,
                )
            )
    print("side".ljust(14), "wall s", "ttft s", "ms/step", "ms/pass", "proposer ms/step", "other ms/step", "drafts")
    for name, values in rows.items():
        cols = list(zip(*values, strict=True))
        medians = [statistics.median(c) for c in cols[:6]]
        print(name.ljust(14), *[f"{m:.4f}" for m in medians], sorted(set(cols[6])))


if __name__ == "__main__":
    main()
