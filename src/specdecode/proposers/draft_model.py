"""A separate, smaller draft model with the target's vocabulary (Leviathan et al. 2023)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specdecode.models.runner import ModelRunner
from specdecode.proposers.base import DraftTokens
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.verify import VerifyResult


@dataclass(frozen=True)
class DraftModelConfig:
    """Options of :class:`DraftModelProposer` (and of the proposers built on it).

    Attributes:
        draft_confidence: stop drafting as soon as the draft's top probability (after the
            request's temperature / top-k / top-p; plain softmax when greedy) falls below this
            value, in [0, 1); 0 drafts all k tokens. A cut draft costs less and loses little:
            unconfident tokens are the ones the target rejects (the dynamic draft length of
            Hugging Face's ``assistant_confidence_threshold``; Mamou et al. 2024, arXiv 2405.04304).

    Raises:
        ValueError: ``draft_confidence`` outside [0, 1).
    """

    draft_confidence: float = field(default=0.0, metadata={"help": "stop drafting when top prob < this (0 = off)"})

    def __post_init__(self) -> None:
        if not isinstance(self.draft_confidence, int | float) or not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be a number in [0, 1), got {self.draft_confidence!r}")


class DraftModelProposer:
    """Drafts k tokens autoregressively with a small model that keeps its own KV cache.

    Greedy requests draft the draft model's argmax (a deterministic proposal, ``probs=None``);
    sampled requests sample from the draft's distribution after the request's temperature /
    top-k / top-p and return it as ``q`` for rejection sampling.

    Cache sync: the proposer remembers which tokens its cache holds. At each ``propose`` it keeps
    the longest prefix shared with the new context (the accepted draft tokens stay cached, the
    rejected ones are truncated away) and feeds only the rest, so rollback is a truncate.

    Args:
        model: the draft ``transformers`` causal LM; its vocabulary must be the target's.
        config: :class:`DraftModelConfig` (default: draft all k tokens).
    """

    name = "draft_model"

    def __init__(self, model: PreTrainedModel, config: DraftModelConfig | None = None) -> None:
        self.config = config or DraftModelConfig()
        self.runner = ModelRunner(model)
        self._cached = torch.empty(0, dtype=torch.int64)  # tokens in the draft's cache, [runner.length]

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def reset(self) -> None:
        self.runner.reset()
        self._cached = torch.empty(0, dtype=torch.int64)

    def _sync(self, context: torch.Tensor) -> torch.Tensor:
        """Roll the cache back to the prefix it shares with ``context``; return the logits of the
        token after ``context`` (float32 ``[V]``)."""
        n = min(self._cached.shape[0], context.shape[0] - 1)  # feed at least the last token
        differ = (self._cached[:n] != context[:n]).nonzero()
        keep = int(differ[0, 0]) if differ.numel() else n
        self.runner.truncate(keep)
        return self.runner.forward(context[keep:], num_logits=1)[-1]

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftTokens:
        logits = self._sync(context)  # (V,)
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        threshold = self.config.draft_confidence
        for i in range(num_tokens):
            if sampling.greedy:
                token = logits.argmax().view(1)  # (1,)
                if threshold > 0 and i > 0 and float(torch.softmax(logits, -1)[token]) < threshold:
                    break
            else:
                q = logits_to_probs(logits, sampling)  # (V,)
                if threshold > 0 and i > 0 and float(q.max()) < threshold:
                    break
                token = sample(q, generator).view(1)
                probs.append(q)
            ids.append(token)
            if i + 1 < num_tokens:
                logits = self.runner.forward(token, num_logits=1)[-1]
        if len(ids) < num_tokens:  # cut by the confidence threshold: the last fed token is the last drafted
            draft_ids = torch.cat(ids)
            self._cached = torch.cat([context, draft_ids])
            return DraftTokens(draft_ids, torch.stack(probs) if probs else None)
        draft_ids = torch.cat(ids)  # (k,)
        # The cache now holds context + draft_ids[:-1]; the last drafted token was never fed.
        self._cached = torch.cat([context, draft_ids[:-1]])
        return DraftTokens(draft_ids, torch.stack(probs) if probs else None)

    def observe(self, result: VerifyResult) -> None:
        """Nothing to do: the next ``propose`` truncates the rejected tokens away."""
