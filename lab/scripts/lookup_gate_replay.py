"""Replay prompt-lookup drafting policies on recorded target answers, priced with a cost table.

Exact decoding fixes the answer, so what any deterministic proposer would have drafted, and how
much of it the target accepts, follows from the target alone's answer: at a context of the prompt
plus ``answer[:t]``, a draft is accepted up to its first token that differs from ``answer[t:]``.
Each step is priced as llama.cpp's exact mode runs it: a pass of the root and d drafts split into
chunks of ``--chunk`` tokens, stopping after the first chunk whose argmax disagrees (a wrong draft
costs its chunk), plus the table's ``step_ms``; a step without a draft costs a one-token pass.

Usage (the records of a ``specdecode bench`` run that has a ``target`` method with token ids, its
prompts rebuilt from the same questions)::

    python lab/scripts/lookup_gate_replay.py lab/results/llamacpp-epyc-avx512-exact/results.json \
        --table lab/results/cost-table-epyc/exact/table.json

Prints, per category and overall, each policy's priced speedup over the target alone.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.prompts import Prompt, encode_chat, load_prompts
from specdecode.cost.table import CostTable, load_cost_table
from specdecode.draft_gate import DraftGate, PassCosts
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer, find_continuation


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def step_cost(table: CostTable, d: int, n: int, chunk: int) -> float:
    """ms of a step drafting d tokens of which n are accepted (exact mode: chunks, early stop)."""
    if d == 0:
        return table.target(1) + (table.step_ms or 0.0)
    width = d + 1
    if not chunk:  # one pass, every row computed (--no-exact, a GPU)
        return table.target(width) + (table.step_ms or 0.0)
    chunks = (n // chunk + 1) if n < d else math.ceil(width / chunk)
    cost, left = 0.0, width
    for _ in range(chunks):
        w = min(chunk, left)
        cost += table.target(w)
        left -= w
    return cost + (table.step_ms or 0.0)


def turn_prompt_ids(tokenizer: Any, prompt: Prompt, previous: list[list[int]]) -> list[int]:
    """Token ids of the chat a turn was decoded from: the prompt's user turns up to this one, each
    earlier one followed by the target's recorded answer to it (``previous``, in order)."""
    messages = []
    for i, user in enumerate(prompt.turns[: len(previous) + 1]):
        messages.append({"role": "user", "content": user})
        if i < len(previous):
            messages.append({"role": "assistant", "content": tokenizer.decode(previous[i], skip_special_tokens=True)})
    return encode_chat(tokenizer, messages)


Policy = Callable[[torch.Tensor, int], list[int]]


def replay(
    prompt: list[int], answer: list[int], propose: Policy, observe: Callable, table: CostTable, chunk: int, k: int = 8
) -> tuple[float, int]:
    """(ms, steps) to decode ``answer`` after ``prompt`` with the policy."""
    context = prompt + answer
    t, ms, steps = 1, table.target(1) * 0, 0  # the first token comes from the prefill (same for all)
    while t < len(answer):
        room = len(answer) - t - 1
        draft = propose(torch.tensor(context[: len(prompt) + t]), max(0, min(k, room)))[: max(0, room)]
        n = lcp(draft, answer[t:])
        ms += step_cost(table, len(draft), n, chunk)
        observe(len(draft), n, answer[t : t + n + 1])  # the gate scores a withheld draft against these
        t += n + 1
        steps += 1
    return ms, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results")
    parser.add_argument("--table", required=True)
    parser.add_argument("--questions", help="the questions file of the run (default: its settings' own, if it exists)")
    parser.add_argument("--chunk", type=int, default=3, help="rows per exact-mode chunk (0: one pass, no early stop)")
    parser.add_argument("--k", type=int, default=8, help="the most tokens drafted per step (a prediction: 16)")
    default_tokenizer = Path.home() / ".cache/specdecode/models/Qwen2.5-Coder-1.5B-Instruct-bf16"
    parser.add_argument("--tokenizer", default=str(default_tokenizer))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    table = load_cost_table(args.table)
    data = json.loads(Path(args.results).read_text())
    settings = data.get("settings", {})
    records = [r for r in data["records"] if r["method"] == "target"]
    prompts = {}
    cats = settings.get("categories")
    questions = args.questions or settings.get("questions")
    if questions is not None and not Path(questions).exists():
        raise SystemExit(f"--questions: the run's questions file {questions} is not here; name it")
    for p in load_prompts(questions, cats, settings.get("prompts_per_category")):
        prompts[(str(p.question_id), p.group)] = p
    answers = {(str(r["question_id"]), r["group"], r["turn"]): r["token_ids"] for r in records}

    def policies() -> dict[str, tuple[Policy, Callable]]:
        out = {}
        for name, low in (("min1", 1), ("min2", 2), ("min3 (default)", 3), ("min4", 4), ("min5", 5)):
            out[name] = (lambda ctx, k, low=low: find_continuation(ctx, k, max(4, low), low, 2.0).tolist(),
                         lambda d, n, tokens: None)
        measured = PassCosts()
        for w in range(1, 34):  # the table's exact-mode curve: full passes of w rows
            measured.ms[w] = table.target(w)
        measured.step_ms, measured.chunk = table.step_ms or 0.0, args.chunk
        gates = {}
        for name, low, high in (("gate", 3, 4), ("gate_max8", 3, 8), ("gate_max16", 3, 16), ("max8_noshadow", 3, 8)):
            gate = DraftGate(measured)
            lookup = PromptLookupProposer(PromptLookupConfig(min_ngram=low, max_ngram=high))
            gates[name] = gate

            def propose(
                ctx: torch.Tensor, k: int, gate: DraftGate = gate, lookup: PromptLookupProposer = lookup
            ) -> list[int]:
                return gate.trim(lookup.propose(ctx, k, None, None)).ids.tolist()  # type: ignore[arg-type]

            if name.endswith("noshadow"):  # the gate before its shadow check: a withheld draft is never scored
                out[name] = (propose, lambda d, n, tokens, gate=gate: gate.observe(d, n))
            else:
                out[name] = (propose, gate.observe)
        out["_gate"] = gates
        return out

    def prediction_policies(prompt_ids: list[int], prediction: str) -> dict[str, tuple[Policy, Callable]]:
        """The prediction proposer over prompt lookup (3..8), by max_spec_factor, ungated and gated."""
        from specdecode.proposers.prediction import PredictionConfig, PredictionProposer, encode_prediction

        ids = encode_prediction(prediction, tokenizer, len(tokenizer))
        out = {}
        for factor in (2.0, 4.0, 8.0):
            for gated in (False, True):
                fallback = PromptLookupProposer(PromptLookupConfig(min_ngram=3, max_ngram=8))
                proposer = PredictionProposer(ids, fallback, len(prompt_ids), PredictionConfig(max_spec_factor=factor))
                gate = DraftGate(gates_costs) if gated else None

                def propose(ctx: torch.Tensor, k: int, p: PredictionProposer = proposer, g: DraftGate | None = gate
                            ) -> list[int]:  # fmt: skip
                    draft = p.propose(ctx, k, None, None)  # type: ignore[arg-type]
                    return (g.trim(draft) if g is not None else draft).ids.tolist()

                def observe(d: int, n: int, tokens: list[int], p: PredictionProposer = proposer,
                            g: DraftGate | None = gate) -> None:  # fmt: skip
                    from specdecode.verify import VerifyResult

                    if g is not None:
                        g.observe(d, n, tokens)
                    p.observe(VerifyResult(n, torch.zeros(n + 1, dtype=torch.int64)))  # tokens unused but counted

                out[f"pred_f{factor:g}{'_gate' if gated else ''}"] = (propose, observe)
        return out

    gates_costs = PassCosts()
    for w in range(1, 34):
        gates_costs.ms[w] = table.target(w)
    gates_costs.step_ms, gates_costs.chunk = table.step_ms or 0.0, args.chunk or None
    passes: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # name: [tokens after the first, steps]

    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (qid, group, turn), answer in sorted(answers.items()):
        prompt = prompts.get((qid, group))
        if prompt is None:
            continue
        ids = turn_prompt_ids(tokenizer, prompt, [answers[(qid, group, i)] for i in range(turn)])
        plain = sum(step_cost(table, 0, 0, args.chunk) for _ in range(len(answer) - 1))
        pols = policies()
        for name, gate in pols.pop("_gate").items():  # a fresh gate per request
            fresh = DraftGate(gate.costs)
            gate.__dict__.update(fresh.__dict__)
        if prompt.prediction is not None:
            pols.update(prediction_policies(ids, prompt.prediction))
        for name, (propose, observe) in pols.items():
            ms, steps = replay(ids, answer, propose, observe, table, args.chunk, args.k)
            totals[group][name] += ms
            totals["all"][name] += ms
            passes[name][0] += len(answer) - 1
            passes[name][1] += steps
        totals[group]["plain"] += plain
        totals["all"]["plain"] += plain
    names = [n for n in next(iter(totals.values())) if n != "plain"]
    print("category".ljust(16), *[n.rjust(15) for n in names])
    for group, row in totals.items():
        print(group.ljust(16), *[f"{row['plain'] / row[n]:15.3f}" if row.get(n) else " " * 15 for n in names])
    print("tokens / pass".ljust(16), *[f"{passes[n][0] / max(1, passes[n][1]):15.2f}" for n in names])


if __name__ == "__main__":
    main()
