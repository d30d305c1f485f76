"""Medusa heads as a proposer (Cai et al. 2024, arXiv 2401.10774).

K heads on the target's last known feature draft the next K tokens at once, without a draft model:
with a context of T tokens the proposer knows ``f_{T-2}`` (the feature of the token before the
last; the last token is fed to the target with the draft), and head i (1-based) on it scores token
``T - 1 + i`` (:class:`~specdecode.drafters.heads.MedusaHeads`). One small forward per step, no
cache, no rollback. The heads do not see the tokens they draft, so deeper heads agree less.

Trees (Medusa's "tree attention", §2.1.2): the candidates of depth d are head d's top tokens,
whatever their parent; a static shape takes head d's r-th best token for rank r, a dynamic tree
(EAGLE-2 reranking, arXiv 2406.16858) ranks nodes by the sum of their heads' log-probabilities.
Drafts are never deeper than K.

On a GPU with CUDA graphs (a target marked by
:func:`~specdecode.models.torch.static_runner.use_static_cache`, or its CPU stand-in:
:func:`specdecode.drafters.graphs.graph_settings`) a greedy chain's heads, logits and argmax replay
as one graph per k (:class:`~specdecode.drafters.graphs.MedusaGraphs`); sampled requests,
``draft_confidence > 0`` and trees stay eager.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.pass_observers import ProposerInfo
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.proposers.trained_drafters import (
    TrainedDrafterConfig,
    check_features,
    load_for_target,
    pick_token,
    rank_scores,
)
from specdecode.sampling import SamplingParams
from specdecode.tree import DraftTree, DynamicTree, TreeSpec, build_dynamic_tree, build_static_tree
from specdecode.verify import VerifyResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdecode.drafters.heads import MedusaHeads


@dataclass(frozen=True)
class MedusaConfig(TrainedDrafterConfig):
    """Options of :class:`MedusaProposer`: ``drafter`` (a folder saved by ``specdecode
    train-drafter --kind medusa``; None: the target's default one) and ``draft_confidence``; see
    :class:`~specdecode.proposers.trained_drafters.TrainedDrafterConfig`.

    Raises:
        ValueError, FileNotFoundError: see :class:`~specdecode.proposers.trained_drafters.TrainedDrafterConfig`.
    """

    kind = "medusa"


class MedusaProposer(ProposerBase):
    """Drafts up to K tokens per step with Medusa heads over the target's features.

    Greedy requests draft each head's argmax over its token map (``probs=None``); sampled requests
    sample each head's distribution after the request's temperature / top-k / top-p and return it
    as ``q`` over the full vocabulary (zero outside the map). Each head's ``q`` depends on the
    context only, never on the tokens drafted before it, which rejection sampling allows (any
    ``q`` chosen from the verified prefix keeps the output exact).

    Args:
        drafter: trained :class:`~specdecode.drafters.heads.MedusaHeads`, attached to the target.
        config: :class:`MedusaConfig` (``drafter`` is not read here; :meth:`for_target` loads it).

    Raises:
        ValueError: ``drafter`` is not attached Medusa heads.
    """

    name = "medusa"
    supports_tree = True
    needs_target_features = True
    default_num_speculative_tokens = 2
    """k when the caller gives none: the shipped heads' chain is fastest at k = 2 on the reference CPU
    (humaneval, 4 prompts: 1.60x against 1.56x at k = 3 and 1.53x at k = 4; heads 3 and 4 are
    accepted 0.04 and 0.00 of the time). lab/results/issue6-medusa-k."""

    def __init__(self, drafter: MedusaHeads, config: MedusaConfig | None = None) -> None:
        from specdecode.drafters.graphs import MedusaGraphs, graph_settings  # torch modules: loaded with a drafter
        from specdecode.drafters.heads import MedusaHeads

        if not isinstance(drafter, MedusaHeads) or not drafter.attached:
            raise ValueError("MedusaProposer needs MedusaHeads attached to the target (load_drafter(path, target))")
        self.drafter = drafter.eval()
        self.config = config or MedusaConfig()
        self.num_heads = drafter.config.num_heads
        settings = graph_settings(self.drafter)
        self.graphed = None if settings is None else MedusaGraphs(self.drafter, settings)  # None: eager heads
        self.reset()

    @classmethod
    def for_target(cls, target: PreTrainedModel | None, config: MedusaConfig | None = None) -> MedusaProposer:
        """Load the drafter of ``config`` (default: the target's default drafter folder) for ``target``.

        Raises:
            FileNotFoundError: no trained drafter there (the message says how to train one).
            IncompatibleModelsError: it was trained for another target.
        """
        config = config or MedusaConfig()
        return cls(load_for_target("medusa", config, target), config)  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        return self.drafter.config.vocab_size

    @property
    def quantization(self) -> str:
        """``"int8-head"`` when the drafter scores with int8 LM-head rows
        (``head_quantization``), else ``"none"``; recorded as the ``draft_quantization`` statistic."""
        return "int8-head" if self.drafter.head_quantized else "none"

    def describe(self) -> ProposerInfo:
        """Its :attr:`quantization`; its head forwards priced on the cost table's ``"medusa"`` curve."""
        return ProposerInfo(self.quantization, "medusa")

    def reset(self) -> None:
        self._last: torch.Tensor | None = None  # (H,): the feature of the newest known position
        self._known = 0  # features received: positions 0 .. _known - 1

    def observe_features(self, hidden: torch.Tensor) -> None:
        """The target's features of the next ``m`` positions, ``[m, H]`` (see :mod:`.base`)."""
        if hidden.shape[0]:
            self._last = hidden[-1]
            self._known += int(hidden.shape[0])

    def observe(self, result: VerifyResult) -> None:
        """Nothing to do: the features of the kept positions came through :meth:`observe_features`."""

    @torch.inference_mode()
    def head_logits(self, context: torch.Tensor) -> torch.Tensor:
        """Every head's scores for the tokens after ``context`` (int64 ``[T]``, T >= 2): float32
        ``[K, N]``, row i - 1 for token ``T - 1 + i``, column j for token ``head_ids[j]``.

        Raises:
            RuntimeError: the features of positions ``0 .. T - 2`` were not all received.
        """
        check_features(self.name, self._known, int(context.shape[0]))
        assert self._last is not None
        self.passes(1)  # every head on one feature: priced by a cost table's "medusa" curve
        return self.drafter.logits(self.drafter(self._last))  # (K, N)

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft ``min(num_tokens, K)`` tokens (fewer when ``draft_confidence`` cuts the draft); see
        :meth:`~specdecode.proposers.base.Proposer.propose`. A context of one token drafts none.

        With :attr:`graphed`, a greedy request without ``draft_confidence`` replays the captured heads,
        logits and argmax of ``min(num_tokens, K)`` (:meth:`~specdecode.drafters.graphs.MedusaGraphs.draft`):
        the same tokens, one host copy.

        Raises:
            RuntimeError: the features of positions ``0 .. T - 2`` were not all received.
        """
        if context.shape[0] < 2:
            return DraftTokens.empty()
        threshold = self.config.draft_confidence
        k = min(num_tokens, self.num_heads)
        if self.graphed is not None and sampling.greedy and threshold == 0 and k >= 1:
            check_features(self.name, self._known, int(context.shape[0]))
            assert self._last is not None
            self.passes(1)  # priced as head_logits' evaluation
            return DraftTokens(self.graphed.draft(self._last, k).to("cpu", copy=True))  # (k,): one host copy
        logits = self.head_logits(context)  # (K, N)
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(min(num_tokens, self.num_heads)):
            token, q, top = pick_token(
                logits[i], self.drafter.head_ids, self.vocab_size, sampling, generator, threshold > 0
            )
            if threshold > 0 and i > 0 and top < threshold:
                break
            ids.append(token)
            if q is not None:
                probs.append(q)
        if not ids:
            return DraftTokens.empty()
        # ids: one copy to the host for the whole draft; probs stay on the drafter's device
        return DraftTokens(torch.cat(ids).cpu(), torch.stack(probs) if probs else None)  # (k,), (k, V) | None

    def propose_tree(
        self,
        context: torch.Tensor,
        tree: TreeSpec,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """Draft a token tree from the heads' ranked candidates (Medusa tree attention; EAGLE-2
        dynamic trees), no deeper than K.

        Candidates are ranked by each head's distribution after the request's temperature /
        top-k / top-p (plain softmax when greedy) and never sampled: a deterministic proposal,
        verified exactly by :func:`~specdecode.verify.rejection_sample_tree`. Node ``[..., r]`` of
        depth d is head d's r-th best token.

        Args:
            context: int64 ``[T]``.
            tree: a :class:`~specdecode.tree.TreeShape` (nodes deeper than K are dropped) or a
                :class:`~specdecode.tree.DynamicTree` (its depth capped at K).
            sampling, generator: the request's; the generator is not used.

        Returns:
            :class:`~specdecode.tree.DraftTree` (empty for a one-token context).
        """
        if context.shape[0] < 2:
            return DraftTree.empty()
        scores = rank_scores(self.head_logits(context), sampling)  # (K, N)
        K = self.num_heads

        def expand(nodes: list[int], ids: list[int], parents: list[int]) -> torch.Tensor:
            depth, up = 1, parents[nodes[0] - 1]  # the nodes of one call share a depth
            while up != 0:
                depth, up = depth + 1, parents[up - 1]
            return scores[min(depth, K - 1)].expand(len(nodes), -1)  # (m, N): head depth + 1's candidates

        columns = self.drafter.head_ids
        if isinstance(tree, DynamicTree):
            spec = dataclasses.replace(tree, depth=min(tree.depth, K))
            return build_dynamic_tree(spec, scores[0], expand, columns)
        return build_static_tree(tree, scores[0], expand, columns).prune(K)  # prune: the nodes of depth <= K
