"""A separate, smaller draft model with the target's vocabulary (Leviathan et al. 2023)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdecode.models.runner import ModelRunner
from specdecode.proposers.base import DraftTokens
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.verify import VerifyResult


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
    """

    name = "draft_model"

    def __init__(self, model: PreTrainedModel) -> None:
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
        for i in range(num_tokens):
            if sampling.greedy:
                token = logits.argmax().view(1)  # (1,)
            else:
                q = logits_to_probs(logits, sampling)  # (V,)
                token = sample(q, generator).view(1)
                probs.append(q)
            ids.append(token)
            if i + 1 < num_tokens:
                logits = self.runner.forward(token, num_logits=1)[-1]
        draft_ids = torch.cat(ids)  # (k,)
        # The cache now holds context + draft_ids[:-1]; the last drafted token was never fed.
        self._cached = torch.cat([context, draft_ids[:-1]])
        return DraftTokens(draft_ids, torch.stack(probs) if probs else None)

    def observe(self, result: VerifyResult) -> None:
        """Nothing to do: the next ``propose`` truncates the rejected tokens away."""
