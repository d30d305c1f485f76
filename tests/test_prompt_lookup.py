"""Prompt lookup: the n-gram search itself, and lossless decoding with it (greedy and sampled)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers import PromptLookupConfig, PromptLookupProposer, make_proposer
from specdecode.proposers.prompt_lookup import find_continuation, find_continuations, find_match

from conftest import constant_target, make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p


def t(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def test_most_recent_match_of_the_longest_ngram() -> None:
    #            0  1  2  3  4  5  6  7  8  9 10 11
    context = t([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    # "1 2 3" (n = 3) occurs at 0 only -> continuation 9 2 3 8
    assert find_continuation(context, 4, max_ngram=3, min_ngram=1).tolist() == [9, 2, 3, 8]
    # with n <= 2, "2 3" occurs at 1 and 4; the most recent (4) continues with 8 7 1
    assert find_continuation(context, 3, max_ngram=2, min_ngram=1).tolist() == [8, 7, 1]


def test_prefers_a_recent_match_with_k_tokens_after_it() -> None:
    context = t([5, 6, 5, 6, 5, 6, 5])  # "6 5" at 1 and 3
    assert find_continuation(context, 2, 2, 1).tolist() == [6, 5]  # at 3: the most recent with 2 after it
    assert find_continuation(context, 1, 2, 1).tolist() == [6]
    assert find_continuation(context, 10, 2, 1).tolist() == [6, 5, 6, 5]  # none has 10: the earliest (1)


def _brute_force_match(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """find_match's rule written out window by window: the longest n with an earlier occurrence
    (ending before the last token), its most recent start with k tokens after it, else the earliest."""
    T = len(ids)
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        starts = [s for s in range(T - n) if ids[s : s + n] == ids[T - n :]]
        if starts:
            full = [s for s in starts if s + n + k <= T]
            start = (full[-1] if full else starts[0]) + n
            return ids[start : start + k], n
    return [], 0


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), min_size=1, max_size=40),  # a small vocabulary: many repeats
    k=st.integers(1, 10),
    ngrams=st.tuples(st.integers(1, 9), st.integers(0, 8)),
)
def test_the_candidate_search_equals_a_window_by_window_search(ids: list[int], k: int, ngrams: tuple[int, int]) -> None:
    min_ngram, max_ngram = ngrams[0], ngrams[0] + ngrams[1]
    tokens, n = find_match(t(ids), k, max_ngram, min_ngram)
    assert (tokens.tolist(), n) == _brute_force_match(ids, k, max_ngram, min_ngram)


def test_no_match_gives_an_empty_draft() -> None:
    assert find_continuation(t([1, 2, 3, 4]), 4, 3, 1).numel() == 0
    assert find_continuation(t([1, 2, 3, 4]), 4, 3, 2).numel() == 0
    assert find_continuation(t([7]), 4, 3, 1).numel() == 0


def test_spec_factor_bounds_the_draft_by_the_match_length() -> None:
    """SuffixDecoding's rule: after a match of n tokens, at most ceil(factor * n) tokens."""
    #            0  1  2  3  4  5  6  7  8  9 10 11 12
    context = t([1, 2, 3, 9, 8, 7, 6, 5, 4, 4, 1, 2, 3])  # "1 2 3" (n = 3) at 0
    assert find_continuation(context, 8, 3, 1, max_spec_factor=None).tolist() == [9, 8, 7, 6, 5, 4, 4, 1]
    assert find_continuation(context, 8, 3, 1, max_spec_factor=2.0).tolist() == [9, 8, 7, 6, 5, 4]  # 6 = 2 * 3
    assert find_continuation(context, 8, 3, 1, max_spec_factor=0.5).tolist() == [9, 8]  # ceil(1.5)
    assert find_continuation(context, 4, 3, 1, max_spec_factor=2.0).tolist() == [9, 8, 7, 6]  # k still bounds it
    # with n <= 1 only "3" matches (n = 1): one token at factor 1, three at factor 2.5
    assert find_continuation(context, 8, 1, 1, max_spec_factor=1.0).tolist() == [9]
    assert find_continuation(context, 8, 1, 1, max_spec_factor=2.5).tolist() == [9, 8, 7]
    # the tree's continuations follow the same rule, each by its own match length
    tree = find_continuations(t([4, 5, 6, 7, 8, 5, 6, 9, 9, 5, 6]), 8, 2, 1, 4, max_spec_factor=1.5)
    assert tree == [[9, 9, 5], [7, 8, 5], [9, 9], [7, 8]]  # "5 6" (n = 2): 3 tokens each; "6" (n = 1): 2
    proposer = make_proposer("prompt_lookup", max_ngram=3, max_spec_factor=2.0)
    assert proposer.propose(context, 8, SamplingParams(), None).ids.tolist() == [9, 8, 7, 6, 5, 4]


def test_long_context() -> None:
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 50_000, (8192,), generator=g)
    context[-3:] = context[4000:4003]
    assert find_continuation(context, 5, 3, 1).tolist() == context[4003:4008].tolist()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"min_ngram": 0}, "min_ngram"),
        ({"max_ngram": 1, "min_ngram": 2}, "max_ngram"),
        ({"max_spec_factor": 0}, "max_spec_factor"),
        ({"max_spec_factor": 65.0}, "max_spec_factor"),
        ({"max_spec_factor": True}, "max_spec_factor"),
    ],
)
def test_bad_config(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PromptLookupConfig(**kwargs)
    with pytest.raises(ValueError, match=name):
        make_proposer("prompt_lookup", **kwargs)


def test_unknown_proposer() -> None:
    with pytest.raises(ValueError, match="proposer must be one of"):
        make_proposer("hydra")


@pytest.mark.parametrize("factor", [None, 1.5])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_target_only(tiny_target, k: int, factor: float | None) -> None:
    cases = {
        "agrees": (constant_target(), [9, 4] + [0] * 12),  # the prompt already shows what comes
        "never": (tiny_target, list(range(0, 90, 3))),  # lookups find little, and guess wrong
        "partly": (tiny_target, [5, 17, 33, 2, 9, 60, 11, 5, 17, 40, 2, 9, 77, 5, 88, 6, 5, 14]),
    }
    rates = {}
    for name, (target, prompt) in cases.items():
        spec = SpeculativeGenerator(target, proposer=PromptLookupProposer(PromptLookupConfig(max_spec_factor=factor)))
        expected = target_only_greedy(target, prompt, 30)
        # every draft sent (no draft gate): the proposer's own drafts agree fully, never, partly
        result = spec.generate(prompt, SamplingParams(max_new_tokens=30), num_speculative_tokens=k, schedule="ungated")
        assert result.token_ids == expected, name
        rates[name] = result.stats.acceptance_rate
    assert rates["agrees"] == 1.0
    assert rates["never"] < 0.2, rates
    assert 0.0 < rates["partly"] < 0.9, rates


@pytest.mark.parametrize("factor", [None, 1.0])
def test_sampled_tokens_follow_the_target(factor: float | None) -> None:
    """A deterministic proposal verified by rejection sampling with one-hot q: the first three
    tokens follow the exact target marginals (chi-square, p > P_MIN, 1,500 seeded samples), with
    drafts bounded by k alone or by the match length too."""
    target = make_tiny_model(vocab_size=12, seed=5, init=0.3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    sampling = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
    exact = exact_marginals(target, prompt, 3, sampling)
    spec = SpeculativeGenerator(target, proposer=PromptLookupProposer(PromptLookupConfig(max_spec_factor=factor)))
    samples = [
        spec.generate(prompt, SamplingParams(**{**sampling.__dict__, "seed": s}), num_speculative_tokens=2)
        for s in range(1_500)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert drafted > 500 and 0 < accepted < drafted
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"
