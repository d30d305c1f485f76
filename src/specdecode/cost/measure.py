"""Measure a pass-cost table on this machine (``specdecode cost-table``): the JSON that
:mod:`specdecode.cost.table` reads to price recorded passes.

What is measured, for the loaded target (and draft), through the runners decoding uses
(:func:`specdecode.models.backends.make_runner`: llama.cpp's context, torch's eager runner, or its
static KV cache and CUDA graphs):

- ``target``: milliseconds of one verification pass of W tokens (every row scored, as the engine
  scores a draft's), after ``depth`` tokens cached, for each W of ``widths``;
- ``draft``: milliseconds of one draft-model pass of W tokens (the last row scored, as a drafting
  step or the catch-up of accepted tokens does), same context, for each W of ``draft_widths``;
- ``prefill_ms_per_token``: a fresh sequence's first pass over ``prefill`` tokens, per token;
- ``step_ms``: the host's work per decoding step outside the passes. The target alone decodes
  ``step_tokens`` greedy tokens after a ``prefill``-token prompt (end of sequence ignored) through
  :class:`~specdecode.SpeculativeGenerator`; its wall time minus its passes' price on the curves
  just measured, over its steps (the passes after the prefill). The smaller of two runs after a
  warm-up; never below 0.

Token ids are random (a pass costs the same whatever the tokens); each timed pass is one median of
``reps`` after ``warmups`` untimed ones, the device synchronized around each, the runner truncated
back to ``depth`` after it. A pass through llama.cpp in exact mode is timed as exact mode runs it
(split into batch-invariant chunks), which is what a recorded pass of that width costs unless the
verifier stopped it early at a mismatch: an exact-mode table is an upper bound on those passes.
The same procedure, on random weights of the default models' shapes, made the shipped H100 tables
(``lab/gpu/gpu_check.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

import torch

DEFAULT_WIDTHS = (1, 2, 3, 5, 9, 17, 33)
"""Target pass widths: one token, the verification widths of k = 1, 2, 4, 8, and trees of 16 and 32 nodes."""
DEFAULT_DRAFT_WIDTHS = (1, 2, 3, 5, 9)
"""Draft pass widths: a drafting step, and catching up after 1-8 accepted tokens."""


@dataclass(frozen=True)
class CostSettings:
    """How :func:`measure_cost_table` measures (the module docstring says what each figure is).

    Attributes:
        widths: target pass widths (tokens), each >= 1.
        draft_widths: draft pass widths (tokens), each >= 1.
        depth: tokens cached before each timed pass (>= 0).
        prefill: tokens of the prefill pass and of the step fit's prompt (>= 1).
        reps: timed passes per width, their median kept (>= 1).
        warmups: untimed passes first (>= 0; a CUDA graph is captured in the first).
        step_tokens: new tokens of each run of the step fit (>= 2), or 0 to skip it (no ``step_ms``).
        seed: of the random token ids.

    Raises:
        ValueError: a field out of its range (the message names it).
    """

    widths: tuple[int, ...] = DEFAULT_WIDTHS
    draft_widths: tuple[int, ...] = DEFAULT_DRAFT_WIDTHS
    depth: int = 400
    prefill: int = 256
    reps: int = 10
    warmups: int = 2
    step_tokens: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("widths", "draft_widths"):
            value = getattr(self, name)
            if not value or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in value):
                raise ValueError(f"{name} must be one or more integers >= 1, got {value!r}")
            object.__setattr__(self, name, tuple(sorted(set(value))))
        for name, low in (("depth", 0), ("prefill", 1), ("reps", 1), ("warmups", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        step = self.step_tokens
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or step == 1:
            raise ValueError(f"step_tokens must be 0 (no step fit) or an integer >= 2, got {step!r}")


def time_pass(runner: Any, ids: torch.Tensor, num_logits: int, depth: int, reps: int, warmups: int) -> float:
    """Median milliseconds of ``runner.forward(ids, num_logits)`` at ``depth`` cached tokens, over
    ``reps`` passes after ``warmups``, the runner's device synchronized around each; the runner is
    truncated back to ``depth`` after each."""
    from specdecode.models.torch.placement import synchronize

    times = []
    for i in range(warmups + reps):
        synchronize(runner.device)
        tic = time.perf_counter()
        runner.forward(ids, num_logits=num_logits)
        synchronize(runner.device)
        if i >= warmups:
            times.append(time.perf_counter() - tic)
        runner.truncate(depth)
    return statistics.median(times) * 1000


def pass_curve(runner: Any, widths: Sequence[int], settings: CostSettings, score_all: bool) -> dict[str, float]:
    """``{str(W): ms}`` for each W of ``widths`` on ``runner`` (reset first; every row scored, a
    verification pass, else the last, a draft pass), ``settings.depth`` random tokens cached."""
    g = torch.Generator().manual_seed(settings.seed)
    runner.reset()
    runner.prepare_widths(widths)  # CUDA graphs captured now, not inside a timed pass
    if settings.depth:
        runner.forward(torch.randint(0, runner.vocab_size, (settings.depth,), generator=g), num_logits=1)
    curve = {}
    for width in widths:
        ids = torch.randint(0, runner.vocab_size, (width,), generator=g)
        ms = time_pass(runner, ids, width if score_all else 1, settings.depth, settings.reps, settings.warmups)
        curve[str(width)] = round(ms, 4)
    return curve


def prefill_ms_per_token(runner: Any, settings: CostSettings) -> float:
    """Milliseconds per token of a fresh sequence's first pass over ``settings.prefill`` random
    tokens on ``runner`` (reset first; the last row scored, as the engine's prefill), median of
    ``settings.reps``."""
    g = torch.Generator().manual_seed(settings.seed + 1)
    runner.reset()
    ids = torch.randint(0, runner.vocab_size, (settings.prefill,), generator=g)
    return time_pass(runner, ids, 1, 0, settings.reps, settings.warmups) / settings.prefill


def fit_step_ms(model: Any, table: dict[str, Any], settings: CostSettings) -> dict[str, Any]:
    """The host's work per step (module docstring): ``{"step_ms": ms, "runs": [...]}``, each run's
    wall seconds, passes' price and steps."""
    from specdecode import SamplingParams, SpeculativeGenerator
    from specdecode.cost.table import parse_cost_table, price
    from specdecode.models.torch.placement import synchronize

    priced = parse_cost_table(table)
    generator = SpeculativeGenerator(model)
    generator.eos_token_ids = frozenset()  # decode every token asked for
    generator.reuse_prompt = False  # every run's prefill is priced from the table: it must run
    g = torch.Generator().manual_seed(settings.seed + 2)
    prompt = torch.randint(0, generator.target.vocab_size, (settings.prefill,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_new_tokens=settings.step_tokens)
    generator.generate(prompt, SamplingParams(temperature=0, max_new_tokens=4), speculative=False)  # warm-up
    runs = []
    for _ in range(2):
        synchronize(generator.target.device)
        tic = time.perf_counter()
        out = generator.generate(prompt, params, speculative=False)
        synchronize(generator.target.device)
        seconds = time.perf_counter() - tic
        widths = list(out.stats.target_pass_widths)
        passes_s = price({"passes": {"target": widths, "draft": []}}, priced)
        runs.append({"seconds": round(seconds, 4), "passes_s": round(passes_s or 0.0, 4), "steps": len(widths) - 1})
    per_step = [max(0.0, (r["seconds"] - r["passes_s"]) * 1000 / r["steps"]) for r in runs if r["steps"] > 0]
    return {"step_ms": round(min(per_step), 4) if per_step else 0.0, "runs": runs}


def measure_cost_table(target: Any, draft: Any | None = None, settings: CostSettings | None = None,
                       command: str = "", note: str = "") -> dict[str, Any]:  # fmt: skip
    """A cost table (:mod:`specdecode.cost.table`'s JSON) measured on this machine.

    Args:
        target: the loaded target (a llama.cpp model or a ``transformers`` model, as
            :func:`specdecode.load.load_models` gives it).
        draft: the loaded draft model, or None (no ``draft`` curve: a draft model's passes are then
            priced at nothing, and marked so).
        settings: :class:`CostSettings` (the defaults: widths 1-33, 400 cached, 10 repeats).
        command: the command line, kept in ``source``.
        note: more to say in ``source`` (``"random weights of ..."``).

    Returns:
        ``{"device", "source", "target", "draft"?, "prefill_ms_per_token", "step_ms"?}``, which
        :func:`~specdecode.cost.table.parse_cost_table` accepts, plus ``"measurement"``
        (settings and the step fit's runs) for the record; write it with ``json.dump``.

    Raises:
        ValueError: a runner cannot hold ``depth`` + the widest pass, or ``prefill`` + ``step_tokens``
            (the runner's message names its context).
    """
    import specdecode
    from specdecode.models.backends import describe_passes, make_runner

    settings = settings or CostSettings()
    runner = make_runner(target)  # one runner (one context or static cache) for the curve and the prefill
    table: dict[str, Any] = {"device": describe_passes(target, runner)}
    table["source"] = (
        f"Measured {date.today().isoformat()} by specdecode {specdecode.__version__} cost-table"
        + (f" (`{command}`)" if command else "")
        + f": median of {settings.reps} passes after {settings.warmups} warm-ups, {settings.depth} tokens cached, "
        f"random token ids; prefill over {settings.prefill} tokens"
        + (f"; step_ms from the target alone's {settings.step_tokens} tokens" if settings.step_tokens else "")
        + (f"; {note}" if note else "")
        + "."
    )
    table["target"] = pass_curve(runner, settings.widths, settings, score_all=True)
    table["prefill_ms_per_token"] = round(prefill_ms_per_token(runner, settings), 5)
    del runner  # its cache freed before the step fit's generator makes its own
    if draft is not None:
        table["draft"] = pass_curve(make_runner(draft), settings.draft_widths, settings, score_all=False)
    measurement: dict[str, Any] = {"settings": {k: list(v) if isinstance(v, tuple) else v
                                                for k, v in settings.__dict__.items()}}  # fmt: skip
    if settings.step_tokens:
        fit = fit_step_ms(target, table, settings)
        table["step_ms"] = fit["step_ms"]
        measurement["step_runs"] = fit["runs"]
    table["measurement"] = measurement
    return table
