"""The benchmark loop: every method on every prompt, interleaved, and ``results.json``.

For each prompt and repeat, every method runs in turn (so machine drift hits all alike), in an order
rotated by one place per prompt and per repeat (:func:`method_order`): no method always runs first
after another prompt's last method, or always right after the same one, so a cost of the place in
the round (a cold cache, a context switched in) is spread over the methods instead of charged to one
of them; each record says its ``position`` in the round. A prompt
runs turn by turn: each turn's context holds the method's own previous answers. A warm-up
generation per method comes before any timing. A peer that raises (at warm-up or later) is
recorded as skipped with the reason and its records are dropped; our own methods' errors propagate.

Cross-request proposer state (the suffix proposer's cache of earlier outputs) is cleared before
every prompt, the warm-up's included (``BenchSettings.reset_proposer_caches``, default True): a
method's timing on a prompt then never depends on what the run decoded before it, e.g. the
warm-up's answer to the same prompt.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from specdecode.bench.methods import BenchModels, BenchSettings, Variant
from specdecode.bench.metrics import Record
from specdecode.bench.prompts import Prompt, encode_chat

WARMUP_TOKENS = 8


def environment(command: Sequence[str] | None = None) -> dict[str, Any]:
    """CPU and GPU names, the CPU's vector capability and native bf16 matmul (which decide how a
    pass over k + 1 tokens costs, :mod:`specdecode.models.torch.cpu`), library versions, torch's thread
    count, the load average (1, 5, 15 min: other work on the machine skews every timing) and the
    command line."""
    import torch
    import transformers

    from specdecode.models.torch.cpu import native_bf16_matmul

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16_matmul": native_bf16_matmul(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": list(command if command is not None else sys.argv),
    }


LLAMACPP_PEERS = ("llamacpp",)
"""Peers priced as one target pass per token after the prompt's (llama-cpp-python's plain ``generate``)."""


def record_passes(variant: Variant, out: Any, prompt_tokens: int) -> dict[str, list[int]] | None:
    """A record's ``passes`` (what :mod:`specdecode.cost.table` prices): ``target``, the tokens
    of each target forward pass (the prefill's first); ``draft``, of each draft-model forward; and
    ``accepted``, the draft tokens accepted per verification step; ``draft_kind``, the cost-table
    curve that prices ``draft`` (its proposer's ``describe().pass_kind``: draft, eagle, medusa). Ours come from its
    statistics; the plain llama.cpp peer's are the prompt, then 1 per further token; None for the
    other peers (their passes are not known)."""
    stats = out.stats
    if stats is not None:
        return {
            "target": list(stats.target_pass_widths),
            "draft": list(stats.draft_pass_widths),
            "accepted": list(stats.accepted_per_step),
            "draft_kind": stats.draft_pass_kind,
        }
    if variant.method.name in LLAMACPP_PEERS and out.token_ids:
        return {"target": [prompt_tokens] + [1] * (len(out.token_ids) - 1), "draft": [], "accepted": []}
    return None


def method_order(variants: Sequence[Variant], prompt_index: int, repeat: int) -> list[Variant]:
    """The order the methods run in for prompt ``prompt_index`` (0-based) at ``repeat``: the given
    order rotated left by ``prompt_index + repeat`` places (a cyclic Latin square over the rounds,
    so each method takes each place equally often over every len(variants) consecutive rounds)."""
    shift = (prompt_index + repeat) % len(variants) if variants else 0
    return [*variants[shift:], *variants[:shift]]


def run_turns(
    models: BenchModels,
    prompt: Prompt,
    variant: Variant,
    settings: BenchSettings,
    repeat: int = 0,
    position: int = 0,
) -> list[Record]:
    """Decode every turn of ``prompt`` with ``variant``, run at ``position`` (0-based) in its round of
    methods; one record per turn (see metrics module)."""
    messages: list[dict[str, str]] = []
    records = []
    if settings.reset_proposer_caches:
        models.clear_proposer_caches()
    for turn, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        prompt_ids = encode_chat(models.tokenizer, messages)
        continues = prompt.keeps_history and turn > 0  # multi_turn: the history's cache may be reused
        out = variant.run(models, prompt_ids, settings, prompt.prediction if turn == 0 else None, continues)
        records.append(
            {
                "question_id": prompt.question_id,
                "category": prompt.category,
                "group": prompt.group,
                "turn": turn,
                "repeat": repeat,
                "position": position,
                "method": variant.label,
                "settings": {**asdict(settings), "num_speculative_tokens": out.num_speculative_tokens},
                "prompt_tokens": len(prompt_ids),
                "new_tokens": len(out.token_ids),
                "wall_time_s": out.wall_time_s,
                "time_to_first_token_s": (
                    out.stats.time_to_first_token_s if out.stats is not None else out.time_to_first_token_s
                ),
                "stats": out.stats.to_dict() if out.stats is not None else None,
                "proposer_weight_bytes": out.proposer_bytes,
                "token_ids": out.token_ids,
                "passes": record_passes(variant, out, len(prompt_ids)),
            }
        )
        answer = models.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
    return records


def _skip(error: Exception, variant: Variant, skipped: dict[str, str], where: str) -> None:
    if not variant.method.peer:
        raise error
    skipped[variant.label] = f"{type(error).__name__} at {where}: {error}"


def warm_up(models: BenchModels, prompts: Sequence[Prompt], variants: Sequence[Variant], settings: BenchSettings,
            skipped: dict[str, str]) -> None:  # fmt: skip
    """One short untimed generation per method on the shortest prompt's first turn."""
    first = min(prompts, key=lambda p: len(p.turns[0]))
    short = replace(first, turns=first.turns[:1])
    brief = replace(settings, max_new_tokens=min(WARMUP_TOKENS, settings.max_new_tokens))
    for variant in variants:
        try:
            run_turns(models, short, variant, brief)
        except Exception as error:  # a peer's failure of any kind is recorded
            _skip(error, variant, skipped, "warm-up")


def run_bench(
    models: BenchModels,
    prompts: Sequence[Prompt],
    variants: Sequence[Variant],
    settings: BenchSettings,
    repeats: int = 1,
    warmup: bool = True,
    progress: bool = True,
    announce: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; return the results (``records``, ``methods``, ``skipped``, ``greedy``).

    Repeat r of a prompt uses seed ``settings.seed + r`` for every method. The caller adds
    ``settings`` and ``environment`` and saves it with :func:`save_results`. With ``announce``,
    the plan (prompts, turns, methods, repeats) goes to stderr before anything runs, and an
    estimate of the whole run's time once the first prompt has run with every method.

    Raises:
        ValueError: no prompts, no methods, or ``repeats`` < 1.
    """
    from tqdm.auto import tqdm

    if not prompts or not variants or repeats < 1:
        raise ValueError(f"need prompts ({len(prompts)}), methods ({len(variants)}) and repeats >= 1 ({repeats})")
    turns = sum(len(p.turns) for p in prompts)
    if announce:
        print(
            f"bench: {len(prompts)} prompts ({turns} turns) x {len(variants)} methods x {repeats} repeats = "
            f"{turns * len(variants) * repeats} generations of up to {settings.max_new_tokens} tokens",
            file=sys.stderr,
        )
    skipped: dict[str, str] = {}
    if warmup:
        warm_up(models, prompts, variants, settings, skipped)
    records: list[Record] = []
    bar = tqdm(total=len(prompts) * repeats * len(variants), desc="bench", unit="run", disable=not progress)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        if announce and index == 1:
            seconds = (time.perf_counter() - started) * turns / len(prompts[0].turns)
            print(f"bench: the first prompt took {time.perf_counter() - started:.0f} s; the whole run about "
                  f"{seconds / 60:.0f} min", file=sys.stderr)  # fmt: skip
        for repeat in range(repeats):
            seeded = replace(settings, seed=settings.seed + repeat)
            for position, variant in enumerate(method_order(variants, index, repeat)):
                bar.set_postfix_str(f"{prompt.group} {prompt.question_id} {variant.label}", refresh=False)
                if variant.label not in skipped:
                    try:
                        records += run_turns(models, prompt, variant, seeded, repeat, position)
                    except Exception as error:  # a peer's failure of any kind is recorded
                        _skip(error, variant, skipped, f"prompt {prompt.question_id}")
                        records = [r for r in records if r["method"] != variant.label]
                bar.update()
    bar.close()
    return {"greedy": settings.greedy, "methods": [v.label for v in variants], "skipped": skipped, "records": records}


def save_results(results: dict[str, Any], out_dir: str | Path) -> Path:
    """Write ``results.json`` into ``out_dir`` (created); return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return path
