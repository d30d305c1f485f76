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

from specdecode.sampling import SamplingParams, argmax_ids, draw_uniforms, inverse_cdf, logits_to_probs
from specdecode.tree import _check_parents, children_lists


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft.

    Attributes:
        num_accepted: n, how many leading draft tokens were accepted (0..k).
        tokens: int64 ``[n + 1]``: the n accepted draft tokens, then the recovered or bonus token.
        path: for a token tree, int64 ``[n]``: the accepted nodes (``1 .. N``) from the root down;
            None for a chain (the accepted nodes are the first n drafts).
    """

    num_accepted: int
    tokens: torch.Tensor
    path: torch.Tensor | None = None

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

    Device: the argmax runs where the logits are (:func:`~specdecode.sampling.argmax_ids`: numpy's
    on the CPU); its ``k + 1`` ids are the one host copy.

    Args:
        draft_ids: int64 ``[k]`` drafted tokens (k may be 0), on the CPU.
        target_logits: ``[k + 1, V]`` target logits, any device; row i scores the token after
            ``draft_ids[:i]``.

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]`` (CPU).

    Raises:
        ValueError: shapes or dtypes other than the above.
    """
    k = _check_shapes(draft_ids, target_logits)
    target_ids = argmax_ids(target_logits)  # (k + 1,) on the CPU: the step's one host copy
    if k == 0:  # the target alone (or an empty draft): its argmax is the token
        return VerifyResult(0, target_ids)
    best, drafted = target_ids.tolist(), draft_ids.tolist()
    n = next((i for i in range(k) if drafted[i] != best[i]), k)
    return VerifyResult(n, target_ids[: n + 1])


def _residuals(p: torch.Tensor, q: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """float64 ``[m, V]``: the residuals ``max(0, p_i - q_i)`` of rows ``p`` ``[m, V]`` (one-hot
    ``q`` at ``ids`` ``[m]`` when ``q`` is None: ``p_i`` with the drafted token removed). Same device."""
    if q is None:
        residual = p.double().clone()  # (m, V)
        residual[torch.arange(ids.shape[0], device=p.device), ids] = 0.0
        return residual
    return (p.double() - q.double()).clamp_min(0.0)  # (m, V)


def _first_rejection(uniforms: list[float], p_x: list[float], q_x: list[float]) -> int:
    """Index of the first draft with ``u_i >= p_i(x_i) / q_i(x_i)`` (``len(p_x)`` if none):
    ``u * q >= p`` (no division; ``q = 0`` for a drafted token cannot happen)."""
    return next((i for i, (p, q) in enumerate(zip(p_x, q_x, strict=True)) if uniforms[i] * q >= p), len(p_x))


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

    Randomness: ``k + 1`` uniforms are drawn from ``generator`` (a CPU generator,
    :func:`~specdecode.sampling.draw_uniforms`): ``u_i`` tests draft i, ``u_k`` picks the recovered
    / bonus token by :func:`~specdecode.sampling.inverse_cdf`. A seed so gives the same tokens on
    every device (up to the rounding of the probabilities).

    Device: the probabilities stay where they are. On the CPU the final row is built once n is
    known; elsewhere every row's candidate final token is computed on the device and one host copy
    brings ``p_i(x_i)``, ``q_i(x_i)`` and the candidates back (one synchronisation per step).

    Args:
        draft_ids: int64 ``[k]`` drafted tokens (k may be 0), on the CPU.
        draft_probs: float ``[k, V]`` draft distributions q the tokens were sampled from, on
            ``target_probs``' device, or None for a deterministic proposal (one-hot q at ``draft_ids``).
        target_probs: float ``[k + 1, V]`` target distributions p, any device; row i is for the
            token after ``draft_ids[:i]``.
        generator: a CPU ``torch.Generator`` (None: torch's default generator).

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]`` (CPU).

    Raises:
        ValueError: shapes or dtypes other than the above.
    """
    k = _check_shapes(draft_ids, target_probs)
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}], got {list(draft_probs.shape)}")
    device = target_probs.device
    uniforms = draw_uniforms(k + 1, generator)  # k acceptance tests, then the recovered / bonus draw
    ids = draft_ids.to(device)  # (k,)
    rows = torch.arange(k, device=device)
    p_x = target_probs[rows, ids].double()  # (k,)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, ids].double()  # (k,)
    if device.type == "cpu":
        n = _first_rejection(uniforms, p_x.tolist(), q_x.tolist())
        q_n = None if draft_probs is None else draft_probs[n : n + 1]
        final = target_probs[k] if n == k else _residuals(target_probs[n : n + 1], q_n, ids[n : n + 1])[0]  # (V,)
        token = int(inverse_cdf(final, uniforms[k]))
    else:  # every row's candidate on the device, one host copy
        finals = torch.cat([_residuals(target_probs[:k], draft_probs, ids), target_probs[k:].double()])  # (k + 1, V)
        candidates = inverse_cdf(finals, uniforms[k])  # (k + 1,)
        host = torch.cat([p_x, q_x, candidates.double()]).tolist()  # 3k + 1 numbers
        n = _first_rejection(uniforms, host[:k], host[k : 2 * k])
        token = int(host[2 * k + n])
    return VerifyResult(n, torch.cat([draft_ids[:n].cpu(), torch.tensor([token], dtype=torch.int64)]))


def rejection_sample_reference(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Plain loop version of :func:`rejection_sample`, written for reading, used by tests (CPU).

    Same arguments, same use of randomness, same result.
    """
    k = draft_ids.shape[0]
    V = target_probs.shape[1]
    uniforms = draw_uniforms(k + 1, generator)
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
        token = int(inverse_cdf(residual, uniforms[k]))
        return VerifyResult(i, torch.tensor(accepted + [token], dtype=torch.int64))
    bonus = int(inverse_cdf(target_probs[k], uniforms[k]))
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


# ---------------------------------------------------------------------------------- token trees
def _check_tree(draft_ids: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> list[list[int]]:
    if draft_ids.dim() != 1 or draft_ids.dtype != torch.int64:
        raise ValueError(f"draft_ids must be int64 [N], got {draft_ids.dtype} {list(draft_ids.shape)}")
    N = draft_ids.shape[0]
    if parents.shape != (N,):
        raise ValueError(f"parents must be [N] = [{N}], got {list(parents.shape)}")
    if target.dim() != 2 or target.shape[0] != N + 1:
        raise ValueError(f"target logits/probs must be [N + 1, V] = [{N + 1}, V], got {list(target.shape)}")
    return children_lists(_check_parents(parents))


def greedy_verify_tree(draft_ids: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Walk down a token tree while some child equals the target's argmax; then add that argmax.

    Exact for the same reason as :func:`greedy_verify`: every accepted node's token is the
    target's argmax after the root path to it, which is what greedy target-only decoding emits
    (SpecInfer, Miao et al. 2024, arXiv 2305.09781, greedy case). Among equal siblings the first
    is taken.

    Args:
        draft_ids: int64 ``[N]``, tokens of nodes ``1 .. N``.
        parents: int64 ``[N]``, parent node of nodes ``1 .. N`` (see :mod:`specdecode.tree`).
        target_logits: ``[N + 1, V]``; row i scores the token after node i's root path.

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]`` and ``path`` ``[n]``.

    Raises:
        ValueError: shapes, dtypes or parents other than the above.
    """
    children = _check_tree(draft_ids, parents, target_logits)
    best = argmax_ids(target_logits).tolist()  # (N + 1,)
    ids = draft_ids.tolist()
    path: list[int] = []
    node = 0
    while True:
        nxt = next((c for c in children[node] if ids[c - 1] == best[node]), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    tokens = [ids[c - 1] for c in path] + [best[node]]
    return VerifyResult(len(path), torch.tensor(tokens, dtype=torch.int64), torch.tensor(path, dtype=torch.int64))


def rejection_sample_tree(
    draft_ids: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Multi-candidate speculative sampling over a token tree of deterministic proposals.

    Rule (the sequential variant of multi-draft speculative sampling: SpecInfer's recursive
    rejection, Miao et al. 2024, arXiv 2305.09781, Algorithm 2, with one-hot draft distributions;
    as in EAGLE's tree sampling): at a node whose target distribution is ``p``, set ``r = p`` and
    try its children ``x_1, x_2, ...`` in order. Child ``x_j`` is accepted with probability
    ``r(x_j) / sum(r)``; on rejection set ``r(x_j) = 0`` and try the next. An accepted child becomes
    the node and the walk continues with its own ``p``; when every child is rejected (or there are
    none) the recovered / bonus token is drawn from ``r / sum(r)``.

    Why it is exact: each try is the modified rejection sampling of Leviathan et al. with a
    one-hot ``q`` at ``x_j`` against the current residual target ``r / sum(r)``, which yields
    exactly ``r / sum(r)``; the residual after a rejection is ``r`` with ``x_j`` removed, so by
    induction over the children the token emitted at the node is distributed as ``p``:
    ``P(x_j) = prod_{i<j} (1 - r_i(x_i)) * r_j(x_j) = p(x_j)`` and any other token y gets
    ``p(y)``. The walk then continues from the emitted token's own distribution, so the sequence is
    distributed as target-only sampling token by token. This needs the candidates to be chosen
    without the verifier's randomness (top-ranked proposer tokens, or tokens sampled with
    independent randomness); they may repeat (a repeated token is then accepted with probability
    0). The chance to accept some child is ``sum_j p(x_j)`` over distinct candidates.

    Randomness: one uniform per child tried, then one for the recovered / bonus token
    (:func:`~specdecode.sampling.inverse_cdf`), from ``generator``, a CPU generator.

    Device: the walk runs on the host over ``N`` candidate probabilities ``p_parent(x)`` and the
    ``N + 1`` row sums, brought back in one copy; the final token is drawn on the probabilities'
    device and its id is the second copy.

    Args:
        draft_ids: int64 ``[N]``, tokens of nodes ``1 .. N``, on the CPU.
        parents: int64 ``[N]``, parent node of nodes ``1 .. N``, on the CPU.
        target_probs: float ``[N + 1, V]`` target distributions, any device; row i is for the
            token after node i.
        generator: a CPU ``torch.Generator`` (None: torch's default generator).

    Returns:
        :class:`VerifyResult` with ``tokens`` ``[n + 1]`` and ``path`` ``[n]`` (CPU).

    Raises:
        ValueError: shapes, dtypes or parents other than the above.
    """
    children = _check_tree(draft_ids, parents, target_probs)
    ids = draft_ids.tolist()
    N = len(ids)
    device = target_probs.device
    p_x = target_probs[parents.to(device), draft_ids.to(device)].double()  # (N,): each node's token under its parent
    sums = target_probs.sum(-1, dtype=torch.float64)  # (N + 1,)
    host = torch.cat([p_x, sums]).tolist()  # N candidate probabilities, N + 1 row sums: one copy
    path: list[int] = []
    node = 0
    while True:
        total = host[N + node]  # the residual's mass: p's, less the candidates rejected so far
        removed: set[int] = set()
        accepted = None
        for child in children[node]:
            x = ids[child - 1]
            mass = 0.0 if x in removed else host[child - 1]
            u = draw_uniforms(1, generator)[0]
            if total > 0 and u * total < mass:
                accepted = child
                break
            if x not in removed:
                removed.add(x)
                total -= mass
        if accepted is None:
            break
        path.append(accepted)
        node = accepted
    row = target_probs[node].double()  # (V,)
    residual = row.clone()
    if removed:
        residual[torch.tensor(sorted(removed), dtype=torch.int64, device=device)] = 0.0
    # the residual's sum is 0 only by rounding (every token of p was a rejected candidate): then p itself
    residual = torch.where(residual.sum() > 0.0, residual, row)
    token = int(inverse_cdf(residual, draw_uniforms(1, generator)[0]))
    tokens = [ids[c - 1] for c in path] + [token]
    return VerifyResult(len(path), torch.tensor(tokens, dtype=torch.int64), torch.tensor(path, dtype=torch.int64))


def verify_tree(
    draft_ids: torch.Tensor,
    parents: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify a token tree: :func:`greedy_verify_tree` when greedy, else :func:`rejection_sample_tree`
    on ``p = logits_to_probs(target_logits, sampling)``.

    Args:
        draft_ids: int64 ``[N]``; parents: int64 ``[N]``; target_logits: float ``[N + 1, V]``.
        sampling: the request's sampling parameters; generator: randomness for sampling.
    """
    if sampling.greedy:
        return greedy_verify_tree(draft_ids, parents, target_logits)
    return rejection_sample_tree(draft_ids, parents, logits_to_probs(target_logits, sampling), generator)
