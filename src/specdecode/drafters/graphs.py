"""The trained drafters' greedy drafts replayed as CUDA graphs (issue 49; docs/design.md §2c).

On a GPU at batch 1 a drafter is bound by kernel launches, not by its weights: eagerly, the EAGLE
head's forward and reduced-vocabulary logits cost 2.30 ms per drafted token on an H100 (0.54 of a
target pass with graphs), Medusa's four heads and their logits 0.31 ms a step. Here the greedy
draft of a step is captured once (:class:`~specdecode.models.torch.graphs.CapturedFunction`) and
replayed with one launch; the proposer copies its ``k`` token ids to the host once a step:

- :class:`EagleHeadGraphs` (EAGLE, Li et al. 2024, arXiv 2401.15077): the head's KV cache is a
  :class:`~specdecode.models.torch.static_cache.StaticKVCache`; entry ``p``, the pair
  ``(f_p, x_{p+1})``, sits at slot ``p`` with rotary position ``p + 1`` and sees slots ``<= p``. Two
  captured functions: the feed of the ``m`` true pairs new since the last step (:meth:`~EagleHeadGraphs.sync`,
  one graph per ``m <= max_graph_width``; a sequence's first feed, the prompt's, runs eagerly, as
  the target's prefill does), and the chain of ``k`` drafting steps (:meth:`~EagleHeadGraphs.chain`,
  one graph per ``k``): logits over the token map, argmax, the target's id of it, the head's forward
  on (the predicted feature, that token) at the next slot, ``k`` times. Rollback is a length change:
  the chain's entries (from predicted features) lie past the length, masked, until overwritten.
- :class:`MedusaGraphs` (Medusa, Cai et al. 2024, arXiv 2401.10774): the K heads on one feature,
  their logits over the token map and the argmax of the first ``k``, one graph per ``k``.

Every call runs in ``torch.inference_mode`` (the buffers are inference tensors). Graphs are
captured on the first use of each width or ``k`` (lazily: a new ``k`` captures anew), in one memory
pool per drafter state. A capture that fails prints one line and leaves that state eager for good:
the same functions run without graphs, and ``graphs_failed`` keeps why.
``stand_in`` (:class:`~specdecode.models.torch.static_runner.StaticCacheSettings`) runs them eagerly
through the fixed buffers: CPU tests of the buffer logic.

Who gets them (:func:`graph_settings`): a drafter attached to a target that
:func:`~specdecode.models.torch.static_runner.use_static_cache` marked with ``cuda_graphs`` on a CUDA
device (``--device cuda``, the default there), or with ``stand_in``. Elsewhere (the CPU default) the
proposers keep their eager paths and the head its ``DynamicCache``, unchanged.

What the proposers keep eager (over the static cache when graphs are on): sampled requests (each
draw takes a uniform from the request's CPU generator, docs/design.md §2b), ``draft_confidence > 0``
(whether to go on is a host decision per token), and token trees (their shapes are chosen on the
host, depth by depth). The drafts are the eager path's: the same modules, dtypes and argmax rule
(the first maximum); only the head's attention reads the whole capacity behind a mask, so its
features may differ from the ``DynamicCache`` path's in the last bits. Verification is untouched, so
decoding stays lossless either way.

Sources: PyTorch's ``torch.cuda.graph`` (warm-up on a side stream, capture, replay, shared pools);
gpt-fast (static KV cache, decoding captured whole).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable, Sequence

import torch

from specdecode.drafters.heads import Drafter, EagleHead, MedusaHeads
from specdecode.models.torch.graphs import CapturedFunction, Tensors
from specdecode.models.torch.static_cache import StaticKVCache
from specdecode.models.torch.static_runner import StaticCacheSettings, rounded_capacity, static_cache_settings
from specdecode.sampling import argmax_on_device


def graph_settings(drafter: Drafter) -> StaticCacheSettings | None:
    """The settings under which ``drafter``'s greedy drafts replay graphs, or None (eager).

    Not None when the ``transformers`` target the drafter is attached to (:attr:`Drafter.target_model`)
    is marked by :func:`~specdecode.models.torch.static_runner.use_static_cache` with ``stand_in``, or
    with ``cuda_graphs`` while the drafter is on a CUDA device: the target's runners replay graphs
    there too. A GGUF target's drafter, or an unmarked target's, gets None.
    """
    target = drafter.target_model
    settings = None if target is None else static_cache_settings(target)
    if settings is None:
        return None
    on_cuda = drafter.head_ids.device.type == "cuda"
    return settings if settings.stand_in or (settings.cuda_graphs and on_cuda) else None


class GraphTable:
    """One drafter state's captured functions, by key (a width, a ``k``), captured on first use.

    Args:
        owner: a name for the one line printed when a capture fails.
        device: the drafter's device (CUDA unless ``stand_in``).
        stand_in: run the functions eagerly through fixed buffers (no CUDA).
    """

    def __init__(self, owner: str, device: torch.device, stand_in: bool) -> None:
        self.owner, self.device, self.stand_in = owner, device, stand_in
        self.graphs: dict[Hashable, CapturedFunction] = {}
        self.failed: str | None = None  # why capturing was given up, if it was
        self._pool: object | None = None

    def run(self, key: Hashable, fn: Callable[..., Tensors], inputs: Sequence[torch.Tensor]) -> Tensors:
        """``fn(*inputs)``: the graph of ``key`` replayed (captured now if new: ``fn`` must be the same
        function for a key), or, once a capture failed, ``fn`` called eagerly on ``inputs`` moved to
        the device. The outputs of a replay are the graph's fixed buffers, overwritten by its next
        replay: copy what you keep.

        Raises:
            ValueError: ``inputs`` of other shapes than those the key was captured with.
        """
        captured = None if self.failed is not None else self.graphs.get(key)
        if captured is None and self.failed is None:
            try:
                if self._pool is None and not self.stand_in:
                    self._pool = torch.cuda.graph_pool_handle()
                captured = CapturedFunction(fn, inputs, self.device, pool=self._pool, stand_in=self.stand_in)
            except Exception as error:  # noqa: BLE001 - any capture failure: the eager calls stay correct
                self.failed = f"{type(error).__name__}: {error}"
                self.graphs.clear()
                print(
                    f"specdecode: CUDA graph capture failed for the {self.owner} ({self.failed}); drafting eagerly",
                    file=sys.stderr,
                )
            else:
                self.graphs[key] = captured
        if captured is None:
            return tuple(fn(*(t.to(self.device) for t in inputs)))
        return captured.replay(*inputs)


class EagleHeadGraphs:
    """An EAGLE head's KV cache in fixed buffers, its passes replayed as graphs (module docstring).

    Holds one sequence's head cache: :attr:`length` valid entries, pairs ``p = 0 .. length - 1``.

    Args:
        drafter: an :class:`~specdecode.drafters.heads.EagleHead` attached to its target.
        settings: the target's :class:`~specdecode.models.torch.static_runner.StaticCacheSettings`
            (``capacity``, ``max_graph_width``, ``stand_in`` are read).
    """

    def __init__(self, drafter: EagleHead, settings: StaticCacheSettings) -> None:
        self.drafter = drafter
        self.settings = settings
        self.cache = StaticKVCache(rounded_capacity(settings.capacity))
        self.length = 0
        self.table = GraphTable("EAGLE head", drafter.head_ids.device, settings.stand_in)

    @property
    def device(self) -> torch.device:
        return self.drafter.head_ids.device

    @property
    def graphs(self) -> dict[Hashable, CapturedFunction]:
        """The captured functions: ``("sync", m)`` and ``("chain", k)``."""
        return self.table.graphs

    @property
    def graphs_failed(self) -> str | None:
        """Why capturing was given up (then everything runs eagerly), or None."""
        return self.table.failed

    def reset(self) -> None:
        """Forget the sequence (the buffers and graphs stay)."""
        self.length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries (a length change; fewer held: nothing to do).

        Raises:
            ValueError: ``length`` < 0.
        """
        if length < 0:
            raise ValueError(f"crop length must be >= 0, got {length}")
        self.length = min(self.length, length)

    def _reserve(self, needed: int) -> None:
        """Grow the cache to hold ``needed`` entries; drop the graphs if its buffers moved."""
        if self.cache.grow(rounded_capacity(needed)):
            self.table.graphs.clear()

    @torch.inference_mode()
    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One eager head forward at the next ``m`` slots (``length .. length + m - 1``), as the
        ``DynamicCache`` path appends: the prompt's pairs, sampled drafts, tree nodes.

        Args:
            features: ``[m, H]`` on the drafter's device, ``f_p`` (true or predicted).
            tokens: int64 ``[m]`` (any device), the token at ``p + 1`` of each.
            positions: int64 ``[m]`` (any device), their rotary positions.
            mask: bool ``[m, length + m]`` (any device), which entries each sees; None: causal
                (entry ``length + i`` sees entries ``<= length + i``).

        Returns:
            ``[m, H]`` predicted features ``f^_{p+1}``, on the device (fresh tensors).

        Raises:
            ValueError: ``mask`` of another shape.
        """
        m, device = int(tokens.shape[0]), self.device
        self._reserve(self.length + m)
        slots = torch.arange(self.length, self.length + m, device=device)  # (m,)
        if mask is None:
            allowed = torch.arange(self.length + m, device=device)[None, :] <= slots[:, None]  # (m, length + m)
        elif tuple(mask.shape) != (m, self.length + m):
            raise ValueError(f"mask must be [{m}, {self.length + m}], got {list(mask.shape)}")
        else:
            allowed = mask.to(device)
        out = self._attend(features, tokens.to(device), positions.to(device), slots, allowed)
        self.length += m
        return out

    @torch.inference_mode()
    def sync(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Feed the ``m`` true pairs ``p = length .. length + m - 1`` (rotary positions ``p + 1``)
        and return the last one's predicted feature.

        Replays the graph of width ``m`` (captured now if new) unless this is the sequence's first
        feed (``length == 0``: the prompt's, whose width varies) or ``m > max_graph_width``.

        Args:
            features: ``[m, H]`` on the device, ``f_p`` of each pair.
            tokens: int64 ``[m]`` (any device), ``x_{p+1}`` of each.

        Returns:
            ``[H]`` on the device: ``f^_{length + m}`` (after the call, ``f^`` of the new last
            position). A graph's output buffer: valid until the next :meth:`sync` of this width.
        """
        m, start = int(tokens.shape[0]), self.length
        if start == 0 or m > self.settings.max_graph_width:
            return self.forward(features, tokens, torch.arange(start + 1, start + m + 1))[-1]
        self._reserve(start + m)
        (out,) = self.table.run(("sync", m), self._sync_fn, (features, tokens, torch.tensor([start])))
        self.length = start + m
        return out

    @torch.inference_mode()
    def chain(self, feature: torch.Tensor, k: int) -> torch.Tensor:
        """Draft ``k`` tokens greedily from ``feature`` (``f^`` of position ``length``, which scores
        token ``length + 1``): the captured chain of ``k`` (captured now if new).

        Step ``i`` takes the argmax over the token map of ``logits(f)``, maps it to the target's id,
        and (but the last) feeds the pair ``(f, that token)`` at slot ``length + i`` (rotary position
        ``length + i + 1``) for the next ``f``. :attr:`length` stays: those entries are dropped.

        Args:
            feature: ``[H]`` on the device.
            k: tokens to draft (>= 1).

        Returns:
            int64 ``[k]`` token ids on the device: the graph's output buffer, overwritten by the next
            chain of this ``k`` (copy it to the host).

        Raises:
            ValueError: ``k`` < 1.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self._reserve(self.length + k)
        fn = functools.partial(self._chain_fn, k)
        (ids,) = self.table.run(("chain", k), fn, (feature.view(-1), torch.tensor([self.length])))
        return ids

    # ---------------------------------------------------------------- the captured functions
    def _attend(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """The head on ``m`` pairs (features ``[m, H]``, tokens and rotary positions int64 ``[m]``)
        writing cache slots ``slots`` (int64 ``[m]``), entry i seeing the slots ``allowed[i]`` (bool
        ``[m, L]``: attention reads the first ``L``) -> ``[m, H]``. All on the device, no host sync."""
        m, L = allowed.shape
        dtype = self.drafter.fc.weight.dtype
        additive = torch.zeros((m, L), dtype=dtype, device=allowed.device)
        additive.masked_fill_(~allowed, torch.finfo(dtype).min)  # (m, L)
        self.cache.prepare(slots, L)
        out = self.drafter(
            features.view(1, m, -1),  # (1, m, H)
            tokens.view(1, m),  # (1, m)
            positions.view(1, m),  # (1, m)
            self.cache,  # type: ignore[arg-type]
            {"full_attention": additive.view(1, 1, m, L)},  # (1, 1, m, L)
        )
        return out[0]  # (m, H)

    def _causal(self, features: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`_attend` in the chain's layout: slot ``s`` holds the pair at rotary position
        ``s + 1`` and sees slots ``<= s``, over the whole capacity (fixed shapes)."""
        every = torch.arange(self.cache.capacity, device=slots.device)  # (L,)
        return self._attend(features, tokens, slots + 1, slots, every[None, :] <= slots[:, None])

    def _sync_fn(self, features: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor) -> Tensors:
        """Captured: pairs at slots ``first .. first + m - 1`` (``first`` int64 ``[1]``) -> the last
        predicted feature ``[H]``."""
        slots = first + torch.arange(int(tokens.shape[0]), device=first.device)  # (m,)
        return (self._causal(features, tokens, slots)[-1],)

    def _chain_fn(self, k: int, feature: torch.Tensor, first: torch.Tensor) -> Tensors:
        """Captured: the ``k`` greedy drafting steps from ``feature`` ``[H]``, the first fed pair at
        slot ``first`` (int64 ``[1]``) -> token ids int64 ``[k]``. The eager proposer's loop, op for op."""
        ids: list[torch.Tensor] = []
        for i in range(k):
            column = argmax_on_device(self.drafter.logits(feature)).view(1)  # (1,): over the token map
            token = self.drafter.head_ids[column]  # (1,): the target's id
            ids.append(token)
            if i + 1 < k:  # draft i + 2 comes from f^ of the pair (f, token) at slot first + i
                feature = self._causal(feature.view(1, -1), token, first + i)[-1]  # (H,)
        return (torch.cat(ids),)  # (k,)


class MedusaGraphs:
    """Medusa heads' greedy draft replayed as one graph per ``k`` (module docstring).

    Args:
        drafter: :class:`~specdecode.drafters.heads.MedusaHeads` attached to its target.
        settings: the target's :class:`~specdecode.models.torch.static_runner.StaticCacheSettings`
            (``stand_in`` is read).
    """

    def __init__(self, drafter: MedusaHeads, settings: StaticCacheSettings) -> None:
        self.drafter = drafter
        self.num_heads = drafter.config.num_heads
        self.table = GraphTable("Medusa heads", drafter.head_ids.device, settings.stand_in)

    @property
    def graphs(self) -> dict[Hashable, CapturedFunction]:
        """The captured functions, by ``k``."""
        return self.table.graphs

    @property
    def graphs_failed(self) -> str | None:
        """Why capturing was given up (then the heads run eagerly), or None."""
        return self.table.failed

    @torch.inference_mode()
    def draft(self, feature: torch.Tensor, k: int) -> torch.Tensor:
        """Heads 1..k's argmax tokens on ``feature`` (``[H]`` on the device, ``f_p``; head i scores
        token ``p + 1 + i``): int64 ``[k]`` target ids on the device, the graph's output buffer
        (overwritten by the next draft of this ``k``: copy it to the host).

        Raises:
            ValueError: ``k`` outside ``[1, K]``.
        """
        if not 1 <= k <= self.num_heads:
            raise ValueError(f"k must be in [1, {self.num_heads}], got {k}")
        (ids,) = self.table.run(k, functools.partial(self._draft_fn, k), (feature.view(-1),))
        return ids

    def _draft_fn(self, k: int, feature: torch.Tensor) -> Tensors:
        """Captured: every head's logits over the token map (as the eager proposer computes them),
        the argmax of the first ``k`` rows, mapped to target ids -> int64 ``[k]``."""
        logits = self.drafter.logits(self.drafter(feature))  # (K, N)
        return (self.drafter.head_ids[argmax_on_device(logits[:k])],)  # (k,)
