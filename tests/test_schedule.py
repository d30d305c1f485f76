"""Adaptive number of speculative tokens: the schedules' rules on synthetic step times, the draft
confidence cut-off, and losslessness of both (greedy equality, sampled marginals)."""

from __future__ import annotations

import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers import DraftModelConfig, DraftModelProposer, PromptLookupProposer, make_proposer
from specdecode.schedule import ScheduleConfig, SpeculationSchedule

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


def run(s: SpeculationSchedule, steps: int, spec_time: float, plain_time: float, accept: float = 1.0) -> list[int]:
    """Drive a schedule with synthetic times: a plain step takes ``plain_time``; a step drafting k
    tokens accepts ``int(accept * k)`` and takes ``spec_time``. Returns the k of every step."""
    ks = []
    for _ in range(steps):
        k = s.next_k()
        ks.append(k)
        s.update(k, int(accept * k), spec_time if k else plain_time)
    return ks


def test_adaptive_falls_back_when_speculation_is_slower_and_probes_with_growing_backoff() -> None:
    config = ScheduleConfig("adaptive", backoff=4, probe_steps=2, max_backoff=16)
    s = SpeculationSchedule(2, config)
    # every speculative step yields 1 token (nothing accepted) in 3 s; a plain step takes 1 s
    ks = run(s, 40, spec_time=3.0, plain_time=1.0, accept=0.0)
    assert ks[0] == 0  # the first step measures a plain pass
    assert ks[1] > 0 and ks[2] == 0  # one speculative step is enough to see it lose
    plain_runs, run_length = [], 0
    for k in ks[2:]:
        if k == 0:
            run_length += 1
        elif run_length:
            plain_runs.append(run_length)
            run_length = 0
    assert plain_runs[:3] == [4, 8, 16]  # backoff doubles, capped at max_backoff
    assert s.fallbacks >= 3 and s.plain_steps == ks.count(0)
    assert sum(1 for k in ks if k) <= 1 + 2 * 3  # probes: probe_steps speculative steps per backoff
    assert ks[1] == 2 and set(ks[2:]) == {0, 1}  # probes start cheap, at probe_k = 1


def test_adaptive_keeps_speculating_when_it_pays_and_refreshes_the_plain_time() -> None:
    config = ScheduleConfig("adaptive", refresh_interval=10)
    s = SpeculationSchedule(4, config)
    ks = run(s, 50, spec_time=1.5, plain_time=1.0, accept=1.0)  # k + 1 tokens per 1.5 s
    assert ks[0] == 0
    assert s.fallbacks == 0
    assert ks[1:].count(0) == 4  # one plain step after every 10 speculative ones (steps 12, 23, 34, 45)
    assert max(ks) == 16  # full acceptance grows k to the ceiling


def test_adaptive_returns_to_speculation_when_it_pays_again() -> None:
    s = SpeculationSchedule(2, ScheduleConfig("adaptive", backoff=3, probe_steps=1))
    run(s, 3, spec_time=5.0, plain_time=1.0, accept=0.0)  # loses: falls back
    assert s.fallbacks == 1
    ks = run(s, 12, spec_time=1.0, plain_time=1.0, accept=1.0)  # now 3+ tokens per second
    assert ks[:2] == [0, 0] and all(k > 0 for k in ks[2:])
    assert s.fallbacks == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"kind": "fast"}, "schedule"),
        ({"max_speculative_tokens": 0}, "max_speculative_tokens"),
        ({"backoff": 0}, "backoff"),
        ({"ema": 0.0}, "ema"),
        ({"fallback_margin": -1.0}, "fallback_margin"),
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
    settings = {**SAMPLING.__dict__, "max_new_tokens": 10}  # room for k to grow; the first 4 are checked
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
