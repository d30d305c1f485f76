"""Suffix decoding: the implicit suffix trie, the proposal rules, the cross-request cache, and
lossless decoding with it (greedy and sampled)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers import SuffixConfig, SuffixProposer, make_proposer
from specdecode.proposers.suffix import SuffixIndex
from specdecode.verify import VerifyResult

from conftest import constant_target, make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

GREEDY = SamplingParams()


def a(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int64)


def index_of(*sequences: list[int]) -> SuffixIndex:
    index = SuffixIndex()
    for s in sequences:
        index.add_sequence(s)
    return index


def speculate(index: SuffixIndex, pattern: list[int], k: int = 8, factor: float = 8.0, min_prob: float = 0.0):
    return index.speculate(a(pattern), k, factor, min_prob)


def brute_force_counts(sequences: list[list[int]], n_max: int) -> dict[tuple[int, ...], Counter]:
    """What followed every n-gram (n <= n_max) inside each sequence: an explicit suffix trie's children."""
    counts: dict[tuple[int, ...], Counter] = {}
    for s in sequences:
        for end in range(len(s) - 1):
            for n in range(1, min(n_max, end + 1) + 1):
                counts.setdefault(tuple(s[end - n + 1 : end + 1]), Counter())[s[end + 1]] += 1
    return counts


def assert_same_trie(index: SuffixIndex, sequences: list[list[int]], n_max: int = 3) -> None:
    assert index.sequences() == sequences
    assert index.num_tokens == sum(map(len, sequences))
    expected = brute_force_counts(sequences, n_max)
    for gram, children in expected.items():
        assert index.continuations(list(gram)) == dict(children), gram
    assert index.continuations([10_000]) == {}


# ---------------------------------------------------------------------------- the structure
def test_longest_match_wins_over_a_more_frequent_shorter_one() -> None:
    index = index_of([7, 2, 3, 4, 5, 2, 3, 6, 8, 2, 3, 6])
    node, length = index.match(a([7, 2, 3]))
    assert (node.shape[0], length) == (1, 3)  # one occurrence of "7 2 3"
    assert speculate(index, [7, 2, 3], k=1).ids == (4,)  # "7 2 3" -> 4, though "2 3" -> 6 twice
    node, length = index.match(a([9, 2, 3]))
    assert (node.shape[0], length) == (3, 2)  # three of "2 3"
    assert speculate(index, [9, 2, 3], k=1).ids == (6,)  # "2 3": 4 once, 6 twice
    assert index.match(a([1]))[1] == 0 and speculate(index, [1]).ids == ()
    assert index.match(a([6]))[1] == 1  # the final 6 has no continuation, the one at 7 has


def test_most_frequent_continuation_then_most_recent_on_ties() -> None:
    assert speculate(index_of([1, 5, 1, 6, 1, 5, 1, 7]), [1], k=1).ids == (5,)  # 5 twice, 6 and 7 once
    assert speculate(index_of([1, 5, 1, 6, 1, 7]), [1], k=1).ids == (7,)  # all once: the latest
    assert speculate(index_of([1, 6, 1, 5]), [1], k=1).ids == (5,)
    # across sequences, later sequences are more recent
    assert speculate(index_of([1, 5], [1, 6]), [1], k=1).ids == (6,)


def test_no_match_across_sequence_boundaries() -> None:
    index = index_of([4, 5], [6, 7])
    assert index.continuations([5]) == {}  # 5 ends its sequence: 6 does not follow it
    assert speculate(index, [4]).ids == (5,)  # the draft stops at the end of the sequence
    assert speculate(index, [5, 6]).match_length == 1  # "5 6" does not occur


def test_draft_length_adapts_to_the_match_length() -> None:
    text = list(range(10, 40))
    index = index_of(text)
    assert speculate(index, [99, 20], k=8, factor=1.0).ids == (21,)  # match 1 -> 1 token
    assert speculate(index, [17, 18, 19, 20], k=8, factor=1.0).ids == (21, 22, 23, 24)  # match 4 -> 4
    assert speculate(index, [19, 20], k=8, factor=2.0).ids == (21, 22, 23, 24)  # ceil(2 * 2)
    assert speculate(index, [20], k=8, factor=1.5).ids == (21, 22)  # ceil(1.5 * 1)
    assert len(speculate(index, text[:20], k=8, factor=1.0).ids) == 8  # the engine's k caps it
    assert speculate(index, [37, 38], k=8, factor=4.0).ids == (39,)  # the text ends


def test_min_token_prob_cuts_the_draft() -> None:
    index = index_of([1, 2, 3, 1, 2, 4, 1, 9])
    # "1" -> 2 (2 of 3); "1 2" -> 3 or 4 (1 of 2: the latest, 4); then one occurrence: 1, 9
    full = speculate(index, [1], min_prob=0.3)
    assert full.ids == (2, 4, 1, 9)
    assert math.isclose(full.score, 2 / 3 + 3 * (1 / 3))
    assert speculate(index, [1], min_prob=0.4).ids == (2,)  # 2/3 * 1/2 = 1/3 < 0.4
    assert speculate(index, [1], min_prob=0.7).ids == ()  # 2/3 < 0.7
    assert speculate(index, [1], min_prob=2 / 3).ids == (2,)


def test_incremental_updates_equal_building_from_scratch() -> None:
    rng = random.Random(0)
    text = [rng.randrange(6) for _ in range(400)]
    index = SuffixIndex()
    index.add_sequence(text[:50])
    held = text[:50]
    while len(held) < len(text):
        if rng.random() < 0.3 and len(held) > 60:  # a rollback, then the same tokens again
            keep = len(held) - rng.randrange(1, 8)
            index.truncate(keep)
            held = held[:keep]
        step = text[len(held) : len(held) + rng.randrange(1, 9)]
        index.extend(step)
        held += step
    scratch = index_of(text)
    assert index.sequences() == scratch.sequences() == [text]
    assert {t: list(p) for t, p in index._where.items()} == {t: list(p) for t, p in scratch._where.items()}
    assert_same_trie(index, [text], n_max=4)
    for end in range(5, 400, 37):
        pattern = a(text[end - 5 : end])
        assert index.speculate(pattern, 8, 2.0, 0.1) == scratch.speculate(pattern, 8, 2.0, 0.1)


def test_eviction_removes_exactly_the_oldest_counts() -> None:
    rng = random.Random(1)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(0, 30))] for _ in range(12)]
    index = index_of(*sequences)
    assert_same_trie(index, sequences)
    for i in range(1, len(sequences) + 1):
        assert index.evict_oldest() == len(sequences[i - 1])
        assert_same_trie(index, sequences[i:])
        if i % 4 == 0:  # and new sequences after evictions (the array is compacted as it grows)
            extra = [rng.randrange(5) for _ in range(40)]
            index.add_sequence(extra)
            sequences.append(extra)
    assert_same_trie(index, sequences[len(sequences) - index.num_sequences :])


def test_proposer_follows_rollbacks_of_its_context() -> None:
    proposer = SuffixProposer()
    prompt = [3, 4, 5, 6, 3, 4]
    draft = proposer.propose(torch.tensor(prompt), 4, GREEDY, None)
    assert draft.ids.dtype == torch.int64 and draft.probs is None
    assert draft.ids.tolist() == [5, 6]  # match "3 4" (2 tokens) -> 2 tokens
    proposer.observe(VerifyResult(1, torch.tensor([5, 9])))  # 5 accepted, then the target's 9
    context = prompt + [5, 9]
    assert proposer._request.last_sequence().tolist() == context
    proposer.propose(torch.tensor(context[:-2] + [1]), 4, GREEDY, None)  # the context was rolled back
    assert proposer._request.last_sequence().tolist() == context[:-2] + [1]
    assert_same_trie(proposer._request, [context[:-2] + [1]])


# ---------------------------------------------------------------------------- requests and the cache
def run_request(proposer: SuffixProposer, prompt: list[int], output: list[int], k: int = 4) -> list[list[int]]:
    """Drive ``proposer`` as the engine does, the target producing ``output`` (one token per step:
    nothing accepted); return the drafts."""
    proposer.reset()
    context, drafts = prompt + output[:1], []
    for token in output[1:]:
        drafts.append(proposer.propose(torch.tensor(context), k, GREEDY, None).ids.tolist())
        proposer.observe(VerifyResult(0, torch.tensor([token])))
        context.append(token)
    return drafts


def test_earlier_outputs_are_used_by_a_later_request() -> None:
    output = [50, 51, 52, 53, 54, 55, 56, 57]
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=2.0))
    run_request(proposer, [1, 2, 3], output)
    proposer.reset()
    assert proposer.cache.sequences() == [output]  # the outputs only, not the prompt
    context = torch.tensor([9, 8, 7, 52, 53])
    assert proposer.propose(context, 4, GREEDY, None).ids.tolist() == [54, 55, 56, 57]
    assert SuffixProposer(SuffixConfig(max_spec_factor=2.0)).propose(context, 4, GREEDY, None).ids.numel() == 0


def test_the_better_of_request_and_cache_wins() -> None:
    proposer = SuffixProposer()
    run_request(proposer, [0], [60, 61, 62, 63, 64, 65])
    proposer.reset()
    # the request says 61 -> 70 once; the cache says 60 61 -> 62 63 (a longer match: more tokens)
    context = torch.tensor([61, 70, 5, 60, 61])
    assert proposer.propose(context, 4, GREEDY, None).ids.tolist() == [62, 63]
    # equal scores: the request index wins
    context = torch.tensor([61, 70, 5, 61])
    assert proposer.propose(context, 4, GREEDY, None).ids.tolist() == [70]


def test_memory_bound_evicts_the_oldest_request_first() -> None:
    proposer = SuffixProposer(SuffixConfig(max_cached_tokens=10))
    outputs = {"A": [20, 21, 22, 23, 24, 25], "B": [30, 31, 32, 33], "C": [40, 41, 42]}
    for name in "AB":
        run_request(proposer, [1], outputs[name])
    proposer.reset()
    assert proposer.cache.sequences() == [outputs["A"], outputs["B"]]  # 10 tokens: at the bound
    assert speculate(proposer.cache, [9, 21], k=2, factor=1.0).ids == (22,)
    run_request(proposer, [1], outputs["C"])
    proposer.reset()
    assert proposer.cache.sequences() == [outputs["B"], outputs["C"]]  # A, the oldest, is gone
    assert proposer.cache.num_tokens == 7
    assert proposer.propose(torch.tensor([9, 21]), 2, GREEDY, None).ids.numel() == 0  # A's 21 -> 22
    assert proposer.propose(torch.tensor([9, 21, 31]), 2, GREEDY, None).ids.tolist() == [32]  # B's
    # an output longer than the bound keeps its last tokens (everything older is evicted)
    run_request(proposer, [1], list(range(100, 125)))
    proposer.reset()
    assert proposer.cache.sequences() == [list(range(115, 125))]
    off = SuffixProposer(SuffixConfig(max_cached_tokens=0))  # a bound of 0 keeps nothing
    run_request(off, [1], outputs["A"])
    off.reset()
    assert off.cache.num_sequences == 0


def test_reset_leaves_no_request_state() -> None:
    proposer = SuffixProposer()
    assert run_request(proposer, [7, 8, 9, 7, 8], [9, 1])[0] == [7, 8, 9]  # "7 8 9" -> 7 8 9
    proposer.reset()
    assert proposer._request.num_sequences == 0 and proposer._output_start is None
    assert proposer.cache.sequences() == [[9, 1]]
    draft = proposer.propose(torch.tensor([7, 8]), 4, GREEDY, None)  # only the old prompt had "7 8 -> 9"
    assert draft.ids.numel() == 0
    assert proposer._request.sequences() == [[7, 8]]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_depth", 0),
        ("max_depth", 1025),
        ("max_depth", 2.0),
        ("max_depth", True),
        ("max_spec_factor", 0.0),
        ("max_spec_factor", -1),
        ("max_spec_factor", float("nan")),
        ("max_spec_factor", 65.0),
        ("min_token_prob", -0.1),
        ("min_token_prob", 1.5),
        ("min_token_prob", "0.1"),
        ("max_cached_tokens", -1),
        ("max_cached_tokens", 10.0),
    ],
)
def test_bad_config(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SuffixConfig(**{name: value})
    with pytest.raises(ValueError, match=name):
        make_proposer("suffix", **{name: value})


def test_registered_with_its_options() -> None:
    proposer = make_proposer("suffix", max_depth=8, max_spec_factor=2, min_token_prob=0.0, max_cached_tokens=5)
    assert isinstance(proposer, SuffixProposer) and proposer.name == "suffix"
    assert proposer.config == SuffixConfig(8, 2, 0.0, 5)
    with pytest.raises(ValueError, match="max_depth"):
        make_proposer("suffix", max_depth=0)


# ---------------------------------------------------------------------------- lossless decoding
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_target_only(tiny_target, k: int) -> None:
    cases = {
        "agrees": (constant_target(), [9, 4] + [0] * 12),  # the prompt already shows what comes
        "never": (tiny_target, list(range(0, 90, 3))),  # no repeats to match: few drafts, wrong
        "partly": (tiny_target, [5, 17, 33, 2, 9, 60, 11, 5, 17, 40, 2, 9, 77, 5, 88, 6, 5, 14]),
    }
    rates = {}
    for name, (target, prompt) in cases.items():
        spec = SpeculativeGenerator(target, proposer=SuffixProposer())
        expected = target_only_greedy(target, prompt, 30)
        result = spec.generate(prompt, SamplingParams(max_new_tokens=30), num_speculative_tokens=k)
        assert result.token_ids == expected, name
        rates[name] = result.stats.acceptance_rate
    assert rates["agrees"] == 1.0
    assert rates["never"] < 0.2, rates
    assert 0.0 < rates["partly"] < 0.9, rates


def test_second_request_benefits_from_the_first(tiny_target) -> None:
    prompt = [5, 17, 33, 2, 9, 60, 11, 40, 77, 88, 6, 14]
    expected = target_only_greedy(tiny_target, prompt, 40)
    spec = SpeculativeGenerator(tiny_target, proposer=SuffixProposer())
    first = spec.generate(prompt, SamplingParams(max_new_tokens=40), num_speculative_tokens=4)
    second = spec.generate(prompt, SamplingParams(max_new_tokens=40), num_speculative_tokens=4)
    assert first.token_ids == second.token_ids == expected
    assert second.stats.accepted_tokens > first.stats.accepted_tokens + 10, (first.stats, second.stats)
    assert second.stats.acceptance_rate > 0.9 > first.stats.acceptance_rate
    assert second.stats.target_forward_passes < first.stats.target_forward_passes


def test_sampled_tokens_follow_the_target() -> None:
    """A deterministic proposal (one-hot q) that also draws on earlier requests' outputs, which
    differ from sample to sample, with evictions: the first three tokens still follow the exact
    target marginals (chi-square, p > P_MIN, 1,500 seeded samples)."""
    target = make_tiny_model(vocab_size=12, seed=5, init=0.3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    sampling = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
    exact = exact_marginals(target, prompt, 3, sampling)
    proposer = SuffixProposer(SuffixConfig(max_spec_factor=2.0, min_token_prob=0.0, max_cached_tokens=64))
    spec = SpeculativeGenerator(target, proposer=proposer)
    samples = [
        spec.generate(prompt, SamplingParams(**{**sampling.__dict__, "seed": s}), num_speculative_tokens=2)
        for s in range(1_500)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert drafted > 1_000 and 0.1 * drafted < accepted < drafted, (drafted, accepted)
    assert 0 < proposer.cache.num_tokens <= 64
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"
