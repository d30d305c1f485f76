"""specdecode: lossless speculative decoding for causal language models.

The names below load on first use (PEP 562), so ``import specdecode.stop_strings`` or ``specdecode --help``
does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.engine import GenerationResult, SpeculativeGenerator
    from specdecode.proposers.base import DraftTokens, Proposer
    from specdecode.proposers.draft_model import DraftModelProposer
    from specdecode.sampling import SamplingParams
    from specdecode.stats import SpecStats

_EXPORTS = {
    "DraftModelProposer": "specdecode.proposers.draft_model",
    "DraftTokens": "specdecode.proposers.base",
    "GenerationResult": "specdecode.engine",
    "Proposer": "specdecode.proposers.base",
    "SamplingParams": "specdecode.sampling",
    "SpecStats": "specdecode.stats",
    "SpeculativeGenerator": "specdecode.engine",
}

__all__ = [
    "DraftModelProposer",
    "DraftTokens",
    "GenerationResult",
    "Proposer",
    "SamplingParams",
    "SpecStats",
    "SpeculativeGenerator",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import an exported name on first access.

    Raises:
        AttributeError: ``name`` is not one of :data:`__all__`.
    """
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
