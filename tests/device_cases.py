"""Every torch path of the engine, built on a chosen device, for the device-policy tests
(``test_device_policy.py`` on the stand-in device of ``fake_device.py``, ``test_cuda.py`` on a GPU).

A case is a proposer kind ("none": the target alone) built from tiny float32 models that were
placed on the device first, exactly as a user would: ``model.to(device)``, then the proposer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from specdecode import GenerationResult, SamplingParams, SpeculativeGenerator
from specdecode.drafters import DrafterConfig, build_drafter
from specdecode.models.torch.static_runner import StaticCacheSettings, use_static_cache
from specdecode.proposers import (
    CrossTokenizerProposer,
    DraftModelProposer,
    EagleProposer,
    EarlyExitConfig,
    EarlyExitProposer,
    LookupFirstTreeProposer,
    MedusaProposer,
    PromptLookupProposer,
    Proposer,
    SuffixProposer,
)

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

CHAIN_KINDS = (
    "none",
    "draft_model",
    "early_exit",
    "medusa",
    "eagle",
    "prompt_lookup",
    "suffix",
    "hybrid",
    "cross_tokenizer",
)
TREE_KINDS = ("draft_model", "medusa", "eagle", "prompt_lookup", "hybrid")
# repeats itself, so that prompt lookup and suffix decoding find n-grams to draft from
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a"
GREEDY = SamplingParams(max_new_tokens=24)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_new_tokens=24, seed=11)
HEADS = 4  # Medusa heads / EAGLE depth of the tiny drafters


def make_models(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """CPU models: the target, a perturbed copy as draft (part of its drafts accepted), and a draft
    with a tokenizer of its own (cross_tokenizer)."""
    V = len(tokenizer)
    target = make_tiny_model(vocab_size=V, seed=0)
    draft_tokenizer = make_tiny_tokenizer(vocab_size=280)
    return {
        "target": target,
        "draft": perturbed_copy(target, noise=0.01),
        "other_draft": make_tiny_model(vocab_size=len(draft_tokenizer), seed=3),
        "draft_tokenizer": draft_tokenizer,
    }


def place(
    models: dict[str, Any], device: torch.device | str, static: StaticCacheSettings | None = None
) -> dict[str, Any]:
    """Copies of the models on ``device`` (``Module.to``), tokenizers as they are; with ``static``,
    every model marked for a static KV cache (and CUDA graphs on a GPU: :func:`use_static_cache`)."""
    placed = {k: copy.deepcopy(v).to(device) if isinstance(v, PreTrainedModel) else v for k, v in models.items()}
    if static is not None:
        for value in placed.values():
            if isinstance(value, PreTrainedModel):
                use_static_cache(value, static)
    return placed


def make_drafter(kind: str, target: PreTrainedModel, seed: int = 0) -> Any:
    """A randomly initialised Medusa / EAGLE drafter over the whole vocabulary, attached to (and so
    placed on the device of) ``target``. Medusa's blocks get std 0.2 (not their identity start), so
    that heads differ; the EAGLE head's decoder matrices std 0.3 (not 0.02), so that its drafts
    depend on what its KV cache holds and at which positions (a wrong slot or a stale entry changes them)."""
    V = target.config.vocab_size
    torch.manual_seed(seed)
    drafter = build_drafter(DrafterConfig.for_target(kind, target, V, num_heads=HEADS), torch.arange(V))
    with torch.no_grad():
        if kind == "medusa":
            for block in drafter.blocks:
                torch.nn.init.normal_(block.weight, std=0.2)
        else:
            for weight in drafter.decoder.parameters():
                if weight.dim() == 2:
                    torch.nn.init.normal_(weight, std=0.3)
    return drafter.attach(target).eval()


def make_proposer(kind: str, models: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> Proposer | None:
    """The proposer ``kind`` over ``models`` (already placed on their device)."""
    target, draft = models["target"], models["draft"]
    if kind == "none":
        return None
    if kind == "draft_model":
        return DraftModelProposer(draft)
    if kind == "early_exit":
        return EarlyExitProposer(target, EarlyExitConfig(exit_layer=1))
    if kind == "medusa":
        return MedusaProposer(make_drafter("medusa", target))
    if kind == "eagle":
        return EagleProposer(make_drafter("eagle", target))
    if kind == "prompt_lookup":
        return PromptLookupProposer()
    if kind == "suffix":
        return SuffixProposer()
    if kind == "hybrid":
        return LookupFirstTreeProposer(DraftModelProposer(draft), min_ngram=2)
    if kind == "cross_tokenizer":
        return CrossTokenizerProposer(
            models["other_draft"], models["draft_tokenizer"], tokenizer, target_vocab_size=len(tokenizer)
        )
    raise ValueError(kind)


def make_generator(kind: str, models: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> SpeculativeGenerator:
    return SpeculativeGenerator(models["target"], tokenizer=tokenizer, proposer=make_proposer(kind, models, tokenizer))


def generate(generator: SpeculativeGenerator, sampling: SamplingParams, **options: Any) -> GenerationResult:
    """One generation of :data:`PROMPT` (raw: no chat template); speculative unless there is no proposer;
    every draft sent (``schedule="ungated"``: the draft gate's choices follow measured times, and these
    cases compare drafts across devices)."""
    options.setdefault("schedule", "ungated")
    return generator.generate(PROMPT, sampling, raw=True, speculative=generator.proposer is not None, **options)


def tokens(generator: SpeculativeGenerator, sampling: SamplingParams, **options: Any) -> list[int]:
    """The token ids of :func:`generate`."""
    return generate(generator, sampling, **options).token_ids
