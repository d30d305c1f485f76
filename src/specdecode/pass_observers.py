"""What the loop reports about each forward pass, and who listens (docs/design.md §2).

The loop (:mod:`specdecode.engine` for one request, :mod:`specdecode.serve.scheduler` for a batch)
reports every **target pass** it makes, and every proposer reports the forwards of **its own model**
(a draft model, an EAGLE head, Medusa heads) through the sink the loop gives it per request. The
listeners are :class:`PassObserver` s:

- :class:`StatsObserver`: one request's :class:`~specdecode.stats.SpecStats` (``target_forward_passes``,
  ``target_pass_widths``, ``prefill_time_s`` / ``target_time_s``, ``draft_pass_widths``, and, read
  once, ``draft_pass_kind`` and ``draft_quantization``): what ``specdecode bench`` records and prices
  with a cost table (:func:`specdecode.bench.runner.record_passes`, :mod:`specdecode.cost.table`);
- the server's :class:`~specdecode.serve.prometheus.ServeMetrics` (the ``prefill`` and ``target``
  phases of ``specdecode_step_phase_seconds``) and its :class:`~specdecode.cost.serve_model.CostModel`
  (``t_target(B, T)`` refined by every decode pass).

A proposer reports a forward of its own model by calling its ``passes`` sink with the tokens fed:
``self.passes(width)``. The loop sets ``proposer.passes`` to a :class:`DraftPasses` per request
(:class:`~specdecode.decode_state.DecodeState` does, for the engine and the server alike); a proposer
built outside a loop reports to :data:`NO_DRAFT_PASSES`, which drops them. What records say about a
proposer (:class:`ProposerInfo`: its quantization, the cost curve that prices its forwards) comes
from its ``describe()``, read once per request; nothing is polled per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.stats import SpecStats


@dataclass(frozen=True)
class ProposerInfo:
    """What records say about a proposer (its ``describe()``; read once per request).

    Attributes:
        quantization: what its drafts run on: ``"int8"`` (an int8 draft model), ``"int8-head"`` (a
            trained drafter's int8 LM-head rows) or ``"none"``; recorded as the ``draft_quantization``
            statistic.
        pass_kind: which pass-cost curve prices its model's forwards (:mod:`specdecode.cost.table`):
            ``"draft"`` (a draft model's), ``"eagle"`` (an EAGLE head's), ``"medusa"`` (Medusa heads');
            recorded as ``draft_pass_kind``.
    """

    quantization: str = "none"
    pass_kind: str = "draft"


NO_PROPOSER = ProposerInfo()
"""The description of decoding without a proposer (and the default of :class:`ProposerBase
<specdecode.proposers.base.ProposerBase>`): no quantization, draft-model curve."""


def describe(proposer: object | None) -> ProposerInfo:
    """``proposer.describe()``, or :data:`NO_PROPOSER` for None (target-only decoding)."""
    return NO_PROPOSER if proposer is None else proposer.describe()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TargetPass:
    """One forward pass of the target, as the loop reports it.

    Attributes:
        widths: tokens fed per row, in row order (>= 1 each): a prompt's length for a prefill, else
            1 + the tokens drafted (a tree: its nodes). One row for the engine and for a sequence's
            own report; the batch's rows for the server's batch-level observers.
        seconds: wall time of the whole pass (device-synchronized where the loop's clock is), >= 0.
        prefill: the pass fed prompts (each row's first pass) rather than verifying drafts.
    """

    widths: tuple[int, ...]
    seconds: float
    prefill: bool = False

    @property
    def rows(self) -> int:
        """Rows (sequences) in the pass."""
        return len(self.widths)

    @property
    def width(self) -> int:
        """The widest row's tokens (a ragged batch pass is priced by it)."""
        return max(self.widths)


class PassObserver:
    """Listens to the passes the loop and the proposer report; both methods do nothing here."""

    def target_pass(self, p: TargetPass) -> None:
        """One target pass (:class:`TargetPass`)."""

    def draft_pass(self, kind: str, width: int) -> None:
        """One forward of the proposer's own model over ``width`` tokens, priced by the cost
        table's curve ``kind`` (:attr:`ProposerInfo.pass_kind`)."""


class DraftPasses:
    """The sink a proposer reports its own model's forwards to: ``passes(width)``.

    Set by the loop per request as ``proposer.passes``; each call reaches every observer as
    ``draft_pass(kind, width)``.

    Args:
        kind: the proposer's :attr:`ProposerInfo.pass_kind`.
        observers: who hears of each forward (the request's).
    """

    __slots__ = ("kind", "observers")

    def __init__(self, kind: str, observers: Sequence[PassObserver]) -> None:
        self.kind = kind
        self.observers = observers

    def __call__(self, width: int) -> None:
        """One forward over ``width`` tokens (>= 1)."""
        for observer in self.observers:
            observer.draft_pass(self.kind, width)


NO_DRAFT_PASSES = DraftPasses("draft", ())
"""The sink of a proposer outside a request (built, measured, probed): its forwards go nowhere."""


class StatsObserver(PassObserver):
    """One request's :class:`~specdecode.stats.SpecStats` as an observer.

    Sets ``draft_pass_kind`` and ``draft_quantization`` from ``info`` once; per target pass counts
    ``target_forward_passes``, appends its width to ``target_pass_widths`` and adds its seconds to
    ``prefill_time_s`` (a prefill) or ``target_time_s``; per draft pass appends its width to
    ``draft_pass_widths``.

    Args:
        stats: the request's statistics (filled in place).
        info: its proposer's description (:func:`describe`).
    """

    def __init__(self, stats: SpecStats, info: ProposerInfo = NO_PROPOSER) -> None:
        self.stats = stats
        stats.draft_pass_kind = info.pass_kind  # what prices draft_pass_widths
        stats.draft_quantization = info.quantization

    def target_pass(self, p: TargetPass) -> None:
        """Count the pass; its width is the request's own row's (``p.widths`` has one)."""
        stats = self.stats
        stats.target_forward_passes += 1
        stats.target_pass_widths.extend(p.widths)
        if p.prefill:
            stats.prefill_time_s += p.seconds
        else:
            stats.target_time_s += p.seconds

    def draft_pass(self, kind: str, width: int) -> None:
        self.stats.draft_pass_widths.append(width)
