"""Prompt lookup first, the model proposer otherwise (``prompt_lookup_min``): which one drafts, that the
model proposer stays in sync across lookup steps, and losslessness with a draft model behind it:
greedy float32 equality with target-only decoding for drafts that agree fully, never and partly
(chains and trees), and the sampled distribution of the first tokens (chi-square, the tolerance of
``stat_checks``). Medusa and EAGLE behind prompt lookup: test_drafters."""

from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.proposers import (
    DraftModelConfig,
    DraftModelProposer,
    DraftTokens,
    LookupFirstProposer,
    LookupFirstTreeProposer,
    get_spec,
    make_proposer,
)
from specdecode.proposers.base import ProposerBase
from specdecode.proposers.hybrid import with_prompt_lookup

from conftest import make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

GREEDY = SamplingParams(max_new_tokens=1)
# prompts whose target-only continuations repeat (n-gram matches) after a start without matches
PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42, 43], [7, 8]]
NEW = 40


class Spy(ProposerBase):
    """A model proposer that drafts ``[99] * k`` and counts its calls."""

    name = "spy"

    def __init__(self) -> None:
        self.proposed: list[list[int]] = []
        self.observed = 0
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:
        self.proposed.append(context.tolist())
        return DraftTokens(torch.full((num_tokens,), 99, dtype=torch.int64))

    def observe(self, result) -> None:
        self.observed += 1


def test_lookup_drafts_when_the_suffix_occurred_and_the_model_otherwise() -> None:
    spy = Spy()
    hybrid = LookupFirstProposer(spy, min_ngram=2, max_ngram=4)
    assert hybrid.name == "spy+lookup" and spy.resets == 1
    # "2 3" occurred at 1: its continuation is drafted, the model is not asked, nor told the result
    draft = hybrid.propose(torch.tensor([1, 2, 3, 4, 5, 2, 3]), 3, GREEDY, None)
    assert draft.ids.tolist() == [4, 5, 2] and draft.probs is None
    hybrid.observe(None)  # type: ignore[arg-type]
    assert spy.proposed == [] and spy.observed == 0
    # only "3" repeats (n = 1 < min_ngram): the model drafts and hears the result
    draft = hybrid.propose(torch.tensor([1, 2, 3, 4, 5, 3]), 3, GREEDY, None)
    assert draft.ids.tolist() == [99, 99, 99] and spy.proposed == [[1, 2, 3, 4, 5, 3]]
    hybrid.observe(None)  # type: ignore[arg-type]
    assert spy.observed == 1
    assert (hybrid.lookup_steps, hybrid.model_steps) == (1, 1)
    hybrid.reset()
    assert (hybrid.lookup_steps, hybrid.model_steps, spy.resets) == (0, 0, 2)


def test_the_longest_match_wins() -> None:
    hybrid = LookupFirstProposer(Spy(), min_ngram=1, max_ngram=3)
    #                        0  1  2  3  4  5  6  7  8  9
    context = torch.tensor([7, 8, 9, 1, 8, 9, 2, 5, 8, 9])
    assert hybrid.propose(context, 2, GREEDY, None).ids.tolist() == [2, 5]  # no "5 8 9" before; "8 9" at 4
    context = torch.tensor([6, 8, 9, 1, 5, 8, 9, 2, 6, 8, 9])
    assert hybrid.propose(context, 2, GREEDY, None).ids.tolist() == [1, 5]  # "6 8 9" at 0 beats "8 9" at 5


def test_options_errors_and_the_registry(tiny_pair) -> None:
    for options, name in (
        ({"prompt_lookup_min": -1}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 1.5}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
    ):
        with pytest.raises(ValueError, match=name):
            DraftModelConfig(**options)
        with pytest.raises(ValueError, match=name):
            get_spec("eagle").make_config(**options)
    assert DraftModelConfig(prompt_lookup_min="2").prompt_lookup_min == 2  # type: ignore[arg-type]  # CLI text
    with pytest.raises(ValueError, match="min_ngram"):
        LookupFirstProposer(Spy(), min_ngram=0)
    plain = make_proposer("draft_model", draft=tiny_pair["perturbed"])
    assert isinstance(plain, DraftModelProposer)
    hybrid = make_proposer("draft_model", draft=tiny_pair["perturbed"], prompt_lookup_min=2, prompt_lookup_max=5)
    assert isinstance(hybrid, LookupFirstTreeProposer) and (hybrid.min_ngram, hybrid.max_ngram) == (2, 5)
    assert not hybrid.needs_target_features
    early = make_proposer("early_exit", target=tiny_pair["target"], exit_layer=1, prompt_lookup_min=1)
    assert early.name == "early_exit+lookup"
    assert type(with_prompt_lookup(Spy(), DraftModelConfig(prompt_lookup_min=1))) is LookupFirstProposer  # no trees


@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("mode", [1, 4, "tree8", "dynamic:10:4:3"])
def test_greedy_equals_target_only(tiny_pair, draft_name: str, mode) -> None:
    """Both sources draft in every case (counted); the output is the target's, token for token."""
    target = tiny_pair["target"]
    config = DraftModelConfig(prompt_lookup_min=2)
    hybrid = with_prompt_lookup(DraftModelProposer(tiny_pair[draft_name], config), config)
    spec = SpeculativeGenerator(target, proposer=hybrid)
    tree = mode if isinstance(mode, str) else None
    k = mode if isinstance(mode, int) else 4
    lookup = model = drafted = accepted = 0
    for prompt in PROMPTS:
        result = spec.generate(
            prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k, tree=tree, schedule="ungated"
        )
        assert result.token_ids == target_only_greedy(target, prompt, NEW)
        assert result.stats.proposer == "draft_model+lookup"
        lookup, model = lookup + hybrid.lookup_steps, model + hybrid.model_steps
        drafted, accepted = drafted + result.stats.draft_tokens, accepted + result.stats.accepted_tokens
    assert lookup > 0 and model > 0, (lookup, model)
    if draft_name == "identical" and tree is None:
        assert accepted / drafted > 0.5  # the model's drafts all pass; lookup's pass where the output repeats
    assert 0 < accepted < drafted or draft_name == "identical"


def test_sampled_tokens_follow_the_target() -> None:
    """Temperature 0.8, top-k 9, top-p 0.95; steps drafted by lookup (one-hot q) and by a perturbed
    draft model (its own q) mixed within requests: the first three tokens follow the exact target-only
    marginals (chi-square p > P_MIN, 1,200 seeded samples)."""
    target = make_tiny_model(vocab_size=12, seed=5, init=0.3)
    draft = make_tiny_model(vocab_size=12, seed=6, init=0.3)
    prompt = [3, 1, 4, 1, 5]
    sampling = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
    exact = exact_marginals(target, prompt, 3, sampling)
    config = DraftModelConfig(prompt_lookup_min=1)
    hybrid = with_prompt_lookup(DraftModelProposer(draft, config), config)
    spec = SpeculativeGenerator(target, proposer=hybrid)
    samples, lookup, model = [], 0, 0
    for seed in range(1_200):
        samples.append(
            spec.generate(prompt, SamplingParams(**{**sampling.__dict__, "seed": seed}), num_speculative_tokens=2)
        )
        lookup, model = lookup + hybrid.lookup_steps, model + hybrid.model_steps
    assert lookup > 200 and model > 200, (lookup, model)
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert 0 < accepted < drafted
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"


def test_a_proposer_without_the_protocol_members_is_a_clear_error(tiny_pair) -> None:
    """The engine reads capabilities, never probes for them: a duck-typed proposer that does not
    declare them is refused up front, naming what is missing."""
    from specdecode.proposers.base import check_proposer

    class Bare:
        name = "bare"

        def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:
            return DraftTokens.empty()

    with pytest.raises(TypeError, match="lacks supports_tree, needs_target_features, default_num_speculative_tokens"):
        SpeculativeGenerator(tiny_pair["target"], proposer=Bare())

    class TreeWithoutMethod(ProposerBase):
        supports_tree = True

        def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:
            return DraftTokens.empty()

    class NoPropose(ProposerBase):
        pass

    with pytest.raises(TypeError, match="lacks propose"):
        check_proposer(NoPropose())

    with pytest.raises(TypeError, match="supports_tree but has no propose_tree"):
        check_proposer(TreeWithoutMethod())
    check_proposer(Spy())  # ProposerBase declares every capability
    assert not Spy.supports_tree and not Spy.needs_target_features and Spy.default_num_speculative_tokens == 4
