"""Replay the draft gate on recorded target answers, priced as the patched llama.cpp build runs.

``lookup_gate_replay.py`` prices exact mode as chunks of 3 rows (the unpatched build). The patched
build (invariant patch version 3) verifies a greedy draft in a first call of 2 rows (the root and
the first draft) and, when that draft is right, a second call with the rest; or, where the gate
sends the draft whole (``DraftTokens.early_stop`` False), in one call. This script prices each
step that way from a measured curve of one-call costs (``llamacpp_patch_passes.py``: 40 cached),
feeds the product's :class:`~specdecode.draft_gate.DraftGate` (and variants of it, given as
``GateConfig`` fields) the same :class:`PassCosts` the engine would have learned, and prints the
priced speedup over plain decoding per category (decoding only: the prefill is the same for all).

Usage::

    python lab/scripts/gate_replay_split.py lab/results/llamacpp-epyc-avx512-exact/results.json
    python lab/scripts/gate_replay_split.py RESULTS --variant "prior_weight=1" --variant pooled
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lookup_gate_replay import lcp, turn_prompt_ids

from specdecode.bench.prompts import load_prompts
from specdecode.draft_gate import DraftGate, GateConfig, PassCosts
from specdecode.proposers.prediction import PredictionConfig, PredictionProposer, encode_prediction
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specdecode.verify import VerifyResult

# one-call pass costs (ms) by rows, 40 cached, 2-core AMD EPYC, patch v3
# (lab/results/issue51-rows-attention/patch_passes-12b06c8.txt)
MEASURED = {1: 33.0, 2: 45.0, 3: 54.4, 4: 64.0, 5: 84.9, 8: 109.1, 9: 130.9, 16: 204.7, 17: 227.0, 33: 420.9}


def one_call(rows: int) -> float:
    """ms of one call computing ``rows`` rows, interpolated between measured widths."""
    if rows in MEASURED:
        return MEASURED[rows]
    widths = sorted(MEASURED)
    below = max(w for w in widths if w < rows)
    above = min((w for w in widths if w > rows), default=None)
    if above is None:
        return MEASURED[below] + (MEASURED[below] - MEASURED[1]) / (below - 1) * (rows - below)
    t = (rows - below) / (above - below)
    return (1 - t) * MEASURED[below] + t * MEASURED[above]


def step_cost(d: int, n: int, early_stop: bool, step_ms: float) -> float:
    """ms of a step drafting d tokens, n accepted: one call of d + 1 rows, or (early stop) 2 rows
    and, when the first draft was right, a second call of the other d - 1."""
    if d == 0:
        return one_call(1) + step_ms
    if not early_stop or d == 1:
        return one_call(d + 1) + step_ms
    return one_call(2) + (one_call(d - 1) if n >= 1 else 0.0) + step_ms


def product_costs(step_ms: float) -> PassCosts:
    """The :class:`PassCosts` the engine learns on the patched build (chunk 2, then 64)."""
    costs = PassCosts(chunk=2, then=64, step_ms=step_ms)
    costs.ms[1], costs.ms[2] = one_call(1), one_call(2)
    for w in range(3, 65):
        costs.ms[w] = one_call(2) + one_call(w - 2)
        costs.whole_ms[w] = one_call(w)
    return costs


class PooledGate(DraftGate):
    """A gate whose trials count for every match length they bound: a wrong draft after an n-token
    match also counts as a failure for shorter matches (they are no better), a right one as a
    success for longer matches (they are no worse)."""

    def _count(self, bucket: tuple[str, int], drafted: int, accepted: int, tally: bool = True) -> None:
        source, n = bucket
        for m in range(1, 6):
            if (accepted > 0 and m > n) or (accepted == 0 and m < n):
                first = self._estimate((source, m))
                first[0] += accepted > 0
                first[1] += 1
        super()._count(bucket, drafted, accepted, tally)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--questions", help="the questions file of the run (default: its settings' own)")
    parser.add_argument("--k", type=int, default=8, help="most tokens drafted per step (a prediction: 16)")
    parser.add_argument("--step-ms", type=float, default=0.5)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="'pooled', GateConfig or 'pred.' PredictionConfig fields: 'max_misses=3;pred.window=8'",
    )
    parser.add_argument("--no-prediction", action="store_true", help="prompt lookup only, also on edits")
    parser.add_argument("--unrelated", action="store_true", help="each turn's prediction: another turn's answer")
    parser.add_argument("--trace", help="QID/TURN: print the first variant's steps with a draft")
    default_tokenizer = Path.home() / ".cache/specdecode/models/Qwen2.5-Coder-1.5B-Instruct-bf16"
    parser.add_argument("--tokenizer", default=str(default_tokenizer))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    data = json.loads(Path(args.results).read_text())
    settings = data.get("settings", {})
    questions = args.questions or settings.get("questions")
    prompts = {
        (str(p.question_id), p.group): p
        for p in load_prompts(questions, settings.get("categories"), settings.get("prompts_per_category"))
    }
    answers = {
        (str(r["question_id"]), r["group"], r["turn"]): r["token_ids"]
        for r in data["records"]
        if r["method"] == "target" and r.get("repeat", 0) == 0
    }

    variants = ["product", *args.variant]

    def make_gate(spec: str) -> DraftGate:
        costs = product_costs(args.step_ms)
        config = GateConfig()
        cls: type[DraftGate] = DraftGate
        for part in filter(None, spec.split(";")):
            if part == "product":
                continue
            if part == "pooled":
                cls = PooledGate
                continue
            if part.startswith("pred."):
                continue
            key, value = part.split("=")
            parsed: Any = tuple(float(v) for v in value.split(",")) if "," in value else float(value)
            parsed = int(parsed) if value.isdigit() else parsed
            parsed = bool(parsed) if isinstance(getattr(config, key), bool) else parsed
            config = replace(config, **{key: parsed})
        return cls(costs, config)

    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    per_turn: list[tuple[str, str, list[float]]] = []
    mal: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # drafts, accepted
    for (qid, group, turn), answer in sorted(answers.items()):
        prompt = prompts.get((qid, group))
        if prompt is None:
            continue
        ids = turn_prompt_ids(tokenizer, prompt, [answers[(qid, group, i)] for i in range(turn)])
        context = ids + answer
        plain = step_cost(0, 0, True, args.step_ms) * (len(answer) - 1)
        row = []
        for spec in variants:
            gate = make_gate(spec)
            lookup: Any = PromptLookupProposer(PromptLookupConfig(min_ngram=3, max_ngram=8))
            prediction = prompt.prediction
            if args.unrelated:  # another turn's answer: a prediction that has nothing to do with this one
                keys = sorted(answers)
                other = keys[(keys.index((qid, group, turn)) + 7) % len(keys)]
                prediction = tokenizer.decode(answers[other], skip_special_tokens=True)
            if prediction is not None and not args.no_prediction:
                pred_config = PredictionConfig()
                for part in filter(None, spec.split(";")):
                    if part.startswith("pred."):
                        key, value = part[5:].split("=")
                        pred_config = replace(pred_config, **{key: type(getattr(pred_config, key))(float(value))})
                ids_p = encode_prediction(prediction, tokenizer, len(tokenizer))
                lookup = PredictionProposer(ids_p, lookup, len(ids), pred_config)
            drafts_with = accepted_sum = 0
            t, ms = 1, 0.0
            while t < len(answer):
                room = len(answer) - t - 1
                draft = lookup.propose(torch.tensor(context[: len(ids) + t]), max(1, min(args.k, room)), None, None)
                if room <= 0:
                    draft = draft.empty()
                kept = gate.trim(draft)
                d = len(kept)
                n = lcp(kept.ids.tolist(), answer[t:]) if d else 0
                ms += step_cost(d, n, kept.early_stop, args.step_ms)
                if args.trace and f"{qid}/{turn}" == args.trace and spec == variants[0] and len(draft):
                    a1, q = gate.acceptance(*draft.evidence) if draft.evidence else (0, 0)
                    print(
                        f"t={t} drafted={len(draft)} n={draft.evidence} a1={a1:.2f} q={q:.2f} kept={d} "
                        f"early={kept.early_stop} right={lcp(draft.ids.tolist(), answer[t:])}"
                    )
                gate.observe(d, n, answer[t : t + n + 1])
                if isinstance(lookup, PredictionProposer):
                    lookup.observe(VerifyResult(n, torch.tensor(answer[t : t + n + 1])))
                if d:
                    drafts_with, accepted_sum = drafts_with + 1, accepted_sum + n
                t += n + 1
            mal[spec][0] += drafts_with
            mal[spec][1] += accepted_sum
            totals[group][spec] += ms
            totals["all"][spec] += ms
            row.append(plain / ms)
        totals[group]["plain"] += plain
        totals["all"]["plain"] += plain
        per_turn.append((f"{qid}/{turn}", group, row))
    print("turns below 1.0 (any variant):")
    for name, group, row in per_turn:
        if min(row) < 1.0:
            print(f"  {name:14s} {group:14s}", *[f"{x:7.3f}" for x in row])
    print("category".ljust(16), *[v[:14].rjust(15) for v in variants])
    for group, sums in totals.items():
        print(group.ljust(16), *[f"{sums['plain'] / sums[v]:15.3f}" for v in variants])
    print("MAL".ljust(16), *[f"{1 + mal[v][1] / max(1, mal[v][0]):15.2f}" for v in variants])
    worst = [min(r[i] for _, _, r in per_turn) for i in range(len(variants))]
    print("worst turn".ljust(16), *[f"{w:15.3f}" for w in worst])


if __name__ == "__main__":
    main()
