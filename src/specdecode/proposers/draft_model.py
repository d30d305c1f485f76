"""A separate, smaller draft model with the target's vocabulary (Leviathan et al. 2023)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.models.backends import make_runner, runner_capabilities, runner_class
from specdecode.models.contract import RunnerCapabilities
from specdecode.models.torch.quant import (
    check_draft_quantization,
    resolve_draft_quantization,
    shared_int8_copy,
    shared_int8_head,
)
from specdecode.pass_observers import ProposerInfo
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.proposers.hybrid import (
    check_prompt_lookup,
    prompt_lookup_max_field,
    prompt_lookup_min_field,
    prompt_lookup_model_k_field,
)
from specdecode.sampling import SamplingParams, argmax_on_device, logits_to_probs, sample
from specdecode.token_map import load_token_map
from specdecode.tree import DraftTree, DynamicTree, TreeSpec, build_dynamic_tree, build_static_tree
from specdecode.verify import VerifyResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class DraftModelConfig:
    """Options of :class:`DraftModelProposer` (and of the proposers built on it).

    Attributes:
        draft_confidence: stop drafting as soon as the draft's top probability (after the
            request's temperature / top-k / top-p; plain softmax when greedy) falls below this
            value, in [0, 1); 0 drafts all k tokens. A cut draft costs less and loses little:
            unconfident tokens are the ones the target rejects (the dynamic draft length of
            Hugging Face's ``assistant_confidence_threshold``; Mamou et al. 2024, arXiv 2405.04304).
        token_map: a reduced draft LM head (FR-Spec, Zhao et al. 2025, arXiv 2502.14856): a token map
            file (``.npy`` / ``.pt``, see :mod:`specdecode.token_map`), or ``"default"``
            for the map shipped for the default target's tokenizer (Qwen2.5); None drafts over the
            full vocabulary. The draft then proposes only the map's tokens (q is zero elsewhere);
            the output stays exact, acceptance drops by the target mass outside the map.
        draft_vocab_size: use only the first N ids of ``token_map`` (its N most frequent tokens);
            None uses all of it. A string of an integer (from the command line) is accepted.
        draft_quantization: ``"int8"`` drafts with a dynamic int8 copy of the draft's linear layers
            (:func:`specdecode.models.torch.quant.quantize_int8`; CPU only, ``down_proj`` stays out of int8;
            with a token map the reduced head is rows of the int8 head,
            :func:`~specdecode.models.torch.quant.int8_rows`):
            a drafted token cost 0.6 of the float32 draft's on an AVX2 CPU and 0.69 of the bfloat16
            draft's on an Intel CPU with AMX (bench cost ratio c 0.403 -> 0.280), at the same
            acceptance; the output stays exact.
            ``"auto"`` (default) does so for a float32 or bfloat16 draft of at least 50M parameters
            on the CPU, ``"none"`` (or None) never.
        prompt_lookup_min, prompt_lookup_max: when >= 1, draft by prompt lookup whenever the context's
            last n tokens (n from max down to min) occurred earlier, and by the model otherwise
            (:mod:`specdecode.proposers.hybrid`); 0 (default) always drafts with the model.
        prompt_lookup_model_k: with prompt lookup first, the most tokens the model drafts in a step
            lookup missed (None: the model's default k, 4 here); k bounds lookup's drafts.

    Raises:
        ValueError: ``draft_confidence`` outside [0, 1); ``token_map`` not None, ``"default"`` or a
            readable map file; ``draft_vocab_size`` not an integer in [1, len(map)], or given
            without ``token_map``; ``draft_quantization`` not ``"auto"``, ``"none"``, ``"int8"`` or None;
            ``prompt_lookup_min`` < 0, ``prompt_lookup_max`` < max(1, min), or ``prompt_lookup_model_k``
            not None or an integer in :data:`~specdecode.limits.K_RANGE`.
    """

    draft_confidence: float = field(default=0.0, metadata={"help": "stop drafting when top prob < this (0 = off)"})
    token_map: str | None = field(
        default=None,
        metadata={"help": "reduced draft LM head over a token map: .npy/.pt file or 'default' (FR-Spec; default off)"},
    )
    draft_vocab_size: int | None = field(
        default=None, metadata={"help": "use the first N (most frequent) ids of --token-map (default: all)"}
    )
    draft_quantization: str | None = field(
        default="auto",
        metadata={"help": "auto (default: int8 for a CPU draft), none, or int8 (dynamic int8 linears)"},
    )
    prompt_lookup_min: int = prompt_lookup_min_field()
    prompt_lookup_max: int = prompt_lookup_max_field()
    prompt_lookup_model_k: int | None = prompt_lookup_model_k_field()

    def __post_init__(self) -> None:
        check_prompt_lookup(self)
        check_draft_quantization(self.draft_quantization)
        if not isinstance(self.draft_confidence, int | float) or not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be a number in [0, 1), got {self.draft_confidence!r}")
        if self.token_map is not None:
            if not isinstance(self.token_map, str | os.PathLike) or not str(self.token_map):
                raise ValueError(f"token_map must be a file path or 'default', got {self.token_map!r}")
            object.__setattr__(self, "token_map", str(self.token_map))
        size = self.draft_vocab_size
        if isinstance(size, str) and size.strip().isdigit():
            size = int(size)
            object.__setattr__(self, "draft_vocab_size", size)
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"draft_vocab_size must be None or an integer >= 1, got {self.draft_vocab_size!r}")
        if size is not None and self.token_map is None:
            raise ValueError("draft_vocab_size needs token_map (the ids it takes the first N of)")
        if self.token_map is not None:
            n = len(self.head_ids())
            if size is not None and size > n:
                raise ValueError(f"draft_vocab_size must be at most {n}, the size of token_map, got {size}")

    def head_ids(self) -> torch.Tensor | None:
        """The draft's token ids (int64 ``[N]``, most frequent first), or None for the full vocabulary.

        Raises:
            ValueError: ``token_map`` names no readable map file (the message names ``token_map``).
        """
        if self.token_map is None:
            return None
        try:
            ids = load_token_map(self.token_map)
        except (OSError, ValueError) as error:
            raise ValueError(f"token_map: {error}") from error
        return ids[: self.draft_vocab_size] if self.draft_vocab_size is not None else ids


class DraftModelProposer(ProposerBase):
    """Drafts k tokens autoregressively with a small model that keeps its own KV cache.

    Greedy requests draft the draft model's argmax (a deterministic proposal, ``probs=None``);
    sampled requests sample from the draft's distribution after the request's temperature /
    top-k / top-p and return it as ``q`` for rejection sampling.

    With a token map (``config.token_map``) the draft scores only the map's N tokens (a reduced
    LM head, :class:`~specdecode.models.torch.runner.ModelRunner` ``head_ids``): greedy drafts the argmax
    over the map; sampling applies temperature, then top-k and top-p to the *reduced* logits (so
    top-k keeps the k most likely tokens of the map, and top-p the nucleus of the draft's
    distribution renormalised over the map), and returns ``q`` over the full vocabulary, zero
    outside the map. ``draft_confidence`` compares the top probability over the map. Rejection
    sampling is exact for any ``q``; the residual supplies the target's mass outside the map.

    Cache sync: the proposer remembers which tokens its cache holds. At each ``propose`` it keeps
    the longest prefix shared with the new context (the accepted draft tokens stay cached, the
    rejected ones are truncated away) and feeds only the rest, so rollback is a truncate.

    Args:
        model: the draft ``transformers`` causal LM; its vocabulary must be the target's. Not
            modified (a token map copies the head rows it needs; ``draft_quantization`` drafts
            with a quantized copy).
        config: :class:`DraftModelConfig` (default: draft all k tokens, full vocabulary).

    Raises:
        ValueError: a token map with ids outside the draft's vocabulary, a draft whose logits a
            reduced head cannot reproduce (see :class:`~specdecode.models.torch.runner.ModelRunner`), or
            ``draft_quantization`` for a draft off the CPU.

    Attributes:
        quantization: what ``config.draft_quantization`` resolved to for this draft, ``"int8"`` or
            ``"none"``.
    """

    name = "draft_model"
    supports_tree = True

    def __init__(self, model: PreTrainedModel, config: DraftModelConfig | None = None) -> None:
        self.config = config or DraftModelConfig()
        head_ids = self.config.head_ids()
        self._cached = torch.empty(0, dtype=torch.int64)  # tokens in the draft's cache, [runner.length]
        capabilities = runner_capabilities(model)
        if not capabilities.model_insides:  # no torch modules to copy or slice (a GGUF file on llama.cpp)
            self._init_plain_runner(model, head_ids, capabilities)
            return
        V = int(model.get_output_embeddings().weight.shape[0])
        if head_ids is not None and int(head_ids.max()) >= V:
            raise ValueError(
                f"token_map {self.config.token_map!r} has ids up to {int(head_ids.max())}, outside the draft's "
                f"vocabulary of {V}: it was built for another tokenizer"
            )
        from specdecode.models.torch.runner import share_plain_check
        from specdecode.models.torch.static_runner import torch_runner

        self.quantization = resolve_draft_quantization(self.config.draft_quantization, model)
        source, head_module = model, None
        if self.quantization == "int8":
            model = shared_int8_copy(model)  # type: ignore[assignment]
        try:
            if self.quantization == "int8" and head_ids is not None:
                share_plain_check(source, model, "head_ids")  # the int8 head has no float weight to check with
                head_module = shared_int8_head(source, head_ids)  # rows of the copy's int8 head
            self.runner = torch_runner(model, head_ids=head_ids, head_module=head_module)
        except ValueError as error:
            raise ValueError(f"token_map: {error}") from error  # only a reduced head raises here

    def _init_plain_runner(self, model: Any, head_ids: torch.Tensor | None, capabilities: RunnerCapabilities) -> None:
        """The draft's runner as :func:`~specdecode.models.backends.make_runner` makes it, for a
        model without torch insides (a GGUF file on llama.cpp: quantized already).

        Raises:
            CapabilityError: ``token_map`` on a runner without ``reduced_head``, or
                ``draft_quantization="int8"`` (an int8 copy needs ``model_insides``); the message
                names the runner and the capability.
        """
        runner = runner_class(model)
        if head_ids is not None:
            capabilities.require("reduced_head", runner, "token_map (a reduced draft LM head; use --backend torch)")
        if self.config.draft_quantization == "int8":
            need = "draft_quantization 'int8' (the file's own quantization runs: use 'auto' or 'none')"
            capabilities.require("model_insides", runner, need)
        self.quantization = "none"
        self.runner = make_runner(model)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def reset(self) -> None:
        """Forget the request in progress. The draft's cells stay, with what they hold: the next
        request's first ``propose`` keeps their common prefix with its context (a conversation's
        next turn, a shared system prompt) and feeds only the rest, as every step does."""

    def clear_cache(self) -> None:
        """Forget the cells kept across requests: the state of a new instance."""
        self.runner.reset()
        self._cached = torch.empty(0, dtype=torch.int64)

    def describe(self) -> ProposerInfo:
        """Its :attr:`quantization`; its forwards priced on the cost table's ``"draft"`` curve."""
        return ProposerInfo(self.quantization, "draft")

    def _sync(self, context: torch.Tensor) -> torch.Tensor:
        """Roll the cache back to the prefix it shares with ``context``; return the logits of the
        token after ``context`` (float32 ``[V]``, or ``[N]`` over the token map)."""
        # feed at least the last token; an interrupted pass may have left fewer cells than _cached says
        n = min(self._cached.shape[0], context.shape[0] - 1, self.runner.length)
        differ = (self._cached[:n] != context[:n]).nonzero()
        keep = int(differ[0, 0]) if differ.numel() else n
        if keep == 0:  # nothing in common: a new sequence (a runner may prefill it otherwise than it appends)
            self.runner.reset()
        else:
            self.runner.truncate(keep)
        self.passes(context.shape[0] - keep)
        return self.runner.forward(context[keep:], num_logits=1)[-1]

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        logits = self._sync(context)  # (V,), or (N,) over the token map
        head_ids = self.runner.head_ids  # (N,) or None
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        threshold = self.config.draft_confidence
        for i in range(num_tokens):
            if sampling.greedy:
                j = argmax_on_device(logits).view(1)  # (1,) on the draft's device
                if threshold > 0 and i > 0 and float(torch.softmax(logits, -1)[j]) < threshold:
                    break
            else:
                q = logits_to_probs(logits, sampling)  # (V,) or (N,)
                if threshold > 0 and i > 0 and float(q.max()) < threshold:
                    break
                j = sample(q, generator).view(1)
                probs.append(q if head_ids is None else q.new_zeros(self.vocab_size).index_copy_(0, head_ids, q))
            token = j if head_ids is None else head_ids[j]  # (1,) full-vocabulary id
            ids.append(token)
            if i + 1 < num_tokens:
                self.passes(1)
                logits = self.runner.forward(token, num_logits=1)[-1]
        draft_ids = torch.cat(ids).cpu()  # (k,): the ids stayed on the draft's device until here (one copy)
        if len(ids) < num_tokens:  # cut by the confidence threshold: the last fed token is the last drafted
            self._cached = torch.cat([context, draft_ids])
            return DraftTokens(draft_ids, torch.stack(probs) if probs else None)
        # The cache now holds context + draft_ids[:-1]; the last drafted token was never fed.
        self._cached = torch.cat([context, draft_ids[:-1]])
        return DraftTokens(draft_ids, torch.stack(probs) if probs else None)

    def propose_tree(
        self,
        context: torch.Tensor,
        tree: TreeSpec,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """Draft a token tree: the draft's ranked candidates at each node (static shape) or its
        EAGLE-2 dynamic tree from cumulative log-probabilities (:mod:`specdecode.tree`).

        Candidates are ranked by the draft's distribution after the request's temperature /
        top-k / top-p (plain softmax when greedy) and never sampled: the tree is a deterministic
        proposal, verified exactly by :func:`~specdecode.verify.rejection_sample_tree`. One draft
        pass per depth: the nodes of a depth that have children are fed together, each attending
        to the context and its own ancestors (:meth:`ModelRunner.forward_masked`). Afterwards the
        draft's cache is cut back to the context; the next step re-feeds the accepted tokens.

        Args:
            context: int64 ``[T]``.
            tree: a :class:`~specdecode.tree.TreeShape` or :class:`~specdecode.tree.DynamicTree`.
            sampling, generator: the request's; the generator is not used.

        Returns:
            :class:`~specdecode.tree.DraftTree`.
        """
        T = int(context.shape[0])
        root = self._sync(context)  # (C,): the runner now holds the whole context
        columns = self.runner.head_ids  # (N,) or None

        def log_probs(logits: torch.Tensor) -> torch.Tensor:  # (..., C)
            if sampling.greedy:
                return torch.log_softmax(logits.float(), dim=-1)
            return logits_to_probs(logits, sampling).log()

        slot: dict[int, int] = {}  # tree node -> its cache position in the draft runner

        def expand(nodes: list[int], ids: list[int], parents: list[int]) -> torch.Tensor:
            base = self.runner.length
            attend = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)  # (m, base + m)
            attend[:, :T] = True
            positions = torch.empty(len(nodes), dtype=torch.int64)  # (m,)
            for row, node in enumerate(nodes):
                attend[row, base + row] = True
                depth, up = 1, parents[node - 1]
                while up != 0:
                    attend[row, slot[up]] = True
                    depth, up = depth + 1, parents[up - 1]
                positions[row] = T - 1 + depth
                slot[node] = base + row
            tokens = torch.tensor([ids[n - 1] for n in nodes], dtype=torch.int64)
            self.passes(len(tokens))
            return log_probs(self.runner.forward_masked(tokens, positions, attend))  # (m, C)

        if isinstance(tree, DynamicTree):
            draft = build_dynamic_tree(tree, log_probs(root), expand, columns)
        else:
            draft = build_static_tree(tree, log_probs(root), expand, columns)
        self.runner.truncate(T)
        self._cached = context.clone()
        return draft

    def observe(self, result: VerifyResult) -> None:
        """Nothing to do: the next ``propose`` truncates the rejected tokens away."""
