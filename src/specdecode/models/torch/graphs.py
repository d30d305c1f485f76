"""Forward passes captured once per width as CUDA graphs and replayed (gpt-fast, vLLM's CUDA graphs).

At batch 1 a small model's decoding step is bound by kernel launches, not by memory: transformers
launches a few hundred kernels per layer call from Python. A CUDA graph records the kernels of one
pass over fixed buffers once; a replay launches them all in one call. A :class:`CapturedPass` owns
the fixed buffers of one pass width: the inputs (token ids and their cache positions) are copied into
them before each replay, the outputs (logits, hidden states) are read from them after it, and must
be copied before the next replay of any width overwrites them.

:class:`CapturedPass` with ``stand_in=True`` keeps those rules but runs the pass eagerly at each
replay and copies its results into the fixed outputs: a CPU stand-in with which tests check the
buffer logic (stale inputs, outputs read after being overwritten) where no GPU is.

Source: PyTorch's ``torch.cuda.graph`` (warm-up on a side stream, capture, replay; graphs of one
runner share one memory pool), as gpt-fast and vLLM capture decoding per batch size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Outputs of one pass: float32 logits [T, V] and hidden states [T, H], both on the model's device.
PassOutputs = tuple[torch.Tensor, torch.Tensor]
PassFunction = Callable[[torch.Tensor, torch.Tensor], PassOutputs]


class CapturedPass:
    """One pass width ``T``: fixed input buffers, the recorded kernels (or the CPU stand-in), fixed outputs.

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
        self.fn = fn
        self.width = width
        self.stand_in = stand_in
        self.ids = torch.zeros(1, width, dtype=torch.int64, device=device)  # (1, T)
        self.positions = torch.zeros(width, dtype=torch.int64, device=device)  # (T,)
        self._load(ids, positions)
        self.graph: torch.cuda.CUDAGraph | None = None
        if stand_in:
            self.logits, self.hidden = (t.clone() for t in fn(self.ids, self.positions))
            return
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: lazy initialisations happen outside the capture
            for _ in range(2):
                fn(self.ids, self.positions)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.logits, self.hidden = fn(self.ids, self.positions)  # (T, V) float32, (T, H): fixed addresses
        self.graph = graph

    def _load(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        if ids.shape != (self.width,) or positions.shape != (self.width,):
            raise ValueError(
                f"a captured pass of width {self.width} needs ids and positions of shape [{self.width}], "
                f"got {list(ids.shape)} and {list(positions.shape)}"
            )
        self.ids.copy_(ids.view(1, self.width), non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor) -> PassOutputs:
        """Run the pass on ``ids`` and ``positions`` (int64 ``[T]``, any device: copied into the fixed
        buffers) and return the fixed outputs: float32 logits ``[T, V]`` and hidden states ``[T, H]``
        on the device. They are overwritten by the next replay of any width of the same runner (a
        shared pool): copy what you keep.

        Raises:
            ValueError: shapes other than ``[T]``.
        """
        self._load(ids, positions)
        if self.graph is not None:
            self.graph.replay()
        else:  # the stand-in: same buffers, eager kernels
            logits, hidden = self.fn(self.ids, self.positions)
            self.logits.copy_(logits)
            self.hidden.copy_(hidden)
        return self.logits, self.hidden
