"""From a caller's constraint and the target's tokenizer to one sequence's grammar state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from specdecode.constraints.spec import Constraint, compile_constraint
from specdecode.constraints.state import ConstraintState
from specdecode.constraints.tokenizer import ll_tokenizer


def make_constraint_state(
    constraint: Constraint,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: Iterable[int],
    grammar_aware_drafting: bool = True,
) -> ConstraintState:
    """A fresh :class:`~specdecode.constraints.state.ConstraintState` for one sequence.

    Args:
        constraint: a :class:`~specdecode.constraints.spec.JsonSchema`, ``Regex`` or ``Grammar``.
        tokenizer: the target's fast tokenizer (or an ``llguidance.LLTokenizer``).
        vocab_size: V, the width of the target's logits.
        eos_token_ids: the ids that end a sequence (allowed once the grammar is complete).
        grammar_aware_drafting: see :class:`~specdecode.constraints.state.ConstraintState`.

    Raises:
        ConstraintError: llguidance rejects the constraint (the message names its parameter).
        ValueError: a tokenizer llguidance cannot read.
    """
    lltok = ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
    grammar = compile_constraint(constraint, lltok)
    return ConstraintState(grammar, lltok, constraint.param, grammar_aware_drafting, vocab_size)
