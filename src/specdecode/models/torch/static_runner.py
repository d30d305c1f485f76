"""The torch runner over a static KV cache, replaying CUDA graphs captured per pass width.

:class:`StaticCacheRunner` is a :class:`~specdecode.models.torch.runner.ModelRunner` (same contract,
same results) whose KV cache is preallocated (:class:`~specdecode.models.torch.static_cache.StaticKVCache`)
and whose chain passes (:meth:`~StaticCacheRunner.forward`) of up to ``max_graph_width`` tokens after
the first (a prompt's prefill, whose length varies from prompt to prompt, runs eagerly) are
captured once per width as CUDA graphs and replayed (:class:`~specdecode.models.torch.graphs.CapturedPass`):
1 for plain decoding, ``k + 1`` for verification, the draft's catch-up widths. Longer passes (a
prefill), token trees (:meth:`~ModelRunner.forward_masked`) and CPU devices run eagerly over the same
cache. Rollback is a length change. A capture that fails falls back to eager passes for good, with
one line on stderr.

Exact mode (``StaticCacheSettings.exact_width``, ``exact=True`` on a GPU): every chain pass after the
first has one width, the tokens padded, so a one-token pass and a verification pass replay the same
graph and every row is bit-identical to a one-token pass (cuBLAS picks its kernels by the row count,
so passes of different widths round differently in bfloat16).

Which models use it: :func:`use_static_cache` marks a model; :func:`torch_runner` (called by
:func:`specdecode.models.backends.make_runner` and the draft-model proposer) then builds this runner
for it instead of the eager one. Docs: docs/design.md §2c.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from specdecode.models.torch.compat import cache_keyword
from specdecode.models.torch.exact import MASKED_ATTENTIONS
from specdecode.models.torch.graphs import CapturedPass, PassOutputs
from specdecode.models.torch.runner import ModelRunner, check_decoder_logits
from specdecode.models.torch.static_cache import StaticKVCache

CAPACITY_BLOCK = 1024  # the cache grows to a multiple of this many positions
DEFAULT_MAX_GRAPH_WIDTH = 64  # widest pass captured (verification of up to 63 drafted tokens)


@dataclass(frozen=True)
class StaticCacheSettings:
    """How :func:`torch_runner` builds runners of a marked model.

    Attributes:
        cuda_graphs: capture and replay passes as CUDA graphs (on a CUDA device; elsewhere eager).
        max_graph_width: the widest pass captured (>= 1); wider ones run eagerly.
        capacity: initial cache positions (a multiple of 1024 is kept; the cache grows as needed,
            dropping the captured graphs, which read the old buffers).
        stand_in: capture nothing; replay eagerly through the fixed buffers
            (:class:`~specdecode.models.torch.graphs.CapturedPass`): CPU tests of the buffer logic.
        compile: compile the captured pass with ``torch.compile`` first (one compilation per width;
            inductor fuses the model's small kernels, as gpt-fast does), then capture the compiled
            kernels. Not on by default: unmeasured on a GPU so far (minutes of compilation per
            process), see docs/design.md §2c.
        compile_backend: ``torch.compile``'s backend (``"inductor"``; ``"eager"`` traces without
            generating code: CPU tests of the traced pass).
        compile_mode: ``torch.compile``'s mode for inductor: None (its default: fused kernels,
            seconds per width) or ``"max-autotune-no-cudagraphs"`` (also tries matrix-product
            kernels: minutes per width). Never a mode with inductor's own CUDA graphs: the runner
            captures its own.
        exact_width: exact mode (None: off): every chain pass after a sequence's first runs as
            passes of exactly this many rows over the whole cache, the tokens first and padding
            after (a longer pass is split), so one-token passes and verification passes run the same
            kernels on the same shapes and every row is bit-identical to a one-token pass
            (:meth:`StaticCacheRunner.forward`). Token trees are refused (their nodes' keys sit
            among their siblings' in the cache, another summation order than decoding the branch).
    """

    cuda_graphs: bool = True
    max_graph_width: int = DEFAULT_MAX_GRAPH_WIDTH
    capacity: int = CAPACITY_BLOCK
    stand_in: bool = False
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    exact_width: int | None = None


DEFAULT_EXACT_WIDTH = 9
"""The pass width of exact mode on a GPU: the widest verification of every proposer's default k
(prompt lookup's 8 drafts) in one pass; a one-token pass then costs a 9-token one."""


_MARKED: weakref.WeakKeyDictionary[PreTrainedModel, StaticCacheSettings] = weakref.WeakKeyDictionary()


def use_static_cache(model: PreTrainedModel, settings: StaticCacheSettings | None = None) -> PreTrainedModel:
    """Mark ``model`` so that its runners (:func:`torch_runner`) keep a static KV cache and, on a CUDA
    device, replay CUDA graphs; returns ``model``. ``settings=None``: :class:`StaticCacheSettings()`.

    Raises:
        ValueError: ``max_graph_width`` < 1 or ``capacity`` < 1, or ``exact_width`` outside
            ``[1, max_graph_width]``.
    """
    settings = settings or StaticCacheSettings()
    if settings.max_graph_width < 1 or settings.capacity < 1:
        raise ValueError(
            f"max_graph_width and capacity must be >= 1, got {settings.max_graph_width} and {settings.capacity}"
        )
    if settings.exact_width is not None and not 1 <= settings.exact_width <= settings.max_graph_width:
        raise ValueError(f"exact_width must be in [1, {settings.max_graph_width}], got {settings.exact_width}")
    _MARKED[model] = settings
    return model


def forget_static_cache(model: PreTrainedModel) -> None:
    """Undo :func:`use_static_cache`: runners made of ``model`` from now on are eager (those made
    already keep what they are)."""
    _MARKED.pop(model, None)


def static_cache_settings(model: object) -> StaticCacheSettings | None:
    """The settings :func:`use_static_cache` gave ``model``, or None (an eager runner)."""
    try:
        return _MARKED.get(model)  # type: ignore[arg-type]
    except TypeError:  # not weak-referenceable: never marked
        return None


def torch_runner(
    model: PreTrainedModel, head_ids: torch.Tensor | None = None, head_module: torch.nn.Module | None = None
) -> ModelRunner:
    """The runner of a ``transformers`` model: a :class:`StaticCacheRunner` if :func:`use_static_cache`
    marked it, else the eager :class:`~specdecode.models.torch.runner.ModelRunner`. Arguments and
    errors: :class:`~specdecode.models.torch.runner.ModelRunner`."""
    settings = static_cache_settings(model)
    if settings is None:
        return ModelRunner(model, head_ids=head_ids, head_module=head_module)
    return StaticCacheRunner(model, head_ids=head_ids, head_module=head_module, settings=settings)


class StaticCacheRunner(ModelRunner):
    """A :class:`~specdecode.models.torch.runner.ModelRunner` over a static KV cache, replaying CUDA
    graphs per pass width (module docstring). Same arguments, contract, shapes and errors, plus:

    Args:
        settings: :class:`StaticCacheSettings` (None: the defaults).

    Raises:
        ValueError: also an attention implementation other than sdpa / eager (the cache is read
            through a ready-made 4D mask), as the batched runner.
    """

    capabilities = replace(ModelRunner.capabilities, prompt_reuse=False)
    """:class:`~specdecode.models.torch.runner.ModelRunner`'s without prompt reuse (not built for the
    static cache: every prefill runs)."""

    def __init__(
        self,
        model: PreTrainedModel,
        head_ids: torch.Tensor | None = None,
        head_module: torch.nn.Module | None = None,
        settings: StaticCacheSettings | None = None,
    ) -> None:
        super().__init__(model, head_ids=head_ids, head_module=head_module)
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention not in MASKED_ATTENTIONS:
            raise ValueError(f"a static KV cache needs sdpa or eager attention, the model uses {attention!r}")
        self.settings = settings or StaticCacheSettings()
        if self.settings.exact_width is not None:  # fixed-width passes: chains exact, no trees
            self.capabilities = replace(type(self).capabilities, batch_invariant=True, trees=False)
        self.cache = StaticKVCache(rounded_capacity(self.settings.capacity))  # type: ignore[assignment]
        check_decoder_logits(self.model, "a static KV cache")  # the pass is decoder + head
        self.graphs: dict[int, CapturedPass] = {}
        self._cache_keyword = cache_keyword(self.model.get_decoder())  # looked up here, not in a traced pass
        self._captured_fn = self._pass if not self.settings.compile else self._compiled_pass()
        self.graphs_failed: str | None = None  # why capturing was given up, if it was
        self._pool: object | None = None

    @property
    def uses_graphs(self) -> bool:
        """Whether chain passes of up to ``max_graph_width`` tokens are replayed (a CUDA device, or the
        stand-in) and no capture has failed."""
        wanted = self.settings.stand_in or (self.settings.cuda_graphs and self.device.type == "cuda")
        return wanted and self.graphs_failed is None

    def reset(self) -> None:
        """Forget the whole sequence (the buffers and graphs stay)."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens: a length change (the stale entries are masked
        until overwritten).

        Raises:
            ValueError: ``length`` is negative or longer than the cached sequence.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        self.length = length

    def _reserve(self, needed: int) -> None:
        """Grow the cache to hold ``needed`` positions; drop the graphs if its buffers moved."""
        if needed > self.max_length:
            raise ValueError(f"the sequence would be {needed} tokens, longer than the model's {self.max_length}")
        if self.cache.grow(rounded_capacity(needed)):  # type: ignore[attr-defined]
            self.graphs.clear()

    def _pass(
        self, ids: torch.Tensor, positions: torch.Tensor, kv_length: int | None = None, num_logits: int | None = None
    ) -> PassOutputs:
        """One causal chain pass: ``ids`` int64 ``[1, T]`` at cache slots ``positions`` int64 ``[T]``
        (both on the device); query i sees slots ``j <= positions[i]`` among the first ``kv_length``
        (default: the whole capacity, as a captured pass must). Returns float32 logits of the last
        ``num_logits`` rows (default all T: ``[T, V]``, ``[T, N]`` with ``head_ids``) and hidden states
        ``[T, H]``, on the device."""
        cache: StaticKVCache = self.cache  # type: ignore[assignment]
        kv_length = cache.capacity if kv_length is None else kv_length
        dtype = self.model.dtype
        slots = torch.arange(kv_length, device=ids.device)  # (L,)
        allowed = slots[None, :] <= positions[:, None]  # (T, L)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        cache.prepare(positions, kv_length)
        decoder = self.model.get_decoder()
        hidden = decoder(
            input_ids=ids,
            position_ids=positions.view(1, -1),
            attention_mask={"full_attention": mask.view(1, 1, *allowed.shape)},
            **{self._cache_keyword: cache},
            use_cache=True,
        ).last_hidden_state  # (1, T, H)
        rows = hidden if num_logits is None else hidden[:, -num_logits:]
        return self._head(rows)[0], hidden[0]

    def _compiled_pass(self) -> Callable[[torch.Tensor, torch.Tensor], PassOutputs]:
        """:meth:`_pass` through ``torch.compile`` (``settings.compile_backend``; inductor without its
        own CUDA graphs, which :class:`CapturedPass` makes), shapes static: one compilation per width."""
        backend = self.settings.compile_backend
        mode = self.settings.compile_mode
        if mode is not None and mode not in ("default", "max-autotune-no-cudagraphs"):
            raise ValueError(f"compile_mode must be None, 'default' or 'max-autotune-no-cudagraphs', got {mode!r}")
        options = {"mode": mode} if backend == "inductor" and mode is not None else {}
        return torch.compile(self._pass, backend=backend, dynamic=False, fullgraph=False, **options)  # type: ignore[return-value]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        num_logits: int = 1,
        return_hidden: bool = False,
        greedy_draft: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`ModelRunner.forward <specdecode.models.torch.runner.ModelRunner.forward>`: append
        ``input_ids`` (int64 ``[T]``, any device) and return float32 logits ``[num_logits, V]`` (and
        hidden states ``[T, H]`` with ``return_hidden``) on :attr:`device`, fresh tensors (not the
        graph's buffers). Passes of up to ``max_graph_width`` tokens replay a captured graph.

        Raises:
            ValueError: ``num_logits`` out of range, or a sequence longer than the model takes.
        """
        T = int(input_ids.shape[0])
        if not 1 <= num_logits <= T:
            raise ValueError(f"num_logits must be in [1, {T}], got {num_logits}")
        start = self.length
        if self.settings.exact_width is not None and start > 0:
            logits, hidden = self._fixed_width(input_ids.view(T), self.settings.exact_width)
            logits = logits[-num_logits:]  # (num_logits, V)
            return (logits, hidden) if return_hidden else logits
        self._reserve(start + T)
        positions = torch.arange(start, start + T)  # (T,) on the CPU: copied into the graph's buffer
        if self.uses_graphs and T <= self.settings.max_graph_width and start > 0:  # not a prompt's prefill
            outputs = self._replay(input_ids.view(T), positions)
        else:
            outputs = None
        if outputs is None:
            ids = input_ids.view(1, T).to(self.device)
            logits, hidden = self._pass(ids, positions.to(self.device), start + T, num_logits)
        else:
            logits, hidden = outputs
        self.length = start + T
        logits = logits[-num_logits:].clone()  # (num_logits, V): the graph's buffer is reused
        return (logits, hidden.clone()) if return_hidden else logits

    def _fixed_width(self, ids: torch.Tensor, width: int) -> PassOutputs:
        """Exact mode: append ``ids`` (int64 ``[T]``) in passes of exactly ``width`` rows at the next
        cache slots, over the whole cache (captured once, or eagerly with the same shapes), padded
        with token 0 after the last chunk's tokens: the padding's keys and values land past
        :attr:`length`, masked for every real row and overwritten later. Returns fresh float32 logits
        ``[T, V]`` and hidden states ``[T, H]`` of the T tokens."""
        logits, hidden = [], []
        for first in range(0, int(ids.shape[0]), width):
            part = ids[first : first + width]
            n, start = int(part.shape[0]), self.length
            self._reserve(start + width)
            padded = torch.zeros(width, dtype=torch.int64, device=part.device)  # (W,)
            padded[:n] = part
            positions = torch.arange(start, start + width)  # (W,) cache slots and rotary positions
            outputs = self._replay(padded, positions) if self.uses_graphs else None
            if outputs is None:  # the captured pass's shapes, eagerly: the whole cache, every row scored
                outputs = self._pass(padded.view(1, width).to(self.device), positions.to(self.device))
            logits.append(outputs[0][:n].clone())  # (n, V): the graph's buffers are reused
            hidden.append(outputs[1][:n].clone())  # (n, H)
            self.length = start + n
        return torch.cat(logits), torch.cat(hidden)

    @torch.inference_mode()
    def prepare_widths(self, widths: Iterable[int]) -> None:
        """Capture the passes of these widths now (those not captured yet, up to ``max_graph_width``;
        nothing where graphs are not used): their warm-up writes placeholder keys and values past
        :attr:`length`, which the next real pass overwrites and the mask hides until then."""
        if not self.uses_graphs:
            return
        if self.settings.exact_width is not None:  # every pass after the first has this width
            widths = [self.settings.exact_width]
        for T in sorted({int(w) for w in widths}):
            if not 1 <= T <= self.settings.max_graph_width or T in self.graphs:
                continue
            self._reserve(self.length + T)
            ids = torch.zeros(T, dtype=torch.int64)
            if self._replay(ids, torch.arange(self.length, self.length + T)) is None:
                return  # capturing failed: eager from now on (said once on stderr)

    def _replay(self, ids: torch.Tensor, positions: torch.Tensor) -> PassOutputs | None:
        """The captured pass of width ``len(ids)``, captured now if new; None if capturing failed
        (then every later pass runs eagerly; one line on stderr says why)."""
        T = int(ids.shape[0])
        captured = self.graphs.get(T)
        if captured is None:
            try:
                if self._pool is None and not self.settings.stand_in:
                    self._pool = torch.cuda.graph_pool_handle()
                captured = CapturedPass(
                    self._captured_fn, T, self.device, ids, positions, pool=self._pool, stand_in=self.settings.stand_in
                )
            except Exception as error:  # noqa: BLE001 - any capture failure: eager passes stay correct
                self.graphs_failed = f"{type(error).__name__}: {error}"
                self.graphs.clear()
                print(
                    f"specdecode: CUDA graph capture failed for {type(self.model).__name__} "
                    f"({self.graphs_failed}); running eager passes",
                    file=sys.stderr,
                )
                return None
            self.graphs[T] = captured
        return captured.replay(ids, positions)

    def forward_masked(self, *args: object, **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """:meth:`ModelRunner.forward_masked <specdecode.models.torch.runner.ModelRunner.forward_masked>`.

        Raises:
            ValueError: also in exact mode (``exact_width``), which runs no token trees.
        """
        if self.settings.exact_width is not None:
            raise ValueError(
                "token trees are not exact on a fixed-width runner (exact mode on a GPU): use a chain, or exact=False"
            )
        return super().forward_masked(*args, **kwargs)  # type: ignore[arg-type]

    def _masked_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: torch.Tensor, cache: object
    ) -> dict:
        """Model keyword arguments of a tree pass; over the static cache, its ``M`` nodes are written
        at slots ``length .. length + M - 1`` (their rotary positions are ``position_ids``)."""
        if cache is self.cache:
            M = int(input_ids.shape[0])
            self._reserve(self.length + M)
            slots = torch.arange(self.length, self.length + M, device=self.device)  # (M,)
            self.cache.prepare(slots, self.length + M)  # type: ignore[attr-defined]
        return super()._masked_inputs(input_ids, position_ids, attend, cache)  # type: ignore[arg-type]


def rounded_capacity(positions: int) -> int:
    """A static cache's capacity for ``positions``: ``positions`` rounded up to a multiple of :data:`CAPACITY_BLOCK`."""
    return max(1, -(-positions // CAPACITY_BLOCK)) * CAPACITY_BLOCK
