"""Adaptive number of speculative tokens: the schedules' rules on synthetic step times, the draft
confidence cut-off, and losslessness of both (greedy equality, sampled marginals)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers import DraftModelConfig, DraftModelProposer, PromptLookupProposer, make_proposer
from specdecode.schedule import ScheduleConfig, SpeculationSchedule, expected_tokens

from conftest import make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p


def test_constant_never_changes() -> None:
    s = SpeculationSchedule(4, "constant")
    for drafted, accepted in [(4, 4), (4, 0), (4, 2)]:
        assert s.next_k() == 4
        s.update(drafted, accepted, 1.0)
    assert s.max_k == 4 and s.plain_steps == 0


def test_heuristic_grows_after_full_acceptance_and_shrinks_after_rejection() -> None:
    s = SpeculationSchedule(4, ScheduleConfig("heuristic", max_speculative_tokens=9))
    ks = []
    for accepted_all in [True, True, True, False, False, False, False, False, True]:
        k = s.next_k()
        ks.append(k)
        s.update(k, k if accepted_all else 0, 1.0)
    assert ks == [4, 6, 8, 9, 8, 7, 6, 5, 4]
    s = SpeculationSchedule(2, "heuristic")
    for _ in range(5):
        s.update(s.next_k(), 0, 1.0)
    assert s.next_k() == 1  # never below 1
    assert SpeculationSchedule(4, "heuristic").max_k == 16  # default ceiling 4 k


def simulate(
    s: SpeculationSchedule,
    steps: int,
    alpha: float | Callable[[int], float],
    draft_s: float,
    slope: float = 0.05,
    seed: int = 0,
) -> tuple[list[int], float]:
    """Drive a schedule with a fake clock: a plain step takes 1 s; a step drafting k tokens takes
    ``draft_s * k`` s of drafting and ``1 + slope * k`` s of verification, and accepts each drafted
    token with probability ``alpha`` (or ``alpha(step)``) until the first rejection (seeded).
    Returns the k of every step and the throughput relative to plain decoding."""
    rng = random.Random(seed)
    ks, tokens, clock = [], 0, 0.0
    for step in range(steps):
        k = s.next_k()
        ks.append(k)
        p = alpha(step) if callable(alpha) else alpha
        accepted = 0
        while k and accepted < k and rng.random() < p:
            accepted += 1
        draft, target = draft_s * k, 1.0 + slope * k
        s.update(k, accepted, draft + target, draft_time_s=draft, target_time_s=target)
        tokens, clock = tokens + accepted + 1, clock + draft + target
    return ks, tokens / clock


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.0, 5) == 1.0


def test_adaptive_model_estimates_and_argmax() -> None:
    s = SpeculationSchedule(4, ScheduleConfig("adaptive", prior_acceptance=0.5, prior_weight=1.0))
    assert s.next_k() == 0 and s.expected_rate(1) == 0.0  # nothing measured: the first step is plain
    s.update(0, 0, 0.5, draft_time_s=0.0, target_time_s=0.5)
    assert s.plain_time == 0.5 and s.acceptance == 0.5
    assert s.draft_time() == pytest.approx(0.25)  # prior_draft_cost * t1 until measured
    assert s.next_k() == 1 and s.probes == 1  # the first probe, right after the first step
    s.update(1, 1, 2.02, draft_time_s=1.5, target_time_s=0.52)  # the first draft also catches up: c unknown
    assert s.draft_time() == pytest.approx(0.25)
    for drafted, accepted in [(4, 4), (4, 2), (6, 6), (2, 0)]:  # steady drafts: c = 0.1 s per token
        s.next_k()
        s.update(drafted, accepted, 0.1 * drafted + 0.5 + 0.02 * drafted, draft_time_s=0.1 * drafted)
    assert s.draft_time() == pytest.approx(0.1)
    # verification pass: a + b n fitted to 0.5 + 0.02 n (anchored at t1 = 0.5; the prior slope, 0.01 per
    # token, weighs a little)
    assert s.verify_time(4) == pytest.approx(0.58, rel=0.03) and s.verify_time(8) == pytest.approx(0.66, rel=0.05)
    # acceptance: successes 1+4+2+6+0 = 13 in trials 1+4+3+6+1 = 15, older ones decayed, prior 0.5 x 1
    assert 0.75 < s.acceptance < 13.5 / 16 + 1e-9
    rates = [s.expected_rate(k) for k in range(s.max_k + 1)]
    alpha = s.acceptance
    assert rates[3] == pytest.approx(expected_tokens(alpha, 3) / (3 * s.draft_time() + s.verify_time(3)))
    assert s.best_k() == max(range(s.max_k + 1), key=rates.__getitem__) > 0


def test_adaptive_first_draft_after_plain_steps_only_lowers_the_draft_cost() -> None:
    s = SpeculationSchedule(2, "adaptive")
    s.update(0, 0, 1.0, draft_time_s=0.0, target_time_s=1.0)
    s.update(1, 0, 9.0, draft_time_s=8.0, target_time_s=1.0)  # a draft model's prompt prefill
    assert s.draft_time() == pytest.approx(0.5)  # the prior, not 8 s per token
    s.update(0, 0, 1.0, draft_time_s=0.0, target_time_s=1.0)
    s.update(1, 0, 1.2, draft_time_s=0.2, target_time_s=1.0)  # after plain steps, but cheaper: a bound
    assert s.draft_time() == pytest.approx(0.2)
    s.update(2, 2, 1.6, draft_time_s=0.6, target_time_s=1.0)  # previous step drafted: a measurement
    assert s.draft_time() == pytest.approx(0.3)


def test_adaptive_plain_time_is_bounded_by_the_verification_passes() -> None:
    s = SpeculationSchedule(2, "adaptive")
    s.update(0, 0, 10.0, draft_time_s=0.0, target_time_s=10.0)  # the first plain step, during a stall
    assert s.plain_time == 10.0
    s.update(1, 0, 1.5, draft_time_s=0.4, target_time_s=1.1)
    assert s.plain_time == pytest.approx(1.1)  # a 1-token pass costs at most a 2-token one
    s.update(0, 0, 1.0, draft_time_s=0.0, target_time_s=1.0)
    assert s.plain_time == pytest.approx(1.1)  # min(plain average 8.2, verification average 1.1)


def test_adaptive_poor_proposer_decodes_plainly_and_probes_rarely() -> None:
    """alpha = 0.1 and drafts at 0.8 of a plain step: plain decoding, a few cheap probes."""
    for seed in range(3):
        s = SpeculationSchedule(4, "adaptive")
        ks, speed = simulate(s, 300, alpha=0.1, draft_s=0.8, seed=seed)
        assert ks[0] == 0 and ks[1] == 1  # t1 first, then one cheap probe
        assert max(ks) <= 2  # probes at probe_k = 1 (and a step or two after a lucky one)
        assert ks.count(0) >= 0.95 * len(ks) and 2 <= s.probes <= 16
        assert s.fallbacks <= 3 and s.plain_steps == ks.count(0)  # a lucky probe may start a few steps
        assert s.acceptance < 0.3
        assert speed >= 0.95  # never much slower than the target alone


def test_adaptive_good_proposer_drafts_long() -> None:
    """alpha = 0.9 and cheap drafts: k grows past the starting k towards the best constant k."""
    best = max(range(1, 17), key=lambda k: expected_tokens(0.9, k) / (0.1 * k + 1 + 0.05 * k))
    best_speed = expected_tokens(0.9, best) / (0.1 * best + 1 + 0.05 * best)
    for seed in range(3):
        s = SpeculationSchedule(4, "adaptive")
        ks, speed = simulate(s, 300, alpha=0.9, draft_s=0.1, seed=seed)
        assert ks[0] == 0 and s.fallbacks <= 1  # (a rejected first draft may switch it off for a while)
        assert ks[30:].count(0) <= 300 // 64  # then only the t1 refreshes, every refresh_interval = 64 steps
        assert statistics.median(ks[30:]) >= 6 and max(ks) > 8
        assert speed >= 0.9 * best_speed


def test_adaptive_follows_a_changing_proposer() -> None:
    """alpha 0.9 -> 0.05 -> 0.9 (drafts at 0.3 of a plain step): off within a few steps, back on
    at a later probe."""

    def alpha(step: int) -> float:
        return 0.05 if 100 <= step < 300 else 0.9

    for seed in range(3):
        s = SpeculationSchedule(4, "adaptive")
        ks, _ = simulate(s, 600, alpha=alpha, draft_s=0.3, seed=seed)
        assert ks[50:100].count(0) <= 1  # speculating (a rejected first probe may delay it)
        assert s.fallbacks >= 1 and ks[130:300].count(0) >= 0.9 * 170  # switched off, probing
        assert ks[500:].count(0) <= 2  # picked up again (probes at most max_backoff = 64 steps apart)


def test_adaptive_probes_stay_within_the_exploration_budget() -> None:
    """Probes whose first draft catches up a long prompt (10 s) cost more than the budget allows:
    after that first probe, none for a long time."""
    s = SpeculationSchedule(4, ScheduleConfig("adaptive", explore_budget=0.03))
    s.update(0, 0, 1.0, draft_time_s=0.0, target_time_s=1.0)
    assert s.next_k() == 1
    s.update(1, 0, 11.0, draft_time_s=10.0, target_time_s=1.0)
    ks = []
    for _ in range(800):
        k = s.next_k()
        ks.append(k)
        s.update(k, 0, 1.0 + 0.5 * k, draft_time_s=0.5 * k, target_time_s=1.0)
    # regret 10 s + the expected loss of a probe (10 s) <= 3% of the elapsed 12 s + n plain steps
    assert ks.index(1) == 655


def test_adaptive_without_split_times_counts_the_step_as_verification() -> None:
    s = SpeculationSchedule(2, ScheduleConfig("adaptive", backoff=3))
    ks = []
    for _ in range(40):  # every speculative step yields 1 token (nothing accepted) in 3 s; plain 1 s
        k = s.next_k()
        ks.append(k)
        s.update(k, 0, 3.0 if k else 1.0)
    assert s.draft_time() == 0.0 and ks.count(0) >= 36
    s = SpeculationSchedule(2, "adaptive")
    ks = []
    for _ in range(40):  # all accepted, 1.2 s per step whatever k
        k = s.next_k()
        ks.append(k)
        s.update(k, k, 1.2 if k else 1.0)
    assert ks[0] == 0 and all(k > 0 for k in ks[1:]) and max(ks) == 8


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"kind": "fast"}, "schedule"),
        ({"max_speculative_tokens": 0}, "max_speculative_tokens"),
        ({"backoff": 0}, "backoff"),
        ({"ema": 0.0}, "ema"),
        ({"fallback_margin": -1.0}, "fallback_margin"),
        ({"probe_k": 0}, "probe_k"),
        ({"explore_budget": 1.5}, "explore_budget"),
        ({"acceptance_decay": 0.0}, "acceptance_decay"),
        ({"prior_weight": 0.0}, "prior_weight"),
    ],
)
def test_bad_schedule_config(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ScheduleConfig(**kwargs)


def test_bad_schedule_name_through_generate(tiny_target) -> None:
    spec = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer())
    with pytest.raises(ValueError, match="schedule must be one of"):
        spec.generate([1, 2, 3], SamplingParams(max_new_tokens=2), schedule="sometimes")


def test_bad_draft_confidence() -> None:
    for value in (-0.1, 1.0, "high"):
        with pytest.raises(ValueError, match="draft_confidence"):
            DraftModelConfig(draft_confidence=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="draft_confidence"):
        make_proposer("draft_model", draft=make_tiny_model(), draft_confidence=2)


PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42]]


@pytest.mark.parametrize("schedule", ["heuristic", "adaptive"])
@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("confidence", [0.0, 0.6])
def test_greedy_equals_target_only(tiny_pair, schedule: str, draft_name: str, confidence: float) -> None:
    target = tiny_pair["target"]
    proposer = DraftModelProposer(tiny_pair[draft_name], DraftModelConfig(draft_confidence=confidence))
    spec = SpeculativeGenerator(target, proposer=proposer)
    for prompt in PROMPTS:
        expected = target_only_greedy(target, prompt, 40)
        result = spec.generate(prompt, SamplingParams(max_new_tokens=40), num_speculative_tokens=2, schedule=schedule)
        assert result.token_ids == expected
        s = result.stats
        assert s.schedule == schedule and s.num_speculative_tokens == 8
        assert s.new_tokens == s.target_forward_passes + s.accepted_tokens
        if draft_name == "identical":
            assert s.acceptance_rate == 1.0
            if schedule == "heuristic" and confidence == 0.0:
                assert s.drafted_per_position[-1] > 0  # k grew to its ceiling
        elif draft_name == "unrelated":
            assert s.acceptance_rate < 0.3


def test_confidence_cut_drafts_fewer_tokens(tiny_pair) -> None:
    target, draft = tiny_pair["target"], tiny_pair["perturbed"]
    counts = {}
    for confidence in (0.0, 0.9):
        proposer = DraftModelProposer(draft, DraftModelConfig(draft_confidence=confidence))
        r = SpeculativeGenerator(target, proposer=proposer).generate(
            PROMPTS[0], SamplingParams(max_new_tokens=40), num_speculative_tokens=6
        )
        assert r.token_ids == target_only_greedy(target, PROMPTS[0], 40)
        counts[confidence] = r.stats.draft_tokens / r.stats.drafts
    assert counts[0.0] > 5.0  # k = 6 (less only in the last steps, near max_new_tokens)
    assert 1.0 <= counts[0.9] < counts[0.0] - 1  # at least one token per draft, clearly fewer


V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=4)


@pytest.mark.parametrize(("schedule", "confidence"), [("heuristic", 0.0), ("heuristic", 0.5), ("adaptive", 0.5)])
def test_sampled_tokens_follow_the_target(schedule: str, confidence: float) -> None:
    """With k varying per step (heuristic from k = 1, so the draft length follows earlier
    acceptances) and drafts cut by confidence, the first four tokens follow the exact target
    marginals (chi-square p > P_MIN, 1,500 seeded samples)."""
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    draft = perturbed_copy(target, noise=0.1, seed=6)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 4, SAMPLING)
    spec = SpeculativeGenerator(target, proposer=DraftModelProposer(draft, DraftModelConfig(confidence)))
    settings = {**SAMPLING.__dict__, "max_new_tokens": 7}  # room for k to grow (1, 3, 5); the first 4 are checked
    samples = [
        spec.generate(prompt, SamplingParams(**{**settings, "seed": s}), 1, schedule=schedule) for s in range(1_500)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert drafted > 1_500 and 0.3 < accepted / drafted < 0.95
    if schedule == "heuristic":
        assert any(r.stats.drafted_per_position[1] for r in samples)  # k really grew past 1
    for pos in range(4):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"
