"""Goodness-of-fit helper for the sampling tests.

Tolerance: a chi-square test of the sampled counts against the exact distribution must give a
p-value above ``P_MIN``. Bins whose expected count is under 5 are pooled into one (the usual
validity rule). Every test that uses it is seeded, so a result never flickers between runs; and
``test_verify.py`` shows the same check rejecting a deliberately broken sampler.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chi2, chisquare

P_MIN = 1e-3


def chi_square_p(samples: list[int] | torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``samples`` (token ids) being drawn from ``probs`` ``[V]``."""
    probs = probs.double().cpu().numpy()
    observed = np.bincount(np.asarray(samples, dtype=np.int64), minlength=probs.shape[0]).astype(float)
    n = observed.sum()
    assert n > 0, "no samples"
    if (observed[probs == 0] > 0).any():
        return 0.0  # a token of probability zero was sampled
    expected = probs * n
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    if keep.sum() < 2:
        return 1.0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return float(chisquare(obs[keep], exp).pvalue)


def pooled_cells(expected: np.ndarray, min_expected: float = 5.0) -> list[np.ndarray]:
    """Cells (index arrays) over the positive entries of ``expected``: one per entry of at least
    ``min_expected``, the rest pooled into one, itself merged into the smallest other cell when its
    total is still under ``min_expected`` (every cell then meets the usual validity rule)."""
    positive = np.flatnonzero(expected > 0)
    cells = [np.array([i]) for i in positive[expected[positive] >= min_expected]]
    small = positive[expected[positive] < min_expected]
    if small.size:
        if expected[small].sum() >= min_expected or not cells:
            cells.append(small)
        else:
            j = int(np.argmin([expected[c].sum() for c in cells]))
            cells[j] = np.concatenate([cells[j], small])
    return cells


def first_two_tokens_p_values(
    pairs: list[tuple[int, int]], first: torch.Tensor, second: dict[int, torch.Tensor]
) -> dict[str, float]:
    """p-values of pairs ``(t1, t2)`` being drawn from ``first`` ``[V]``, then ``t2`` from
    ``second[t1]`` ``[V]``: one test per position instead of one over the sparse joint cells.

    - ``"token 1"``: the first tokens against ``first`` (:func:`chi_square_p`);
    - ``"token 2 given token 1"``: given the first tokens, the second tokens are independent draws
      from ``second[t1]``; Pearson's statistic summed over every ``t1`` (expected counts
      ``n(t1) * second[t1]``, cells pooled by :func:`pooled_cells` on ``len(pairs) * first[t1] *
      second[t1]``, so from the law, not the sample) is chi-square with the summed degrees of freedom;
    - ``"impossible pairs"``: 0.0, present only when a token of probability zero was drawn.

    Use with :func:`check_all` (Bonferroni over the tests).
    """
    n = len(pairs)
    p_values = {"token 1": chi_square_p([t1 for t1, _ in pairs], first)}
    if any(t1 not in second or float(second[t1][t2]) == 0.0 for t1, t2 in pairs):
        p_values["impossible pairs"] = 0.0
        return p_values
    statistic, dof = 0.0, 0
    for t1, law in second.items():
        seconds = [t2 for a, t2 in pairs if a == t1]
        law = law.double().cpu().numpy()
        cells = pooled_cells(n * float(first[t1]) * law)
        if not seconds or len(cells) < 2:
            continue
        counts = np.bincount(np.asarray(seconds, dtype=np.int64), minlength=law.shape[0])
        observed = np.array([counts[c].sum() for c in cells], dtype=float)
        expected = len(seconds) * np.array([law[c].sum() for c in cells])
        statistic += float(((observed - expected) ** 2 / expected).sum())
        dof += len(cells) - 1
    p_values["token 2 given token 1"] = float(chi2.sf(statistic, dof)) if dof else 1.0
    return p_values


def check_all(p_values: dict[str, float], alpha: float = P_MIN) -> bool:
    """Whether every test passes at family-wise significance ``alpha`` (Bonferroni: each p-value
    above ``alpha / len(p_values)``): a correct sampler fails with probability at most ``alpha``."""
    return min(p_values.values()) > alpha / len(p_values)
