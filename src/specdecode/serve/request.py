"""What passes between the HTTP layer and the scheduler: a validated request, the events it
receives, and the errors that refuse it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.logprobs import TokenLogprob
from specdecode.sampling import SamplingParams


class QueueFullError(Exception):
    """The waiting queue holds ``--max-queue`` requests already (HTTP 429)."""


class InvalidRequestError(ValueError):
    """A request the scheduler cannot run; ``param`` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Event:
    """What a request receives from the scheduler, once per step that gave it tokens.

    Attributes:
        token_ids: the new token ids (may be empty on the last event).
        text: the new text that is safe to show.
        finish_reason: None while running; then ``"stop"``, ``"length"``, ``"abort"`` (client
            gone), ``"timeout"`` or ``"error"``.
        summary: on the last event: ``usage``, ``speculative`` and ``timings`` dicts.
        error: on an ``"error"`` / ``"timeout"`` event, the message.
        logprobs: for a request with ``logprobs``, one record per token of ``token_ids``
            (:mod:`specdecode.logprobs`); else None.
    """

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    summary: dict[str, Any] | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class ServeRequest:
    """One validated, tokenized request.

    Attributes:
        request_id: unique id (``cmpl-...`` / ``chatcmpl-...``).
        prompt_ids: the prompt's token ids (chat template applied already).
        sampling: temperature, top-k, top-p, seed, ``max_new_tokens`` (= max_tokens), stop.
        speculative: whether this request may draft at all.
        proposer: the proposer's name (None when not speculative).
        num_speculative_tokens: the most tokens drafted per step (k).
        speculation: this request's speculation mode (``"on"`` or ``"adaptive"``) in place of the
            server's ``--speculation``, or None for the server's (see
            :meth:`Admission.mode <specdecode.serve.admission.Admission.mode>`).
        on_event: called from the scheduler thread with every :class:`Event`; must be thread-safe.
        endpoint: the HTTP route, for the audit log.
        audit_settings: settings recorded in the audit log.
        audit_prompt: the prompt as received (audited only with ``--audit-log-prompts``).
        created: arrival time (Unix seconds).
        deadline: ``time.monotonic()`` after which the request times out.
        ignore_eos: do not stop at end-of-sequence tokens (benchmarks: fixed-length outputs).
        logprobs: report each token's log-probability and this many alternatives (0 .. 20, the
            target's raw distribution, :mod:`specdecode.logprobs`); None: off.
        constraint: structured output (``response_format``, a required tool call): a
            :class:`~specdecode.constraints.JsonSchema` the scheduler turns into the sequence's
            grammar state; None: unconstrained.
        prediction: the predicted answer's token ids (OpenAI's ``prediction``,
            :mod:`specdecode.proposers.prediction`), drafted first when the request speculates; None: none.
        user: the client's OpenAI ``user`` field (the prefix cache's scope under
            ``--prefix-cache-scope user``), or None.
        admitted_by: the :class:`~specdecode.serve.admission.Admission` that checked it (set by
            :meth:`~specdecode.serve.admission.Admission.admit`), so it is checked once; None: not yet.
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    speculative: bool
    proposer: str | None
    num_speculative_tokens: int
    on_event: Callable[[Event], None]
    endpoint: str = ""
    audit_settings: dict[str, Any] = field(default_factory=dict)
    audit_prompt: Any = None
    created: float = field(default_factory=time.time)
    deadline: float = math.inf
    ignore_eos: bool = False
    speculation: str | None = None
    logprobs: int | None = None
    constraint: Any = None
    prediction: list[int] | None = None
    user: str | None = None
    admitted_by: Any = field(default=None, repr=False, compare=False)

    @property
    def max_k(self) -> int:
        return self.num_speculative_tokens if self.speculative else 0


def usage(prompt_tokens: int, completion_tokens: int, prediction: Any = None, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's ``usage`` object: ``prompt_tokens_details.cached_tokens`` (prompt tokens whose KV a
    cached prefix held, not prefilled again); with a prediction's
    :class:`~specdecode.proposers.prediction.PredictionRecord`, its ``completion_tokens_details``
    (``accepted_prediction_tokens``, ``rejected_prediction_tokens``)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if prediction is not None:
        out["completion_tokens_details"] = prediction.completion_tokens_details()
    return out
