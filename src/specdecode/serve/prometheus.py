"""Prometheus metrics of the server, named and defined as vLLM's (``vllm:`` becomes ``specdecode_``).

Speculation counters (vLLM's ``SpecDecodingStats``, summed over all requests and steps):

- ``specdecode_spec_decode_num_drafts_total``: steps in which a sequence verified at least one
  draft token (one per sequence per step);
- ``specdecode_spec_decode_num_draft_tokens_total``: draft tokens verified;
- ``specdecode_spec_decode_num_accepted_tokens_total``: draft tokens accepted;
- ``specdecode_spec_decode_num_accepted_tokens_per_pos_total{position="i"}``: drafts whose
  token at position i (0-based) was accepted. Acceptance rate = accepted / draft tokens; mean
  acceptance length = 1 + accepted / drafts; per-position rate = per_pos[i] / drafts that
  reached position i.

Prefix caching (vLLM's names): ``specdecode_prefix_cache_queries_total`` (prompt tokens looked up)
and ``specdecode_prefix_cache_hits_total`` (of those, tokens whose KV a cached prefix held); hit rate
= hits / queries. ``specdecode_prefix_cache_evictions_total``: cached prefixes dropped for room.

Every server gets its own :class:`prometheus_client.CollectorRegistry`, so several servers (tests)
live in one process. The scheduler thread updates the metrics; the ``/metrics`` route renders them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.pass_observers import PassObserver, TargetPass

PREFIX = "specdecode_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics(PassObserver):
    """The server's counters, gauges and histograms in one registry (thread-safe, as prometheus-client is);
    an observer of the scheduler's target passes (:meth:`target_pass`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, PREFIX
        self.requests = Counter(
            p + "requests", "Requests by endpoint and HTTP status", ["endpoint", "status"], registry=r
        )
        self.request_success = Counter(
            p + "request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens, cached ones included", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.prefix_cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled again)", registry=r
        )
        self.prefix_cache_evictions = Counter(
            p + "prefix_cache_evictions", "Cached prefixes dropped to give a new request an empty slot", registry=r
        )
        self.running = Gauge(p + "num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests in the waiting queue", registry=r)
        self.kv_reserved = Gauge(
            p + "kv_cache_reserved_tokens", "KV-cache tokens reserved by running sequences", registry=r
        )
        self.kv_budget = Gauge(
            p + "kv_cache_budget_tokens", "KV-cache budget in tokens (--kv-budget-tokens)", registry=r
        )
        self.batch_size = Histogram(
            p + "batch_size", "Sequences per batched target pass (decode steps)", buckets=BATCH_BUCKETS, registry=r
        )
        self.steps = Counter(p + "decode_steps", "Batched target passes (decode steps)", registry=r)
        self.speculating_rows = Counter(
            p + "speculating_rows",
            "Sequence-steps that drafted at least one token (decided by the scheduler)",
            registry=r,
        )
        self.num_drafts = Counter(p + "spec_decode_num_drafts", "Drafts verified (sequence-steps)", registry=r)
        self.num_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted",
            ["position"],
            registry=r,
        )
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_phase = Histogram(
            p + "step_phase_seconds",
            "Time of each phase of a decode step: plan (choose k per sequence), draft (all proposers), "
            "target (the batched pass), verify (verify, roll back, emit), step (all of it); prefill passes",
            ["phase"],
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "request_queue_time_seconds", "Time waiting in the queue", buckets=LATENCY_BUCKETS, registry=r
        )

    def target_pass(self, p: TargetPass) -> None:
        """One batched target pass: its seconds in ``step_phase_seconds{phase="prefill"}`` or ``{phase="target"}``."""
        self.step_phase.labels(phase="prefill" if p.prefill else "target").observe(p.seconds)

    def observe_verification(self, drafted: int, accepted: int) -> None:
        """One sequence's verification of ``drafted`` tokens, ``accepted`` of them kept."""
        if drafted <= 0:
            return
        self.num_drafts.inc()
        self.num_draft_tokens.inc(drafted)
        self.num_accepted_tokens.inc(accepted)
        for i in range(accepted):
            self.accepted_per_pos.labels(position=str(i)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
