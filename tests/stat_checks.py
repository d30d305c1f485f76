"""Goodness-of-fit helper for the sampling tests.

Tolerance: a chi-square test of the sampled counts against the exact distribution must give a
p-value above ``P_MIN``. Bins whose expected count is under 5 are pooled into one (the usual
validity rule). Every test that uses it is seeded, so a result never flickers between runs; and
``test_verify.py`` shows the same check rejecting a deliberately broken sampler.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare

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
