"""The verifiers as pure functions: greedy acceptance, rejection sampling against its reference,
and the distribution of every output position (accepted, recovered and bonus) against p."""

from __future__ import annotations

import pytest
import torch

from specdecode.verify import VerifyResult, greedy_verify, rejection_sample, rejection_sample_reference

from stat_checks import P_MIN, chi_square_p


def one_hot_logits(ids: list[int], V: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(ids), V)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


@pytest.mark.parametrize(
    ("draft", "target", "n", "tokens"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [7, 2, 3, 4], 0, [7]),  # first rejected: target's own token
        ([1, 2, 3], [1, 2, 9, 4], 2, [1, 2, 9]),  # partly
        ([], [6], 0, [6]),  # no draft: plain decoding step
    ],
)
def test_greedy_verify(draft: list[int], target: list[int], n: int, tokens: list[int]) -> None:
    result = greedy_verify(torch.tensor(draft, dtype=torch.int64), one_hot_logits(target))
    assert result.num_accepted == n
    assert result.tokens.tolist() == tokens


def test_verify_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[k \+ 1, V\]"):
        greedy_verify(torch.tensor([1, 2]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="int64"):
        greedy_verify(torch.tensor([1.0]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.tensor([1]), torch.full((1, 4), 0.25), torch.full((2, 5), 0.2))


def random_dists(k: int, V: int, seed: int, sharpness: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """p [k+1, V] and q [k, V]: q is p perturbed, with a few zeros in each so that both the
    ``p = 0 < q`` and the ``q = 0 < p`` cases occur."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, V, generator=g) * sharpness
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:k] + torch.randn(k, V, generator=g), -1)
    p[:, 0] = 0.0  # the target never emits token 0; the draft may
    q[:, 1] = 0.0  # the draft never proposes token 1; the target may emit it
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def test_fast_and_reference_agree() -> None:
    k, V = 4, 12
    p, q = random_dists(k, V, seed=0)
    draw = torch.Generator().manual_seed(1)
    for trial in range(300):
        ids = torch.multinomial(q, 1, generator=draw).view(-1)
        a = rejection_sample(ids, q, p, torch.Generator().manual_seed(trial))
        b = rejection_sample_reference(ids, q, p, torch.Generator().manual_seed(trial))
        assert (a.num_accepted, a.tokens.tolist()) == (b.num_accepted, b.tokens.tolist())
        c = rejection_sample(ids, None, p, torch.Generator().manual_seed(trial))
        d = rejection_sample_reference(ids, None, p, torch.Generator().manual_seed(trial))
        assert (c.num_accepted, c.tokens.tolist()) == (d.num_accepted, d.tokens.tolist())


def broken_residual(ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, g: torch.Generator) -> VerifyResult:
    """A wrong sampler: after a rejection it draws from p instead of norm(max(0, p - q))."""
    result = rejection_sample(ids, q, p, g)
    n = result.num_accepted
    if n == ids.shape[0]:
        return result
    token = torch.multinomial(p[n], 1, generator=g)
    return VerifyResult(n, torch.cat([ids[:n], token]))


def tokens_per_position(sampler, p: torch.Tensor, q: torch.Tensor | None, trials: int, seed: int) -> list[list[int]]:
    """Run ``sampler`` on fresh drafts; collect the token it outputs at each position 0..k."""
    k = p.shape[0] - 1
    g = torch.Generator().manual_seed(seed)
    at: list[list[int]] = [[] for _ in range(k + 1)]
    for _ in range(trials):
        if q is None:  # deterministic proposer: always the same draft (the argmax of p here)
            ids = p[:k].argmax(-1)
        else:
            ids = torch.multinomial(q, 1, generator=g).view(-1)
        for i, token in enumerate(sampler(ids, q, p, g).tokens.tolist()):
            at[i].append(token)
    return at


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-draft", "one-hot-draft"])
def test_every_position_follows_p(deterministic: bool) -> None:
    """Position i of the output (accepted draft, recovered token or bonus token) is distributed
    as p_i when p does not depend on the prefix. k = 3, 20,000 trials; every position must pass
    the chi-square check (p-value > P_MIN) and have enough samples to mean something."""
    k, V = 3, 10
    # sharper p for the one-hot draft (its argmax), so that all k are accepted often enough
    p, q = random_dists(k, V, seed=3, sharpness=2.5 if deterministic else 1.0)
    at = tokens_per_position(rejection_sample, p, None if deterministic else q, trials=20_000, seed=4)
    for i in range(k + 1):
        assert len(at[i]) >= 1_000, f"position {i} reached only {len(at[i])} times"
        assert chi_square_p(at[i], p[i]) > P_MIN, f"position {i} does not follow p"


def test_check_catches_a_broken_residual() -> None:
    """The same check fails a sampler whose recovered token ignores q."""
    k, V = 3, 10
    p, q = random_dists(k, V, seed=3, sharpness=1.0)
    at = tokens_per_position(broken_residual, p, q, trials=20_000, seed=4)
    assert min(chi_square_p(at[i], p[i]) for i in range(k)) < 1e-6


def test_check_catches_a_missing_bonus() -> None:
    """...and one that repeats the last draft instead of sampling the bonus token from p_{k+1}."""

    def no_bonus(ids: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, g: torch.Generator) -> VerifyResult:
        result = rejection_sample(ids, q, p, g)
        if result.num_accepted == ids.shape[0]:
            return VerifyResult(result.num_accepted, torch.cat([ids, ids[-1:]]))
        return result

    k, V = 3, 10
    p, q = random_dists(k, V, seed=3, sharpness=1.0)
    at = tokens_per_position(no_bonus, p, q, trials=20_000, seed=4)
    assert chi_square_p(at[k], p[k]) < 1e-6
