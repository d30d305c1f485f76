"""How many tokens to draft at each step: constant, heuristic, or adaptive with a fallback.

The engine asks the schedule for k before every step (:meth:`SpeculationSchedule.next_k`) and
tells it what happened after verification (:meth:`SpeculationSchedule.update`). The schedule
never touches tokens, so it cannot change what is generated under greedy decoding, and under
sampling every step is still exact rejection sampling (the target distribution holds for any
k, chosen before the step is drawn).

- ``constant``: k = ``num_speculative_tokens`` every step.
- ``heuristic``: start at ``num_speculative_tokens``; after a step whose draft was accepted in
  full, k += 2; after a rejection, k -= 1; within [1, ``max_speculative_tokens``]. This is the
  schedule of Hugging Face assisted generation (``num_assistant_tokens_schedule="heuristic"``,
  ``AssistedCandidateGenerator.update_candidate_strategy``), which follows the accepted length
  without any model of cost.
- ``adaptive``: the heuristic, plus a fallback to plain decoding measured on this machine. The
  schedule keeps two exponential moving averages of wall time: seconds per token of speculative
  steps (draft + verification, divided by the tokens the step produced) and seconds per plain step
  (a target pass over one token). When speculation is slower per token than a plain step (times
  ``1 + fallback_margin``), it decodes plainly for ``backoff`` steps, then probes speculation
  again for ``probe_steps`` steps starting from k = ``probe_k`` (a cheap probe: a proposer that
  has become good grows k again through the heuristic); every repeated failure doubles the
  backoff (up to ``max_backoff``), a success resets it. A plain step is also taken every ``refresh_interval``
  speculative steps so the plain-step time stays current, and the first step of a request is
  plain (its time is the first measurement). So speculation is never much slower than the target
  alone: at worst, one probe of ``probe_steps`` steps per backoff period.

  Because the fallback reads the clock, a seeded *sampled* generation with ``adaptive`` may draw
  different (equally exact) tokens from run to run; greedy output is always the same. Use
  ``heuristic`` or ``constant`` when sampled runs must be reproducible token for token.

Speculative-step cost model behind the fallback (DESIGN.md §4): with acceptance α, k drafts and a
draft costing c target passes per token, a step yields (1 - α^(k+1)) / (1 - α) tokens for
(k c + 1) passes; speculation loses once that ratio drops under 1. The schedule measures the
ratio instead of modelling it, since on CPU a (k + 1)-token pass costs more than a 1-token pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

ScheduleKind = Literal["constant", "heuristic", "adaptive"]
SCHEDULES: tuple[str, ...] = ("constant", "heuristic", "adaptive")


@dataclass(frozen=True)
class ScheduleConfig:
    """Options of :class:`SpeculationSchedule`.

    Attributes:
        kind: ``"constant"``, ``"heuristic"`` or ``"adaptive"`` (see the module docstring).
        max_speculative_tokens: the ceiling the heuristic grows k to (tokens); None = 4 x the
            starting k, at most 64.
        fallback_margin: adaptive only; speculation is dropped when its seconds per token exceed
            a plain step's times (1 + margin). 0.0 = as soon as it is slower.
        backoff: adaptive only; plain steps after the first fallback.
        max_backoff: adaptive only; the longest backoff (steps).
        probe_steps: adaptive only; speculative steps measured after a backoff before deciding again.
        probe_k: adaptive only; k of the first probe step after a backoff.
        refresh_interval: adaptive only; a plain step every this many speculative steps.
        ema: weight of the newest measurement in the moving averages, in (0, 1].

    Raises:
        ValueError: a value outside its range (named in the message).
    """

    kind: ScheduleKind = "constant"
    max_speculative_tokens: int | None = None
    fallback_margin: float = 0.0
    backoff: int = 8
    max_backoff: int = 256
    probe_steps: int = 1
    probe_k: int = 1
    refresh_interval: int = 32
    ema: float = field(default=0.3)

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.kind!r}")
        if self.max_speculative_tokens is not None and not (
            isinstance(self.max_speculative_tokens, int) and 1 <= self.max_speculative_tokens <= 64
        ):
            raise ValueError(
                f"max_speculative_tokens must be an integer in [1, 64], got {self.max_speculative_tokens!r}"
            )
        if not 0.0 <= self.fallback_margin <= 10.0:
            raise ValueError(f"fallback_margin must be in [0, 10], got {self.fallback_margin!r}")
        for name in ("backoff", "max_backoff", "probe_steps", "probe_k", "refresh_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema!r}")


class SpeculationSchedule:
    """Chooses k per step for one request (stateful; one instance per ``generate`` call).

    Args:
        num_speculative_tokens: the starting k (the constant k for ``constant``), >= 1.
        config: :class:`ScheduleConfig`, or a kind name.
    """

    def __init__(self, num_speculative_tokens: int, config: ScheduleConfig | str = "constant") -> None:
        self.config = ScheduleConfig(kind=config) if isinstance(config, str) else config  # type: ignore[arg-type]
        start = num_speculative_tokens
        if self.config.kind == "constant":
            self.max_k = start
        else:
            self.max_k = max(start, self.config.max_speculative_tokens or min(64, 4 * start))
        self.k = start
        self.plain_steps = 0  # steps the schedule decoded without speculation
        self.fallbacks = 0  # times the adaptive schedule switched speculation off
        self._spec_s_per_token: float | None = None
        self._plain_s: float | None = None
        self._plain_left = 1 if self.config.kind == "adaptive" else 0  # the first step measures a plain pass
        self._probe_left = 0
        self._in_backoff = False
        self._since_plain = 0
        self._backoff = self.config.backoff

    @property
    def kind(self) -> str:
        return self.config.kind

    def next_k(self) -> int:
        """Tokens to draft at the next step: 0 (plain step) or in [1, :attr:`max_k`]."""
        if self._plain_left > 0:
            return 0
        return self.k

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.config.ema) * old + self.config.ema * new

    def update(self, num_drafted: int, num_accepted: int, step_time_s: float) -> None:
        """Record one step: ``num_drafted`` tokens proposed, ``num_accepted`` kept, ``step_time_s``
        seconds of wall time for proposing and verifying (the step produced ``num_accepted + 1``
        tokens)."""
        config = self.config
        if num_drafted == 0:  # a plain step: the schedule's choice, or a proposer with nothing to offer
            self._plain_s = self._average(self._plain_s, step_time_s)
            if self._plain_left > 0:
                self._plain_left -= 1
                self.plain_steps += 1
                if self._plain_left == 0 and self._in_backoff:
                    self._in_backoff = False
                    self._probe_left = config.probe_steps  # back from a backoff: measure afresh
                    self._spec_s_per_token = None
                    self.k = min(self.max_k, config.probe_k)
            return
        if config.kind == "constant":
            return
        self.k = min(self.max_k, self.k + 2) if num_accepted == num_drafted else max(1, self.k - 1)
        if config.kind != "adaptive":
            return
        self._spec_s_per_token = self._average(self._spec_s_per_token, step_time_s / (num_accepted + 1))
        self._since_plain += 1
        if self._probe_left > 0:
            self._probe_left -= 1
            if self._probe_left > 0:
                return
        assert self._plain_s is not None  # the first step of an adaptive schedule is plain
        if self._spec_s_per_token > self._plain_s * (1 + config.fallback_margin):
            self._plain_left = self._backoff
            self._in_backoff = True
            self._backoff = min(config.max_backoff, 2 * self._backoff)
            self.fallbacks += 1
            self._since_plain = 0
        else:
            self._backoff = config.backoff
            if self._since_plain >= config.refresh_interval:
                self._plain_left = 1  # one plain step keeps the plain-step time current
                self._since_plain = 0
