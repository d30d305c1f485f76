"""The batched runner (ragged rows, one KV cache) against one-sequence ModelRunner logits (and the
target's features, return_hidden), float32;
and the cost model / speculation plan of the server."""

from __future__ import annotations

import copy

import pytest
import torch

from specdecode.cost.serve_measure import default_batch_grid, measure_target_costs, monotone
from specdecode.cost.serve_model import AcceptanceEstimate, CostModel, expected_tokens, plan_speculation
from specdecode.models.torch.batch import TorchBatchedRunner
from specdecode.models.torch.runner import ModelRunner
from specdecode.schedule import acceptance_trials

from conftest import make_tiny_model

ATOL = 1e-4  # float32, different reduction lengths (padded keys): differences are ~1e-6


def tokens(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, 96, (n,), generator=g)


class Pair:
    """A TorchBatchedRunner and one ModelRunner per row, driven alike; every forward is compared."""

    def __init__(self, model, max_rows: int, capacity: int = 8, hidden: bool = False) -> None:
        self.model = model
        self.hidden = hidden  # also compare the target's features (return_hidden)
        self.batched = TorchBatchedRunner(model, max_rows, capacity=capacity)
        self.singles: list[ModelRunner] = []

    def add(self) -> None:
        self.batched.add_row()
        self.singles.append(ModelRunner(self.model))

    def remove(self, row: int) -> None:
        moved = self.batched.remove_row(row)
        last = self.singles.pop()
        if moved is not None:
            self.singles[row] = last

    def truncate(self, row: int, drop: int) -> None:
        self.batched.truncate(row, self.batched.lengths[row] - drop)
        self.singles[row].truncate(self.singles[row].length - drop)

    def forward(self, first: int, inputs: list[torch.Tensor], num_logits: list[int]) -> None:
        got = self.batched.forward(first, inputs, num_logits, return_hidden=self.hidden)
        if self.hidden:
            got, features = got
        for b, (x, m, logits) in enumerate(zip(inputs, num_logits, got, strict=True)):
            want = self.singles[first + b].forward(x, m, return_hidden=self.hidden)
            if self.hidden:
                want, want_features = want
                assert features[b].shape == want_features.shape == (x.shape[0], self.model.config.hidden_size)
                torch.testing.assert_close(features[b], want_features, atol=ATOL, rtol=0)
            assert logits.shape == want.shape
            torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
            assert torch.equal(logits.argmax(-1), want.argmax(-1))
        assert self.batched.lengths == [r.length for r in self.singles]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_batched_logits_equal_single_sequence_logits(attention: str) -> None:
    model = make_tiny_model(seed=0)
    model.config._attn_implementation = attention
    g = torch.Generator().manual_seed(0)
    pair = Pair(model, max_rows=4, capacity=8)  # small capacity: the cache must grow
    for _ in range(3):
        pair.add()
    pair.forward(0, [tokens(g, 5), tokens(g, 11), tokens(g, 3)], [1, 1, 1])  # ragged prefill
    pair.forward(0, [tokens(g, 3), tokens(g, 1), tokens(g, 5)], [3, 1, 5])  # ragged decode step
    pair.truncate(0, 2)  # per-row rollback
    pair.truncate(2, 4)
    pair.forward(0, [tokens(g, 4), tokens(g, 2), tokens(g, 1)], [4, 2, 1])  # stale entries must be masked
    pair.remove(1)  # leave: the last row moves into row 1
    pair.add()  # join at the end, prefilled alone
    pair.forward(2, [tokens(g, 30)], [1])
    pair.forward(0, [tokens(g, 2), tokens(g, 5), tokens(g, 1)], [2, 5, 1])
    pair.remove(2)  # the last row leaves
    pair.remove(0)
    pair.forward(0, [tokens(g, 6)], [6])


@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "logits+features"])
def test_many_steps_with_random_joins_leaves_and_rollbacks(hidden: bool) -> None:
    model = make_tiny_model(seed=3)
    g = torch.Generator().manual_seed(1)
    pair = Pair(model, max_rows=3, capacity=16, hidden=hidden)
    for step in range(25):
        n = pair.batched.num_rows
        if n < 3 and (n == 0 or torch.rand(1, generator=g) < 0.3):
            pair.add()
            pair.forward(n, [tokens(g, int(torch.randint(1, 12, (1,), generator=g)))], [1])
            continue
        if n > 1 and torch.rand(1, generator=g) < 0.2:
            pair.remove(int(torch.randint(0, n, (1,), generator=g)))
            continue
        sizes = [int(torch.randint(1, 6, (1,), generator=g)) for _ in range(n)]
        pair.forward(0, [tokens(g, s) for s in sizes], sizes)
        for row, s in enumerate(sizes):
            drop = int(torch.randint(0, s, (1,), generator=g))  # keep >= 1 of the new tokens
            pair.truncate(row, drop)


def test_runner_errors() -> None:
    model = make_tiny_model(seed=0)
    runner = TorchBatchedRunner(model, max_rows=1)
    with pytest.raises(ValueError, match="max_rows"):
        TorchBatchedRunner(model, max_rows=0)
    runner.add_row()
    with pytest.raises(RuntimeError, match="rows"):
        runner.add_row()
    with pytest.raises(ValueError, match="num_logits"):
        runner.forward(0, [torch.tensor([1, 2])], [3])
    with pytest.raises(ValueError, match="rows"):
        runner.forward(1, [torch.tensor([1])], [1])
    with pytest.raises(ValueError, match="truncate"):
        runner.truncate(0, 1)
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        TorchBatchedRunner(flash, max_rows=1)


# ---------------------------------------------------------------------------------- cost model
def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_plan_speculation_follows_the_costs() -> None:
    flat = lambda B, T: 1.0  # noqa: E731  memory-bound: scoring more tokens costs nothing
    steep = lambda B, T: B * T  # noqa: E731  compute-bound: cost proportional to tokens scored
    assert plan_speculation([0.8, 0.8], [4, 4], [0.0, 0.0], flat) == [4, 4]
    assert plan_speculation([0.8, 0.8], [4, 2], [0.0, 0.0], flat) == [4, 2]  # each row's own cap
    assert plan_speculation([0.8, 0.8], [4, 4], [0.0, 0.0], steep) == [0, 0]
    assert plan_speculation([0.8, 0.8], [0, 4], [0.0, 0.0], flat) == [0, 4]  # row 0 does not speculate
    # A draft that costs 5% of a target pass per token: the good row drafts, the bad one does not.
    ks = plan_speculation([0.9, 0.02], [4, 4], [0.05, 0.05], flat)
    assert ks[0] > 0 and ks[1] == 0
    # A draft as slow as the target itself never pays.
    assert plan_speculation([0.6], [4], [1.0], flat) == [0]
    assert plan_speculation([], [], [], flat) == []
    # The margin: one row, a draft at 10% of a pass per token and alpha 0.2 expects 1.2 tokens in
    # 1.1 passes (+9%): it drafts without a margin, not with 10%.
    assert plan_speculation([0.2], [1], [0.1], flat, margin=0.0) == [1]
    assert plan_speculation([0.2], [1], [0.1], flat, margin=0.1) == [0]
    assert plan_speculation([0.2], [1], [0.1], flat) == [1]  # the default margin, 5%, lets +9% through
    assert plan_speculation([0.1], [1], [0.05], flat) == [0]  # +4.8% is not enough
    assert plan_speculation([0.1], [1], [0.05], flat, margin=0.0) == [1]
    # A one-off catch-up cost charged to a row that drafts at all: the good row then waits.
    assert plan_speculation([0.9], [4], [0.05], flat) == [4]
    assert plan_speculation([0.9], [4], [0.05], flat, setup_costs=[5.0]) == [0]
    assert plan_speculation([0.9, 0.9], [4, 4], [0.05, 0.05], flat, setup_costs=[5.0, 0.0]) == [0, 4]


def test_acceptance_estimate_uses_prior_and_forgets() -> None:
    est = AcceptanceEstimate()
    assert est.rate(prior=0.6) == pytest.approx(0.6)
    for _ in range(20):
        est.observe(4, 0)
    low = est.rate(prior=0.6)
    trials = sum(0.9**i for i in range(20))  # a step rejecting its first token tried one position
    assert low == pytest.approx(4 * 0.6 / (trials + 4)) and low < 0.2
    for _ in range(60):
        est.observe(0, 0)  # not drafting: drifts back to the prior
    assert est.rate(prior=0.6) > 0.5 > low


def test_acceptance_estimate_is_per_position() -> None:
    """alpha in E(alpha, k) is the probability that each next drafted token is accepted: a step
    accepting 2 of 4 tried 3 positions (the 4th was never tried), so the estimate tends to 2/3,
    not accepted / drafted = 1/2."""
    assert acceptance_trials(4, 2) == 3 and acceptance_trials(4, 4) == 4 and acceptance_trials(4, 0) == 1
    assert acceptance_trials(0, 0) == 0
    est = AcceptanceEstimate()
    for _ in range(100):
        est.observe(4, 2)
    assert est.rate(prior=0.6) == pytest.approx((20 + 4 * 0.6) / (30 + 4), rel=1e-3)  # steady state: 2/3 pulled to 0.6
    full = AcceptanceEstimate()
    for _ in range(100):
        full.observe(4, 4)
    assert full.rate(prior=0.6) > 0.95


def test_cost_model_interpolates_and_learns_draft_cost() -> None:
    cost = CostModel([1, 4], [1, 5], [[1.0, 2.0], [3.0, 6.0]])
    assert cost.target_time(1, 1) == 1.0
    assert cost.target_time(4, 5) == 6.0
    assert cost.target_time(1, 3) == pytest.approx(1.5)
    assert cost.target_time(2, 1) == pytest.approx(1 + 2 / 3)
    assert cost.target_time(16, 9) == 6.0  # clamped at the grid's ends
    assert cost.draft_time("draft_model") == 0.0
    cost.observe_draft("draft_model", 0.4, 4)
    assert cost.draft_time("draft_model") == pytest.approx(0.1)
    cost.observe_draft("draft_model", 0.0, 0)  # nothing drafted: no information
    assert cost.draft_time("draft_model") == pytest.approx(0.1)
    assert monotone([[2.0, 1.0], [1.0, 3.0]]) == [[1.0, 1.0], [1.0, 3.0]]  # the faster sample wins
    assert monotone([[5.0, 1.0, 2.0], [1.0, 1.5, 4.0]]) == [[1.0, 1.0, 2.0], [1.0, 1.5, 4.0]]
    assert cost.catchup_time("draft_model") == pytest.approx(0.05 * 0.1)  # the prior: 5% of c_p
    cost.observe_catchup("draft_model", 2.2, 2, 100)  # 2 drafted (0.2 s), 2 s for 100 context tokens
    assert cost.catchup_time("draft_model") == pytest.approx(0.02)
    cost.observe_catchup("draft_model", 1.0, 1, 0)  # nothing to catch up: no information
    assert cost.catchup_time("draft_model") == pytest.approx(0.02)
    cost.observe_target(4, 5, 16.0)  # 16 s where the table says 6: the row's factor moves 10% of the way
    factor = 0.9 + 0.1 * 16.0 / 6.0
    assert cost.target_time(4, 5) == pytest.approx(6.0 * factor)
    assert cost.target_time(4, 1) == pytest.approx(3.0 * factor)  # the whole row: the shape is kept
    assert cost.target_time(1, 5) == 2.0  # other rows unchanged
    cost.observe_target(3, 5, 100.0)  # a batch size off the grid: ignored
    assert cost.scale == [1.0, pytest.approx(factor)]
    assert default_batch_grid(8) == [1, 2, 4, 8] and default_batch_grid(6) == [1, 2, 4, 6]


def test_measure_target_costs_on_a_tiny_model() -> None:
    cost = measure_target_costs(make_tiny_model(seed=0), [1, 2], [1, 3], context=8, repeats=1)
    assert cost.batch_sizes == [1, 2] and cost.tokens == [1, 3]
    flat = [t for row in cost.target_s for t in row]
    assert all(t > 0 for t in flat)
    assert cost.target_s == monotone(cost.target_s)
