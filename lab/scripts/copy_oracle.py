"""How far can any proposer that copies from the context go on a benchmark's prompts?

Reads a ``specdecode bench`` results file and replays the ``target`` method's greedy answers
(greedy output is the target's, whatever proposer is used, so the answers are the same for every
lossless method). Per category group it prints:

- ``prefill``: the share of the target's wall time spent before the first token (prefill and the
  first token), which every method spends alike;
- ``max e2e``: ``1 / prefill``, the end-to-end speedup of infinitely fast decoding (Amdahl);
- ``2x e2e needs``: the decode speedup (time per output token after the first) that an end-to-end
  2x would need, ``(1 - p) / (0.5 - p)``;
- ``oracle@K``: tokens per target pass of a copy oracle drafting up to K tokens: at each step it
  drafts the longest run of the coming answer tokens that occurs anywhere in the context (prompt
  and answer so far), i.e. the best any context-copy proposer (prompt lookup, suffix decoding over
  this request) could draft with a perfect choice of match, at no cost. A proposer's decode speedup
  is at most its tokens per pass times (one-token pass time / (K+1)-token pass time), so it is at
  most the oracle's value.
- ``lookup@4``: the tokens per pass prompt lookup reached in the replay with n-grams 1 to 3 and k = 4
  (its defaults before 2026-11-25).

Usage: python lab/scripts/copy_oracle.py lab/results/issue4-pld-summarization-rag-8/results.json [--k 4,8,16]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.prompts import encode_chat, load_prompts
from specdecode.models.torch.hf_loading import load_tokenizer, resolve_model_dir
from specdecode.proposers.prompt_lookup import PromptLookupConfig, find_continuation


def longest_copy(context: list[int], coming: list[int], limit: int) -> int:
    """The longest prefix of ``coming`` (at most ``limit`` tokens) that occurs in ``context``."""
    best = 0
    if not coming:
        return 0
    for j, token in enumerate(context):
        if token != coming[0]:
            continue
        n = 0
        while n < limit and n < len(coming) and j + n < len(context) and context[j + n] == coming[n]:
            n += 1
        best = max(best, n)
        if best == limit:
            break
    return best


def tokens_per_pass(prompt: list[int], answer: list[int], limit: int, oracle: bool) -> tuple[int, int]:
    """``(passes, tokens)`` replaying ``answer`` with drafts of at most ``limit`` tokens: the oracle's
    longest copy, or prompt lookup's draft (n-grams 1 to 3) accepted as far as it matches."""
    passes, i = 0, 0
    config = PromptLookupConfig(max_ngram=3, min_ngram=1, max_spec_factor=None)
    while i < len(answer):
        remaining = len(answer) - i - 1  # the last token comes from the pass, never from a draft
        if oracle:
            accepted = longest_copy(prompt + answer[:i], answer[i:], min(limit, remaining))
        else:
            context = torch.tensor(prompt + answer[:i], dtype=torch.int64)
            draft = find_continuation(context, max(1, min(limit, remaining)), config.max_ngram, config.min_ngram)
            accepted = 0
            while accepted < min(len(draft), remaining) and int(draft[accepted]) == answer[i + accepted]:
                accepted += 1
        passes += 1
        i += accepted + 1
    return passes, len(answer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a specdecode bench results.json with a 'target' method (greedy)")
    parser.add_argument("--k", default="4,8,16", help="draft lengths for the oracle (comma list)")
    args = parser.parse_args()
    limits = [int(k) for k in args.k.split(",")]
    data: dict[str, Any] = json.loads(Path(args.results).read_text())
    records = [r for r in data["records"] if r["method"] == "target" and r.get("repeat", 0) == 0]
    if not records:
        raise SystemExit(f"{args.results}: no records of the 'target' method")
    tokenizer = load_tokenizer(resolve_model_dir(None, "target"))
    prompts = {p.question_id: p for p in load_prompts(None, None, None)}
    by_question: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_question[r["question_id"]].append(r)
    groups: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for qid, turns in by_question.items():
        messages: list[dict[str, str]] = []
        for r in sorted(turns, key=lambda r: r["turn"]):
            messages.append({"role": "user", "content": prompts[qid].turns[r["turn"]]})
            prompt = encode_chat(tokenizer, messages)
            if len(prompt) != r["prompt_tokens"]:
                raise SystemExit(
                    f"question {qid} turn {r['turn']}: prompt of {len(prompt)} tokens, recorded {r['prompt_tokens']}"
                )
            g = groups[r["group"]]
            g["wall"] += r["wall_time_s"]
            g["first"] += r["stats"]["time_to_first_token_s"]
            for k in limits:
                passes, tokens = tokens_per_pass(prompt, r["token_ids"], k, oracle=True)
                g[f"oracle@{k} passes"] += passes
                g[f"oracle@{k} tokens"] += tokens
            passes, tokens = tokens_per_pass(prompt, r["token_ids"], 4, oracle=False)
            g["lookup passes"] += passes
            g["lookup tokens"] += tokens
            messages.append(
                {"role": "assistant", "content": tokenizer.decode(r["token_ids"], skip_special_tokens=True)}
            )
    header = ["group", "prefill", "max e2e", "2x e2e needs", *(f"oracle@{k}" for k in limits), "lookup@4"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, g in groups.items():
        p = g["first"] / g["wall"]
        need = f"{(1 - p) / (0.5 - p):.2f}x decode" if p < 0.5 else "impossible"
        cells = [name, f"{p:.0%}", f"{1 / p:.1f}x", need]
        cells += [f"{g[f'oracle@{k} tokens'] / g[f'oracle@{k} passes']:.2f}" for k in limits]
        cells.append(f"{g['lookup tokens'] / g['lookup passes']:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
