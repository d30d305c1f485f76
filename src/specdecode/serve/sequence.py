"""A request in the batch: the engine's per-sequence :class:`~specdecode.decode_state.DecodeState`
plus what the server keeps beside it (batch row, KV reservation, acceptance estimate, timings), and
the ``usage`` / ``speculative`` / ``timings`` summary a response and the audit log report."""

from __future__ import annotations

import time
from typing import Any

import torch

from specdecode.cost.serve_model import AcceptanceEstimate
from specdecode.decode_state import DecodeState
from specdecode.draft_gate import DraftGate
from specdecode.proposers.base import Proposer
from specdecode.proposers.prediction import prediction_record, with_prediction
from specdecode.serve.proposer_pool import PoolKey
from specdecode.serve.request import ServeRequest, usage
from specdecode.stats import SpecStats


class RunningSequence(DecodeState):
    """A running request: its :class:`~specdecode.decode_state.DecodeState` (context, proposer,
    generator, text stream, stats, limits; the engine's own), its batch row, KV reservation,
    acceptance estimate and timings."""

    def __init__(
        self,
        req: ServeRequest,
        row: int,
        max_length: int,
        reserved: int,
        proposer: Proposer | None,
        eos: frozenset[int],
        tokenizer: Any,
        constraint: Any = None,
        device: torch.device | str = "cpu",
    ) -> None:
        prediction = torch.tensor(req.prediction, dtype=torch.int64) if req.prediction is not None else None
        proposer = with_prediction(proposer, prediction, len(req.prompt_ids)) if proposer is not None else proposer
        stats = SpecStats(
            num_speculative_tokens=req.max_k,
            proposer=req.proposer if req.speculative and req.proposer else "none",
            prompt_tokens=len(req.prompt_ids),
            prediction=prediction_record(proposer, prediction),
        )
        super().__init__(
            req.prompt_ids,
            req.sampling,
            max_length,
            req.max_k,
            proposer=proposer,
            eos_token_ids=eos,
            tokenizer=tokenizer,
            stats=stats,
            ignore_eos=req.ignore_eos,
            num_logprobs=req.logprobs,
            constraint=constraint,  # the request's grammar state (structured output), or None
            device=device,  # the batched runner's: where its logits live (drafts' probs go there)
        )
        self.req = req
        self.row = row
        self.reserved = reserved  # KV tokens reserved against the budget
        self.estimate = AcceptanceEstimate()
        self.started = time.time()  # joined the batch
        self.first_token: float | None = None
        self.error: str | None = None
        self.proposer_error: str | None = None  # the proposer failed; the sequence went on without it
        self.drafted_at: int | None = None  # context length at the proposer's last call
        self.gate: DraftGate | None = None  # a greedy adaptive request's draft gate (the scheduler's)
        self.pooled: tuple[PoolKey, Proposer] | None = None  # the proposer taken from the scheduler's pool, unwrapped

    def behind(self) -> int:
        """Context tokens the proposer has to catch up on before drafting: 0 right after its
        previous draft (it sees at most the k + 1 tokens one step adds), else all since its last
        call (the whole context before its first)."""
        if self.drafted_at is not None and self.T - self.drafted_at <= self.req.max_k + 1:
            return 0
        return self.T - (self.drafted_at or 0)

    def max_draft(self) -> int:
        """The most tokens it may draft this step: its k, within :meth:`room`."""
        return min(self.req.max_k if self.proposer is not None else 0, self.room())

    def summary(self, mode: str) -> dict[str, Any]:
        """``usage``, ``speculative`` and ``timings`` of the sequence (for the response and the audit
        log); ``mode`` is the speculation mode it decoded with."""
        enabled = self.req.speculative and (self.proposer is not None or self.proposer_error is not None)
        now = time.time()
        created = self.req.created
        return {
            "usage": usage(self.prompt_len, len(self.generated), self.stats.prediction, self.cached_tokens),
            "speculative": speculative_summary(self.req, mode, enabled, self.stats, self.proposer_error),
            "timings": {
                "created": created,
                "started": self.started,
                "first_token": self.first_token,
                "finished": now,
                "queue_s": self.started - created,
                "ttft_s": None if self.first_token is None else self.first_token - created,
                "e2e_s": now - created,
            },
        }


def speculative_summary(
    req: ServeRequest, mode: str, enabled: bool, stats: SpecStats, proposer_error: str | None = None
) -> dict[str, Any]:
    """The ``speculative`` object of a response (see :mod:`specdecode.serve.app`)."""
    out = {
        "enabled": enabled,
        "proposer": req.proposer if enabled else None,
        "num_speculative_tokens": req.max_k if enabled else 0,
        "mode": mode,
        "drafts": stats.drafts,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "mean_acceptance_length": stats.mean_acceptance_length,
        "target_forward_passes": stats.target_forward_passes,
        "gated_draft_tokens": stats.gated_draft_tokens,
        "lossless": True,
    }
    if stats.prediction is not None:
        out["prediction"] = stats.prediction.to_dict()
    if proposer_error is not None:
        out["proposer_error"] = proposer_error
    return out
