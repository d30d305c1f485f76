"""The transformers-version shims: the KV-cache keyword each model's forward takes."""

from __future__ import annotations

import warnings

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.drafters import build_drafter
from specdecode.drafters.heads import DrafterConfig
from specdecode.models.torch.compat import cache_keyword, cache_kwargs
from specdecode.proposers import make_proposer
from specdecode.proposers.eagle import EagleProposer

from conftest import make_tiny_model
from reference import target_only_greedy


class OldModel(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):  # transformers < 5.2x
        return past_key_values


class NewModel(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False):  # transformers >= 5.2x
        return cache


class OpaqueModel(torch.nn.Module):
    def forward(self, *args, **kwargs):
        return kwargs


def test_the_keyword_follows_the_models_forward():
    marker = object()
    assert (
        cache_keyword(OldModel()) == "past_key_values" and OldModel()(1, **cache_kwargs(OldModel(), marker)) is marker
    )
    assert cache_keyword(NewModel()) == "cache" and NewModel()(1, **cache_kwargs(NewModel(), marker)) is marker
    assert cache_kwargs(OpaqueModel(), marker) == {"past_key_values": marker}  # the name every 5.x accepts
    wrapped = NewModel()
    wrapped.forward = lambda *a, **k: None  # an instance-level hook (accelerate) does not hide the class's
    assert cache_keyword(wrapped) == "cache"


@pytest.mark.parametrize("proposer", ["draft_model", "eagle", "draft_model@tree"])
def test_decoding_passes_the_cache_without_deprecation_warnings(proposer):
    """Chains, trees (masked passes and the mask check) and a feature drafter: no FutureWarning about
    the cache keyword from the installed transformers, and the output is still the target's."""
    target = make_tiny_model(vocab_size=64, seed=0)
    draft = make_tiny_model(vocab_size=64, seed=1)
    name, _, tree = proposer.partition("@")
    if name == "eagle":
        torch.manual_seed(0)
        drafter = build_drafter(DrafterConfig.for_target("eagle", target, 64), torch.arange(64)).attach(target)
        built = EagleProposer(drafter.eval())
    else:
        built = make_proposer(name, draft=draft)
    prompt = [3, 9, 27, 17, 51, 25, 11]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*", category=FutureWarning)
        result = SpeculativeGenerator(target, proposer=built).generate(
            prompt, SamplingParams(max_new_tokens=12), num_speculative_tokens=3, tree="tree8" if tree else None
        )
    assert result.token_ids == target_only_greedy(target, prompt, 12)
