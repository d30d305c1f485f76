"""Speculation that follows the load: a cost model measured at start-up, and the per-step plan.

Speculation trades target compute for fewer target passes. Alone, a decode pass is memory-bound:
verifying k + 1 tokens costs about as much as scoring one, so drafting pays. In a large batch
the pass becomes compute-bound, its time grows with the tokens scored, and the rejected draft
tokens are pure waste; a sequence whose drafts are mostly rejected wastes draft time at any load.
The scheduler therefore decides, before every step, how many tokens each sequence drafts.

The model (all times in seconds, measured on this machine):

- ``t_target(B, T)``: one batched target pass over ``B`` rows of ``T`` tokens each (``T = 1 +`` the
  largest draft in the batch; shorter rows are padded). Measured at start-up on a grid of batch
  sizes (1, 2, 4, ... up to ``--max-batch-size``) and ``T`` in {1, 2, 3, k/2 + 1, k + 1} at a
  fixed context (:func:`~specdecode.cost.serve_measure.measure_target_costs`), interpolated
  linearly in each axis between grid points and clamped outside it. While serving, every pass of
  a batch size on the grid moves that row's speed factor (:meth:`CostModel.observe_target`, an
  exponential moving average): the start-up minute may have been a slow or a fast one, and
  serving contexts are longer than the 64 tokens measured; the table keeps the shape, the factor
  follows the level.
- ``c_p``: the time proposer ``p`` takes per drafted token for one sequence (a draft model runs
  one forward per token; prompt lookup almost nothing). Measured at start-up for the server's
  default proposer (:func:`~specdecode.cost.serve_measure.measure_draft_cost`), for the others on
  their first use, and refined while serving (an exponential moving average) with the calls that
  drafted right after the sequence's previous draft: a call that first catches up with more
  context (the proposer's prompt prefill on a sequence's first call, the tokens of steps it did
  not draft) is a one-off cost, not the per-token one the plan needs, and would hold drafting
  back long after.
- ``alpha_i``: sequence i's per-position acceptance probability (the alpha of the formula below),
  ``(accepted + w * alpha_p) / (trials + w)`` with its own recent counts (decayed by :data:`DECAY`
  per step) and the server's running estimate ``alpha_p`` of its proposer as the prior (weight
  ``w`` = :data:`PRIOR_WEIGHT` trials). A step that accepted m of d drafted tokens is m successes in
  ``min(m + 1, d)`` trials (:func:`acceptance_trials`): the positions after the first rejection
  were never tried. (Counting d trials, ``accepted / drafted``, vLLM's reported acceptance rate,
  underestimates alpha the more the longer the draft: at alpha = 0.9 and k = 4 it gives 0.77, so
  E(alpha, 4) is priced 3.2 instead of 4.1 and the plan, in a load run at concurrency 1, fell back
  from k = 4 to k = 1 on prompts where k = 4 was 1.3-1.5x faster than plain decoding.) A sequence
  that stops drafting forgets its counts step by step, drifting back to the prior, so it is tried
  again later (the model keeps exploring).
- A row drafting k tokens yields ``E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens per step
  in expectation (Leviathan et al. 2023, arXiv 2211.17192, eq. 1), one when k = 0.

Per step, choose ``k_i`` in ``0 .. kmax_i`` (the request's ``num_speculative_tokens``, cut to the
tokens it may still produce) to maximise the batch's goodput, expected tokens per second::

    R(k) = sum_i E(alpha_i, k_i) / (t_target(B, 1 + max_i k_i) + sum_i [k_i > 0] (k_i * c_{p_i} + u_i))

where ``u_i`` is row i's catch-up charge: a proposer that did not draft at the previous step (or
ever) must first be fed the context it missed (the draft model prefills the whole prompt on its
first call), a one-off cost of ``behind_i`` tokens x the proposer's catch-up seconds per token
(:meth:`CostModel.catchup_time`), spread over the drafting steps the row has left (its remaining
tokens / ``E(alpha_i, kmax_i)``); 0 right after a draft.

Search (:func:`plan_speculation`): for every K in 0 .. max kmax_i, rows draft ``min(K, kmax_i)``
or nothing; a row joins the drafting set, in order of its gain per second of draft time, while its
gain per draft second ``(E_i - 1) / (k_i c_i)`` beats the current ``R`` (adding it raises R exactly
then). The best K wins; K = 0 (no speculation) is always a candidate, and a K > 0 must beat it by
:data:`SPECULATION_MARGIN` (5%): the model's inputs are estimates (a table measured at a short
context, acceptance learned mostly from steps that chose to draft), and near break-even they flip
from step to step. The catch-up charge ``u_i`` matters more: without it, in a paired load run at
concurrency 2 (``lab/results/issue7-serve-paired*``), a request running alone for its last tokens
drafted one token and paid its draft's prompt prefill (about a second) for it, 17-19 times per
run (adaptive / off 0.95); with it, 1.01. So at a batch size where
``t_target(B, K + 1)`` is well above ``t_target(B, 1)`` nobody drafts, and a sequence with a low
``alpha_i`` stops drafting first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdecode.pass_observers import PassObserver, TargetPass
from specdecode.schedule import acceptance_trials, expected_tokens  # E(alpha, k): Leviathan et al. 2023, eq. 1

PRIOR_WEIGHT = 4.0  # trials (positions tried) of prior evidence behind alpha_p
DECAY = 0.9  # per step, weight of a sequence's older acceptance counts
INITIAL_ACCEPTANCE = 0.6  # alpha_p before the server has seen any draft of proposer p
DRAFT_COST_EMA = 0.9  # weight of the old draft cost estimate per observation
CATCHUP_PRIOR = 0.05  # catch-up seconds per context token, as a fraction of c_p, before measured
SPECULATION_MARGIN = 0.05  # a plan that drafts must be expected to beat plain decoding by this fraction
TARGET_COST_EMA = 0.9  # weight of the old speed factor of a batch size's row per pass observed


@dataclass
class CostModel(PassObserver):
    """Measured costs (see the module docstring); an observer of the server's target passes
    (:meth:`target_pass`: every decode pass refines ``t_target``).

    Attributes:
        batch_sizes: grid of B, increasing.
        tokens: grid of T (tokens per row), increasing.
        target_s: ``[len(batch_sizes)][len(tokens)]`` seconds of one target pass.
        draft_s_per_token: per proposer name, seconds per drafted token for one sequence.
    """

    batch_sizes: list[int]
    tokens: list[int]
    target_s: list[list[float]]
    draft_s_per_token: dict[str, float] = field(default_factory=dict)
    scale: list[float] = field(default_factory=list)
    catchup_s_per_token: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scale = list(self.scale) or [1.0] * len(self.batch_sizes)

    def target_time(self, batch: int, tokens: int) -> float:
        """``t_target(B, T)`` in seconds: the start-up table times its row's speed factor
        (:meth:`observe_target`), interpolated linearly in T, then in B (clamped at the grid's ends)."""
        per_b = [
            f * float(np.interp(tokens, self.tokens, row)) for f, row in zip(self.scale, self.target_s, strict=True)
        ]
        return float(np.interp(batch, self.batch_sizes, per_b))

    def draft_time(self, proposer: str) -> float:
        """``c_p``: seconds per drafted token of ``proposer`` (0 if never measured)."""
        return self.draft_s_per_token.get(proposer, 0.0)

    def observe_draft(self, proposer: str, seconds: float, tokens: int) -> None:
        """Refine ``c_p`` with one measured ``propose`` call that drafted ``tokens`` tokens."""
        if tokens <= 0:
            return
        old = self.draft_s_per_token.get(proposer)
        new = seconds / tokens
        self.draft_s_per_token[proposer] = new if old is None else DRAFT_COST_EMA * old + (1 - DRAFT_COST_EMA) * new

    def catchup_time(self, proposer: str) -> float:
        """Seconds per context token a proposer takes to catch up before it drafts (the draft
        model's prefill of what it has not seen); before any is measured, :data:`CATCHUP_PRIOR` x
        ``c_p``."""
        return self.catchup_s_per_token.get(proposer, CATCHUP_PRIOR * self.draft_time(proposer))

    def observe_catchup(self, proposer: str, seconds: float, drafted: int, behind: int) -> None:
        """Refine :meth:`catchup_time` with a call that first fed the proposer ``behind`` context
        tokens, then drafted ``drafted`` tokens in ``seconds`` (exponential moving average)."""
        if behind <= 0:
            return
        new = max(0.0, seconds - drafted * self.draft_time(proposer)) / behind
        old = self.catchup_s_per_token.get(proposer)
        self.catchup_s_per_token[proposer] = new if old is None else DRAFT_COST_EMA * old + (1 - DRAFT_COST_EMA) * new

    def target_pass(self, p: TargetPass) -> None:
        """A batched pass the scheduler made: a decode pass refines ``t_target`` (:meth:`observe_target`
        with its rows and its widest row's tokens); a prefill does not."""
        if not p.prefill:
            self.observe_target(p.rows, p.width, p.seconds)

    def observe_target(self, batch: int, tokens: int, seconds: float) -> None:
        """Refine the level of ``t_target(batch, .)`` with one pass measured while serving.

        Each batch size of the grid has a speed factor (1 at start-up) by which its row of the
        table is multiplied; a pass of ``batch`` rows and ``tokens`` tokens moves the factor toward
        ``seconds`` / the start-up table's time for it (an exponential moving average, weight
        :data:`TARGET_COST_EMA` on the old factor). The start-up table measures the shape (what
        more tokens cost) at a 64-token context in one minute of the machine; serving passes have
        real context lengths and the machine's current speed, which scale a row as a whole. A
        scale rather than a per-point average keeps a row consistent: refining only the
        plain-step point a batch runs all the time would make the untried draft lengths look
        cheap. Batch sizes off the grid are ignored."""
        if batch not in self.batch_sizes or seconds <= 0:
            return
        i = self.batch_sizes.index(batch)
        base = float(np.interp(tokens, self.tokens, self.target_s[i]))
        if base > 0:
            self.scale[i] = TARGET_COST_EMA * self.scale[i] + (1 - TARGET_COST_EMA) * seconds / base

    def to_dict(self) -> dict[str, object]:
        """The model as JSON-ready data (lists, dicts, floats); :meth:`from_dict` reads it back."""
        return {
            "batch_sizes": self.batch_sizes,
            "tokens": self.tokens,
            "target_s": self.target_s,
            "scale": self.scale,
            "draft_s_per_token": dict(self.draft_s_per_token),
            "catchup_s_per_token": dict(self.catchup_s_per_token),
        }

    @classmethod
    def from_dict(cls, data: Any) -> CostModel:
        """A model from :meth:`to_dict`'s data (e.g. read back from JSON), checked field by field.

        Args:
            data: a mapping with ``batch_sizes`` and ``tokens`` (strictly increasing integers >= 1),
                ``target_s`` (``[len(batch_sizes)][len(tokens)]`` seconds, finite and > 0), and
                optionally ``scale`` (``len(batch_sizes)`` finite factors > 0; default all 1),
                ``draft_s_per_token`` and ``catchup_s_per_token`` (proposer name -> seconds,
                finite and >= 0; default empty).

        Raises:
            ValueError: ``data`` is not a mapping, a field is missing, unknown or malformed; the
                message names the field.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"cost model: expected a mapping of fields, got {type(data).__name__}")
        unknown = sorted(set(data) - _FIELDS)
        if unknown:
            raise ValueError(f"cost model: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
        for name in ("batch_sizes", "tokens", "target_s"):
            if name not in data:
                raise ValueError(f"cost model: field {name!r} is missing")
        batch_sizes = _increasing_ints("batch_sizes", data["batch_sizes"])
        tokens = _increasing_ints("tokens", data["tokens"])
        rows = data["target_s"]
        if not isinstance(rows, list) or len(rows) != len(batch_sizes):
            raise ValueError(f"cost model: target_s must be a list of {len(batch_sizes)} rows (one per batch size)")
        target_s = [_times(f"target_s[{i}]", row, len(tokens), positive=True) for i, row in enumerate(rows)]
        scale = data.get("scale")
        scale = [1.0] * len(batch_sizes) if scale is None else _times("scale", scale, len(batch_sizes), positive=True)
        return cls(
            batch_sizes,
            tokens,
            target_s,
            draft_s_per_token=_per_proposer("draft_s_per_token", data.get("draft_s_per_token")),
            scale=scale,
            catchup_s_per_token=_per_proposer("catchup_s_per_token", data.get("catchup_s_per_token")),
        )


_FIELDS = frozenset({"batch_sizes", "tokens", "target_s", "scale", "draft_s_per_token", "catchup_s_per_token"})


def _increasing_ints(name: str, value: Any) -> list[int]:
    ok = isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if not ok or value[0] < 1 or any(a >= b for a, b in zip(value[:-1], value[1:], strict=True)):
        raise ValueError(
            f"cost model: {name} must be a non-empty, strictly increasing list of integers >= 1, got {value!r}"
        )
    return list(value)


def _number(name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"cost model: {name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"cost model: {name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _times(name: str, value: Any, length: int, positive: bool) -> list[float]:
    if not isinstance(value, list) or len(value) != length:
        raise ValueError(f"cost model: {name} must be a list of {length} numbers, got {value!r}")
    return [_number(f"{name}[{j}]", v, positive) for j, v in enumerate(value)]


def _per_proposer(name: str, value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"cost model: {name} must map proposer names to seconds, got {value!r}")
    return {k: _number(f"{name}[{k!r}]", v, positive=False) for k, v in value.items()}


@dataclass
class AcceptanceEstimate:
    """A sequence's recent per-position acceptance counts, decayed per step (see the module docstring)."""

    accepted: float = 0.0
    trials: float = 0.0

    def rate(self, prior: float) -> float:
        """``alpha_i`` in [0, 1] with ``prior`` (the proposer's running estimate) weighted PRIOR_WEIGHT trials."""
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.trials + PRIOR_WEIGHT)

    def observe(self, drafted: int, accepted: int) -> None:
        """One step that accepted ``accepted`` of ``drafted`` tokens: decay the old counts, add this
        step's (``drafted`` = 0: just forget a little)."""
        self.accepted = DECAY * self.accepted + accepted
        self.trials = DECAY * self.trials + acceptance_trials(drafted, accepted)


def plan_speculation(
    alphas: Sequence[float],
    max_ks: Sequence[int],
    draft_costs: Sequence[float],
    target_time: Callable[[int, int], float],
    margin: float = SPECULATION_MARGIN,
    setup_costs: Sequence[float] | None = None,
) -> list[int]:
    """Tokens to draft per row this step, maximising expected tokens per second (module docstring).

    Args:
        alphas: per row, estimated acceptance rate in [0, 1].
        max_ks: per row, the most tokens it may draft (0: the row does not speculate).
        draft_costs: per row, seconds per drafted token of its proposer.
        target_time: ``t_target(B, T)`` in seconds.
        margin: a plan that drafts must beat plain decoding's expected rate by this fraction.
        setup_costs: per row, seconds charged on top of ``k_i c_i`` when the row drafts at all
            (its proposer's catch-up, amortised by the caller); None: 0.

    Returns:
        per row, k_i in ``0 .. max_ks[i]``.
    """
    B = len(alphas)
    best_rate, best = (1.0 + margin) * B / target_time(B, 1), [0] * B
    setups = setup_costs or [0.0] * B
    for K in range(1, max(max_ks, default=0) + 1):
        ks = [min(K, m) for m in max_ks]
        gains = [expected_tokens(a, k) - 1.0 for a, k in zip(alphas, ks, strict=True)]
        costs = [k * c + (u if k else 0.0) for k, c, u in zip(ks, draft_costs, setups, strict=True)]
        order = sorted(
            (i for i in range(B) if ks[i] > 0 and gains[i] > 0),
            key=lambda i: gains[i] / costs[i] if costs[i] > 0 else float("inf"),
            reverse=True,
        )
        tokens, seconds, chosen = float(B), target_time(B, K + 1), [0] * B
        for i in order:
            if gains[i] * seconds <= costs[i] * tokens:  # gain / cost <= current rate: adding lowers it
                break
            tokens, seconds, chosen[i] = tokens + gains[i], seconds + costs[i], ks[i]
        if any(chosen):
            seconds += target_time(B, 1 + max(chosen)) - target_time(B, K + 1)  # rows capped below K
            if tokens / seconds > best_rate:
                best_rate, best = tokens / seconds, chosen
    return best
