"""Prompt lookup first, a model proposer otherwise: the ``prompt_lookup_min`` option of the proposers
with a model (``draft_model``, ``early_exit``, ``medusa``, ``eagle``).

Each step, the context's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are
looked up earlier in the context (:func:`~specdecode.proposers.prompt_lookup.find_continuation`). When
they occurred, the tokens that followed are the draft (no model call); when not, the model proposer
drafts. This is SAM-Decoding's rule (Hu et al. 2024, arXiv 2411.10666: a retrieval draft when the
suffix match is long enough, else an auxiliary drafter such as EAGLE) with prompt lookup's n-gram
match (Saxena 2023) as the retrieval. It pays off where an answer copies its prompt for stretches
(code completion repeats the signature and docstring, edits, summaries) and the model drafts the rest.

Lossless in both modes: the choice depends on the context only, a lookup draft is deterministic
(``probs=None``, one-hot q for the verifier) and a model draft carries its own q, so greedy output
equals the target's and sampling stays exact (modified rejection sampling is exact for any q chosen
from the past). The model proposer keeps its state in sync across lookup steps: the draft model and
early exit re-sync their caches from the context, Medusa and EAGLE receive the target's features of
every kept position whichever proposer drafted.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

import torch

from specdecode.limits import check_num_speculative_tokens
from specdecode.pass_observers import DraftPasses, ProposerInfo
from specdecode.proposers.base import DraftTokens, Proposer, ProposerBase, default_num_speculative_tokens
from specdecode.proposers.prompt_lookup import PromptLookupConfig, find_continuations, find_match
from specdecode.sampling import SamplingParams
from specdecode.tree import DraftTree, TreeSpec, trie_tree
from specdecode.verify import VerifyResult

DEFAULT_PROMPT_LOOKUP_MAX = 8
# k of a lookup-first proposer when the caller gives none (measured; see LookupFirstProposer)
LOOKUP_FIRST_DEFAULT_K = 8


def prompt_lookup_min_field() -> Any:
    """The ``prompt_lookup_min`` field of a model proposer's options (0: off)."""
    return field(
        default=0,
        metadata={
            "help": "draft by prompt lookup when the context's last N or more tokens occurred earlier, "
            "else by the model (SAM-Decoding's hybrid; 0 = off, default)"
        },
    )


def prompt_lookup_max_field() -> Any:
    """The ``prompt_lookup_max`` field: the longest n-gram looked up first."""
    return field(
        default=DEFAULT_PROMPT_LOOKUP_MAX,
        metadata={"help": f"with --prompt-lookup-min: longest n-gram looked up (default {DEFAULT_PROMPT_LOOKUP_MAX})"},
    )


def prompt_lookup_model_k_field() -> Any:
    """The ``prompt_lookup_model_k`` field: the most tokens the model drafts in a step lookup missed."""
    return field(
        default=None,
        metadata={
            "help": "with --prompt-lookup-min: the most tokens the model drafts when lookup finds nothing "
            "(default: the model proposer's own default k; -k then bounds lookup's drafts)"
        },
    )


def check_prompt_lookup(config: Any) -> None:
    """Validate ``config.prompt_lookup_min`` (an integer >= 0) and ``config.prompt_lookup_max`` (an
    integer >= max(1, prompt_lookup_min)); a string of an integer (from a command line) is accepted.

    Raises:
        ValueError: either outside those bounds (the message names it).
    """
    for name in ("prompt_lookup_min", "prompt_lookup_max", "prompt_lookup_model_k"):
        value = getattr(config, name, None)
        if isinstance(value, str) and value.strip().isdigit():
            object.__setattr__(config, name, int(value))
    low, high = config.prompt_lookup_min, config.prompt_lookup_max
    if not isinstance(low, int) or isinstance(low, bool) or low < 0:
        raise ValueError(f"prompt_lookup_min must be an integer >= 0 (0 = off), got {low!r}")
    if not isinstance(high, int) or isinstance(high, bool) or high < max(1, low):
        raise ValueError(f"prompt_lookup_max must be an integer >= max(1, prompt_lookup_min = {low}), got {high!r}")
    check_model_k(getattr(config, "prompt_lookup_model_k", None))


def check_model_k(value: int | None) -> int | None:
    """``value`` if it is None or an integer in :data:`~specdecode.limits.K_RANGE` (``prompt_lookup_model_k``).

    Raises:
        ValueError: anything else (the message names ``prompt_lookup_model_k``).
    """
    return check_num_speculative_tokens(value, "prompt_lookup_model_k", optional=True)


class LookupFirstProposer(ProposerBase):
    """Drafts from an n-gram match in the context when there is one, else with ``model``.

    Args:
        model: the model proposer (a :class:`~specdecode.proposers.base.ProposerBase`: its
            ``vocab_size``, ``drafter``, ``describe()`` and ``passes`` are this proposer's).
        min_ngram: the shortest suffix of the context whose earlier occurrence is trusted (>= 1).
        max_ngram: the longest one, looked up first (>= min_ngram).

        model_k: the most tokens the model drafts in a step where lookup found nothing (k, the
            engine's ``num_tokens``, bounds both); None: the model's own default k
            (:func:`~specdecode.proposers.base.default_num_speculative_tokens`: 2 for EAGLE and
            Medusa, whose later positions are rarely accepted, 4 for a draft model).

    Attributes:
        lookup_steps, model_steps: the steps of the current request drafted by lookup, by the model.
        default_num_speculative_tokens: 8 whatever the model's own default: k bounds lookup's
            drafts (the model drafts at most ``model_k``), and copied runs are long. Measured on the
            reference CPU (lab/notebook/2026-11-25-lookup-k.md): humaneval,
            8 prompts, EAGLE behind lookup 4.55x at k = 8 against 3.53x at k = 4 (faster on 8 of
            8); all dev categories, 2 prompts each, EAGLE / draft model behind lookup 1.78x / 1.97x
            at k = 8 against 1.75x / 1.93x at k = 4 (humaneval -20% time per token, the other
            categories within +-5%).

    Raises:
        ValueError: bounds outside the above.
    """

    default_num_speculative_tokens = LOOKUP_FIRST_DEFAULT_K

    def __init__(
        self,
        model: ProposerBase,
        min_ngram: int,
        max_ngram: int = DEFAULT_PROMPT_LOOKUP_MAX,
        model_k: int | None = None,
    ) -> None:
        PromptLookupConfig(max_ngram=max_ngram, min_ngram=min_ngram)  # the bounds of prompt lookup's own options
        self.model = model
        self.model_k = check_model_k(model_k) or default_num_speculative_tokens(model)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.name = f"{model.name}+lookup"
        self.needs_target_features = model.needs_target_features
        self.reset()

    @property
    def vocab_size(self) -> int | None:  # type: ignore[override]
        """The model proposer's (the engine checks it against the target's)."""
        return self.model.vocab_size

    @property
    def drafter(self) -> torch.nn.Module | None:  # type: ignore[override]
        """The model proposer's trained drafter, if any (the server's cost probe feeds it features)."""
        return self.model.drafter

    def describe(self) -> ProposerInfo:
        """The model proposer's (prompt lookup makes no forwards)."""
        return self.model.describe()

    @property
    def passes(self) -> DraftPasses:  # type: ignore[override]
        """The model proposer's sink (its forwards are the only ones): setting it sets the model's."""
        return self.model.passes

    @passes.setter
    def passes(self, sink: DraftPasses) -> None:
        self.model.passes = sink

    def clear_cache(self) -> None:
        self.model.clear_cache()

    def reset(self) -> None:
        self.model.reset()
        self._model_drafted = False
        self.lookup_steps = 0
        self.model_steps = 0

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """The continuation of the longest matching n-gram (up to ``num_tokens`` tokens, ``probs=None``)
        when the context's last ``min_ngram`` .. ``max_ngram`` tokens occurred earlier; else the model's
        draft of up to ``min(num_tokens, model_k)`` tokens. See :meth:`~specdecode.proposers.base.Proposer.propose`."""
        ids, n = find_match(context, num_tokens, self.max_ngram, self.min_ngram)  # (m,)
        self._model_drafted = not ids.numel()
        if ids.numel():
            self.lookup_steps += 1
            return DraftTokens(ids, None, ("prompt_lookup", n))
        self.model_steps += 1
        return self.model.propose(context, min(num_tokens, self.model_k), sampling, generator)

    def observe_features(self, hidden: torch.Tensor) -> None:
        """Passed on to the model proposer at every step (see :mod:`.base`)."""
        self.model.observe_features(hidden)  # type: ignore[attr-defined]

    def observe(self, result: VerifyResult) -> None:
        """Passed on to the model proposer after the steps it drafted."""
        if self._model_drafted:
            self.model.observe(result)


class LookupFirstTreeProposer(LookupFirstProposer):
    """:class:`LookupFirstProposer` for a model proposer that drafts trees: with a match, the trie of
    every match's continuation (as :meth:`PromptLookupProposer.propose_tree`); else the model's tree."""

    supports_tree = True

    def propose_tree(
        self,
        context: torch.Tensor,
        tree: TreeSpec,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """A deterministic trie of at most ``tree.num_nodes`` nodes and ``tree.depth`` levels from the
        n-gram matches, or the model's tree when nothing matches."""
        found = find_continuations(context, tree.depth, self.max_ngram, self.min_ngram, tree.num_nodes)
        self._model_drafted = not found
        if found:
            self.lookup_steps += 1
            return trie_tree(found, tree.num_nodes, tree.depth)
        self.model_steps += 1
        return self.model.propose_tree(context, tree, sampling, generator)  # type: ignore[attr-defined]


def with_prompt_lookup(model: ProposerBase, config: Any) -> Proposer:
    """``model`` itself when ``config.prompt_lookup_min`` is 0, else ``model`` behind prompt lookup
    (:class:`LookupFirstTreeProposer` when ``model`` drafts trees)."""
    if not config.prompt_lookup_min:
        return model
    kind = LookupFirstTreeProposer if model.supports_tree else LookupFirstProposer
    return kind(
        model, config.prompt_lookup_min, config.prompt_lookup_max, getattr(config, "prompt_lookup_model_k", None)
    )
