"""How many tokens to draft at each step: constant, heuristic, or adaptive (expected throughput).

The engine asks the schedule for k before every step (:meth:`SpeculationSchedule.next_k`) and
tells it what happened after verification (:meth:`SpeculationSchedule.update`). The schedule
never touches tokens, so it cannot change what is generated under greedy decoding, and under
sampling every step is still exact rejection sampling: k is chosen *before* the step is drafted
and verified, from earlier steps only, and the target distribution holds for any k.

- ``constant``: k = ``num_speculative_tokens`` every step; a greedy request's copied drafts (prompt
  lookup, a prediction) pass the draft gate (:mod:`specdecode.draft_gate`: sent only as far as this
  request's acceptance and this machine's measured pass costs say they pay). The default.
- ``ungated``: ``constant`` without the draft gate: every draft is sent.
- ``heuristic``: start at ``num_speculative_tokens``; after a step whose draft was accepted in
  full, k += 2; after a rejection, k -= 1; within [1, ``max_speculative_tokens``]. This is the
  schedule of Hugging Face assisted generation (``num_assistant_tokens_schedule="heuristic"``,
  ``AssistedCandidateGenerator.update_candidate_strategy``), which follows the accepted length
  without any model of cost. Gated as ``constant``.
- ``adaptive``: per step, the k in {0, 1, ..., ``max_speculative_tokens``} with the highest
  expected tokens per second under a model measured during the request (k = 0: plain decoding).
  Growth to long drafts when the proposer is good, and falling back to plain decoding when it is
  not, both follow from the one maximisation.

The adaptive model (all times in seconds, all measured on this machine during the request)::

    rate(0) = 1 / t1
    rate(k) = E(alpha, k) / (k * c + t_verify(k)),   E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)

- ``t1``: the target pass of a plain step (one token), a moving average of the plain steps'
  target time, but at most the average verification pass (which scores more tokens; this bounds
  a plain step measured while the machine stalled). The first step of a request is plain (it
  measures t1), and while speculating a plain step is taken every ``refresh_interval``
  speculative steps to keep t1 current.
- ``t_verify(k) = a + b k``: the target pass that verifies k drafted tokens (k + 1 tokens), a
  least-squares line over the recent verification passes (each weighted ``(1 - ema)`` per newer
  one) and the point (0, t1) (a plain step is the pass that verifies nothing), with a weak ridge
  pulling b to ``prior_verify_slope * t1`` per token, so that it is defined from the first step
  on; b >= 0.
- ``c``: draft seconds per drafted token, a moving average of ``draft_time / drafted`` over
  steps whose previous step also drafted. The first draft after plain steps also feeds the
  proposer the tokens it missed (the whole prompt, for the first draft of a request with a draft
  model or early exit), so such a step may only lower ``c``; before any such measurement ``c`` is
  ``prior_draft_cost * t1`` (or the lowest of those upper bounds, if lower).
- ``alpha``: the per-position acceptance probability (Leviathan et al. 2023, arXiv 2211.17192,
  eq. 1), a Beta-style estimate ``(accepted + w0 alpha0) / (trials + w0)`` over positions: a step
  that accepted m of d drafted tokens adds m successes in ``min(m + 1, d)`` trials, and older
  evidence decays by ``acceptance_decay`` per newer trial (0.9: about the last ten positions
  weigh), so a proposer that becomes worse or better is followed within a few steps. Prior ``alpha0 = prior_acceptance``
  with ``w0 = prior_weight`` trials.

Speculation is chosen only when its best rate beats ``rate(0) * (1 + fallback_margin)``.

Exploration: at k = 0 the schedule learns nothing about alpha, so it *probes*: one step at k =
``probe_k`` (cheap) after ``backoff`` plain steps; a probe whose draft is rejected doubles the
backoff (up to ``max_backoff``), a fully accepted one resets it, and if the estimate then says
speculation pays the schedule simply speculates again. Probes are also held to a budget: the
measured regret of this request's speculative steps, ``sum(step time - tokens * t1)`` (negative
while speculation wins), plus the expected loss of the next probe (the average loss of earlier
probes) must stay within ``explore_budget`` of the request's elapsed decode time; the first probe
(right after the first, plain, step) is always taken. So with a useless proposer the schedule
probes once, then only as often as the budget allows, and a proposer that becomes good is picked
up again at the next probes. What no in-request rule can avoid is the first probe's cost: a
proposer with its own cache (draft model, early exit) processes the whole prompt on its first
draft.

``adaptive`` needs the draft time of each step (``update(..., draft_time_s=...)``, as the engine
passes it; the rest of the step is the target's, or pass ``target_time_s``); without it the whole
step time counts as verification and c as 0. Because it reads the clock, a seeded *sampled* generation with
``adaptive`` may draw different (equally exact) tokens from run to run; greedy output is always
the same. Use ``heuristic`` or ``constant`` when sampled runs must be reproducible token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from specdecode.draft_gate import DraftGate, PassCosts
from specdecode.limits import MAX_SPECULATIVE_TOKENS, check_num_speculative_tokens
from specdecode.proposers.base import DraftTokens

if TYPE_CHECKING:
    import torch

ScheduleKind = Literal["constant", "heuristic", "adaptive", "ungated"]
SCHEDULES: tuple[str, ...] = ("constant", "heuristic", "adaptive", "ungated")
GATED: tuple[str, ...] = ("constant", "heuristic")  # the kinds whose greedy requests pass the draft gate
VERIFY_SLOPE_WEIGHT = 1.0  # ridge weight of the prior slope of t_verify, in (weight x tokens^2) of observations


def expected_tokens(alpha: float, k: int) -> float:
    """``E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)``: expected tokens of a step drafting k tokens
    with per-position acceptance ``alpha`` in [0, 1] (``k + 1`` when alpha = 1; 1 when k = 0)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def acceptance_trials(drafted: int, accepted: int) -> int:
    """Positions a chain draft tried, for estimating the per-position ``alpha`` of
    :func:`expected_tokens`: all ``drafted`` when every one was accepted, else ``accepted + 1`` (the
    first rejection ends the chain; the positions after it were never tried)."""
    return drafted if accepted >= drafted else accepted + 1


@dataclass(frozen=True)
class ScheduleConfig:
    """Options of :class:`SpeculationSchedule` (the ``adaptive`` ones: see the module docstring).

    Attributes:
        kind: ``"constant"``, ``"heuristic"`` or ``"adaptive"`` (see the module docstring).
        max_speculative_tokens: the largest k of ``heuristic`` and ``adaptive`` (tokens); None = 4 x
            the starting k, at most :data:`~specdecode.limits.MAX_SPECULATIVE_TOKENS`.
        fallback_margin: adaptive only; speculate only when the best expected rate exceeds plain
            decoding's times (1 + margin). 0.0 = whenever it is expected to be faster.
        backoff: adaptive only; plain steps before a probe after speculation stopped paying.
        max_backoff: adaptive only; the longest backoff (steps).
        probe_k: adaptive only; k of a probe.
        refresh_interval: adaptive only; while speculating, a plain step every this many
            speculative steps (keeps t1 current).
        explore_budget: adaptive only; probes may keep the request's speculative regret within
            this fraction of its elapsed decode time, in [0, 1].
        prior_acceptance: adaptive only; alpha before any draft, in [0, 1].
        prior_weight: adaptive only; trials of evidence behind ``prior_acceptance``, > 0.
        acceptance_decay: adaptive only; weight of older acceptance evidence per newer trial, in (0, 1].
        prior_draft_cost: adaptive only; draft seconds per token, as a fraction of t1, before measured.
        prior_verify_slope: adaptive only; extra verification time per drafted token, as a
            fraction of t1, before measured.
        ema: weight of the newest measurement in the moving averages of times, in (0, 1].

    Raises:
        ValueError: a value outside its range (named in the message).
    """

    kind: ScheduleKind = "constant"
    max_speculative_tokens: int | None = None
    fallback_margin: float = 0.0
    backoff: int = 8
    max_backoff: int = 64
    probe_k: int = 1
    refresh_interval: int = 64
    explore_budget: float = 0.03
    prior_acceptance: float = 0.5
    prior_weight: float = 0.5
    acceptance_decay: float = 0.9
    prior_draft_cost: float = 0.5
    prior_verify_slope: float = 0.02
    ema: float = field(default=0.2)

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.kind!r}")
        if self.max_speculative_tokens is not None:
            check_num_speculative_tokens(self.max_speculative_tokens, "max_speculative_tokens")
        if not 0.0 <= self.fallback_margin <= 10.0:
            raise ValueError(f"fallback_margin must be in [0, 10], got {self.fallback_margin!r}")
        for name in ("backoff", "max_backoff", "probe_k", "refresh_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("explore_budget", "prior_acceptance"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("acceptance_decay", "ema"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        for name in ("prior_weight", "prior_draft_cost", "prior_verify_slope"):
            value = getattr(self, name)
            if not 0.0 <= value <= 100.0 or (name == "prior_weight" and value == 0.0):
                raise ValueError(f"{name} must be in {'(' if name == 'prior_weight' else '['}0, 100], got {value!r}")


class SpeculationSchedule:
    """Chooses k per step for one request (stateful; one instance per ``generate`` call).

    Args:
        num_speculative_tokens: the starting k (the constant k for ``constant``), >= 1.
        config: :class:`ScheduleConfig`, or a kind name.
        costs: the generator's measured :class:`~specdecode.draft_gate.PassCosts`; with ``greedy`` and a
            gated kind (:data:`GATED`), copied drafts pass a :class:`~specdecode.draft_gate.DraftGate`
            (:meth:`trim`). None: no gate.
        greedy: the request decodes greedily (sampled requests are never gated: see
            :mod:`specdecode.draft_gate`).

    Attributes:
        gate: the request's :class:`~specdecode.draft_gate.DraftGate`, or None.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        config: ScheduleConfig | str = "constant",
        costs: PassCosts | None = None,
        greedy: bool = False,
    ) -> None:
        self.config = ScheduleConfig(kind=config) if isinstance(config, str) else config  # type: ignore[arg-type]
        self.gate = DraftGate(costs) if costs is not None and greedy and self.config.kind in GATED else None
        start = num_speculative_tokens
        if self.config.kind in ("constant", "ungated"):
            self.max_k = start
        else:
            self.max_k = max(start, self.config.max_speculative_tokens or min(MAX_SPECULATIVE_TOKENS, 4 * start))
        self.k = start
        self.plain_steps = 0  # steps the schedule decoded without speculation
        self.fallbacks = 0  # times the adaptive schedule switched speculation off
        self.probes = 0  # adaptive: probe steps taken from plain decoding
        # adaptive state (module docstring)
        self._t1: float | None = None  # min(plain-step average, verification passes' average)
        self._plain_s: float | None = None  # the plain steps' average
        self._draft_s: float | None = None  # c from steps whose previous step drafted
        self._draft_bound: float | None = None  # lowest c seen on the first draft after plain steps
        self._split = True  # draft and target times were given
        self._verify = [0.0] * 5  # decayed sums of w, w n, w n^2, w y, w n y over verification passes
        self._accepted = 0.0
        self._trials = 0.0
        self._pending: int | None = None  # the k decided for the current step
        self._probing = False
        self._speculating = False
        self._previous_drafted = False
        self._plain_run = 0
        self._backoff = 1  # the first probe right after the first (plain) step
        self._since_plain = 0
        self._regret_s = 0.0
        self._elapsed_s = 0.0
        self._probe_loss_s: float | None = None

    @property
    def kind(self) -> str:
        return self.config.kind

    # ------------------------------------------------------------------ the model (adaptive)
    @property
    def plain_time(self) -> float | None:
        """t1: seconds of a plain step's target pass (None before the first plain step)."""
        return self._t1

    @property
    def acceptance(self) -> float:
        """alpha: the estimated per-position acceptance probability."""
        c = self.config
        return (self._accepted + c.prior_weight * c.prior_acceptance) / (self._trials + c.prior_weight)

    def draft_time(self) -> float:
        """c: estimated draft seconds per drafted token (0 before t1 is known or without split times)."""
        if not self._split or self._t1 is None:
            return 0.0
        if self._draft_s is not None:
            return self._draft_s
        prior = self.config.prior_draft_cost * self._t1
        return prior if self._draft_bound is None else min(prior, self._draft_bound)

    def verify_time(self, k: int) -> float:
        """t_verify(k) = a + b k: estimated seconds of a target pass verifying k drafted tokens."""
        if self._t1 is None:
            return 0.0
        t1 = self._t1
        # the data, the point (0, t1) with weight 1, and a ridge pulling b to the prior slope
        w, wn, wnn, wy, wny = (s + v for s, v in zip(self._verify, (1.0, 0.0, 0.0, t1, 0.0), strict=True))
        ridge, prior = VERIFY_SLOPE_WEIGHT, self.config.prior_verify_slope * t1
        det = w * (wnn + ridge) - wn * wn
        b = max(0.0, (w * (wny + ridge * prior) - wn * wy) / det)
        a = max(0.0, (wy - b * wn) / w)
        return a + b * k

    def expected_rate(self, k: int) -> float:
        """Expected tokens per second of a step drafting k tokens (k = 0: plain decoding)."""
        if self._t1 is None:
            return 0.0
        if k <= 0:
            return 1.0 / self._t1
        return expected_tokens(self.acceptance, k) / (k * self.draft_time() + self.verify_time(k))

    def best_k(self) -> int:
        """The k in 0 .. max_k with the highest :meth:`expected_rate` (0 unless speculation beats
        plain decoding by ``fallback_margin``)."""
        if self._t1 is None:
            return 0
        rates = [self.expected_rate(k) for k in range(1, self.max_k + 1)]
        best = max(range(len(rates)), key=rates.__getitem__)
        return best + 1 if rates[best] > (1 + self.config.fallback_margin) * self.expected_rate(0) else 0

    def _decide(self) -> int:
        """The adaptive choice for the next step (once per step; see the module docstring)."""
        config = self.config
        self._probing = False
        if self._t1 is None:
            return 0  # the first step measures t1
        best = self.best_k()
        if best > 0:
            if not self._speculating:
                self._backoff = config.backoff
            self._speculating = True
            if self._since_plain >= config.refresh_interval:
                return 0  # one plain step keeps t1 current
            return best
        if self._speculating:  # speculation stopped paying
            self._speculating = False
            self.fallbacks += 1
            self._backoff = config.backoff
            self._plain_run = 0
        affordable = (
            self._probe_loss_s is None or self._regret_s + self._probe_loss_s <= config.explore_budget * self._elapsed_s
        )
        if self._plain_run >= self._backoff and affordable:
            self._probing = True
            self.probes += 1
            return min(self.max_k, config.probe_k)
        return 0

    # ------------------------------------------------------------------ the engine's interface
    def trim(self, draft: DraftTokens) -> DraftTokens:
        """The draft the target verifies: ``draft`` cut by the draft gate (copied drafts of a gated
        greedy request), else unchanged."""
        return self.gate.trim(draft) if self.gate is not None else draft

    @property
    def gated_tokens(self) -> int:
        """Drafted tokens the gate kept from the target in this request."""
        return self.gate.gated_tokens if self.gate is not None else 0

    def next_k(self) -> int:
        """Tokens to draft at the next step: 0 (plain step) or in [1, :attr:`max_k`]."""
        if self.config.kind != "adaptive":
            return self.k
        if self._pending is None:
            self._pending = self._decide()
        return self._pending

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.config.ema) * old + self.config.ema * new

    def update(
        self,
        num_drafted: int,
        num_accepted: int,
        step_time_s: float,
        *,
        draft_time_s: float | None = None,
        target_time_s: float | None = None,
        tokens: torch.Tensor | Sequence[int] = (),
    ) -> None:
        """Record one step: ``num_drafted`` tokens proposed, ``num_accepted`` kept (the step produced
        ``num_accepted + 1`` tokens), ``step_time_s`` seconds of wall time for proposing and
        verifying, of which ``draft_time_s`` proposing and ``target_time_s`` the target pass and
        verification (adaptive only; ``target_time_s`` None: the rest of the step; both None: see
        the module docstring); ``tokens``: what the step decoded (the draft gate scores a draft it
        withheld against them)."""
        if self.gate is not None:
            self.gate.observe(num_drafted, num_accepted, tokens)
        if self.config.kind == "adaptive":
            self._update_adaptive(num_drafted, num_accepted, step_time_s, draft_time_s, target_time_s)
            return
        if num_drafted == 0 or self.config.kind in ("constant", "ungated"):  # a proposer with nothing to offer
            return
        self.k = min(self.max_k, self.k + 2) if num_accepted == num_drafted else max(1, self.k - 1)

    def _update_adaptive(
        self, drafted: int, accepted: int, step_s: float, draft_s: float | None, target_s: float | None
    ) -> None:
        config = self.config
        chosen = self._pending if self._pending is not None else drafted
        self._pending = None
        if draft_s is None:
            self._split = False
            draft_s, target_s = 0.0, step_s
        elif target_s is None:
            target_s = max(0.0, step_s - draft_s)
        self._elapsed_s += step_s
        if drafted == 0:  # a plain step: the schedule's choice, or a proposer with nothing to offer
            self._plain_s = self._average(self._plain_s, target_s)
            self._t1 = self._plain_s if self._verify[0] == 0 else min(self._plain_s, self._verify[3] / self._verify[0])
            if chosen == 0:
                self.plain_steps += 1
                self._since_plain = 0
                if not self._speculating:
                    self._plain_run += 1
            else:
                self._regret_s += step_s - self._t1
            self._previous_drafted = False
            return
        if self._t1 is None:  # (the engine's first adaptive step is plain; a caller's may not be)
            self._t1 = target_s
        trials = acceptance_trials(drafted, accepted)  # `accepted` successes in min(accepted + 1, drafted) trials
        keep = config.acceptance_decay**trials
        self._accepted = keep * self._accepted + accepted
        self._trials = keep * self._trials + trials
        # costs
        per_token = draft_s / drafted
        if self._previous_drafted:
            self._draft_s = self._average(self._draft_s, per_token)
        elif self._draft_s is not None and per_token < self._draft_s:
            self._draft_s = self._average(self._draft_s, per_token)  # an upper bound may only lower c
        else:
            self._draft_bound = per_token if self._draft_bound is None else min(self._draft_bound, per_token)
        keep = 1 - config.ema
        n, y = float(drafted), target_s
        self._verify = [keep * s + v for s, v in zip(self._verify, (1.0, n, n * n, y, n * y), strict=True)]
        self._t1 = min(self._t1, self._verify[3] / self._verify[0])  # a 1-token pass costs at most a longer one
        # regret against plain decoding, and the probe's outcome
        loss = step_s - (accepted + 1) * self._t1
        self._regret_s += loss
        if self._probing:
            self._probing = False
            self._probe_loss_s = self._average(self._probe_loss_s, max(0.0, loss))
            self._backoff = config.backoff if accepted == drafted else min(config.max_backoff, 2 * self._backoff)
            self._plain_run = 0
        self._since_plain += 1
        self._previous_drafted = True
