"""Settings of ``specdecode serve`` (one frozen dataclass; the CLI flags map one to one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.limits import check_num_speculative_tokens

SPECULATION_MODES = ("on", "off", "adaptive")
PREFIX_CACHE_SCOPES = ("global", "user")


@dataclass(frozen=True)
class ServeSettings:
    """Server options. Each field is the CLI flag of the same name (``max_batch_size`` is
    ``--max-batch-size``).

    Attributes:
        model_name: the ``model`` id served (``/v1/models``; requests must name it).
        proposer: default proposer of requests (a name of ``specdecode.proposers.PROPOSERS``), or
            None: no speculation (every request decodes with the target alone).
        proposer_options: options of the default proposer (fields of its config dataclass).
        num_speculative_tokens: default k of requests (a request may ask for any in
            :data:`~specdecode.limits.K_RANGE`); None: each
            request's proposer's own default (:meth:`k_for`).
        speculation: ``"on"`` (every speculative request drafts its k every step), ``"off"``
            (nobody drafts) or ``"adaptive"`` (the cost model of :mod:`specdecode.cost.serve_model`
            decides per step and per sequence).
        max_batch_size: the most sequences decoding together (rows of the batched KV cache).
        kv_budget_tokens: KV-cache tokens the running sequences may reserve together; a sequence
            reserves ``prompt + max_tokens + k + 1`` when it joins the batch.
        max_queue: the most requests waiting to join the batch; more get HTTP 429.
        request_timeout_s: a request still unfinished this many seconds after it arrived is
            ended (HTTP 504, or an error event when streaming).
        max_body_bytes: request bodies larger than this get HTTP 413.
        api_key: if set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (compared in
            constant time); ``/health`` and ``/metrics`` stay open.
        audit_log: path of the JSONL audit log, or None for none.
        audit_log_prompts: write prompts into the audit log.
        default_max_tokens: ``max_tokens`` of a chat request that gives none (cut to the context).
        prefix_cache: keep what finished requests read as cached prefixes, so a request that
            re-sends a history prefills only its new tokens (:mod:`specdecode.models.prefix_cache`;
            backends whose batched runner has ``capabilities.prefix_cache``: llama.cpp).
        prefix_cache_scope: who may reuse a cached prefix: ``"global"`` (any request) or
            ``"user"`` (requests with the same OpenAI ``user`` field; none: only each other).

    Raises:
        ValueError: a value out of range; the message names the CLI flag.
    """

    model_name: str = "specdecode"
    proposer: str | None = "draft_model"
    proposer_options: dict[str, Any] = field(default_factory=dict)
    num_speculative_tokens: int | None = None
    speculation: str = "adaptive"
    max_batch_size: int = 8
    kv_budget_tokens: int = 65536
    max_queue: int = 64
    request_timeout_s: float = 600.0
    max_body_bytes: int = 1 << 20
    api_key: str | None = None
    audit_log: str | None = None
    audit_log_prompts: bool = False
    default_max_tokens: int = 512
    prefix_cache: bool = True
    prefix_cache_scope: str = "global"

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")

        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"--speculation must be one of {list(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.prefix_cache_scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(
                f"--prefix-cache-scope must be one of {list(PREFIX_CACHE_SCOPES)}, got {self.prefix_cache_scope!r}"
            )
        if self.num_speculative_tokens is not None:
            check_num_speculative_tokens(self.num_speculative_tokens, "--num-speculative-tokens")
        for name in ("max_batch_size", "kv_budget_tokens", "max_queue", "max_body_bytes", "default_max_tokens"):
            positive_int(name, getattr(self, name))
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s!r}")
        if not self.model_name:
            raise ValueError("--served-model-name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")

    def k_for(self, proposer: str | None, requested: int | None = None) -> int:
        """The k of a request: ``requested`` (the request's ``num_speculative_tokens``), else the
        server's ``--num-speculative-tokens``, else the default of ``proposer`` (with the server's
        options when it is the server's own proposer; :meth:`ProposerSpec.default_k
        <specdecode.proposers.ProposerSpec.default_k>`; 4 for None or an unknown name)."""
        if requested is not None:
            return requested
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        from specdecode.proposers import PROPOSERS
        from specdecode.proposers.base import DEFAULT_NUM_SPECULATIVE_TOKENS

        if proposer not in PROPOSERS:
            return DEFAULT_NUM_SPECULATIVE_TOKENS
        options = self.proposer_options if proposer == self.proposer else {}
        return PROPOSERS[proposer].default_k(**options)
