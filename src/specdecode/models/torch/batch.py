"""A target model run over a batch of sequences of different lengths, with one KV cache for all.

The cache is one preallocated buffer per layer, ``K, V: [rows, H_kv, capacity, D]`` (gpt-fast's
static cache, with one length pointer per row instead of one for the batch). Row ``r`` holds the
first ``lengths[r]`` tokens of its sequence.

One :meth:`TorchBatchedRunner.forward` over rows ``first .. first + B - 1`` with inputs of ``n_b``
tokens each (ragged; right-padded to ``T = max n_b``):

- token ``t`` of row ``b`` is written at cache position ``p[b, t] = lengths[b] + t`` and gets
  rotary position ``p[b, t]`` (``position_ids``, ``(B, T)``);
- it attends to the cache positions ``j <= p[b, t]`` of its own row: a 4D additive mask
  ``(B, 1, T, L)`` with ``L = max_b lengths[b] + T``, given to the model as the ready-made mask
  mapping ``{"full_attention": mask}`` so that ``transformers`` builds none of its own;
- the padding tokens (``t >= n_b``) are computed too, but their logits are dropped and their keys
  and values, written past the row's valid length, are never attended by a valid query and are
  overwritten by the row's next tokens;
- afterwards ``lengths[b] += n_b``.

Rollback of one row is :meth:`TorchBatchedRunner.truncate`: its length pointer moves back, the stale
entries stay in the buffer, masked by the rule above, until overwritten. Rows join at the end
(:meth:`add_row`) and leave by :meth:`remove_row`, which moves the last row into the hole, so that
the active rows are always ``0 .. num_rows - 1`` and the decode batch is a view of the buffers.

Works with ``transformers`` decoder-only models whose attention layers call
the KV cache's ``update(key, value, layer_idx)`` and apply rotary embeddings from
``position_ids`` (Qwen2, Llama, Mistral, ...), with ``sdpa`` or ``eager`` attention. Sliding-window
layers get the same mask, cut to the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel

from specdecode.models.contract import RowTable, RunnerCapabilities
from specdecode.models.torch.compat import cache_kwargs
from specdecode.models.torch.exact import MASKED_ATTENTIONS, exact_passes
from specdecode.models.torch.runner import check_decoder_logits
from specdecode.models.torch.static_cache import grown_buffer


class BatchedKVCache:
    """Per-layer key / value buffers with a length per row; passed to the model as its KV cache
    (``cache`` or ``past_key_values``, :func:`specdecode.models.torch.compat.cache_kwargs`).

    Buffers are created on the first :meth:`update` of each layer (shape, dtype and device from
    the model's keys) and grow along the sequence axis when a forward needs more room.

    Args:
        max_rows: rows of every buffer (the most sequences at once).
        capacity: initial positions per row (grows as needed, in steps of ``block``).
        block: capacity grows to a multiple of this.
    """

    is_compileable = False

    def __init__(self, max_rows: int, capacity: int = 256, block: int = 256) -> None:
        self.max_rows = max_rows
        self.capacity = capacity
        self.block = block
        self.keys: list[torch.Tensor] = []  # per layer (max_rows, H_kv, capacity, D)
        self.values: list[torch.Tensor] = []
        # Set by TorchBatchedRunner.forward for the call in progress:
        self._first = 0  # first row of the call
        self._positions: torch.Tensor | None = None  # (B, T) int64 write positions
        self._kv_length = 0  # L: positions returned to attention

    def prepare(self, first: int, positions: torch.Tensor, kv_length: int) -> None:
        """Say where the next forward writes: rows ``first ..`` at ``positions`` ``(B, T)``; grow if needed."""
        self._first, self._positions, self._kv_length = first, positions, kv_length
        if kv_length > self.capacity:
            new = -(-kv_length // self.block) * self.block
            self.keys = [grown_buffer(k, new) for k in self.keys]
            self.values = [grown_buffer(v, new) for v in self.values]
            self.capacity = new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this call's keys / values and return the rows' first ``L`` positions.

        Args:
            key_states, value_states: ``(B, H_kv, T, D)`` from the attention layer.
            layer_idx: the layer (layers call in order 0, 1, ...).

        Returns:
            ``(B, H_kv, L, D)`` keys and values (views of the buffers).
        """
        assert self._positions is not None, "BatchedKVCache.prepare must be called before the forward"
        if layer_idx == len(self.keys):  # first use of this layer
            _, heads, _, dim = key_states.shape
            shape = (self.max_rows, heads, self.capacity, dim)
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        B = key_states.shape[0]
        rows = torch.arange(B, device=key_states.device)[:, None]  # (B, 1)
        k = self.keys[layer_idx][self._first : self._first + B]  # (B, H, cap, D) view
        v = self.values[layer_idx][self._first : self._first + B]
        k[rows, :, self._positions] = key_states.transpose(1, 2)  # (B, T, H, D) scattered per row
        v[rows, :, self._positions] = value_states.transpose(1, 2)
        return k[:, :, : self._kv_length], v[:, :, : self._kv_length]

    @torch.inference_mode()
    def move_row(self, source: int, target: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``source`` into row ``target``."""
        for k, v in zip(self.keys, self.values, strict=True):
            k[target, :, :length] = k[source, :, :length]
            v[target, :, :length] = v[source, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions returned to attention in the call in progress (for code that asks)."""
        return self._kv_length

    def memory_bytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class TorchBatchedRunner:
    """A ``transformers`` causal LM over up to ``max_rows`` sequences that share one forward pass.

    Rows are the sequences, ``0 .. num_rows - 1``. Each row keeps its own length; see the module
    docstring for how ragged rows, padding, masks and rollback work.

    Devices (the runner contract's device policy, docs/design.md §2b): :attr:`device` is the
    model's; the per-row logits and hidden states come back there. Inputs are CPU ids; the runner
    builds ids, positions and masks and moves them to :attr:`device` itself.

    Args:
        model: a decoder-only ``transformers`` causal LM (RoPE, ``sdpa`` or ``eager`` attention).
        max_rows: the most sequences at once.
        capacity: initial cache positions per row (grows as needed).

    Raises:
        ValueError: ``max_rows`` < 1, or an attention implementation other than sdpa / eager.
    """

    capabilities = RunnerCapabilities(backend="torch", returns_hidden=True, trees=False, model_insides=True)
    """The runner contract's capabilities (:class:`~specdecode.models.contract.RunnerCapabilities`):
    features, no trees, the model's insides; one pass scores every row (no greedy hints).
    Batch-invariant only for a model marked for exact passes (an instance then declares it)."""

    def __init__(self, model: PreTrainedModel, max_rows: int, capacity: int = 256) -> None:
        self.rows = RowTable(max_rows)  # checks max_rows
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention not in MASKED_ATTENTIONS:
            raise ValueError(f"the batched runner needs sdpa or eager attention, the model uses {attention!r}")
        self.model = model.eval()
        if exact_passes(model):  # every row of a pass is what a one-token pass computes
            self.capabilities = replace(type(self).capabilities, batch_invariant=True)
        self.max_rows = max_rows
        self.cache = BatchedKVCache(max_rows, capacity)
        config = model.config
        self._layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        self._window = getattr(config, "sliding_window", None)

    @property
    def device(self) -> torch.device:
        """Where the logits and hidden states live: the model's device (the contract's device)."""
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_length(self) -> int:
        """Longest sequence the model takes (``max_position_embeddings``)."""
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @property
    def lengths(self) -> list[int]:
        """Per row, its cached tokens (:class:`~specdecode.models.contract.RowTable`)."""
        return self.rows.lengths

    def add_row(self, slot: int | None = None, keep: int = 0) -> int:
        """Start an empty row at the end; returns its index. (No prefix cache here:
        ``capabilities.prefix_cache`` is False, ``slot`` and ``keep`` must be left out.)

        Raises:
            RuntimeError: all ``max_rows`` rows are in use.
            CapabilityError: ``slot`` or ``keep`` given.
        """
        if slot is not None or keep:
            self.capabilities.require("prefix_cache", self, "a row adopting a cached prefix")
        return self.rows.add()

    def remove_row(self, row: int, keep: bool = False) -> int | None:
        """Free ``row``: the last row's cached entries move into its place (``keep``: refused, no
        prefix cache here).

        Returns:
            the former index of the row that moved to ``row`` (the caller renumbers it), or None
            when ``row`` was the last one.
        """
        if keep:
            self.capabilities.require("prefix_cache", self, "a row keeping its cells")
        last = self.num_rows - 1
        if self.rows.check_row(row) != last:
            self.cache.move_row(last, row, self.lengths[last])
        return self.rows.remove(row)

    def truncate(self, row: int, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``row`` (rollback: the length pointer moves).

        Raises:
            ValueError: ``length`` is negative or longer than the row.
        """
        self.rows.truncate(row, length)

    def _masks(self, positions: torch.Tensor, kv_length: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Additive masks ``(B, 1, T, L)``: 0 where key ``j <= position`` (and inside the window), else -inf-like."""
        keys = torch.arange(kv_length, device=positions.device)  # (L,)
        allowed = keys[None, None, :] <= positions[:, :, None]  # (B, T, L)
        masks = {}
        for kind in self._layer_types:
            ok = allowed
            if kind == "sliding_attention" and self._window:
                ok = allowed & (keys[None, None, :] > positions[:, :, None] - self._window)
            mask = torch.zeros(ok.shape, dtype=dtype, device=positions.device)
            masks[kind] = mask.masked_fill_(~ok, torch.finfo(dtype).min)[:, None]  # (B, 1, T, L)
        return masks

    @torch.inference_mode()
    def forward(
        self,
        first: int,
        inputs: Sequence[torch.Tensor],
        num_logits: Sequence[int],
        return_hidden: bool = False,
        greedy_drafts: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Append ``inputs[b]`` to row ``first + b`` for every b, in one pass of the model.

        Args:
            first: the first row; the call covers rows ``first .. first + len(inputs) - 1``.
            inputs: per row, int64 ``[n_b]`` (n_b >= 1) on the CPU, the tokens after the row's cached ones.
            num_logits: per row, how many of its last positions to score (1 <= num_logits[b] <= n_b).
            return_hidden: also return the target's *features* (the decoder's final hidden states,
                what the LM head reads) of every input token, for proposers that draft from them
                (Medusa, EAGLE); the pass is then ``get_decoder()`` followed by the LM head, checked
                once per model to give the model's own logits.
            greedy_drafts: unused (every row is scored in one pass); the llama.cpp batched runner
                uses it to stop a split verification pass early.

        Returns:
            per row, float32 ``[num_logits[b], V]`` on :attr:`device`; row i scores the token after
            ``inputs[b][n_b - num_logits[b] + i]``, exactly as
            :meth:`specdecode.models.torch.runner.ModelRunner.forward` does for one sequence. With
            ``return_hidden``: ``(logits, hidden)``, ``hidden[b]`` ``[n_b, H]`` in the model's dtype.

        Raises:
            ValueError: rows outside ``0 .. num_rows - 1``, an empty input, or a bad ``num_logits``;
                with ``return_hidden``, a model whose logits are not ``lm_head(hidden states)``.
        """
        B = len(inputs)
        self.rows.check_call(first, B, len(num_logits))
        sizes = [int(x.shape[0]) for x in inputs]
        for b, (n, m) in enumerate(zip(sizes, num_logits, strict=True)):
            if n < 1 or not 1 <= m <= n:
                raise ValueError(f"row {first + b}: need 1 <= num_logits ({m}) <= tokens ({n})")
        T = max(sizes)
        device = self.device
        ids = torch.zeros(B, T, dtype=torch.int64)  # (B, T), padded with token 0
        for b, x in enumerate(inputs):
            ids[b, : sizes[b]] = x.cpu()  # CPU ids (a no-op for the contract's inputs)
        starts = torch.tensor(self.lengths[first : first + B], dtype=torch.int64)  # (B,)
        positions = (starts[:, None] + torch.arange(T)[None, :]).to(device)  # (B, T)
        kv_length = int(starts.max()) + T
        self.cache.prepare(first, positions, kv_length)
        # Score only the positions some row needs: [B, P, V] for the P distinct ones.
        wanted = sorted({n - m + i for n, m in zip(sizes, num_logits, strict=True) for i in range(m)})
        keep: int | torch.Tensor = 0 if wanted == list(range(T)) else torch.tensor(wanted, device=device)
        kwargs = {
            "input_ids": ids.to(device),
            "position_ids": positions,
            "attention_mask": self._masks(positions, kv_length, self.model.dtype),
            **cache_kwargs(self.model, self.cache),
            "use_cache": True,
        }
        hidden = None
        if return_hidden:
            check_decoder_logits(self.model, "return_hidden")
            hidden = self.model.get_decoder()(**kwargs).last_hidden_state  # (B, T, H)
            picked = hidden if isinstance(keep, int) else hidden[:, keep]  # (B, P, H)
            logits = self.model.get_output_embeddings()(picked)  # (B, P, V)
        else:
            logits = self.model(**kwargs, logits_to_keep=keep).logits  # (B, P, V)
        column = {p: i for i, p in enumerate(wanted)}
        result = []
        for b, (n, m) in enumerate(zip(sizes, num_logits, strict=True)):
            cols = [column[p] for p in range(n - m, n)]
            result.append(logits[b, cols[0] : cols[-1] + 1].float())  # (m, V): wanted is sorted, runs are contiguous
            self.rows.lengths[first + b] += n
        if hidden is None:
            return result
        return result, [hidden[b, :n] for b, n in enumerate(sizes)]
