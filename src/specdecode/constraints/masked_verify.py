"""Verification under a grammar: the target's logits masked to the allowed tokens, then the plain
verifier (pure functions over tensors).

Constrained decoding by the target alone samples each token from ``p'``: the target's logits with
every token the grammar forbids set to ``-inf``, then temperature, top-k, top-p and softmax
(:func:`~specdecode.sampling.logits_to_probs`), i.e. ``p`` restricted to the allowed tokens and
renormalised; greedy takes the argmax of the masked logits. Speculation stays exact under the
constraint by verifying against ``p'`` at every position of the pass, each with its own mask (the
grammar state after the drafts before it): :func:`~specdecode.verify.greedy_verify` then emits the
masked argmax at each position, and modified rejection sampling (Leviathan et al. 2023, arXiv
2211.17192, Theorem 1) emits tokens distributed as ``p'`` whatever the draft's ``q`` was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.verify import VerifyResult, rejection_sample, verify, verify_tree


@dataclass(frozen=True)
class DraftCut:
    """A probabilistic draft cut before position k at a forbidden token.

    Attributes:
        token: the forbidden token the proposer sampled at position k (never sent to the target).
        probs: float ``[V]``, the proposer's q at position k (the distribution ``token`` came from).
    """

    token: int
    probs: torch.Tensor


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[n, V]`` with the tokens ``allowed`` (bool ``[n, V]``, same device) forbids set to
    ``-inf`` (a new tensor, float32)."""
    if allowed.shape != logits.shape:
        raise ValueError(f"allowed must be bool {list(logits.shape)} like the logits, got {list(allowed.shape)}")
    return logits.float().masked_fill(~allowed, float("-inf"))


def verify_constrained(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    allowed: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
    cut: DraftCut | None = None,
) -> VerifyResult:
    """Verify a draft against the target's distribution masked to the grammar.

    Without ``cut``: :func:`~specdecode.verify.verify` on the masked logits. A draft token the
    grammar forbids has masked probability 0, so it is rejected for certain (greedy: it is never the
    masked argmax); the recovered token then comes from ``p'``.

    With ``cut`` (a sampled draft whose token at position k the grammar forbids was dropped before
    the target pass): exactness needs the token emitted at position k to be what rejecting that
    token gives, the residual ``norm(max(0, p'_k - q_k))``, not ``p'_k`` itself (drawing a bonus
    token from ``p'_k`` would favour the tokens q already proposed often: their total probability
    would exceed ``p'``). So the cut token is put back as draft k + 1 with its q row; it is rejected
    with probability 1 (``p'_k(token) = 0``), and :func:`~specdecode.verify.rejection_sample` draws
    the residual. The row after it is never read.

    Args:
        draft_ids: int64 ``[k]``, the drafts sent to the target (CPU).
        draft_probs: float ``[k, V]`` on the logits' device, or None (deterministic drafts).
        target_logits: float ``[k + 1, V]``, any device: row i scores the token after ``draft_ids[:i]``.
        allowed: bool ``[k + 1, V]`` on the logits' device: row i, the tokens the grammar allows
            after ``draft_ids[:i]``.
        sampling: the request's sampling parameters.
        generator: randomness for sampling (unused when greedy).
        cut: the dropped forbidden draft token and its q row, or None.

    Returns:
        :class:`~specdecode.verify.VerifyResult`, ``tokens`` ``[n + 1]``, each allowed by the grammar.

    Raises:
        ValueError: shapes other than the above.
    """
    masked = mask_logits(target_logits, allowed)  # (k + 1, V)
    if sampling.greedy or cut is None:
        return verify(draft_ids, draft_probs, masked, sampling, generator)
    p = logits_to_probs(masked, sampling)  # (k + 1, V)
    k = draft_ids.shape[0]
    ids = torch.cat([draft_ids, torch.tensor([cut.token], dtype=torch.int64)])  # (k + 1,)
    q = torch.cat([draft_probs[:k] if draft_probs is not None else _one_hot(draft_ids, p), cut.probs[None].to(p)])
    return rejection_sample(ids, q, torch.cat([p, p[-1:]]), generator)  # row k + 1: never read


def _one_hot(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """float ``[k, V]`` one-hot rows at ``ids`` (int64 ``[k]``, CPU), on ``like``'s device and dtype."""
    device = like.device
    out = torch.zeros(ids.shape[0], like.shape[1], dtype=like.dtype, device=device)  # (k, V)
    out[torch.arange(ids.shape[0], device=device), ids.to(device)] = 1.0
    return out


def verify_tree_constrained(
    draft_ids: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    allowed: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """:func:`~specdecode.verify.verify_tree` on the masked logits; ``allowed`` bool ``[N + 1, V]``,
    row i the tokens allowed after node i's root path. A tree's candidates are deterministic, so a
    forbidden node (pruned before the pass, or not) changes nothing: its masked probability is 0."""
    return verify_tree(draft_ids, parents, mask_logits(target_logits, allowed), sampling, generator)
