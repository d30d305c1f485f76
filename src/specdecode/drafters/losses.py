"""The training losses of the drafters, on the target's features and predictions.

Labels are the token-map columns of the target's predictions ``y_p`` (-100 outside the map; the
drafter scores with the target's LM-head rows of the map).

- Medusa head i at position p (:func:`medusa_loss`): cross-entropy of its scores against
  ``y_{p+i}`` (the target's prediction of token ``p + 1 + i``), weighted ``0.8 ** (i - 1)``
  (Medusa's decay).
- EAGLE at position p (:func:`eagle_loss`): input (``x_{p+1}``, ``f_p`` + uniform noise in
  ±``noise``, EAGLE-1's augmentation), output ``f^_{p+1}``; loss = SmoothL1(``f^_{p+1}``,
  ``f_{p+1}``) (feature regression) + ``cls_weight`` x cross-entropy of its scores against
  ``y_{p+1}``. With ``ttt_steps`` D > 1 the head is also unrolled D - 1 more steps on its own
  predicted features, as it drafts, and scored at each (EAGLE-3's training-time test).

The classification target (:data:`DISTILL`) is the target's top-1 prediction (a hard label) or its
whole distribution over the token map (``"soft"``, KL distillation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.drafters.heads import EagleHead, MedusaHeads

DISTILL = ("top1", "soft")


def _sample_positions(B: int, span: int, count: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """int64 ``[B, m]``: ``m = min(count, span)`` distinct positions in ``[0, span)`` per row (all if None)."""
    if count is None or count >= span:
        return torch.arange(span).expand(B, span)
    return torch.stack([torch.randperm(span, generator=generator)[:count] for _ in range(B)])


def _classification_loss(
    drafter: MedusaHeads | EagleHead, logits: torch.Tensor, target: torch.Tensor, teacher: torch.Tensor | None
) -> torch.Tensor:
    """Cross-entropy of ``logits`` float32 ``[..., N]`` against the target's predictions.

    ``teacher`` None: hard labels ``target`` (map columns, -100 ignored). Otherwise ``teacher`` is the
    target's true feature ``[..., H]`` at the labelled position and the label is its distribution over
    the token map (soft cross-entropy = KL distillation up to the teacher's entropy).
    """
    if teacher is None:
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100)
    with torch.no_grad():
        probs = torch.softmax(drafter.logits(teacher), dim=-1)  # (..., N)
    return -(probs * torch.log_softmax(logits, dim=-1)).sum(-1).mean()


def medusa_loss(
    drafter: MedusaHeads,
    features: torch.Tensor,
    labels: torch.Tensor,
    loss_positions: int | None = None,
    generator: torch.Generator | None = None,
    distill: str = "top1",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa loss on a batch.

    Args:
        features: ``[B, L, H]``.
        labels: int64 ``[B, L]`` map columns of the target's predictions ``y_p`` (-100 outside the map).
        loss_positions: positions per sequence the loss is computed at (random, distinct; None: all).
            The LM-head rows dominate the cost, so a sample keeps a CPU step short.
        generator: for the sample.
        distill: ``"top1"`` or ``"soft"`` (see :class:`~specdecode.drafters.train.TrainConfig`).

    Returns:
        ``(loss, correct [K], counted [K])``: the weighted cross-entropy and per-head top-1 hits.
    """
    K = drafter.config.num_heads
    B, L = labels.shape
    picked = _sample_positions(B, L - K, loss_positions, generator)  # (B, m): positions p
    rows = torch.arange(B).view(B, 1)
    hidden = drafter(features[rows, picked].float())  # (B, m, K, H)
    total = features.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(K, dtype=torch.int64)
    counted = torch.zeros(K, dtype=torch.int64)
    for i in range(1, K + 1):
        logits = drafter.logits(hidden[:, :, i - 1])  # (B, m, N)
        target = labels[rows, picked + i]  # y_{p+i}
        teacher = features[rows, picked + i] if distill == "soft" else None  # f_{p+i}
        total = total + 0.8 ** (i - 1) * _classification_loss(drafter, logits, target, teacher)
        with torch.no_grad():
            valid = target >= 0
            correct[i - 1] = int(((logits.argmax(-1) == target) & valid).sum())
            counted[i - 1] = int(valid.sum())
    return total, correct, counted


def rollout_mask(span: int, step: int, batch: int, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The additive attention mask of rollout step ``step`` (1-based) over ``span`` rollouts at once.

    Rollout p (started from the true feature ``f_p``) sees the true pairs q <= p, which the head's cache
    holds from step 1, and its own earlier steps only (one diagonal block per earlier step), as it does
    when drafting. Step 1 needs no mask (causal over the true pairs): returns None.

    Returns:
        ``{"full_attention": [batch, 1, span, span * step]}`` of ``dtype`` (0 allowed, dtype min masked).
    """
    if step == 1:
        return None
    lower = torch.ones(span, span, dtype=torch.bool).tril()
    eye = torch.eye(span, dtype=torch.bool)
    allowed = torch.cat([lower] + [eye] * (step - 1), dim=1)  # (span, span * step)
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return {"full_attention": additive.view(1, 1, *allowed.shape).expand(batch, 1, *allowed.shape)}


def eagle_loss(
    drafter: EagleHead,
    tokens: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    noise: float,
    cls_weight: float,
    loss_positions: int | None = None,
    generator: torch.Generator | None = None,
    distill: str = "top1",
    ttt_steps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE loss on a batch (see the module docstring).

    Step 1 is teacher forcing: input ``f_p`` (+ noise) and ``x_{p+1}``, output ``f^_{p+1}``. With
    ``ttt_steps`` D > 1, the head is also unrolled as it drafts (EAGLE-3's "training-time test", Li et
    al. 2025, arXiv 2503.01840; HASS, Zhang et al. 2024, arXiv 2408.15766): step j takes its own
    ``f^_{p+j-1}`` of step j - 1 (gradients flow through it) with ``x_{p+j}``, attends to the true
    pairs up to p and to its own earlier steps (:func:`rollout_mask`), and is scored against
    ``f_{p+j}`` and ``y_{p+j}``; the loss of step j is weighted ``0.8 ** (j - 1)`` (Medusa's decay),
    so the first position, which matters most for acceptance, keeps the largest weight. D = 1 is
    EAGLE-1's teacher forcing; rollouts start at p = 0 .. L - 1 - D.

    Args:
        tokens: int64 ``[B, L]``; features: ``[B, L, H]``; labels: int64 ``[B, L]`` map columns of ``y_p``.
        noise, cls_weight: see :class:`~specdecode.drafters.train.TrainConfig` (noise on step 1's true features only).
        loss_positions: positions per sequence the classification loss is computed at, per step
            (random; None: all); the regression loss uses every position.
        generator: for the sample.
        distill: ``"top1"`` or ``"soft"`` (see :class:`~specdecode.drafters.train.TrainConfig`).
        ttt_steps: D >= 1, the draft steps unrolled (1 <= D < L).

    Returns:
        ``(loss, correct [D], counted [D])``: top-1 hits and labels counted per step.

    Raises:
        ValueError: ``ttt_steps`` outside ``[1, L)``.
    """
    B, L = tokens.shape
    if not isinstance(ttt_steps, int) or not 1 <= ttt_steps < L:
        raise ValueError(f"ttt_steps must be an integer in [1, {L}) for sequences of {L} tokens, got {ttt_steps!r}")
    span = L - ttt_steps  # rollouts start at p = 0 .. span - 1
    current = features[:, :span].float()
    if noise > 0:
        current = current + (torch.rand_like(current) * 2 - 1) * noise
    cache = drafter.new_cache() if ttt_steps > 1 else None
    dtype = drafter.fc.weight.dtype
    rows = torch.arange(B).view(B, 1)
    total = features.new_zeros((), dtype=torch.float32)
    correct = torch.zeros(ttt_steps, dtype=torch.int64)
    counted = torch.zeros(ttt_steps, dtype=torch.int64)
    for j in range(1, ttt_steps + 1):
        positions = torch.arange(j, span + j).expand(B, span)
        mask = rollout_mask(span, j, B, dtype)
        predicted = drafter(current, tokens[:, j : span + j], positions, cache, mask)  # (B, span, H): f^_{p+j}
        truth = features[:, j : span + j]  # f_{p+j}
        regression = F.smooth_l1_loss(predicted.float(), truth.float())
        picked = _sample_positions(B, span, loss_positions, generator)  # (B, m)
        logits = drafter.logits(predicted[rows, picked])  # (B, m, N)
        target = labels[:, j : span + j][rows, picked]
        teacher = truth[rows, picked] if distill == "soft" else None
        classification = _classification_loss(drafter, logits, target, teacher)
        total = total + 0.8 ** (j - 1) * (regression + cls_weight * classification)
        with torch.no_grad():
            valid = target >= 0
            correct[j - 1] = int(((logits.argmax(-1) == target) & valid).sum())
            counted[j - 1] = int(valid.sum())
        current = predicted
    return total, correct, counted
