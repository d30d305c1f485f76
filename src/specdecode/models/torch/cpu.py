"""CPU compute paths: which dtype multiplies fast here, and oneDNN for few-row float32 linears.

Speculative decoding assumes that a pass over ``k + 1`` tokens costs about as much as a pass over
one (decoding is memory-bound). On a CPU that holds only on some paths:

- **bfloat16 without native support** (x86 CPUs with AVX2 but neither AVX512-BF16 / AMX nor
  AVX-NE-CONVERT: most laptops, AMD Zen 2/3, Intel client chips): torch 2.13 has no blocked bf16
  GEMM there (oneDNN refuses bf16, ``mkldnn_linear: bf16 path needs ...``) and multiplies row by
  row, so a pass over M tokens costs about M one-token passes. Measured on the project's 2-core
  AMD EPYC (Zen 3, ``lab/scripts/bench_cpu_paths.py``, lab/notebook/2026-11-23-cpu-avx2-float32.md):
  the default target's pass over 1 / 5 / 9 / 17 tokens takes 226 / 848 / 1,482 / 2,795 ms, and a
  300-token prefill 41 s.
  No proposer can win there: verifying 4 drafts costs 3.75 plain steps.
- **float32 through MKL** (torch's default CPU GEMM): blocked, but slow for few rows on AMD
  (430 / 1,263 / 1,487 / 1,892 ms; prefill 10.4 s).
- **float32 through oneDNN** (:func:`use_onednn_linears`): 365 / 610 / 687 / 861 ms (prefill
  8.3 s). A plain step costs 1.3-1.6x the bf16 one, but 17 tokens cost 2.4 plain steps instead
  of 12, so verification is cheap enough for speculation (and token trees) to pay, and float32 is
  also the exact dtype.
- **float32 through oneDNN with prepacked weights** (the default of :func:`use_onednn_linears`
  since session 15): a pass over 2-64 tokens multiplies by a copy of each weight reordered once
  into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch's
  compiler does for frozen CPU linears) instead of reordering the plain weight on every call;
  one-token passes keep the plain weight (the packed one was not faster there). Measured on the
  same machine (``lab/scripts/bench_cpu_paths.py --paths float32+onednn,float32+packed``): see
  lab/notebook/2026-11-25-prepacked-onednn.md. The copy costs the layers' memory a second
  time (about 6 GB for the float32 1.5B target), made on the first multi-token pass.

:func:`auto_dtype` picks bfloat16 where it is native (or on a GPU) and float32 otherwise;
:func:`specdecode.models.torch.hf_loading.load_model` then routes the float32 model's large linears through
oneDNN. ``lab/scripts/bench_cpu_paths.py`` measures all three paths on a machine.
"""

from __future__ import annotations

import copy
import weakref

import torch
import torch.nn.functional as F

ONEDNN_MAX_ROWS = 64  # above this many rows MKL was as fast or faster (prefill); oneDNN below
ONEDNN_MIN_WEIGHTS = 1 << 20  # smaller layers (k/v projections of small models): MKL was faster
ONEDNN_PACK_ROWS = 8  # the row count prepacked weights are laid out for (2-17 rows timed alike with 8 and 32)
ONEDNN_PACK_RESERVE = 2 << 30  # the least bytes left available after a model's prepacked copies (pack_reserve)


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively through oneDNN (AVX512-BF16/AMX or
    AVX-NE-CONVERT); False on AVX2-only CPUs, where torch multiplies bf16 row by row."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(torch.backends.mkldnn.is_available() and check is not None and check())
    except RuntimeError:  # the op is missing from this build
        return False


def auto_dtype(device: str | torch.device = "cpu") -> str:
    """The compute dtype ``"auto"`` stands for: ``"bfloat16"`` on a GPU or a CPU with native bf16
    matrix multiplication (:func:`native_bf16_matmul`), else ``"float32"`` (see the module docstring)."""
    if torch.device(device).type != "cpu" or native_bf16_matmul():
        return "bfloat16"
    return "float32"


class _PackBudget:
    """Whether one model's routed layers may hold prepacked copies: decided once for all of them
    (all or none), on the first multi-row call, from the memory available then. Copies of a model
    (``copy.deepcopy``) get one fresh, undecided budget of their own."""

    __slots__ = ("allowed", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes  # bytes of all the model's routed weights: what the copies would take
        self.allowed: bool | None = None

    def __deepcopy__(self, memo: dict) -> _PackBudget:
        return _PackBudget(self.nbytes)

    def decide(self) -> bool:
        if self.allowed is None:
            free = available_memory()
            self.allowed = free is None or free - self.nbytes >= pack_reserve()
        return self.allowed


class _Packed:
    """Holds a layer's prepacked weight and the (storage, version) of the weight it was made from
    (``weight`` None with a key: its model's :class:`_PackBudget` declined packing). Copies
    (``copy.deepcopy`` of a model, e.g. by :func:`specdecode.models.torch.quant.quantize_int8`) start
    empty and repack on their first use: oneDNN tensors have no storage to copy."""

    __slots__ = ("budget", "key", "weight")

    def __init__(self, budget: _PackBudget) -> None:
        self.budget = budget
        self.key: tuple[int, int] | None = None
        self.weight: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> _Packed:
        return _Packed(copy.deepcopy(self.budget, memo))  # one budget per copied model


def _meminfo(field: str) -> int | None:
    """Bytes of ``field`` (``MemAvailable``, ``MemTotal``) of ``/proc/meminfo``, or None where that
    cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable``), or None where unknown."""
    return _meminfo("MemAvailable")


def pack_reserve() -> int:
    """Bytes of memory the prepacked copies of a model must leave available: the larger of
    :data:`ONEDNN_PACK_RESERVE` and a quarter of the machine's memory (``MemTotal``), room for
    the KV cache, activations and whatever else the process loads later."""
    total = _meminfo("MemTotal")
    return max(ONEDNN_PACK_RESERVE, (total or 0) // 4)


def _packed_weight(module: torch.nn.Linear) -> torch.Tensor:
    """``module.weight`` in oneDNN's blocked layout for :data:`ONEDNN_PACK_ROWS` rows, made once and
    remade when the weight's storage or version changes (``load_state_dict``, in-place edits); the
    plain weight when the model's copies would leave less than :func:`pack_reserve` bytes
    available (:class:`_PackBudget`, decided once per model)."""
    holder: _Packed = module._specdecode_packed  # type: ignore[assignment]
    weight = module.weight
    key = (weight.data_ptr(), weight._version)
    if holder.key != key:
        holder.weight = None
        if holder.budget.decide():
            with torch.no_grad():
                holder.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_PACK_ROWS)
        holder.key = key
    return weight if holder.weight is None else holder.weight


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    weight = self.weight
    if (
        rows > ONEDNN_MAX_ROWS
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))  # the op has no backward
    ):
        return F.linear(x, weight, self.bias)
    if rows > 1 and getattr(self, "_specdecode_packed", None) is not None:
        weight = _packed_weight(self)
    return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")


class _RoutedForward:
    """A routed layer's ``forward``: :func:`_onednn_forward` on a layer it holds only weakly.

    A bound method stored on its own module (``module.forward = MethodType(f, module)``) makes a
    reference cycle, so a dropped model's weights would wait for Python's cycle collector; this
    holder makes none, and a dropped model frees its memory at once. ``copy.deepcopy`` of the
    model (which registers the copied layer in ``memo`` before copying its attributes) gives the
    copy a forward bound to the copied layer.
    """

    __slots__ = ("layer",)

    def __init__(self, layer: torch.nn.Linear) -> None:
        self.layer = weakref.ref(layer)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer()
        if layer is None:
            raise RuntimeError("the routed linear layer was freed; its forward cannot run")
        return _onednn_forward(layer, x)

    def __deepcopy__(self, memo: dict) -> _RoutedForward:
        layer = self.layer()
        return _RoutedForward(memo.get(id(layer), layer))  # the copy's own layer when the model is copied


def use_onednn_linears(model: torch.nn.Module, pack: bool = True) -> int:
    """Route the float32 CPU ``nn.Linear`` layers of ``model`` with at least
    :data:`ONEDNN_MIN_WEIGHTS` weights through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the
    kernel torch's own compiler uses for CPU linears) when called on at most
    :data:`ONEDNN_MAX_ROWS` rows; other calls, and calls that need gradients (oneDNN's op has no
    backward), stay on ``F.linear`` (MKL). Weights are not replaced
    (tied embeddings stay tied, ``state_dict`` is unchanged). Idempotent.

    With ``pack`` (default), calls on 2 to :data:`ONEDNN_MAX_ROWS` rows multiply by a copy of the
    weight prepacked into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` for
    :data:`ONEDNN_PACK_ROWS` rows), made on the layer's first such call and remade when the weight
    changes; one-row calls use the plain weight. This is
    what makes verifying k drafts cheap on AVX2 CPUs (module docstring); it costs the routed
    layers' memory a second time once a multi-token pass has run, so it is decided once for all
    the layers routed by this call: when their copies would leave less than :func:`pack_reserve`
    bytes available (a quarter of the machine's memory, at least 2 GiB) at the first multi-row
    call, none is made and every layer stays on its plain weight (same results, slower
    multi-token passes).

    The result equals ``F.linear``'s up to float32 rounding (another summation order); as with
    any kernel, a pass over many rows and one over a single row may differ in the last bits.

    Args:
        model: a module; layers on another device or dtype are left alone.
        pack: prepack weights for multi-row calls (see above); False routes the plain weight only.

    Returns:
        How many layers were routed (0 when oneDNN is not available in this torch build).
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    routed = [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear)
        and not getattr(module, "_specdecode_onednn", False)
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.numel() >= ONEDNN_MIN_WEIGHTS
    ]
    budget = _PackBudget(sum(m.weight.numel() * m.weight.element_size() for m in routed))
    for module in routed:
        module.forward = _RoutedForward(module)  # type: ignore[method-assign]  # no reference cycle
        module._specdecode_onednn = True  # type: ignore[assignment]
        if pack:
            module._specdecode_packed = _Packed(budget)  # type: ignore[assignment]
    return len(routed)


def prepack(model: torch.nn.Module) -> int:
    """Take ``model``'s packing decision now and make its prepacked copies (:func:`use_onednn_linears`),
    instead of on its first multi-row call.

    The decision depends on the memory available when it is taken, so whichever model reaches it
    first gets the memory. For a target that speculation will verify drafts with, call this right
    after loading it and before loading a draft: the target's multi-token passes are what every
    step pays (on the AVX2 reference CPU a 5-token pass costs 1.72 one-token passes packed, 2.06
    unpacked: lab/notebook/2026-11-25-eagle-vs-draft-avx2.md), while a
    draft model mostly runs one-token passes, which do not use the packed copies. Idempotent; a
    model with no routed layers (not float32, not on the CPU, or small) is left as it is.

    Returns:
        How many layers of ``model`` hold a prepacked weight afterwards (:func:`packed_layers`; 0
        when its budget declined).
    """
    for module in model.modules():
        if getattr(module, "_specdecode_packed", None) is not None:
            _packed_weight(module)  # the first call decides for the model's whole budget
    return packed_layers(model)


def packed_layers(model: torch.nn.Module) -> int:
    """How many layers of ``model`` hold a prepacked oneDNN weight now (:func:`use_onednn_linears`)."""
    return sum(
        1
        for module in model.modules()
        if getattr(getattr(module, "_specdecode_packed", None), "weight", None) is not None
    )
