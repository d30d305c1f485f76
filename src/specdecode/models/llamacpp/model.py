"""The ``llamacpp`` backend: GGUF models on llama.cpp's kernels (llama-cpp-python's C API).

A :class:`LlamaCppModel` loads a GGUF file once; each :class:`LlamaCppRunner` made from it is a
llama.cpp context with its own KV cache, and implements the runner contract the engine and the
proposers use (docs/design.md §2b, :class:`~specdecode.models.torch.runner.ModelRunner` is the torch
one): ``forward(new_ids, num_logits)`` -> float32 logits ``[num_logits, V]``, ``truncate(n)``
(``llama_memory_seq_rm``), ``reset``, ``length``, ``vocab_size``, ``max_length``, and token trees
(``forward_masked``, ``compact``), walked depth-first on the one sequence so that every node is
exact (:mod:`specdecode.models.llamacpp.tree`).

Batch invariance ("exact" mode). Speculative decoding verifies k + 1 tokens in one pass; plain
decoding runs one token per pass. Greedy output is the same text only when the pass over k + 1
tokens gives every row the logits a one-token pass would, bit for bit. llama.cpp's CPU kernels do
that for short passes only: measured with llamafile's sgemm not built in (``-DGGML_LLAMAFILE=OFF``,
as ``scripts/setup.sh`` builds it), passes of up to 7 tokens are bit-identical to one-token passes
when the weights are not repacked (``use_extra_bufts = False``), and up to 3 when they are (the
repacked Q4_K kernels take another summation order for passes of 4+ rows; the default, and faster).
So ``exact=True`` splits every verification pass (one that returns the logits of more than one
position) into chunks of at most :attr:`LlamaCppOptions.invariant_tokens` tokens (:data:`INVARIANT_TOKENS`
for the loading chosen; ``tests/test_llamacpp.py`` checks it on the real target), and greedy output
equals plain decoding on this backend by construction. The set-up's build carries specdecode's
batch-invariance patch (:mod:`specdecode.models.llamacpp.invariant_patch`): there every pass run on
ggml's reference kernels is invariant at any width, and an exact model verifies up to
:data:`PATCHED_INVARIANT_TOKENS` tokens in one pass (:func:`options_for_build`). With every layer on a GPU the measured
rule is CUDA's: passes of up to :data:`GPU_INVARIANT_TOKENS` (9) tokens are bit-identical, so
verification of up to 8 drafted tokens is one pass (:func:`options_for_placement`). ``exact=False``
verifies in one pass: the
output then equals plain decoding up to near-ties that rounding flips. Sampling stays exact in
distribution in both modes (verification is ours, over the returned logits).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdecode.models.contract import RunnerCapabilities
from specdecode.models.first_pass import FirstPass
from specdecode.models.llamacpp import huge_pages
from specdecode.models.prefix_cache import common_prefix
from specdecode.sampling import argmax_ids

if TYPE_CHECKING:
    from specdecode.models.llamacpp.kernels import ReferenceKernels
    from specdecode.models.llamacpp.tree import TreeCache

INVARIANT_TOKENS = {False: 7, True: 3}
"""Longest pass measured to give logits bit-identical to one-token passes on llama.cpp's CPU
kernels built without llamafile, by whether the weights are repacked (docs/llamacpp.md,
``lab/scripts/llamacpp_invariance.py``); an exact runner splits longer verification passes."""

PATCHED_INVARIANT_TOKENS = 64
"""Longest verification pass an exact runner makes in one go on a llama.cpp build with specdecode's
batch-invariance patch (:mod:`specdecode.models.llamacpp.invariant_patch`, which the set-up applies):
with ggml's reference kernels on, every row of a pass of any width is then what a one-token pass
computes (``tests/test_llamacpp.py``); wider verification passes are split. Passes of at most this
many tokens run on the reference kernels, so a prompt's prefill of more tokens keeps the fast
tiled kernels."""

GPU_INVARIANT_TOKENS = 9
"""Longest pass measured to give logits bit-identical to one-token passes with every layer on a
GPU: llama.cpp's CUDA kernels (llama-cpp-python 0.3.36 built for sm_90 with flash-attention
kernels off) on an NVIDIA H100, the default target's Q4_K_M layout with random weights, 400
tokens cached, 20 contexts: every row of passes of 1..9 tokens equal to one-token decoding, the
largest logit difference 0.0, with flash attention on llama.cpp's choice and on
(lab/results/issue42-h100/run2/llamacpp.json). Wider passes were not measured; an exact runner
on a GPU splits them. Other cards are assumed to behave alike: not measured."""


def _lib() -> Any:
    """llama-cpp-python's low-level module, imported on first use (it loads the native library).

    Raises:
        ImportError: llama-cpp-python is not installed (the message says how to install it).
    """
    try:
        import llama_cpp
        from llama_cpp._logger import set_verbose
    except ImportError as error:  # pragma: no cover - the set-up installs it
        raise ImportError(
            "the llamacpp backend needs llama-cpp-python: CMAKE_ARGS=-DGGML_LLAMAFILE=OFF "
            "pip install llama-cpp-python==0.3.36 (scripts/setup.sh does it)"
        ) from error
    if not getattr(_lib, "_ready", False):
        set_verbose(False)
        llama_cpp.llama_backend_init()
        _lib._ready = True  # type: ignore[attr-defined]
    return llama_cpp


def default_threads() -> int:
    """The CPU cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


@dataclass(frozen=True)
class LlamaCppOptions:
    """How a GGUF model runs on llama.cpp.

    Attributes:
        threads: CPU threads for every pass (None: the cores this process may use).
        n_ctx: KV-cache size of each runner in tokens (prompt + new tokens + drafts), at most the
            model's training context.
        n_batch: most tokens one ``llama_decode`` call takes (a longer prefill is split).
        exact: batch-invariant verification (see the module docstring): verification passes split
            into chunks of at most ``invariant_tokens``.
        repack: let llama.cpp repack the weights for its fastest CPU kernels (``use_extra_bufts``).
        flash_attn: llama.cpp's flash attention; None: with ``exact``, on, with ggml's CPU
            reference kernels for the passes of at most ``invariant_tokens`` tokens
            (:mod:`specdecode.models.llamacpp.kernels`: its fast CPU kernel sums a one-token pass
            over 512+ cached tokens in per-thread chunks, so passes of different sizes round
            differently), or off where this llama.cpp build has no such switch; llama.cpp's own
            choice without ``exact``, and with every layer on a GPU (:func:`options_for_placement`).
            True with ``exact`` where there is no switch: on, and passes are then invariant only
            while fewer than 256 tokens are cached.
        invariant_tokens: the longest batch-invariant pass; None: :data:`INVARIANT_TOKENS` for
            ``repack`` (CPU kernels), or :data:`GPU_INVARIANT_TOKENS` once a model loads with every
            layer on a GPU (:func:`options_for_placement`).
        gpu_layers: layers offloaded to a GPU where llama.cpp was built with one (-1: all); 0 on a
            CPU-only build.
        huge_pages: on Linux, put the weights llama.cpp loads into host memory in 2 MiB pages
            (:mod:`specdecode.models.llamacpp.huge_pages`: one-token passes 2-5% faster on a 2-core
            CPU, 1.5-1.7 s more at load; the same results). Not where every layer runs on a GPU.

    Raises:
        ValueError: a value out of range (named in the message).
    """

    threads: int | None = None
    n_ctx: int = 8192
    n_batch: int = 512
    exact: bool = True
    repack: bool = True
    flash_attn: bool | None = None
    invariant_tokens: int | None = None
    gpu_layers: int = -1
    huge_pages: bool = True
    invariant_tokens_given: bool | None = field(default=None, repr=False, compare=False)
    """Whether ``invariant_tokens`` was the caller's (else the CPU default, which the patched build
    widens and a GPU replaces); None: from ``invariant_tokens`` (given where not None). An init field
    so that ``dataclasses.replace`` carries it: a copy with ``gpu_layers=0`` (``--device cpu``)
    must not turn the filled-in default into the caller's (it did until 2026-11-28, keeping every
    load through ``specdecode.load`` at chunks of 3 on the patched build)."""

    def __post_init__(self) -> None:
        if self.invariant_tokens_given is None:
            object.__setattr__(self, "invariant_tokens_given", self.invariant_tokens is not None)
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be None or an integer >= 1, got {self.threads!r}")
        for name in ("n_ctx", "n_batch", "invariant_tokens"):
            value = getattr(self, name)
            if value is None and name == "invariant_tokens":
                object.__setattr__(self, name, INVARIANT_TOKENS[bool(self.repack)])
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def n_threads(self) -> int:
        return self.threads or default_threads()


def options_for_placement(options: LlamaCppOptions, all_layers_on_gpu: bool) -> LlamaCppOptions:
    """``options`` for a model whose every layer runs on a GPU (``all_layers_on_gpu``), else
    ``options`` unchanged: in exact mode the CPU rules give way to the GPU's measured ones. An
    ``invariant_tokens`` the caller left out becomes :data:`GPU_INVARIANT_TOKENS`, and flash
    attention left to specdecode (None) is llama.cpp's choice, as measured; the CPU reference
    kernels (:mod:`specdecode.models.llamacpp.kernels`) are not used, since no pass runs on the CPU."""
    if not all_layers_on_gpu or not options.exact or options.invariant_tokens_given:
        return options
    return replace(options, invariant_tokens=GPU_INVARIANT_TOKENS)  # still not the caller's


GREEDY_FIRST_ROWS = 2
"""Rows of a greedy verification pass's first chunk where passes are invariant at any width (the
patched build): the root and the first drafted token, so a draft whose first token is wrong costs a
2-row pass (~50 ms on the 2-core EPYC) instead of its whole pass; a right one costs one more pass's
fixed part (~15 ms) for the rest."""


def greedy_first_chunk(invariant_tokens: int) -> int:
    """Rows of a greedy verification pass's first chunk: :data:`GREEDY_FIRST_ROWS` where passes are
    invariant beyond the unpatched build's 3 tokens, else the invariant chunk itself."""
    return GREEDY_FIRST_ROWS if invariant_tokens > INVARIANT_TOKENS[True] else invariant_tokens


def greedy_chunks(total: int, invariant_tokens: int) -> list[int]:
    """Where a greedy verification pass of ``total`` rows ends its chunks (exclusive ends): the first
    chunk of :func:`greedy_first_chunk` rows, then chunks of ``invariant_tokens``."""
    first = min(greedy_first_chunk(invariant_tokens), total)
    return [first, *range(first + invariant_tokens, total, invariant_tokens), *([total] if first < total else [])]


def options_for_build(options: LlamaCppOptions, on_gpu: bool) -> LlamaCppOptions:
    """``options`` for this process's llama.cpp build: in exact mode on the CPU, with the reference
    kernels in use (``flash_attn`` not False) and ``invariant_tokens`` left to specdecode, a build with
    the batch-invariance patch (:func:`specdecode.models.llamacpp.kernels.invariant_rows`) verifies
    up to :data:`PATCHED_INVARIANT_TOKENS` tokens in one pass; anything else keeps ``options``."""
    if on_gpu or not options.exact or options.invariant_tokens_given or options.flash_attn is False:
        return options
    from specdecode.models.llamacpp.kernels import invariant_rows

    if not invariant_rows():
        return options
    return replace(options, invariant_tokens=PATCHED_INVARIANT_TOKENS)  # still not the caller's


class LlamaCppModel:
    """A GGUF model loaded once on llama.cpp; its runners (contexts, KV caches) share the weights.

    Args:
        path: a ``.gguf`` file.
        options: :class:`LlamaCppOptions`.

    Attributes:
        path: the GGUF file.
        vocab_size: rows of the logits (``llama_vocab_n_tokens``).
        hidden_size: ``n_embd``.
        eos_token_ids: end-of-generation tokens (llama.cpp's EOS and EOT).

    Raises:
        FileNotFoundError: no such file.
        ValueError: llama.cpp cannot load it.
    """

    backend = "llamacpp"
    """The backend it runs on, for records (:func:`specdecode.models.backends.backend_of`)."""

    def __init__(self, path: str | Path, options: LlamaCppOptions | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {self.path}")
        self.options = options or LlamaCppOptions()
        lib = _lib()
        params = lib.llama_model_default_params()
        offload = bool(lib.llama_supports_gpu_offload())
        params.n_gpu_layers = (self.options.gpu_layers if self.options.gpu_layers >= 0 else 999) if offload else 0
        params.use_extra_bufts = bool(self.options.repack)  # repacked: faster; invariant to 3 rows unless patched
        before = huge_pages.anonymous_mappings() if self.options.huge_pages else set()
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}")
        self.huge_page_bytes = 0
        """Bytes this load collapsed into 2 MiB pages (``huge_pages``): its weights in host memory (and
        any older mapping the kernel merged a new buffer into); 0 where nothing was."""
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.hidden_size = int(lib.llama_model_n_embd(self._model))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self._model))
        eos = {int(lib.llama_vocab_eos(self._vocab)), int(lib.llama_vocab_eot(self._vocab))}
        self.eos_token_ids = frozenset(i for i in eos if i >= 0)
        self.weight_bytes = int(lib.llama_model_size(self._model))
        n_layer = int(lib.llama_model_n_layer(self._model))
        self.on_gpu = offload and params.n_gpu_layers >= n_layer + 1  # every layer and the output layer
        """Whether every layer runs on a GPU (a GPU build, ``gpu_layers`` -1 or above the layer count)."""
        if self.options.huge_pages and not self.on_gpu:  # the buffers this load added: its weights
            self.huge_page_bytes = huge_pages.collapse(huge_pages.anonymous_mappings() - before)
        self.options = options_for_build(options_for_placement(self.options, self.on_gpu), self.on_gpu)

    @property
    def capabilities(self) -> RunnerCapabilities:
        """What its runners (:meth:`make_runner`) can do: :attr:`LlamaCppRunner.capabilities`, with
        ``batch_invariant`` and ``greedy_hints`` as :attr:`LlamaCppOptions.exact` says, and where a
        greedy verification pass stops early (:func:`greedy_chunks`) as ``greedy_stop_rows`` and
        ``greedy_stop_then``."""
        exact = bool(self.options.exact)
        chunk = self.options.invariant_tokens if exact else None
        first = greedy_first_chunk(chunk) if chunk is not None else None
        return replace(
            LlamaCppRunner.capabilities, batch_invariant=exact, greedy_hints=exact, greedy_stop_rows=first,
            greedy_stop_then=chunk,
        )  # fmt: skip

    @property
    def dtype(self) -> str:
        """What the weights are, for records: ``"gguf"`` and the file's quantization (e.g.
        ``"gguf-Q4_K_M"`` from the name's last dash-separated part, else ``"gguf"``)."""
        quant = self.path.stem.rsplit("-", 1)[-1].rsplit(".", 1)[-1]
        return f"gguf-{quant}" if quant[:1] in "QFBI" and any(c.isdigit() for c in quant) else "gguf"

    def make_runner(self, n_ctx: int | None = None) -> LlamaCppRunner:
        """A new context on these weights, with its own KV cache (see :class:`LlamaCppRunner`)."""
        return LlamaCppRunner(self, n_ctx)

    def __del__(self) -> None:
        model = getattr(self, "_model", None)
        if model:
            try:
                _lib().llama_model_free(model)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
            self._model = None


def new_context(model: LlamaCppModel, n_ctx: int, n_seq_max: int = 1) -> tuple[Any, ReferenceKernels | None]:
    """A llama.cpp context (its own KV cache) on ``model`` with ``model.options``: ``n_ctx`` cells
    (cut to the training context), ``n_seq_max`` sequences each in its own KV stream
    (``kv_unified`` off: a sequence's cells and attention never depend on another's), flash
    attention as :attr:`LlamaCppOptions.flash_attn` says.

    Returns:
        ``(ctx, kernels)``: the context, and in exact mode with flash attention on its CPU
        backend's reference-kernel switch (:mod:`specdecode.models.llamacpp.kernels`), to be set
        before every pass (:func:`decode_batch` does); else None.

    Raises:
        ValueError: llama.cpp cannot create the context.
    """
    from specdecode.models.llamacpp.kernels import reference_kernels

    options = model.options
    on_gpu = model.on_gpu
    flash = options.flash_attn if options.flash_attn is not None else (True if options.exact and not on_gpu else None)
    ctx = _make_context(model, n_ctx, n_seq_max, flash)
    if not options.exact or flash is not True or on_gpu:
        return ctx, None
    kernels = reference_kernels(_lib(), ctx, options.invariant_tokens)  # type: ignore[arg-type]
    if kernels is None and options.flash_attn is None:  # no switch here: flash attention off, as before
        _lib().llama_free(ctx)
        return _make_context(model, n_ctx, n_seq_max, False), None
    return ctx, kernels


def _make_context(model: LlamaCppModel, n_ctx: int, n_seq_max: int, flash: bool | None) -> Any:
    """``llama_init_from_model`` with the parameters :func:`new_context` describes (``flash`` None:
    llama.cpp's choice)."""
    lib = _lib()
    options = model.options
    params = lib.llama_context_default_params()
    params.n_ctx = min(n_ctx, model.n_ctx_train * n_seq_max)
    params.n_batch = params.n_ubatch = options.n_batch
    params.n_seq_max = n_seq_max
    params.kv_unified = False
    params.n_threads = params.n_threads_batch = options.n_threads
    params.flash_attn_type = {
        None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
        False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    }[flash]
    params.no_perf = True
    ctx = lib.llama_init_from_model(model._model, params)
    if not ctx:
        raise ValueError(f"llama.cpp could not create a context of {params.n_ctx} tokens for {model.path}")
    return ctx


def decode_batch(
    lib: Any,
    ctx: Any,
    batch: Any,
    tokens: list[int],
    positions: list[int],
    seq_ids: list[int],
    scored: list[bool],
    kernels: ReferenceKernels | None = None,
    prompt: bool | None = None,
) -> None:
    """Fill ``batch`` (from ``llama_batch_init``) with one token per entry: id, position, its one
    sequence id and whether to score it; set ``kernels`` (the context's reference-kernel switch,
    from :func:`new_context`) for a pass of that many tokens; then one ``llama_decode`` on ``ctx``.
    ``prompt``: whether it is a prompt's first pass, which keeps the fast kernels past 3 tokens
    (:meth:`ReferenceKernels.before_pass`); None: when every sequence in it starts at position 0 and
    at most one row per sequence is scored (a prefill; a pass scoring more rows, such as a prompt's
    log-probabilities, must match one-token decoding row for row).

    Raises:
        RuntimeError: ``llama_decode`` failed (the status and the token count are named).
    """
    for j, token in enumerate(tokens):
        batch.token[j] = token
        batch.pos[j] = positions[j]
        batch.n_seq_id[j] = 1
        batch.seq_id[j][0] = seq_ids[j]
        batch.logits[j] = scored[j]
    batch.n_tokens = len(tokens)
    if kernels is not None:
        if prompt is None:
            first: dict[int, int] = {}
            for seq, position in zip(seq_ids, positions, strict=False):
                first[seq] = min(position, first.get(seq, position))
            prompt = max(first.values()) == 0 and sum(scored[: len(tokens)]) <= len(first)
        kernels.before_pass(len(tokens), prompt=prompt)
    status = lib.llama_decode(ctx, batch)
    if status != 0:
        raise RuntimeError(f"llama_decode failed with status {status} ({len(tokens)} tokens at {positions[0]}..)")


def reuses_prefixes(exact: bool, kernels: ReferenceKernels | None) -> bool:
    """Whether a context may keep a common prefix's cells for a new sequence (prefix caching): in
    exact mode only where every pass runs on the invariant reference kernels (``kernels.every_pass``,
    a patched CPU build), so that a kept cell is bit for bit the cell a fresh prefill writes;
    outside exact mode always, as llama.cpp's server does (a kept cell then equals a fresh one up
    to rounding: the fast kernels round a prefill's rows by its width)."""
    return not exact or (kernels is not None and kernels.every_pass)


def free_context(owner: Any) -> None:
    """Free ``owner._batch`` and ``owner._ctx`` once (a runner's ``__del__``; quiet at interpreter exit)."""
    lib = getattr(owner, "_lib", None)
    if lib is None:
        return
    try:
        lib.llama_batch_free(owner._batch)
        lib.llama_free(owner._ctx)
    except Exception:  # pragma: no cover - interpreter shutdown
        pass
    owner._lib = None


class LlamaCppRunner:
    """One sequence on a :class:`LlamaCppModel` (batch 1), its KV cache rolled back by truncation.

    The runner contract of :class:`~specdecode.models.torch.runner.ModelRunner`: the cache holds the
    first :attr:`length` tokens; :meth:`forward` appends, :meth:`truncate` drops the newest
    (``llama_memory_seq_rm``), never re-running a prefill.

    Args:
        model: the loaded model.
        n_ctx: KV-cache size (default: the model's options).

    Attributes:
        reference_kernels: the context's reference-kernel switch in exact mode with flash attention
            on (:mod:`specdecode.models.llamacpp.kernels`), else None.

    Raises:
        ValueError: llama.cpp cannot create the context.
    """

    head_ids = None  # the full vocabulary (capabilities.reduced_head is False)

    capabilities = RunnerCapabilities(backend="llamacpp", returns_hidden=True, trees=True, prompt_reuse=True)
    """The runner contract's capabilities (:class:`~specdecode.models.contract.RunnerCapabilities`):
    features (embeddings), trees (walked depth-first) and prompt reuse (:meth:`restart`); no reduced
    head, no torch insides (a
    drafter reads the LM head and embeddings from the GGUF file). An instance's ``batch_invariant``
    and ``greedy_hints`` are its model's ``exact`` option (:attr:`LlamaCppModel.capabilities`)."""

    def __init__(self, model: LlamaCppModel, n_ctx: int | None = None) -> None:
        lib = _lib()
        self.model = model
        options = model.options
        self.capabilities = model.capabilities
        self._ctx, self.reference_kernels = new_context(model, n_ctx or options.n_ctx, n_seq_max=1)
        self.reuses_prefixes = reuses_prefixes(options.exact, self.reference_kernels)
        """:meth:`restart` keeps a common prefix's cells (:func:`reuses_prefixes`)."""
        self._n_ctx = int(lib.llama_n_ctx(self._ctx))
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(options.n_batch, 0, 1)
        self._lib = lib
        # a recurrent state is no cache of rows: clear its data too (as llama-cpp-python does)
        self._clear_data = bool(lib.llama_model_is_recurrent(model._model) or lib.llama_model_is_hybrid(model._model))
        self.length = 0
        self.passes = 0  # llama_decode calls made (a split verification pass counts each chunk)
        self._tree: TreeCache | None = None  # a token tree's nodes after the cached sequence (forward_masked)
        self._embeddings = False  # a tree pass wants hidden states
        self._first: FirstPass | None = None  # the sequence's first pass (by restart) while its cells hold it
        self._ids: list[int] = []  # the tokens of cells 0 .. len - 1 (a prefix of the cached sequence)
        self.cached_tokens = 0  # prompt tokens the last restart did not feed (cells kept)
        self.reused_prompt = False  # the last restart answered from the kept first pass (no pass at all)

    # ------------------------------------------------------------------ the contract
    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_length(self) -> int:
        """Tokens the KV cache holds (the context size this runner was made with)."""
        return self._n_ctx

    @property
    def dtype(self) -> str:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # logits come back in host memory, whatever llama.cpp ran on

    def prepare_widths(self, widths: Iterable[int]) -> None:
        """Nothing to prepare (the runner contract's hook for runners that capture CUDA graphs)."""

    def reset(self) -> None:
        """Forget the whole sequence (its first pass included: :meth:`restart` runs it again).

        The cells are freed, their K and V left as they are (as :meth:`truncate` leaves them, and
        llama-cpp-python's ``reset``): a free cell is masked out of attention, so what it holds never
        reaches a row. Zeroing them cost 2.5 ms a request for the default target's 8,192 cells on the
        2-core EPYC (a 28-token answer takes ~1.1 s). A recurrent or hybrid model's state is cleared."""
        self._lib.llama_memory_clear(self._memory, self._clear_data)
        self.length = 0
        self._tree = None
        self._first = None
        self._ids = []

    def restart(
        self, input_ids: torch.Tensor, num_logits: int = 1, return_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A new sequence's first pass over ``input_ids``, reusing what the cells hold (prefix
        caching, as llama-cpp-python's ``Llama.generate`` and llama-server's ``cache_prompt``):

        - the current sequence began with a restart of these arguments and its cells are still
          there: those cells kept (the rest dropped, ``llama_memory_seq_rm``) and that pass's rows
          returned again, with no pass run (:mod:`specdecode.models.first_pass`);
        - else the cells of the longest common prefix of the cached sequence and ``input_ids`` are
          kept (at most ``T - num_logits``; none with ``return_hidden``, whose features cover every
          prompt token) and only the rest is fed;
        - else :meth:`reset` then :meth:`forward`.

        :attr:`cached_tokens` says how many prompt tokens were not fed. Exact in exact mode: a
        common prefix is kept only where every pass gives each row what a one-token pass gives
        (:attr:`reuses_prefixes`: the patched build's reference kernels), so a kept cell is the
        cell a fresh prefill writes, bit for bit (``tests/test_prefix_cache.py``).

        Args and returns: those of :meth:`forward` (int64 ``[T]``; float32 ``[num_logits, V]``, with
        ``return_hidden`` also ``[T, H]``).

        Raises:
            ValueError, RuntimeError: as :meth:`forward`.
        """
        ids = [int(i) for i in input_ids.reshape(-1).tolist()]
        kept = self._first.answer(ids, num_logits, return_hidden) if self._first is not None else None
        if kept is not None:
            self._tree = None  # a tree's nodes, if any, come after the kept cells: dropped with the rest
            self._cut(len(ids))
            self.length = len(ids)
            self.cached_tokens = len(ids)
            self.reused_prompt = True
            return kept
        n = 0
        if self.reuses_prefixes and not return_hidden and self._tree is None:
            n = min(common_prefix(self._ids, ids), len(ids) - num_logits)
        if n > 0:
            self.truncate(n)
        else:
            self.reset()
        self.cached_tokens, self.reused_prompt = n, False
        out = self.forward(input_ids[n:], num_logits, return_hidden)
        self._first = FirstPass.keep(ids, num_logits, out)
        return out

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens (rollback). After a tree pass
        (:meth:`forward_masked`) the first ``length`` entries must be one chain (as :meth:`compact`).

        Raises:
            ValueError: ``length`` is negative or longer than the cached sequence.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}")
        if self._tree is not None:
            self.compact(torch.arange(length)) if length else self.reset()
            return
        if length < self.length:
            if not self._lib.llama_memory_seq_rm(self._memory, 0, length, -1):  # pragma: no cover
                raise RuntimeError(f"llama.cpp could not truncate the cache to {length} tokens")
            self.length = length
            del self._ids[length:]
            if self._first is not None and length < self._first.length:
                self._first = None  # its cells are gone

    def forward(
        self,
        input_ids: torch.Tensor,
        num_logits: int = 1,
        return_hidden: bool = False,
        greedy_draft: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append ``input_ids`` to the sequence and return the logits of its last positions.

        Args:
            input_ids: int64 ``[T]``, T >= 1, the tokens after the :attr:`length` cached ones.
            num_logits: how many of the last positions to score (1 <= num_logits <= T).
            return_hidden: also return the final hidden states of all T tokens (llama.cpp's
                embeddings of a generative model: the output norm's result, what its LM head reads;
                ``llama_set_embeddings`` is on for this pass only, and llama.cpp then scores every
                token, so a prefill with features costs the LM head on every prompt token).
            greedy_draft: for a greedy verification pass (``num_logits == T``), the drafted tokens
                ``input_ids[1:]`` (int64 ``[T - 1]``): an exact runner, which splits the pass into
                batch-invariant chunks anyway, stops after the first chunk whose rows' argmax
                disagrees with them; the rows after that would be discarded by the verifier.

        Returns:
            float32 ``[num_logits, V]``; row i scores the token after ``input_ids[T - num_logits + i]``.
            With ``return_hidden``: ``(logits, hidden)``, hidden float32 ``[T, H]`` (as many rows
            as logits when ``greedy_draft`` stopped early: the tokens computed).
            With ``greedy_draft`` and a mismatch, only the rows of the chunks computed ``[m, V]``,
            ``m < num_logits``; the cache then holds only those tokens (``length`` says so).

        Raises:
            ValueError: ``num_logits`` out of range, or the sequence would not fit in the context.
            RuntimeError: ``llama_decode`` failed.
        """
        if self._tree is not None:
            raise RuntimeError("forward after forward_masked: keep a path first (compact or truncate)")
        ids = [int(i) for i in input_ids.reshape(-1).tolist()]
        T = len(ids)
        if not 1 <= num_logits <= T:
            raise ValueError(f"num_logits must be in [1, {T}], got {num_logits}")
        if self.length + T > self._n_ctx:
            raise ValueError(f"sequence of {self.length + T} tokens exceeds the context of {self._n_ctx} tokens")
        options = self.model.options
        chunk = options.n_batch
        if options.exact and num_logits > 1:  # a verification pass: batch-invariant chunks
            chunk = min(chunk, options.invariant_tokens)
        rows: list[torch.Tensor] = []
        hidden: list[torch.Tensor] = []
        first_scored = T - num_logits
        check = greedy_draft is not None and num_logits == T and options.exact
        ends = greedy_chunks(T, chunk) if check else list(range(chunk, T, chunk)) + [T]
        if return_hidden:
            self._lib.llama_set_embeddings(self._ctx, True)
        try:
            start = 0
            for end in ends:
                part = ids[start:end]
                scored = [start + i >= first_scored for i in range(len(part))]
                out = self._decode(part, scored, hidden if return_hidden else None)
                if out is not None:
                    rows.append(out)
                if check and out is not None and end < T:
                    expected = greedy_draft[start:end]  # type: ignore[index]  # these rows' tokens
                    if not torch.equal(argmax_ids(out), expected):
                        break  # the verifier rejects within this chunk: later rows would be thrown away
                start = end
        finally:
            if return_hidden:
                self._lib.llama_set_embeddings(self._ctx, False)
        logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        return (logits, torch.cat(hidden)) if return_hidden else logits

    def _decode(
        self, ids: list[int], scored: list[bool], hidden: list[torch.Tensor] | None = None, start: int | None = None
    ) -> torch.Tensor | None:
        """One ``llama_decode`` of ``ids`` at the next positions (at ``start ..`` when given: a tree
        pass, which keeps :attr:`length` itself); float32 logits ``[sum(scored), V]`` of the scored
        tokens (None if none). With ``hidden`` (embeddings on: llama.cpp outputs every token), the
        scored rows are picked from all n, and the n hidden states ``[n, H]`` are appended."""
        lib = self._lib
        n = len(ids)
        first = self.length if start is None else start
        outputs_asked = [True] * n if hidden is not None else scored  # embeddings on: llama.cpp outputs every token
        positions = list(range(first, first + n))
        prompt = first == 0 and sum(scored) <= 1  # a prefill (logits of its last row at most), embeddings or not
        kernels = self.reference_kernels
        decode_batch(lib, self._ctx, self._batch, ids, positions, [0] * n, outputs_asked, kernels, prompt)
        if start is None:
            if len(self._ids) == first:  # a chain's tokens: known (a tree's nodes are not)
                self._ids.extend(ids)
            self.length += n
        self.passes += 1
        if hidden is not None:
            H = self.model.hidden_size
            pointer = lib.llama_get_embeddings(self._ctx)  # (n, H): every token, in batch order
            array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n, H))
            hidden.append(torch.from_numpy(array.copy()))
        m = sum(scored)
        if m == 0:
            return None
        V = self.vocab_size
        pointer = lib.llama_get_logits(self._ctx)  # the output rows, contiguous, in batch order
        if hidden is None:  # llama.cpp output the scored rows only: one copy straight into a tensor
            logits = torch.empty((m, V), dtype=torch.float32)
            ctypes.memmove(logits.data_ptr(), pointer, m * V * 4)
            return logits  # (m, V) float32: a copy, the next decode overwrites the buffer
        array = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n, V))
        picked = array[[i for i in range(n) if scored[i]]]  # embeddings on: llama.cpp scored every token
        return torch.from_numpy(picked)  # (m, V) float32: a copy (fancy indexing copies)

    # ------------------------------------------------------------------ token trees
    def forward_masked(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attend: torch.Tensor,
        num_logits: int | None = None,
        return_hidden: bool = False,
        greedy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append a token tree's nodes and score them, as
        :meth:`specdecode.models.torch.runner.ModelRunner.forward_masked` (the same arguments and
        results), walked depth-first on the one sequence (:mod:`specdecode.models.llamacpp.tree`):
        each node's logits are bit-identical to decoding its branch token by token in exact mode.

        Args:
            input_ids: int64 ``[M]``, M >= 1, nodes in topological order (parents first).
            position_ids: int64 ``[M]``: the cached length plus the node's depth below it.
            attend: bool ``[M, length + M]``: node i attends to every cached token, to the tree
                nodes on its root path and to itself, nothing else (a tree, not an arbitrary mask).
            num_logits: score the last this many nodes (default all M).
            return_hidden: also return the final hidden states of the M nodes ``[M, H]``.
            greedy: a hint of the runner contract for greedy verification (one tree over the
                cache, its root first): decode only the nodes the greedy walk reaches; the other
                rows (logits and hidden states) are NaN.

        Returns:
            float32 ``[num_logits, V]``; with ``return_hidden`` ``(logits, hidden [M, H])``.

        Raises:
            ValueError: bad shapes, a mask that is not a tree over the whole cached sequence,
                positions other than the depths, or a tree that does not fit in the context.
            RuntimeError: ``llama_decode`` failed.
        """
        from specdecode.models.llamacpp.tree import TreeCache

        M = int(input_ids.shape[0]) if input_ids.dim() == 1 else -1
        num_logits = M if num_logits is None else num_logits
        L = self.length + M
        if M < 1 or position_ids.shape != (M,) or attend.shape != (M, L) or not 1 <= num_logits <= M:
            raise ValueError(
                f"forward_masked: need input_ids [M], position_ids [M], bool attend [M, {self.length} + M] and "
                f"1 <= num_logits <= M; got {list(input_ids.shape)}, {list(position_ids.shape)}, "
                f"{list(attend.shape)}, {num_logits}"
            )
        if attend.dtype != torch.bool:
            raise ValueError(f"forward_masked: attend must be bool, got {attend.dtype}")
        positions = [int(p) for p in position_ids.tolist()]
        if max(positions) >= self._n_ctx:
            raise ValueError(f"tree reaches position {max(positions)}; the context holds {self._n_ctx} tokens")
        options = self.model.options
        if self._tree is None:
            chunk = min(options.n_batch, options.invariant_tokens) if options.exact else options.n_batch
            self._tree = TreeCache(self.length, chunk, self._tree_decode, self._cut)
        tree = self._tree
        try:
            entries = tree.add([int(i) for i in input_ids.tolist()], positions, attend)
        except ValueError:
            if tree.length == tree.trunk:
                self._tree = None  # no tree yet: the runner is as before
            raise
        self.length = tree.length
        tree.hidden = {}
        self._embeddings = return_hidden
        if return_hidden:
            self._lib.llama_set_embeddings(self._ctx, True)
        try:
            single_root = all(tree.parent(e) >= entries[0] for e in entries[1:])
            if greedy and single_root and num_logits == M:
                rows = tree.score_greedy(entries)
            else:
                rows = tree.score_all(entries)
        finally:
            if return_hidden:
                self._lib.llama_set_embeddings(self._ctx, False)
            self._embeddings = False
        V, H = self.vocab_size, self.model.hidden_size
        nan = torch.full((V,), float("nan"))
        logits = torch.stack([rows.get(e, nan) for e in entries[M - num_logits :]])  # (num_logits, V)
        if not return_hidden:
            return logits
        blank = torch.full((H,), float("nan"))
        hidden = torch.stack([tree.hidden.get(e, blank) for e in entries])  # (M, H)
        tree.hidden = {}
        return logits, hidden

    def _tree_decode(
        self, ids: list[int], start: int, scored: list[bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One pass of a tree walk (:class:`~specdecode.models.llamacpp.tree.TreeCache`): ``ids`` at
        positions ``start ..``; logits of the scored ones, and all n hidden states ``[n, H]`` while
        embeddings are on (a pass with ``return_hidden``)."""
        hidden: list[torch.Tensor] | None = [] if self._embeddings else None
        out = self._decode(ids, scored, hidden, start=start)
        return out, (hidden[0] if hidden else None)

    def _cut(self, n: int) -> None:
        """Drop the cells from position ``n`` on."""
        if not self._lib.llama_memory_seq_rm(self._memory, 0, n, -1):  # pragma: no cover
            raise RuntimeError(f"llama.cpp could not truncate the cache to {n} tokens")
        del self._ids[n:]

    def compact(self, keep: torch.Tensor) -> None:
        """Keep the entries ``keep`` (ascending) and nothing after the first of them, as
        :meth:`specdecode.models.torch.runner.ModelRunner.compact`: after a tree pass, ``keep`` must be one
        root path of the tree (the accepted one); the cache then holds it in consecutive cells, as
        plain decoding would (rolled back to where it leaves the path the walk ended on, the rest
        decoded again without logits). Without a tree, ``keep`` must be consecutive entries.

        Raises:
            ValueError: ``keep`` empty, not increasing, out of range, or not one path / run.
        """
        keep_list = [int(k) for k in torch.as_tensor(keep, dtype=torch.int64).reshape(-1).tolist()]
        if self._tree is None:
            n = len(keep_list)
            if n == 0 or keep_list[0] < 0 or keep_list[-1] >= self.length or keep_list[-1] - keep_list[0] + 1 != n:
                raise ValueError(
                    f"compact on llama.cpp without a tree: keep must be consecutive entries in [0, {self.length}), "
                    f"got {keep_list}"
                )
            self.truncate(keep_list[-1] + 1)
            return
        self.length = self._tree.settle(keep_list)
        self._tree = None
        if self._first is not None and self.length < self._first.length:  # a path that ends inside the cached sequence
            self._first = None

    def __del__(self) -> None:
        free_context(self)
