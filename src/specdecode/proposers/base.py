"""The one protocol every proposer speaks (DESIGN.md §2).

The engine calls ``reset()`` once per request, then per step ``propose(...)`` and, after
verification, ``observe(...)``. It never branches on a proposer's name.

A proposer that can offer several candidates per position also has ``propose_tree(context,
tree, sampling, generator) -> DraftTree`` (:mod:`specdecode.tree`; ``tree`` is a compiled
``TreeShape`` or a ``DynamicTree``); the engine uses it for ``tree=`` requests and refuses a
tree for a proposer without it. ``observe`` then gets a result whose ``path`` names the accepted
nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdecode.sampling import SamplingParams
from specdecode.verify import VerifyResult


@dataclass(frozen=True)
class DraftTokens:
    """Tokens a proposer drafts for one step.

    Attributes:
        ids: int64 ``[k]`` drafted tokens (k may be 0: nothing to propose this step).
        probs: float32 ``[k, V]`` the distributions q the ids were sampled from, or None for a
            deterministic proposal (treated as one-hot q by the verifier; always None when greedy).
    """

    ids: torch.Tensor
    probs: torch.Tensor | None = None

    @staticmethod
    def empty() -> DraftTokens:
        return DraftTokens(torch.empty(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for the target to verify."""

    name: str

    def reset(self) -> None:
        """Forget everything about the previous request (no state leaks between calls)."""

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft up to ``num_tokens`` tokens to follow ``context``.

        Args:
            context: int64 ``[T]``, the prompt and every token generated so far.
            num_tokens: k >= 1, the most tokens to draft.
            sampling: the request's sampling parameters; a proposer that samples applies the same
                :func:`~specdecode.sampling.logits_to_probs` transform as the target.
            generator: the request's random generator (for proposers that sample).
        """
        ...

    def observe(self, result: VerifyResult) -> None:
        """Feedback after verification: ``result.num_accepted`` of the draft were kept."""
