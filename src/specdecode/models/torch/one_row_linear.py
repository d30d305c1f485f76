"""Run one-row linear layers as two-row ones, where that is faster (CPU bf16 decoding).

Decoding one token runs every ``nn.Linear`` of the model on a single row, a matrix-vector product.
On some CPUs PyTorch's one-row bf16 kernel is slower than its two-row matrix product (measured by
``lab/scripts/bench_linear_rows.py``); computing the row twice and keeping the first copy is then
faster. Row 0 of the two-row product is the same dot products as the one-row product, possibly
summed in another order, so the result may differ in the last bits, as any change of kernel does.
In bfloat16 on a CPU with AVX512-BF16 it is what makes one-row calls round as every row of a wider
product does: exact passes pad for good (:mod:`specdecode.models.torch.exact`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_FLAG = "_specdecode_padded_row"


def _pad(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.numel() != x.shape[-1]:
        return None  # not exactly one row: unchanged
    setattr(module, _FLAG, True)
    return (torch.cat([x, x], dim=-2), *args[1:])  # [..., 2, in]


def _unpad(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
    if not getattr(module, _FLAG, False):
        return None
    setattr(module, _FLAG, False)
    return output[..., :1, :]  # [..., 1, out]


def pad_linear_rows(model: torch.nn.Module) -> list[RemovableHandle]:
    """Give every ``nn.Linear`` of ``model`` (or ``model`` itself) hooks that compute a call on exactly
    one row (input ``[..., 1, in]`` with one row in all) as two equal rows and return the first;
    other inputs pass unchanged. Returns the hooks' handles (``handle.remove()`` undoes it). Exact
    passes keep them for good (:mod:`specdecode.models.torch.exact`)."""
    handles = []
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(_pad))
            handles.append(module.register_forward_hook(_unpad))
    return handles


@contextmanager
def pad_single_rows(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, every ``nn.Linear`` of ``model`` called on exactly one row (input
    ``[..., 1, in]`` with one row in all) computes it as two equal rows and returns the first.

    Inputs of other shapes pass unchanged. Hooks are removed on exit, also after an error. Not
    used by the engine or the server yet: on the reference CPU it makes a bfloat16 one-token step
    of the 1.5B target 8% faster and of the 0.5B draft 6% slower (hook overhead on small layers;
    lab/notebook/2026-11-22-one-row-linear.md).

    Args:
        model: any ``torch.nn.Module``; its ``nn.Linear`` submodules (or itself) get the hooks.

    Yields:
        ``model`` itself.
    """
    handles = pad_linear_rows(model)
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for module in model.modules():
            if hasattr(module, _FLAG):
                delattr(module, _FLAG)
