"""A preallocated KV cache for one sequence whose write positions are a tensor (gpt-fast's static cache).

One buffer per layer, ``K, V: [1, H_kv, capacity, D]``, allocated on the first :meth:`StaticKVCache.update`
of each layer (shape, dtype and device from the model's keys). Before each forward the runner says
where the pass writes (:meth:`StaticKVCache.prepare`: ``positions``, a device tensor, and how many
positions attention reads); attention then reads the first ``kv_length`` positions of the buffers.
What lies past the sequence's length is stale and must be masked by the caller: query ``i`` may
attend to positions ``j <= positions[i]`` only (docs/design.md §2c).

Because the buffers never move and the write positions are a tensor, a pass over them can be
captured once as a CUDA graph and replayed (:mod:`specdecode.models.torch.graphs`); rollback is a
change of the runner's length alone. Works with ``transformers`` decoder-only models whose attention
layers call the cache's ``update(key, value, layer_idx, ...)`` (Qwen2, Llama, Mistral, ...), as
:class:`specdecode.models.torch.batch.BatchedKVCache` does for many rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def grown_buffer(buffer: torch.Tensor, capacity: int) -> torch.Tensor:
    """A copy of a key or value buffer ``[rows, H_kv, positions, D]`` with ``capacity`` positions, the
    held ones first, zeros after (a new tensor: views of the old one do not follow)."""
    rows, heads, old, dim = buffer.shape
    grown = buffer.new_zeros(rows, heads, capacity, dim)
    grown[:, :, :old] = buffer
    return grown


@dataclass
class StaticLayerBuffers:
    """One layer's keys and values, ``[1, H_kv, capacity, D]`` each, in the model's dtype and device."""

    keys: torch.Tensor
    values: torch.Tensor


class StaticKVCache:
    """Per-layer key / value buffers of fixed capacity for one sequence; passed to the model as its KV
    cache (``cache`` or ``past_key_values``, :func:`specdecode.models.torch.compat.cache_kwargs`).

    Args:
        capacity: positions per layer (the longest sequence it holds without :meth:`grow`), >= 1.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    is_compileable = False

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.layers: list[StaticLayerBuffers] = []
        self._positions: torch.Tensor | None = None  # int64 [T] on the model's device: this pass's writes
        self._kv_length = 0  # positions attention reads in this pass

    def prepare(self, positions: torch.Tensor, kv_length: int) -> None:
        """Say where the next forward writes (``positions``: int64 ``[T]`` on the model's device, each
        ``< capacity``) and how many positions attention reads (``kv_length <= capacity``; the whole
        capacity for a pass captured as a CUDA graph, whose shapes are fixed).

        Raises:
            ValueError: ``kv_length`` outside ``[1, capacity]``.
        """
        if not 1 <= kv_length <= self.capacity:
            raise ValueError(f"kv_length must be in [1, {self.capacity}], got {kv_length}")
        self._positions, self._kv_length = positions, kv_length

    def grow(self, capacity: int) -> bool:
        """Make room for ``capacity`` positions (copying what is held); True if the buffers moved (a
        captured CUDA graph reads the old ones and must be dropped)."""
        if capacity <= self.capacity:
            return False
        self.capacity = capacity
        for layer in self.layers:
            layer.keys = grown_buffer(layer.keys, capacity)
            layer.values = grown_buffer(layer.values, capacity)
        return bool(self.layers)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys / values at the prepared positions; return the first ``kv_length``.

        Args:
            key_states, value_states: ``(1, H_kv, T, D)`` from the attention layer.
            layer_idx: the layer (layers call in order 0, 1, ...).

        Returns:
            ``(1, H_kv, kv_length, D)`` keys and values (views of the buffers).
        """
        assert self._positions is not None, "StaticKVCache.prepare must be called before the forward"
        if layer_idx == len(self.layers):  # first use of this layer
            _, heads, _, dim = key_states.shape
            self.layers.append(
                StaticLayerBuffers(
                    key_states.new_zeros(1, heads, self.capacity, dim),
                    value_states.new_zeros(1, heads, self.capacity, value_states.shape[-1]),
                )
            )
        layer = self.layers[layer_idx]
        layer.keys.index_copy_(2, self._positions, key_states)  # in place: the buffers never move
        layer.values.index_copy_(2, self._positions, value_states)
        return layer.keys[:, :, : self._kv_length], layer.values[:, :, : self._kv_length]

    def crop(self, tokens_to_remove: int) -> None:
        """Nothing to do: the runner's length says what is valid (rollback is a length change)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions attention reads in the pass in progress (for code that asks)."""
        return self._kv_length

    def memory_bytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))
