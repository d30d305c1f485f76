"""An EAGLE head as a proposer (Li et al. 2024, arXiv 2401.15077; dynamic trees: EAGLE-2, arXiv 2406.16858).

The head (:class:`~specdecode.drafters.heads.EagleHead`) drafts at the feature level: from the pair
(feature ``f_p``, token ``x_{p+1}``) at position ``p + 1`` it predicts ``f^_{p+1}``, whose LM-head
scores give token ``p + 2``; drafting feeds its predicted features back autoregressively.

Cache layout: the head keeps its own KV cache; entry ``p`` is the pair ``(f_p, x_{p+1})``, with
*true* target features only. With a context of T tokens the proposer knows ``f_0 .. f_{T-2}``; at
``propose`` it feeds the pairs not yet cached (``p`` up to ``T - 2``) in one forward, whose last
output ``f^_{T-1}`` scores draft 1 (token ``T``); then ``(f^, drafted token)`` pairs for the next
drafts. Afterwards the cache is cut back to the ``T - 1`` true entries, so the entries made from
predicted features never outlive a step and rollback costs nothing: a rejected draft's feature
never arrives.

On a GPU with CUDA graphs (a target marked by
:func:`~specdecode.models.torch.static_runner.use_static_cache`, or its CPU stand-in:
:func:`specdecode.drafters.graphs.graph_settings`) the head's cache is a static one, the feed of the
new pairs replays one graph per width and a greedy chain of k drafts one graph per k, with one
host copy per step (:class:`~specdecode.drafters.graphs.EagleHeadGraphs`). Sampled requests,
``draft_confidence > 0`` and trees stay eager (over that cache). Elsewhere the head keeps a
``DynamicCache`` and every forward is eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.pass_observers import ProposerInfo
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.proposers.trained_drafters import (
    FeatureLog,
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

    from specdecode.drafters.heads import EagleHead


@dataclass(frozen=True)
class EagleConfig(TrainedDrafterConfig):
    """Options of :class:`EagleProposer`: ``drafter`` (a folder saved by ``specdecode
    train-drafter --kind eagle``; None: the target's default one) and ``draft_confidence``; see
    :class:`~specdecode.proposers.trained_drafters.TrainedDrafterConfig`.

    Raises:
        ValueError, FileNotFoundError: see :class:`~specdecode.proposers.trained_drafters.TrainedDrafterConfig`.
    """

    kind = "eagle"


class EagleProposer(ProposerBase):
    """Drafts k tokens per step (or a token tree) with an EAGLE head over the target's features.

    Greedy requests draft the head's argmax over its token map (``probs=None``); sampled requests
    sample the head's distribution after the request's temperature / top-k / top-p and return it
    as ``q`` over the full vocabulary (zero outside the map), so rejection sampling stays exact.

    Greedy chains without ``draft_confidence`` replay CUDA graphs where the target is marked for
    them (:attr:`graphed`, decided here once: see the module docstring).

    Args:
        drafter: a trained :class:`~specdecode.drafters.heads.EagleHead`, attached to the target.
        config: :class:`EagleConfig` (``drafter`` is not read here; :meth:`for_target` loads it).

    Raises:
        ValueError: ``drafter`` is not an attached EAGLE head.
    """

    name = "eagle"
    supports_tree = True
    needs_target_features = True
    default_num_speculative_tokens = 2
    """k when the caller gives none: the shipped head's chain peaks at k = 2 on the reference CPU
    (humaneval, 4 prompts: 1.65x against 1.60x at k = 3 and 1.46x at k = 4; its acceptance falls
    to 0.07 at the third position). lab/notebook/2026-11-25-eagle-trees.md."""

    def __init__(self, drafter: EagleHead, config: EagleConfig | None = None) -> None:
        from specdecode.drafters.graphs import EagleHeadGraphs, graph_settings  # torch modules: loaded with a drafter
        from specdecode.drafters.heads import EagleHead

        if not isinstance(drafter, EagleHead) or not drafter.attached:
            raise ValueError("EagleProposer needs an EagleHead attached to the target (load_drafter(path, target))")
        self.drafter = drafter.eval()
        self.config = config or EagleConfig()
        settings = graph_settings(self.drafter)
        # the head's static cache and captured passes, or None: a DynamicCache and eager forwards
        self.graphed = None if settings is None else EagleHeadGraphs(self.drafter, settings)
        self.reset()

    @classmethod
    def for_target(cls, target: PreTrainedModel | None, config: EagleConfig | None = None) -> EagleProposer:
        """Load the drafter of ``config`` (default: the target's default drafter folder) for ``target``.

        Raises:
            FileNotFoundError: no trained drafter there (the message says how to train one).
            IncompatibleModelsError: it was trained for another target.
        """
        config = config or EagleConfig()
        return cls(load_for_target("eagle", config, target), config)  # type: ignore[arg-type]

    @property
    def vocab_size(self) -> int:
        return self.drafter.config.vocab_size

    @property
    def quantization(self) -> str:
        """``"int8-head"`` when the drafter scores with int8 LM-head rows
        (``head_quantization``), else ``"none"``; recorded as the ``draft_quantization`` statistic."""
        return "int8-head" if self.drafter.head_quantized else "none"

    def describe(self) -> ProposerInfo:
        """Its :attr:`quantization`; its head forwards priced on the cost table's ``"eagle"`` curve."""
        return ProposerInfo(self.quantization, "eagle")

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    def reset(self) -> None:
        if self.graphed is None:
            self.cache = self.drafter.new_cache()
        else:
            self.graphed.reset()  # its buffers and graphs stay
        self._cached = 0  # head cache entries, all from true features: pairs p = 0 .. _cached - 1
        self._features = FeatureLog()

    def observe_features(self, hidden: torch.Tensor) -> None:
        """The target's features of the next ``m`` positions, ``[m, H]`` (see :mod:`.base`)."""
        self._features.add(hidden)

    def observe(self, result: VerifyResult) -> None:
        """Nothing to do: the accepted positions' features came through :meth:`observe_features`."""

    def _cache_length(self) -> int:
        """Entries in the head cache."""
        return self.cache.get_seq_length() if self.graphed is None else self.graphed.length

    def _crop(self, length: int) -> None:
        """Keep the first ``length`` entries of the head cache."""
        if self.graphed is not None:
            self.graphed.crop(length)
            return
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # crop(-n) removes n entries in every transformers version

    def _head(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One head forward through the cache: features ``[m, H]``, token ids int64 ``[m]``, positions
        int64 ``[m]``, optional bool ``mask [m, cached + m]`` -> predicted features ``[m, H]``."""
        m = int(tokens.shape[0])
        self.passes(m)  # priced by a cost table's "eagle" curve (specdecode.cost.table)
        if self.graphed is not None:  # over the static cache, at its next slots
            return self.graphed.forward(features, tokens, positions, mask)  # (m, H)
        attention = None
        if mask is not None:  # moved as bool, the additive mask built on the device
            dtype, allowed = self.drafter.fc.weight.dtype, mask.to(self.device)
            additive = torch.zeros(mask.shape, dtype=dtype, device=self.device)
            additive.masked_fill_(~allowed, torch.finfo(dtype).min)  # (m, L)
            attention = {"full_attention": additive.view(1, 1, *mask.shape)}  # (1, 1, m, L)
        out = self.drafter(
            features.view(1, m, -1),  # (1, m, H)
            tokens.view(1, m).to(self.device),  # (1, m)
            positions.view(1, m).to(self.device),  # (1, m)
            self.cache,
            attention,
        )
        return out[0]  # (m, H)

    def _sync(self, context: torch.Tensor) -> torch.Tensor:
        """Cache the true pairs up to ``p = T - 2``; return ``f^_{T-1}`` ``[H]`` (scores token T).

        At least the last pair is fed (re-fed if a previous call cached it), whose output is needed.
        """
        T = int(context.shape[0])
        check_features(self.name, self._features.count, T)
        start = min(self._cached, T - 2)
        self._crop(start)
        features = self._features.get(start, T - 1)  # (m, H): f_start .. f_{T-2}
        if self.graphed is not None:  # a captured pass per width (the first feed eagerly)
            self.passes(T - 1 - start)
            last = self.graphed.sync(features, context[start + 1 : T])  # (H,)
        else:
            last = self._head(features, context[start + 1 : T], torch.arange(start + 1, T))[-1]  # (H,)
        self._cached = T - 1
        self._features.drop_before(T - 2)  # a later call re-feeds at most the pair of T - 2
        return last

    @torch.inference_mode()
    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        """Draft up to ``num_tokens`` tokens (fewer when ``draft_confidence`` cuts the draft); see
        :meth:`~specdecode.proposers.base.Proposer.propose`. A context of one token drafts none.

        With :attr:`graphed`, a greedy request without ``draft_confidence`` drafts through the captured
        chain of ``num_tokens`` steps (:meth:`~specdecode.drafters.graphs.EagleHeadGraphs.chain`):
        the same tokens, one host copy for the step; the rest runs the loop below.

        Raises:
            RuntimeError: the features of positions ``0 .. T - 2`` were not all received.
        """
        T = int(context.shape[0])
        if T < 2:
            return DraftTokens.empty()
        feature = self._sync(context)  # (H,): f^_{T-1}
        threshold = self.config.draft_confidence
        if self.graphed is not None and sampling.greedy and threshold == 0 and num_tokens >= 1:
            for _ in range(num_tokens - 1):
                self.passes(1)  # the chain's head forwards, priced as the eager loop's
            ids_k = self.graphed.chain(feature, num_tokens)  # (k,) on the device: the graph's buffer
            return DraftTokens(ids_k.to("cpu", copy=True))  # one copy to the host for the whole draft
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(num_tokens):
            logits = self.drafter.logits(feature)  # (N,)
            token, q, top = pick_token(
                logits, self.drafter.head_ids, self.vocab_size, sampling, generator, threshold > 0
            )
            if threshold > 0 and i > 0 and top < threshold:
                break
            ids.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < num_tokens:  # draft i + 1 is token T + i: feed (f^_{T-1+i}, it) at position T + i
                feature = self._head(feature.view(1, -1), token, torch.tensor([T + i]))[-1]
        self._crop(T - 1)  # drop the entries made from predicted features
        if not ids:
            return DraftTokens.empty()
        # ids: one copy to the host for the whole draft; probs stay on the drafter's device
        return DraftTokens(torch.cat(ids).cpu(), torch.stack(probs) if probs else None)  # (k,), (k, V) | None

    @torch.inference_mode()
    def propose_tree(
        self,
        context: torch.Tensor,
        tree: TreeSpec,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """Draft a token tree: the head's ranked candidates at each node (static shape) or the
        EAGLE-2 dynamic tree from cumulative log-probabilities (:mod:`specdecode.tree`).

        Candidates are ranked by the head's distribution after the request's temperature / top-k /
        top-p (plain softmax when greedy) and never sampled: a deterministic proposal, verified
        exactly by :func:`~specdecode.verify.rejection_sample_tree`. One head forward per depth:
        node n (token ``t`` at depth d, position ``T - 1 + d``) is fed as the pair (its parent's
        predicted feature, ``t``), attending to the cached true pairs and its own ancestors (a 4D
        mask); its output scores its children. Afterwards the cache is cut back to the true pairs.

        Args:
            context: int64 ``[T]``.
            tree: a :class:`~specdecode.tree.TreeShape` or :class:`~specdecode.tree.DynamicTree`.
            sampling, generator: the request's; the generator is not used.

        Returns:
            :class:`~specdecode.tree.DraftTree` (empty for a one-token context).

        Raises:
            RuntimeError: the features of positions ``0 .. T - 2`` were not all received.
        """
        T = int(context.shape[0])
        if T < 2:
            return DraftTree.empty()
        predicted = {0: self._sync(context)}  # node -> its predicted feature (H,), which scores its children
        slot: dict[int, int] = {}  # node -> its head cache entry

        def expand(nodes: list[int], ids: list[int], parents: list[int]) -> torch.Tensor:
            base = self._cache_length()
            attend = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)  # (m, base + m)
            attend[:, : T - 1] = True  # the true pairs
            positions = torch.empty(len(nodes), dtype=torch.int64)  # (m,)
            for row, node in enumerate(nodes):
                attend[row, base + row] = True
                depth, up = 1, parents[node - 1]
                while up != 0:
                    attend[row, slot[up]] = True
                    depth, up = depth + 1, parents[up - 1]
                positions[row] = T - 1 + depth
                slot[node] = base + row
            features = torch.stack([predicted[parents[n - 1]] for n in nodes])  # (m, H)
            tokens = torch.tensor([ids[n - 1] for n in nodes], dtype=torch.int64)  # (m,)
            out = self._head(features, tokens, positions, attend)  # (m, H)
            predicted.update(zip(nodes, out, strict=True))
            return rank_scores(self.drafter.logits(out), sampling)  # (m, N)

        root = rank_scores(self.drafter.logits(predicted[0]), sampling)  # (N,)
        columns = self.drafter.head_ids
        if isinstance(tree, DynamicTree):
            draft = build_dynamic_tree(tree, root, expand, columns)
        else:
            draft = build_static_tree(tree, root, expand, columns)
        self._crop(T - 1)
        return draft
