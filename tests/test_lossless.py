"""Lossless, end to end on tiny float32 models: greedy equality with target-only decoding, and
the sampled distribution of the first generated tokens against the exact target marginals."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.torch.runner import ModelRunner
from specdecode.sampling import logits_to_probs

from conftest import make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, check_all, chi_square_p, first_two_tokens_p_values

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]


@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_target_only(tiny_pair, draft_name: str, k: int) -> None:
    target = tiny_pair["target"]
    spec = SpeculativeGenerator(target, tiny_pair[draft_name])
    sampling = SamplingParams(max_new_tokens=40)
    rates = []
    for prompt in PROMPTS:
        expected = target_only_greedy(target, prompt, 40)
        baseline = spec.generate(prompt, sampling, num_speculative_tokens=k, speculative=False)
        result = spec.generate(prompt, sampling, num_speculative_tokens=k)
        assert baseline.token_ids == expected
        assert result.token_ids == expected
        assert result.finish_reason == "length"
        rates.append(result.stats.acceptance_rate)
    rate = sum(rates) / len(rates)
    # the three drafts really are what they claim to be
    if draft_name == "identical":
        assert rate == 1.0
    elif draft_name == "unrelated":
        assert rate < 0.2
    else:
        assert 0.2 < rate < 0.95, rate


def test_stats_are_consistent(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["perturbed"])
    k = 3
    s = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=30), num_speculative_tokens=k).stats
    assert s.new_tokens == 30
    assert s.draft_tokens == sum(s.drafted_per_position)
    assert s.accepted_tokens == sum(s.accepted_per_position)
    assert len(s.accepted_per_position) == k
    assert s.mean_acceptance_length == pytest.approx(1 + s.accepted_tokens / s.drafts)
    # every token comes from a target pass: the prefill gives 1, each verification pass n + 1
    # (k shrinks near max_new_tokens, so nothing is cut off here)
    assert s.new_tokens == s.target_forward_passes + s.accepted_tokens


class EosAt:
    """A tokenizer stand-in: decodes ids as letters, so stop strings and EOS can be placed."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_stops_inside_an_accepted_draft(tiny_pair, k: int) -> None:
    """EOS, a stop string and max_new_tokens that fall inside a step of accepted drafts end the
    output exactly where target-only decoding ends it."""
    target = tiny_pair["target"]
    full = target_only_greedy(target, PROMPTS[0], 40)
    spec = SpeculativeGenerator(target, tiny_pair["identical"], tokenizer=EosAt())
    # EOS: pick the token at position 13 (mid-step for every k > 1) as the EOS id
    eos = full[13]
    first = full.index(eos)
    spec.eos_token_ids = frozenset({eos})
    r = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=40), num_speculative_tokens=k)
    assert r.token_ids == full[: first + 1] and r.finish_reason == "stop"
    assert r.stats.accepted_tokens > 0
    # stop string made of the letters of tokens 20..22
    spec.eos_token_ids = frozenset()
    text = EosAt().decode(full)
    stop = text[20:23]
    cut = text.find(stop)
    r = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=40, stop=(stop,)), num_speculative_tokens=k)
    assert r.text == text[:cut] and r.finish_reason == "stop"
    assert r.token_ids == full[: cut + len(stop)]
    # max_new_tokens
    r = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=11), num_speculative_tokens=k)
    assert r.token_ids == full[:11] and r.finish_reason == "length"


def test_truncate_then_decode_equals_fresh_prefill(tiny_target) -> None:
    tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    runner = ModelRunner(tiny_target)
    runner.forward(tokens[:8], num_logits=1)
    runner.truncate(5)
    assert runner.length == 5
    rolled_back = runner.forward(tokens[5:10], num_logits=5)
    fresh = ModelRunner(tiny_target).forward(tokens, num_logits=5)
    torch.testing.assert_close(rolled_back, fresh, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="truncate length"):
        runner.truncate(11)


def test_a_repeated_prompt_reuses_its_first_pass_bit_for_bit(tiny_target, tiny_pair) -> None:
    """``ModelRunner.restart`` (prompt reuse, specdecode.models.first_pass): the same prompt again
    returns the first pass's rows with no pass and every pass after it equals a fresh sequence's bit
    for bit; other arguments, a rollback into the prompt, a tree's compaction into it or ``reset``
    run a pass. Through the engine: the same tokens as a generator that runs every prefill, greedy
    and sampled, the second request's prefill reused. A plain ``forward`` keeps nothing."""
    prompt, rest = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79]), torch.tensor([32, 38, 46, 26, 43])
    runner, fresh = ModelRunner(tiny_target), ModelRunner(tiny_target)
    first = runner.restart(prompt)
    assert not runner.reused_prompt
    runner.forward(rest, num_logits=5)
    again = runner.restart(prompt)
    assert runner.reused_prompt and runner.length == 8 and torch.equal(again, first)
    fresh.forward(prompt)
    assert torch.equal(runner.forward(rest, num_logits=5), fresh.forward(rest, num_logits=5))
    for ids, n, hidden in [(prompt, 2, False), (prompt[:-1], 1, False), (prompt, 1, True)]:
        runner.restart(ids, num_logits=n, return_hidden=hidden)
        assert not runner.reused_prompt
    runner.restart(prompt, return_hidden=True)
    assert runner.reused_prompt
    runner.truncate(7)
    runner.restart(prompt)
    assert not runner.reused_prompt
    runner.forward(rest[:3], num_logits=3)
    runner.compact(torch.tensor([6, 9]))  # entries into the prompt's: it is gone
    runner.restart(prompt)
    assert not runner.reused_prompt
    runner.reset()
    runner.restart(prompt)
    assert not runner.reused_prompt
    runner.reset()
    runner.forward(prompt)  # not a restart: nothing kept
    runner.restart(prompt)
    assert not runner.reused_prompt
    reusing = SpeculativeGenerator(tiny_pair["target"], tiny_pair["perturbed"])
    alone = SpeculativeGenerator(tiny_pair["target"], tiny_pair["perturbed"])
    alone.reuse_prompt = False
    runs = [SamplingParams(max_new_tokens=12), SamplingParams(temperature=1.0, seed=5, max_new_tokens=12)]
    reusing.generate(PROMPTS[0], runs[0], num_speculative_tokens=3)
    for sampling in runs:
        a = reusing.generate(PROMPTS[0], sampling, num_speculative_tokens=3)
        b = alone.generate(PROMPTS[0], sampling, num_speculative_tokens=3)
        assert a.stats.prefill_reused and not b.stats.prefill_reused and a.token_ids == b.token_ids


def test_same_seed_same_answer_no_state_leak(tiny_pair) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], tiny_pair["perturbed"])
    sampling = SamplingParams(temperature=1.0, top_k=20, seed=7, max_new_tokens=25)
    a = spec.generate(PROMPTS[0], sampling, num_speculative_tokens=3)
    spec.generate(PROMPTS[1], SamplingParams(temperature=0.7, seed=1, max_new_tokens=9), num_speculative_tokens=5)
    b = spec.generate(PROMPTS[0], sampling, num_speculative_tokens=3)
    assert a.token_ids == b.token_ids
    assert a.stats.accepted_per_position == b.stats.accepted_per_position


# ---------------------------------------------------------------- sampled distribution
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    return target, perturbed_copy(target, noise=0.1, seed=6)


@pytest.mark.parametrize("k", [1, 2])
def test_sampled_tokens_follow_the_target(small_vocab_pair, k: int) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95: the first three tokens with speculation follow the
    exact target-only marginals (chi-square p > P_MIN, 1,500 seeded samples). With k = 1 the third
    token is a bonus token whenever the draft was accepted; with k = 2 the second and third are
    accepted or recovered tokens."""
    target, draft = small_vocab_pair
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLING)
    spec = SpeculativeGenerator(target, draft)
    samples = [
        spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=k)
        for s in range(1_500)
    ]
    rate = sum(r.stats.accepted_tokens for r in samples) / sum(r.stats.draft_tokens for r in samples)
    assert 0.3 < rate < 0.95, f"draft should agree only partly, acceptance {rate:.2f}"
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


def test_exact_marginals_match_target_only_sampling(small_vocab_pair) -> None:
    """The reference itself: target-only sampling through the engine follows ``exact_marginals``."""
    target, _ = small_vocab_pair
    exact = exact_marginals(target, [3, 1, 4], 3, SAMPLING)
    spec = SpeculativeGenerator(target)
    samples = [
        spec.generate([3, 1, 4], SamplingParams(**{**SAMPLING.__dict__, "seed": s}), speculative=False)
        for s in range(1_000)
    ]
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN


def test_joint_of_first_two_tokens(small_vocab_pair) -> None:
    """Beyond marginals: the joint distribution of tokens 1 and 2 (k = 1)."""
    target, draft = small_vocab_pair
    prompt = [3, 1, 4]
    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([prompt])).logits[0, -1].double(), SAMPLING).double()
        batch = torch.tensor([prompt + [v] for v in range(V_SMALL)])
        p2 = logits_to_probs(target(batch).logits[:, -1].double(), SAMPLING).double()
    spec = SpeculativeGenerator(target, draft)
    pairs = []
    for s in range(1_500):
        ids = spec.generate(
            prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s, "max_new_tokens": 2}), num_speculative_tokens=1
        ).token_ids
        pairs.append((ids[0], ids[1]))
    # token 1, and token 2 given token 1 (not the sparse V x V joint cells): family-wise P_MIN
    p_values = first_two_tokens_p_values(pairs, p1, {t1: p2[t1] for t1 in p1.nonzero().flatten().tolist()})
    assert check_all(p_values, P_MIN), p_values
    assert len(set(itertools.islice(pairs, 200))) > 5
