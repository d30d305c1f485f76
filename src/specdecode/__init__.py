"""specdecode: lossless speculative decoding for causal language models."""

from specdecode.engine import GenerationResult, SpeculativeGenerator
from specdecode.proposers.base import DraftTokens, Proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.sampling import SamplingParams
from specdecode.stats import SpecStats

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
