"""The target's side of a decoding step, written once for both loops (docs/design.md §2).

:class:`~specdecode.engine.SpeculativeGenerator` (one sequence) and the server's
:class:`~specdecode.serve.scheduler.Scheduler` (a batch of rows) call the same three functions, over
their own runner seen as a :data:`RowsForward` (the engine: a batch of one):

- :func:`prefill`: one pass over the prompts; each sequence's first token (the target's own);
- :func:`score`: one pass over every sequence's ``[last token + draft]``;
- :func:`verify_truncate`: step 3 and 4 of one sequence: verify the drafts scored, roll its cache
  back to the context plus the accepted drafts, give the proposer its feedback.

Each pass is reported to each sequence's observers (its own row's width) and to the loop's
``observers`` (every row's widths: the server's metrics and cost model), as a
:class:`~specdecode.pass_observers.TargetPass`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdecode.decode_state import DecodeState
from specdecode.pass_observers import PassObserver, TargetPass
from specdecode.proposers.base import DraftTokens
from specdecode.verify import VerifyResult

RowsForward = Callable[
    [list[torch.Tensor], list[int], "list[torch.Tensor | None] | None"],
    tuple[list[torch.Tensor], list["torch.Tensor | None"]],
]
"""One target pass over consecutive rows: ``(inputs, num_logits, greedy_drafts)`` -> ``(logits, features)``.

``inputs[b]``: int64 ``[n_b]`` (CPU), the row's new tokens; ``num_logits[b]``: the last rows of logits
wanted; ``greedy_drafts[b]``: the row's greedy draft (int64 ``[n_b - 1]``) or None, a hint that lets a
split pass stop at a wrong draft token (fewer logits); the list None: no hints (prefill).
Returns per row float32 logits ``[<= num_logits[b], V]`` on the runner's device and the target's
features ``[n_b, H]`` where the row's proposer reads them, else None."""

Clock = Callable[[], float]
"""Seconds (the loop's clock: device-synchronized off the CPU)."""


def report(
    states: Sequence[DecodeState],
    widths: Sequence[int],
    seconds: float,
    observers: Sequence[PassObserver],
    prefill: bool,
) -> None:
    """Report one target pass: to each state its own row's width, to ``observers`` every row's."""
    for s, width in zip(states, widths, strict=True):
        s.target_pass(TargetPass((width,), seconds, prefill))
    if observers:
        batch = TargetPass(tuple(widths), seconds, prefill)
        for observer in observers:
            observer.target_pass(batch)


def prefill(
    states: Sequence[DecodeState], forward: RowsForward, clock: Clock, observers: Sequence[PassObserver] = ()
) -> tuple[list[VerifyResult], list[torch.Tensor]]:
    """One pass over the prompts of ``states`` (consecutive new rows, each caching its prompt's
    first ``cached_tokens`` already: a reused prefix, else nothing); each one's first token, the
    target's own (under a constraint: from the masked distribution).

    Each state gets the features of the tokens fed (``after_prefill``: ``[P - cached, H]`` where its
    proposer reads them) and the pass is reported (``prefill=True``, the tokens fed per row).

    Returns:
        per state its :class:`~specdecode.verify.VerifyResult` (one token, ``num_accepted`` 0) and
        its logits ``[1, V]`` (the last prompt position's: log-probabilities of the first token).
    """
    tic = clock()
    inputs = [s.prefill_ids() for s in states]
    logits, hidden = forward(inputs, [1] * len(states), None)  # per row (1, V), (P - cached, H) | None
    seconds = clock() - tic
    report(states, [x.shape[0] for x in inputs], seconds, observers, prefill=True)
    results = []
    for s, row_logits, row_hidden in zip(states, logits, hidden, strict=True):
        s.after_prefill(row_hidden)  # (P, H): every prompt position
        results.append(s.verify(DraftTokens.empty(), row_logits))  # on the logits' device
    return results, logits


def score(
    states: Sequence[DecodeState],
    drafts: Sequence[DraftTokens],
    forward: RowsForward,
    clock: Clock,
    observers: Sequence[PassObserver] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], float]:
    """Step 2: one target pass over every state's last token and draft, reported to the observers.

    A greedy row without a constraint hints its draft (a split pass may stop at a mismatch with
    the raw argmax; a constrained row's argmax is the masked one: no hint).

    Args:
        states, drafts: the rows, in row order; ``drafts[b]`` from ``states[b].propose`` (ids
            int64 ``[k_b]`` on the CPU).

    Returns:
        ``(logits, features, seconds)``: per row float32 ``[scored_b + 1, V]`` (``scored_b <= k_b``:
        fewer only when greedy and a draft token was wrong) and ``[k_b + 1, H]`` | None, and the
        pass's seconds.
    """
    inputs = [s.step_input(d.ids) for s, d in zip(states, drafts, strict=True)]  # (k_b + 1,) each
    hints = [  # a split pass compares with the raw argmax: no hint for a constrained row, nor where
        # the draft gate chose one whole pass (``early_stop`` False)
        d.ids if s.sampling.greedy and len(d) and s.constraint is None and d.early_stop else None
        for s, d in zip(states, drafts, strict=True)
    ]
    tic = clock()
    logits, hidden = forward(inputs, [x.shape[0] for x in inputs], hints)
    seconds = clock() - tic
    report(states, [x.shape[0] for x in inputs], seconds, observers, prefill=False)
    return logits, hidden, seconds


def verify_truncate(
    state: DecodeState,
    draft: DraftTokens,
    logits: torch.Tensor,
    hidden: torch.Tensor | None,
    truncate: Callable[[int], None],
) -> VerifyResult:
    """Steps 3-4 of one sequence: verify the drafts the pass scored, roll back, feed back.

    Args:
        state: the sequence (its runner caches ``context[:T - 1]`` plus the pass's tokens).
        draft: the draft sent, ids int64 ``[k]`` (CPU), probs ``[k, V]`` | None.
        logits: float32 ``[scored + 1, V]`` of the pass, ``scored <= k`` (greedy: the rejection is
            among the drafts scored).
        hidden: the target's features of the pass ``[k + 1, H]``, or None.
        truncate: rolls the sequence's cache back to a length in tokens (the runner's ``truncate``,
            bound to the row for a batch).

    Returns:
        the :class:`~specdecode.verify.VerifyResult`: ``n`` accepted drafts and the target's token.
    """
    result = state.verify(draft, logits)  # 3.
    n = result.num_accepted
    truncate(state.T + n)  # 4. keep context + accepted drafts
    state.after_verify(len(draft), result, hidden[: n + 1] if hidden is not None else None)  # 4. feedback, 5. stats
    return result
