"""Reference decoders, written independently of the engine, that the lossless tests compare against."""

from __future__ import annotations

import torch

from specdecode.sampling import SamplingParams, logits_to_probs


def target_only_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding written independently of the engine: full forward, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def exact_marginals(target, prompt: list[int], positions: int, sampling: SamplingParams) -> list[torch.Tensor]:
    """Exact distribution of each of the first ``positions`` tokens of target-only sampling,
    by enumerating every prefix (V^(positions-1) sequences, batched)."""
    marginals = []
    prefixes = [((), 1.0)]
    with torch.no_grad():
        for _ in range(positions):
            batch = torch.tensor([prompt + list(t) for t, _ in prefixes])
            probs = logits_to_probs(target(batch).logits[:, -1].double(), sampling).double()  # (B, V)
            weights = torch.tensor([w for _, w in prefixes], dtype=torch.float64)
            marginals.append((weights[:, None] * probs).sum(0))
            prefixes = [
                (t + (v,), w * float(probs[b, v]))
                for b, (t, w) in enumerate(prefixes)
                for v in range(probs.shape[1])
                if probs[b, v] > 0
            ]
    return marginals
