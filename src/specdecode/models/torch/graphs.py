"""Functions captured once as CUDA graphs over fixed buffers and replayed (gpt-fast, vLLM's CUDA graphs).

At batch 1 a small model's decoding step is bound by kernel launches, not by memory: transformers
launches a few hundred kernels per layer call from Python. A CUDA graph records the kernels of one
call over fixed buffers once; a replay launches them all in one call. A :class:`CapturedFunction`
owns the fixed buffers of one function of fixed-shape tensors: the inputs are copied into them
before each replay, the outputs are read from them after it, and must be copied before the next
replay overwrites them. :class:`CapturedPass` is the target's pass of one width (token ids and
their cache positions in, logits and hidden states out); the trained drafters' chains
(:mod:`specdecode.drafters.graphs`) are other captured functions.

``stand_in=True`` keeps those rules but runs the function eagerly at each replay and copies its
results into the fixed outputs: a CPU stand-in with which tests check the buffer logic (stale
inputs, outputs read after being overwritten) where no GPU is.

Source: PyTorch's ``torch.cuda.graph`` (warm-up on a side stream, capture, replay; graphs of one
runner share one memory pool), as gpt-fast and vLLM capture decoding per batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Outputs of one pass: float32 logits [T, V] and hidden states [T, H], both on the model's device.
PassOutputs = tuple[torch.Tensor, torch.Tensor]
PassFunction = Callable[[torch.Tensor, torch.Tensor], PassOutputs]
Tensors = tuple[torch.Tensor, ...]


class CapturedFunction:
    """A function of fixed-shape tensors: fixed input buffers, the recorded kernels (or the CPU
    stand-in), fixed outputs.

    Args:
        fn: ``fn(*inputs) -> tuple of tensors``, called with the input buffers (same shapes and dtypes
            as ``inputs``, on ``device``); it must read only them and tensors that never move
            (weights, a static KV cache), and make no host sync (no ``.item()``, ``.cpu()``, data-
            dependent shapes).
        inputs: the first call's inputs (any device): they give the buffers' shapes and dtypes, and
            the warm-up calls run on them (a function that writes a cache writes there what the real
            call writes, so they harm nothing).
        device: where the buffers live (CUDA unless ``stand_in``).
        pool: the memory pool shared by one owner's graphs (``torch.cuda.graph_pool_handle()``), or None.
        stand_in: no graph: :meth:`replay` runs ``fn`` eagerly on the buffers and copies its outputs
            into the fixed ones (CPU tests of the buffer logic).

    Raises:
        RuntimeError: the capture failed (the caller falls back to eager calls).
    """

    def __init__(
        self,
        fn: Callable[..., Sequence[torch.Tensor]],
        inputs: Sequence[torch.Tensor],
        device: torch.device,
        pool: object | None = None,
        stand_in: bool = False,
    ) -> None:
        self.fn = fn
        self.stand_in = stand_in
        self.inputs: Tensors = tuple(torch.zeros(t.shape, dtype=t.dtype, device=device) for t in inputs)
        self.load(*inputs)
        self.graph: torch.cuda.CUDAGraph | None = None
        if stand_in:
            self.outputs: Tensors = tuple(t.clone() for t in fn(*self.inputs))
            return
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: lazy initialisations happen outside the capture
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs = tuple(fn(*self.inputs))  # fixed addresses
        self.graph = graph

    def load(self, *inputs: torch.Tensor) -> None:
        """Copy ``inputs`` (any device, the buffers' shapes) into the input buffers.

        Raises:
            ValueError: another number of inputs, or another shape.
        """
        shapes = [tuple(t.shape) for t in inputs]
        if shapes != [tuple(b.shape) for b in self.inputs]:
            raise ValueError(
                f"a captured function takes inputs of shapes {[list(b.shape) for b in self.inputs]}, "
                f"got {[list(s) for s in shapes]}"
            )
        for buffer, value in zip(self.inputs, inputs, strict=True):
            buffer.copy_(value, non_blocking=True)

    def replay(self, *inputs: torch.Tensor) -> Tensors:
        """Run the function on ``inputs`` (copied into the fixed buffers first, :meth:`load`) and return
        the fixed outputs, on the device. The next replay overwrites them (and, in a shared pool,
        another graph's replay may reuse the memory of their intermediates): copy what you keep.

        Raises:
            ValueError: see :meth:`load`.
        """
        self.load(*inputs)
        if self.graph is not None:
            self.graph.replay()
        else:  # the stand-in: same buffers, eager kernels
            for fixed, fresh in zip(self.outputs, self.fn(*self.inputs), strict=True):
                fixed.copy_(fresh)
        return self.outputs


class CapturedPass(CapturedFunction):
    """One pass width ``T`` of a model over a static KV cache (a :class:`CapturedFunction` of the
    token ids and their cache positions).

    Args:
        fn: the pass, ``fn(ids, positions) -> (logits, hidden)``: ids int64 ``[1, T]``, positions
            int64 ``[T]`` (cache slots and rotary positions), both on ``device``; it must read only
            them and tensors that never move (weights, the static KV cache), and make no host sync.
        width: ``T``, tokens per pass (>= 1).
        device: the model's device (CUDA unless ``stand_in``).
        ids, positions: the first call's inputs (``[T]`` int64, any device): the warm-up passes run
            on them (they write the same keys and values as the real pass, so they harm nothing).
        pool: the memory pool shared by one runner's graphs (``torch.cuda.graph_pool_handle()``), or None.
        stand_in: no graph: :meth:`replay` runs ``fn`` eagerly on the buffers and copies its outputs
            into the fixed ones (CPU tests of the buffer logic).

    Raises:
        ValueError: ``ids`` or ``positions`` not of shape ``[T]``.
        RuntimeError: the capture failed (the caller falls back to eager passes).
    """

    def __init__(
        self,
        fn: PassFunction,
        width: int,
        device: torch.device,
        ids: torch.Tensor,
        positions: torch.Tensor,
        pool: object | None = None,
        stand_in: bool = False,
    ) -> None:
        self.width = width
        self._check(ids, positions)
        super().__init__(fn, (ids.view(1, width), positions), device, pool=pool, stand_in=stand_in)

    @property
    def ids(self) -> torch.Tensor:
        """The fixed input ids, int64 ``[1, T]``."""
        return self.inputs[0]

    @property
    def positions(self) -> torch.Tensor:
        """The fixed input positions, int64 ``[T]``."""
        return self.inputs[1]

    @property
    def logits(self) -> torch.Tensor:
        """The fixed output logits, float32 ``[T, V]``."""
        return self.outputs[0]

    @property
    def hidden(self) -> torch.Tensor:
        """The fixed output hidden states, ``[T, H]``."""
        return self.outputs[1]

    def _check(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        if ids.shape != (self.width,) or positions.shape != (self.width,):
            raise ValueError(
                f"a captured pass of width {self.width} needs ids and positions of shape [{self.width}], "
                f"got {list(ids.shape)} and {list(positions.shape)}"
            )

    def replay(self, ids: torch.Tensor, positions: torch.Tensor) -> PassOutputs:  # type: ignore[override]
        """Run the pass on ``ids`` and ``positions`` (int64 ``[T]``, any device: copied into the fixed
        buffers) and return the fixed outputs: float32 logits ``[T, V]`` and hidden states ``[T, H]``
        on the device. They are overwritten by the next replay of any width of the same runner (a
        shared pool): copy what you keep.

        Raises:
            ValueError: shapes other than ``[T]``.
        """
        self._check(ids, positions)
        logits, hidden = super().replay(ids.view(1, self.width), positions)
        return logits, hidden
