"""CPU compute paths: which dtype multiplies fast here, and oneDNN for few-row float32 linears.

Speculative decoding assumes that a pass over ``k + 1`` tokens costs about as much as a pass over
one (decoding is memory-bound). On a CPU that holds only on some paths:

- **bfloat16 without native support** (x86 CPUs with AVX2 but neither AVX512-BF16 / AMX nor
  AVX-NE-CONVERT: most laptops, AMD Zen 2/3, Intel client chips): torch 2.13 has no blocked bf16
  GEMM there (oneDNN refuses bf16, ``mkldnn_linear: bf16 path needs ...``) and multiplies row by
  row, so a pass over M tokens costs about M one-token passes. Measured on the project's 2-core
  AMD EPYC (Zen 3, ``scripts/bench_cpu_paths.py``, docs/benchmarks.md): the default target's pass
  over 1 / 5 / 9 / 17 tokens takes 226 / 848 / 1,482 / 2,795 ms, and a 300-token prefill 41 s.
  No proposer can win there: verifying 4 drafts costs 3.75 plain steps.
- **float32 through MKL** (torch's default CPU GEMM): blocked, but slow for few rows on AMD
  (430 / 1,263 / 1,487 / 1,892 ms; prefill 10.4 s).
- **float32 through oneDNN** (:func:`use_onednn_linears`): 365 / 610 / 687 / 861 ms (prefill
  8.3 s). A plain step costs 1.3-1.6x the bf16 one, but 17 tokens cost 2.4 plain steps instead
  of 12, so verification is cheap enough for speculation (and token trees) to pay, and float32 is
  also the exact dtype.

:func:`auto_dtype` picks bfloat16 where it is native (or on a GPU) and float32 otherwise;
:func:`specdecode.models.loading.load_model` then routes the float32 model's large linears through
oneDNN. ``scripts/bench_cpu_paths.py`` measures all three paths on a machine.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

ONEDNN_MAX_ROWS = 64  # above this many rows MKL was as fast or faster (prefill); oneDNN below
ONEDNN_MIN_WEIGHTS = 1 << 20  # smaller layers (k/v projections of small models): MKL was faster


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


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > ONEDNN_MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route the float32 CPU ``nn.Linear`` layers of ``model`` with at least
    :data:`ONEDNN_MIN_WEIGHTS` weights through oneDNN (``torch.ops.mkldnn._linear_pointwise``, the
    kernel torch's own compiler uses for CPU linears) when called on at most
    :data:`ONEDNN_MAX_ROWS` rows; other calls stay on ``F.linear`` (MKL). Weights are not copied
    (tied embeddings stay tied). Idempotent.

    The result equals ``F.linear``'s up to float32 rounding (another summation order); as with
    any kernel, a pass over many rows and one over a single row may differ in the last bits.

    Args:
        model: a module; layers on another device or dtype are left alone.

    Returns:
        How many layers were routed (0 when oneDNN is not available in this torch build).
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or getattr(module, "_specdecode_onednn", False):
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.numel() < ONEDNN_MIN_WEIGHTS:
            continue
        module.forward = types.MethodType(_onednn_forward, module)  # type: ignore[method-assign]
        module._specdecode_onednn = True  # type: ignore[assignment]
        count += 1
    return count
