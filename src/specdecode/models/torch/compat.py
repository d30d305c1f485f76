"""Differences between the transformers versions specdecode supports (``transformers>=5.0,<6``).

The KV cache keyword: models take it as ``past_key_values`` up to transformers 5.2x, where it
became ``cache`` (``past_key_values`` still works there with a FutureWarning and is to be removed
in 5.40). :func:`cache_kwargs` names it the way the model's own ``forward`` does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

CACHE_KEYWORDS = ("cache", "past_key_values")  # newest first


@functools.cache
def _cache_keyword(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters
    for name in CACHE_KEYWORDS:
        if name in parameters:
            return name
    return "past_key_values"  # a forward taking **kwargs only: the name every 5.x version still accepts


def cache_keyword(model: torch.nn.Module) -> str:
    """``"cache"`` or ``"past_key_values"``: the KV-cache keyword of ``type(model).forward`` (the class's,
    so wrappers that replace an instance's ``forward``, such as accelerate's hooks, do not hide it)."""
    return _cache_keyword(type(model).forward)


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` to pass a KV cache (a ``transformers.Cache`` or None) to ``model``."""
    return {cache_keyword(model): cache}
