"""Proposers, all behind one protocol (:class:`~specdecode.proposers.base.Proposer`), and their registry.

The CLI (``--proposer NAME``), the API (``from_pretrained(proposer=NAME)``) and ``specdecode bench``
take proposers from :data:`PROPOSERS`, so a new proposer is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from specdecode.proposers.base import DraftTokens, Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer


@dataclass(frozen=True)
class ProposerSpec:
    """How to build a proposer by name.

    Attributes:
        name: registry name (``--proposer``).
        build: ``build(draft_model, **options)``; ``draft_model`` is None unless ``needs_draft``.
        needs_draft: a draft model must be loaded for it.
    """

    name: str
    build: Callable[..., Proposer]
    needs_draft: bool = False


def _draft_model(draft: PreTrainedModel | None, **options: Any) -> Proposer:
    if draft is None:
        raise ValueError("proposer 'draft_model' needs a draft model (--draft)")
    if options:
        raise ValueError(f"proposer 'draft_model' takes no options, got {sorted(options)}")
    return DraftModelProposer(draft)


def _prompt_lookup(draft: PreTrainedModel | None, **options: Any) -> Proposer:
    return PromptLookupProposer(PromptLookupConfig(**options))


PROPOSERS: dict[str, ProposerSpec] = {
    spec.name: spec
    for spec in (
        ProposerSpec("draft_model", _draft_model, needs_draft=True),
        ProposerSpec("prompt_lookup", _prompt_lookup),
    )
}


def make_proposer(name: str, draft: PreTrainedModel | None = None, **options: Any) -> Proposer:
    """Build the proposer registered as ``name``.

    Raises:
        ValueError: unknown name, a missing draft model, or bad options (named in the message).
    """
    if name not in PROPOSERS:
        raise ValueError(f"proposer must be one of {sorted(PROPOSERS)}, got {name!r}")
    return PROPOSERS[name].build(draft, **options)


__all__ = [
    "PROPOSERS",
    "DraftModelProposer",
    "DraftTokens",
    "PromptLookupConfig",
    "PromptLookupProposer",
    "Proposer",
    "ProposerSpec",
    "make_proposer",
]
