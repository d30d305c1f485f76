"""Verification of drafted tokens against the target: pure functions over tensors.

Terms (as in vLLM's rejection sampler):

- **accepted tokens**: the leading draft tokens the verifier keeps;
- **recovered token**: after the first rejection, a token sampled from the residual
  ``norm(max(0, p - q))`` (greedy: the target's argmax at the rejected position);
- **bonus token**: when all k drafts are accepted, one more token sampled from the target's
  distribution at position k + 1, which the same target pass computed for free.

Every step therefore yields ``num_accepted + 1`` new tokens.

``p`` is the target's distribution and ``q`` the draft's, both after the same temperature / top-k /
top-p processing (:func:`specdecode.sampling.logits_to_probs`). A deterministic proposal (n-gram,
argmax draft) passes ``draft_probs=None`` and is treated as one-hot ``q``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import SamplingParams, logits_to_probs


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft.

    Attributes:
        num_accepted: n, how many leading draft tokens were accepted (0..k).
        tokens: int64 ``[n + 1]``: the n accepted draft tokens, then the recovered or bonus token.
    """

    num_accepted: int
    tokens: torch.Tensor

    @property
    def next_token(self) -> int:
        """The token the target added itself (recovered when n < k, bonus when n == k)."""
        return int(self.tokens[-1])


def _check_shapes(draft_ids: torch.Tensor, target: torch.Tensor) -> int:
    if draft_ids.dim() != 1 or draft_ids.dtype != torch.int64:
        raise ValueError(f"draft_ids must be int64 [k], got {draft_ids.dtype} {list(draft_ids.shape)}")
    k = draft_ids.shape[0]
    if target.dim() != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target logits/probs must be [k + 1, V] = [{k + 1}, V], got {list(target.shape)}")
    return k


def greedy_verify(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; then add the target's own argmax.

    Exact: the returned tokens are the ones greedy target-only decoding produces, since each
    accepted draft token equals the target's argmax given the accepted tokens before it.

    Args:
        draft_ids: int64 ``[k]`` drafted tokens (k may be 0).
        target_logits: ``[k + 1, V]`` target logits; row i scores the token after ``draft_ids[:i]``.

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]``.

    Raises:
        ValueError: shapes or dtypes other than the above.
    """
    k = _check_shapes(draft_ids, target_logits)
    target_ids = target_logits.argmax(dim=-1)  # (k + 1,)
    mismatch = (draft_ids != target_ids[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyResult(n, target_ids[: n + 1].clone())


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Modified rejection sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1;
    Chen et al. 2023, arXiv 2302.01318).

    Draft token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``. At the first
    rejection the recovered token is drawn from ``norm(max(0, p_i - q_i))``; if all k are accepted
    the bonus token is drawn from ``p_{k+1}``. The output is distributed exactly as sampling from
    ``p`` token by token (Leviathan et al., Theorem 1), whatever ``q`` is.

    Randomness: k uniforms are drawn from ``generator`` first (one per draft position), then one
    ``torch.multinomial`` draw for the recovered / bonus token.

    Args:
        draft_ids: int64 ``[k]`` drafted tokens (k may be 0).
        draft_probs: float ``[k, V]`` draft distributions q the tokens were sampled from, or None
            for a deterministic proposal (one-hot q at ``draft_ids``).
        target_probs: float ``[k + 1, V]`` target distributions p; row i is for the token after
            ``draft_ids[:i]``.
        generator: source of randomness (None: torch's default generator).

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]``.

    Raises:
        ValueError: shapes or dtypes other than the above.
    """
    k = _check_shapes(draft_ids, target_probs)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)  # (k,)
    p = target_probs.double()
    rows = torch.arange(k)
    p_x = p[rows, draft_ids]  # (k,)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        if draft_probs.shape != (k, target_probs.shape[1]):
            raise ValueError(
                f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}"
            )
        q_x = draft_probs.double()[rows, draft_ids]  # (k,)
    # u < p/q  <=>  u * q < p  (no division, and q = 0 for a drafted token cannot happen)
    rejected = (uniforms * q_x >= p_x).nonzero()
    n = int(rejected[0, 0]) if rejected.numel() else k
    if n == k:
        final = p[k]  # bonus: the target's own distribution
    else:
        final = p[n].clone() if draft_probs is None else (p[n] - draft_probs[n].double()).clamp_min(0.0)
        if draft_probs is None:  # one-hot q: the residual is p with the rejected token removed
            final[draft_ids[n]] = 0.0
        # the residual's sum is > 0 whenever a rejection can happen
    next_token = torch.multinomial(final.float(), 1, generator=generator)  # (1,)
    return VerifyResult(n, torch.cat([draft_ids[:n], next_token]))


def rejection_sample_reference(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Plain loop version of :func:`rejection_sample`, written for reading, used by tests.

    Same arguments, same use of randomness, same result.
    """
    k = draft_ids.shape[0]
    V = target_probs.shape[1]
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    accepted: list[int] = []
    for i in range(k):
        x = int(draft_ids[i])
        q = torch.zeros(V, dtype=torch.float64) if draft_probs is None else draft_probs[i].double()
        if draft_probs is None:
            q[x] = 1.0
        p = target_probs[i].double()
        if uniforms[i] < min(1.0, float(p[x]) / float(q[x])):
            accepted.append(x)
            continue
        residual = torch.clamp(p - q, min=0.0)
        token = int(torch.multinomial(residual.float(), 1, generator=generator))
        return VerifyResult(i, torch.tensor(accepted + [token], dtype=torch.int64))
    bonus = int(torch.multinomial(target_probs[k].float(), 1, generator=generator))
    return VerifyResult(k, torch.tensor(accepted + [bonus], dtype=torch.int64))


def verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify one draft: :func:`greedy_verify` when ``sampling`` is greedy, else
    :func:`rejection_sample` on ``p = logits_to_probs(target_logits, sampling)``.

    Args:
        draft_ids: int64 ``[k]``.
        draft_probs: float ``[k, V]`` or None (deterministic proposal; always None when greedy).
        target_logits: float ``[k + 1, V]``.
        sampling: the request's sampling parameters.
        generator: randomness for sampling (unused when greedy).
    """
    if sampling.greedy:
        return greedy_verify(draft_ids, target_logits)
    return rejection_sample(draft_ids, draft_probs, logits_to_probs(target_logits, sampling), generator)
