"""How well a drafter agrees with its target: top-1 agreement per draft position on held-out
sequences, and the expected accepted drafts per step that implies.

For EAGLE, position j > 1 is measured autoregressively, as drafting runs (the head's own predicted
features, attending to the true pairs before the rollout and to its own earlier steps), with the
corpus tokens as token inputs. The expected number of accepted tokens per step for a chain of k
drafts is ``sum_j prod_{i<=j} a_i`` (greedy, treating positions as independent).
"""

from __future__ import annotations

import torch

from specdecode.drafters.heads import EagleHead, MedusaHeads
from specdecode.drafters.losses import eagle_loss


@torch.no_grad()
def validate(
    drafter: MedusaHeads | EagleHead,
    tokens: torch.Tensor,
    features: torch.Tensor,
    labels: torch.Tensor,
    depth: int = 4,
    batch_size: int = 4,
) -> list[float]:
    """Top-1 agreement with the target per draft position 1..depth on held-out sequences.

    Medusa: head j's top-1 against ``y_{p+j}``. EAGLE: position 1 from the true feature ``f_p``;
    position j > 1 autoregressive from its own predicted features (token inputs: the target's
    tokens ``x``), scored against ``y_{p+j}``.

    Returns:
        ``[depth]`` agreements in [0, 1] (Medusa: ``min(depth, K)`` of them).
    """
    drafter.eval()
    hits = torch.zeros(depth, dtype=torch.float64)
    total = torch.zeros(depth, dtype=torch.float64)
    L = tokens.shape[1]
    for start in range(0, tokens.shape[0], batch_size):
        x = tokens[start : start + batch_size]
        f = features[start : start + batch_size].float()
        y = labels[start : start + batch_size]
        if isinstance(drafter, MedusaHeads):
            K = min(depth, drafter.config.num_heads)
            hidden = drafter(f[:, : L - K])  # (B, L - K, K, H)
            for j in range(1, K + 1):
                target = y[:, j : L - K + j]
                valid = target >= 0
                hits[j - 1] += float(((drafter.logits(hidden[:, :, j - 1]).argmax(-1) == target) & valid).sum())
                total[j - 1] += float(valid.sum())
            continue
        # EAGLE: the training loss's rollout of ``depth`` steps (no noise), scored at every position
        _, correct, counted = eagle_loss(drafter, x, f, y, noise=0.0, cls_weight=0.0, ttt_steps=depth)
        hits += correct.double()
        total += counted.double()
    drafter.train()
    kept = total > 0
    return (hits[kept] / total[kept]).tolist()


def expected_accepted(agreement: list[float]) -> float:
    """``sum_j prod_{i<=j} a_i``: expected accepted drafts per step of a chain (independence assumed)."""
    out, running = 0.0, 1.0
    for a in agreement:
        running *= a
        out += running
    return out
