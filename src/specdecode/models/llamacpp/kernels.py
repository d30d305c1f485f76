"""ggml's CPU reference kernels, switched on per pass, so exact mode can keep flash attention on.

Why. llama.cpp's CPU flash attention (``ggml_compute_forward_flash_attn_ext_f16`` in ggml-cpu's
``ops.cpp``) takes other summation orders by pass shape: a one-token pass over 512 or more KV cells
splits the cells among the threads and adds the partial sums (``use_split_kv_path``), and 8 or more
query rows go through a tiled kernel. So with flash attention on, a verification pass of 2-3 tokens
stops matching one-token passes once 256 tokens are cached (llama.cpp pads the cells it attends
over to 256), and exact mode had to turn flash attention off for the whole context, prefill
included (measured: a 600-token prefill 4.3 s with it off, 3.6 s on, on 2 threads).

ggml's CPU backend has a switch for its reference kernels (``ggml_backend_cpu_set_use_ref``, public
in ``ggml-cpu.h``): flash attention then runs every query row over all KV cells in one pass,
without the split and without tiles, the same code for one row as for three (it also skips operator
fusion and the tiled matrix kernels of 8+ rows). On a build with specdecode's batch-invariance
patch (:mod:`specdecode.models.llamacpp.invariant_patch`, :func:`invariant_rows`) the switch also
makes repacked matrix products multiply every row as a one-row pass does, so passes of any width
are invariant while it is on. The switch is read each time a graph is computed, so it can change
between ``llama_decode`` calls. :class:`ReferenceKernels` turns it on for the passes exact mode
needs invariant: on a patched build every pass, prefills included (``every_pass``: each cell is
then what one-token decoding writes, so a reused prefix is exact, and on the 2-core Zen 3 EPYC the
prefills were faster than on the fast kernels); on an unpatched one the passes of at most
``invariant_tokens`` tokens (every one-token decode and every verification chunk), off for longer
ones (a prompt's prefill, which then gets the fast tiled kernel: plain decoding and speculative
decoding prefill the same way, so their outputs stay equal, but a reused prefix would not be).

How. llama.cpp keeps its backends in the context's scheduler and exposes neither in its C API; the
scheduler comes from the C++ accessor ``llama_context::get_sched() const`` (exported by
``libllama``), the backends from ggml's C API (``ggml_backend_sched_get_backend``), and the switch
through the CPU backend's registry (``ggml_backend_reg_get_proc_address``), as llama.cpp itself
finds ``ggml_backend_cpu_set_threadpool``. Where any of that is missing (another llama.cpp build,
another platform's name mangling), :func:`reference_kernels` returns None and the runner falls back
to flash attention off (the behaviour before). ``tests/test_llamacpp.py`` checks invariance after
600 cached tokens either way.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
from typing import Any

_GET_SCHED = "_ZNK13llama_context9get_schedEv"  # llama_context::get_sched() const (Itanium C++ ABI)
_DEVICE_TYPE_CPU = 0  # GGML_BACKEND_DEVICE_TYPE_CPU

PROMPT_REFERENCE_TOKENS = 3
"""A prompt's first pass runs on the reference kernels only up to this many tokens (the rule before
the batch-invariance patch widened verification passes): a longer one keeps llama.cpp's fast tiled
kernels (a 33-token pass: 459 ms against 569 on the reference kernels, 2-core EPYC)."""


class ReferenceKernels:
    """The reference-kernel switch of one llama.cpp context's CPU backend.

    Args:
        set_use_ref: ``ggml_backend_cpu_set_use_ref`` (ctypes function).
        backend: the context's CPU backend (``ggml_backend_t``, an address).
        invariant_tokens: passes of at most this many tokens run on the reference kernels.
        every_pass: every pass runs on them, prefills included (a build with the batch-invariance
            patch, where a pass of any width gives each row what a one-token pass gives): every
            cell is then what one-token decoding writes, whichever pass wrote it, so a cached
            prefix is reused exactly (:mod:`specdecode.models.prefix_cache`). Measured on the
            2-core AMD EPYC Zen 3 (AVX2): prefills of 512 and 2,048 tokens of the default target
            took 7.4 s and 36.2 s on them against 9.4 s and 41.0 s on the fast kernels
            (lab/notebook/2026-12-07-prefix-cache.md).

    Attributes:
        on: whether the switch is on now (it starts off, llama.cpp's default).
    """

    def __init__(self, set_use_ref: Any, backend: int, invariant_tokens: int, every_pass: bool = False) -> None:
        self._set = set_use_ref
        self._backend = backend
        self.invariant_tokens = invariant_tokens
        self.every_pass = every_pass
        self.on = False

    def before_pass(self, n_tokens: int, prompt: bool = False) -> None:
        """Set the switch for a ``llama_decode`` of ``n_tokens`` tokens: on for at most
        :attr:`invariant_tokens`, off for more (one ctypes call, only when it changes). A ``prompt``
        pass (a prefill: every sequence in it starts at position 0 and scores at most its last row,
        the same pass for plain and speculative decoding, whose rows no later pass has to match;
        :func:`~specdecode.models.llamacpp.model.decode_batch` decides) of more than
        :data:`PROMPT_REFERENCE_TOKENS` tokens runs the fast kernels whatever its size."""
        limit = min(self.invariant_tokens, PROMPT_REFERENCE_TOKENS) if prompt else self.invariant_tokens
        want = self.every_pass or n_tokens <= limit
        if want != self.on:
            self._set(self._backend, want)
            self.on = want


@functools.cache
def invariant_rows() -> int:
    """The version of specdecode's batch-invariance patch in this llama.cpp build's CPU backend, 0
    for none (:mod:`specdecode.models.llamacpp.invariant_patch`): where it is in, a pass of any
    width run on the reference kernels gives every row what a one-token pass gives, so exact mode
    verifies in one pass instead of chunks of :data:`~specdecode.models.llamacpp.model.INVARIANT_TOKENS`.
    Asked once per process of the CPU backend's registry (``ggml_backend_reg_get_proc_address``)."""
    from specdecode.models.llamacpp.invariant_patch import MARKER

    base = _ggml_base()
    cpu = _ggml_lib("ggml-cpu")
    if base is None or cpu is None:
        return 0
    try:
        cpu_reg = cpu.ggml_backend_cpu_reg
        proc = base.ggml_backend_reg_get_proc_address
    except AttributeError:
        return 0
    cpu_reg.argtypes, cpu_reg.restype = [], ctypes.c_void_p
    proc.argtypes, proc.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    reg = cpu_reg()
    address = proc(reg, MARKER.encode()) if reg else None
    if not address:
        return 0
    return int(ctypes.CFUNCTYPE(ctypes.c_int)(address)())


@functools.cache
def _ggml_base() -> Any:
    """``libggml-base`` next to llama-cpp-python's ``libllama`` (None if not found), loaded once."""
    return _ggml_lib("ggml-base")


@functools.cache
def _ggml_lib(name: str) -> Any:
    """ggml's library ``name`` (e.g. ``"ggml-cpu"``) next to llama-cpp-python's ``libllama`` (None if
    not found), loaded once."""
    import llama_cpp
    from llama_cpp._ctypes_extensions import load_shared_library

    try:
        return load_shared_library(name, pathlib.Path(llama_cpp.__file__).parent / "lib")
    except (FileNotFoundError, OSError, RuntimeError):
        return None


def reference_kernels(lib: Any, ctx: Any, invariant_tokens: int) -> ReferenceKernels | None:
    """The reference-kernel switch of ``ctx``'s CPU backend, or None where this llama.cpp build does
    not offer it (see the module docstring); on a build with the batch-invariance patch
    (:func:`invariant_rows`) it is on for every pass (``every_pass``).

    Args:
        lib: llama-cpp-python's ``llama_cpp`` package.
        ctx: a ``llama_context`` pointer from ``llama_init_from_model``.
        invariant_tokens: passes of at most this many tokens run on the reference kernels.
    """
    native = getattr(getattr(lib, "llama_cpp", None), "_lib", None)  # llama_cpp.llama_cpp._lib: libllama
    get_sched = getattr(native, _GET_SCHED, None)
    base = _ggml_base()
    if get_sched is None or base is None:
        return None
    try:
        get_sched.argtypes, get_sched.restype = [ctypes.c_void_p], ctypes.c_void_p
        n_backends = base.ggml_backend_sched_get_n_backends
        n_backends.argtypes, n_backends.restype = [ctypes.c_void_p], ctypes.c_int
        get_backend = base.ggml_backend_sched_get_backend
        get_backend.argtypes, get_backend.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p
        get_device = base.ggml_backend_get_device
        get_device.argtypes, get_device.restype = [ctypes.c_void_p], ctypes.c_void_p
        device_type = base.ggml_backend_dev_type
        device_type.argtypes, device_type.restype = [ctypes.c_void_p], ctypes.c_int
        device_reg = base.ggml_backend_dev_backend_reg
        device_reg.argtypes, device_reg.restype = [ctypes.c_void_p], ctypes.c_void_p
        proc = base.ggml_backend_reg_get_proc_address
        proc.argtypes, proc.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    except AttributeError:  # an older ggml without these
        return None
    sched = get_sched(ctypes.cast(ctx, ctypes.c_void_p))
    if not sched:
        return None
    backends = [get_backend(sched, i) for i in range(n_backends(sched))]
    if len(backends) != 1 or not backends[0] or device_type(get_device(backends[0])) != _DEVICE_TYPE_CPU:
        return None  # a GPU in the scheduler: its kernels are not switched here
    address = proc(device_reg(get_device(backends[0])), b"ggml_backend_cpu_set_use_ref")
    if not address:
        return None
    set_use_ref = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_bool)(address)
    return ReferenceKernels(set_use_ref, backends[0], invariant_tokens, every_pass=invariant_rows() > 0)
