"""Proposers, all behind one protocol (:class:`~specdecode.proposers.base.Proposer`), and their registry.

The CLI (``--proposer NAME`` and one flag per option), the API (``from_pretrained(proposer=NAME,
**options)``) and ``specdecode bench`` take proposers from :data:`PROPOSERS`, so a new proposer is
one :class:`ProposerSpec` here: a name, an options dataclass (validated in ``__post_init__``, one
CLI flag per field, help text in the field's ``metadata["help"]``) and a build function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdecode.models.backends import backend_of, runner_capabilities
from specdecode.proposers.base import DEFAULT_NUM_SPECULATIVE_TOKENS, DraftTokens, Proposer, proposer_weight_bytes
from specdecode.proposers.cross_tokenizer import CrossTokenizerConfig, CrossTokenizerProposer, tokenizer_of
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdecode.proposers.eagle import EagleConfig, EagleProposer
from specdecode.proposers.early_exit import EarlyExitConfig, EarlyExitProposer
from specdecode.proposers.hybrid import LookupFirstProposer, LookupFirstTreeProposer, with_prompt_lookup
from specdecode.proposers.medusa import MedusaConfig, MedusaProposer
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer
from specdecode.proposers.suffix import SuffixConfig, SuffixProposer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ProposerSpec:
    """How to build a proposer by name.

    Attributes:
        name: registry name (``--proposer``).
        config: the options dataclass (``config(**options)`` validates them; no model needed).
        build: ``build(config, target, draft) -> Proposer``; ``target`` is the target model (for
            proposers that share its weights), ``draft`` is None unless ``needs_draft``.
        needs_draft: a draft model must be loaded for it.
        description: one line for ``--help`` and the docs.
        needs_target_features: the proposer reads the target's features (``needs_target_features``
            of :mod:`.base`; the engine and the server pass them).
        default_num_speculative_tokens: the k its proposers use when the caller gives none (the
            built proposer's class attribute of the same name; :meth:`default_k` for given options).
        backends: the backends it runs on (:mod:`specdecode.models.backends`); a proposer that reads
            the torch model's insides (early exit: the target's first layers, the runner capability
            ``model_insides``) is ``("torch",)``. Medusa and EAGLE read the target's final hidden
            states, which llama.cpp returns too. Declarative data for the load path only (which
            backend to load, or a refusal before any weights load); a built proposer asks its
            runner's :class:`~specdecode.models.contract.RunnerCapabilities`, never this name.
    """

    name: str
    config: type
    build: Callable[[Any, PreTrainedModel | None, PreTrainedModel | None], Proposer]
    needs_draft: bool = False
    description: str = ""
    needs_target_features: bool = False
    default_num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    backends: tuple[str, ...] = ("torch", "llamacpp")

    def default_k(self, **options: Any) -> int:
        """The k a proposer built with ``options`` drafts when the caller gives none, without
        building it: :attr:`default_num_speculative_tokens`, or the lookup-first wrapper's (8) when
        ``prompt_lookup_min`` puts prompt lookup first (:func:`.hybrid.with_prompt_lookup`).

        Raises:
            ValueError: bad options (as :meth:`make_config`).
        """
        if getattr(self.make_config(**options), "prompt_lookup_min", 0):  # the validated value, as built
            return LookupFirstProposer.default_num_speculative_tokens
        return self.default_num_speculative_tokens

    def make_config(self, **options: Any) -> Any:
        """The validated options.

        Raises:
            ValueError: an option this proposer does not take, or a bad value (named in the message).
        """
        known = {f.name for f in dataclasses.fields(self.config)}
        unknown = sorted(set(options) - known)
        if unknown:
            takes = ", ".join(sorted(known)) or "no options"
            raise ValueError(f"proposer {self.name!r} does not take {unknown}; it takes {takes}")
        return self.config(**options)


@dataclass(frozen=True)
class NoOptions:
    """A proposer without options."""


def _draft_model(config: DraftModelConfig, target: PreTrainedModel | None, draft: PreTrainedModel | None) -> Proposer:
    if draft is None:
        raise ValueError("proposer 'draft_model' needs a draft model (--draft)")
    return with_prompt_lookup(DraftModelProposer(draft, config), config)


def _cross_tokenizer(
    config: CrossTokenizerConfig, target: PreTrainedModel | None, draft: PreTrainedModel | None
) -> Proposer:
    """Both tokenizers come from the folders the models were loaded from (``name_or_path``); a
    draft folder without one, with the target's embedding size, is taken to share the target's.
    Two GGUF models on llama.cpp: the tokenizers in their files."""
    if draft is None or target is None:
        raise ValueError("proposer 'cross_tokenizer' needs a draft model (--draft) and the target model")
    insides = {runner_capabilities(m).model_insides for m in (target, draft)}
    if insides == {False}:  # no torch modules (GGUF files): the tokenizers their files carry, the weights' bytes
        from specdecode.models.backends import load_llamacpp_tokenizer

        return CrossTokenizerProposer(
            draft,
            load_llamacpp_tokenizer(draft),
            load_llamacpp_tokenizer(target),
            config,
            target_vocab_size=target.vocab_size,
            cost_ratio=draft.weight_bytes / target.weight_bytes,  # decoding reads every weight once per pass
        )
    if len(insides) > 1:
        raise ValueError(
            "proposer 'cross_tokenizer': the target and the draft run on one backend, got "
            f"{backend_of(target)} and {backend_of(draft)}"
        )

    def count(model: PreTrainedModel) -> int:
        return sum(p.numel() for p in model.parameters())

    def rows(model: PreTrainedModel) -> int:
        return int(model.get_output_embeddings().weight.shape[0])

    target_tokenizer = tokenizer_of(target, "target")
    same = rows(draft) == rows(target)
    return CrossTokenizerProposer(
        draft,
        tokenizer_of(draft, "draft", fallback=target_tokenizer if same else None),
        target_tokenizer,
        config,
        target_vocab_size=rows(target),
        cost_ratio=count(draft) / count(target),  # decoding reads every weight once per pass
    )


def _early_exit(config: EarlyExitConfig, target: PreTrainedModel | None, draft: Any) -> Proposer:
    if target is None:
        raise ValueError("proposer 'early_exit' needs the target model (its first layers draft)")
    return with_prompt_lookup(EarlyExitProposer(target, config), config)


def _medusa(config: MedusaConfig, target: PreTrainedModel | None, draft: Any) -> Proposer:
    return with_prompt_lookup(MedusaProposer.for_target(target, config), config)


def _eagle(config: EagleConfig, target: PreTrainedModel | None, draft: Any) -> Proposer:
    return with_prompt_lookup(EagleProposer.for_target(target, config), config)


def _prompt_lookup(config: PromptLookupConfig, target: PreTrainedModel | None, draft: Any) -> Proposer:
    return PromptLookupProposer(config)


def _suffix(config: SuffixConfig, target: PreTrainedModel | None, draft: Any) -> Proposer:
    return SuffixProposer(config)


PROPOSERS: dict[str, ProposerSpec] = {}


def register(spec: ProposerSpec) -> ProposerSpec:
    """Add (or replace) a proposer in :data:`PROPOSERS`; returns it."""
    PROPOSERS[spec.name] = spec
    return spec


register(ProposerSpec("draft_model", DraftModelConfig, _draft_model, True, "a smaller model with the same vocabulary"))
register(
    ProposerSpec(
        "prompt_lookup",
        PromptLookupConfig,
        _prompt_lookup,
        False,
        "n-gram match in the context",
        default_num_speculative_tokens=PromptLookupProposer.default_num_speculative_tokens,
    )
)
register(ProposerSpec("suffix", SuffixConfig, _suffix, False, "suffix tree over the prompt and earlier outputs"))
register(
    ProposerSpec(
        "early_exit", EarlyExitConfig, _early_exit, False, "the target's first layers draft", backends=("torch",)
    )
)
register(
    ProposerSpec(
        "cross_tokenizer",
        CrossTokenizerConfig,
        _cross_tokenizer,
        True,
        "a draft model with another tokenizer",
    )
)

register(
    ProposerSpec(
        "medusa",
        MedusaConfig,
        _medusa,
        False,
        "trained Medusa heads on the target (--drafter)",
        needs_target_features=True,
        default_num_speculative_tokens=MedusaProposer.default_num_speculative_tokens,
    )
)
register(
    ProposerSpec(
        "eagle",
        EagleConfig,
        _eagle,
        False,
        "a trained EAGLE head on the target (--drafter)",
        needs_target_features=True,
        default_num_speculative_tokens=EagleProposer.default_num_speculative_tokens,
    )
)


def get_spec(name: str) -> ProposerSpec:
    """The registered proposer ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(PROPOSERS)}, got {name!r}")
    return PROPOSERS[name]


def make_proposer(
    name: str, draft: PreTrainedModel | None = None, target: PreTrainedModel | None = None, **options: Any
) -> Proposer:
    """Build the proposer registered as ``name``.

    Args:
        name: a key of :data:`PROPOSERS`.
        draft: the draft model, for proposers that need one.
        target: the target model, for proposers that share its weights.
        options: the proposer's options (fields of its config dataclass).

    Raises:
        ValueError: unknown name, a missing model, or bad options (named in the message).
    """
    spec = get_spec(name)
    return spec.build(spec.make_config(**options), target, draft)


__all__ = [
    "proposer_weight_bytes",
    "PROPOSERS",
    "CrossTokenizerConfig",
    "CrossTokenizerProposer",
    "DraftModelConfig",
    "DraftModelProposer",
    "DraftTokens",
    "EagleConfig",
    "EagleProposer",
    "EarlyExitConfig",
    "EarlyExitProposer",
    "LookupFirstProposer",
    "LookupFirstTreeProposer",
    "MedusaConfig",
    "MedusaProposer",
    "NoOptions",
    "PromptLookupConfig",
    "PromptLookupProposer",
    "Proposer",
    "ProposerSpec",
    "SuffixConfig",
    "SuffixProposer",
    "get_spec",
    "make_proposer",
    "register",
]
