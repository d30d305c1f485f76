"""Continuous batching of speculative decoding: one thread owns the models and runs every step.

Requests arrive from the HTTP layer (:meth:`Scheduler.submit`) into a bounded FIFO queue. The
scheduler thread loops:

0. **housekeeping**: end the sequences whose client went away (:meth:`Scheduler.abort`) or whose
   deadline passed, freeing their rows; admit waiting requests, in order, while a row is free
   and the KV budget holds their reservation; prefill the new rows together (one ragged pass)
   and emit each one's first token (the target's own);
1. **draft**: decide each running sequence's k for this step (:mod:`specdecode.cost.serve_model`,
   ``--speculation``) and ask its own proposer (one instance per sequence, built by
   :func:`specdecode.proposers.make_proposer`; draft weights shared, caches not; kept between
   requests in :class:`~specdecode.serve.proposer_pool.ProposerPool`) for k tokens;
2. **score**: ONE batched target pass over every row's ``[last token + draft]`` (ragged,
   :class:`~specdecode.models.torch.batch.TorchBatchedRunner`);
3. **verify** each row with :func:`specdecode.verify.verify` and the request's own
   ``torch.Generator`` (seeded from the request's ``seed``);
4. **roll back** each row to its context plus its accepted tokens (``truncate``: a length
   pointer), and give the proposer its feedback;
5. **emit** each row's new tokens; stop on EOS, a stop string (held back by
   :class:`~specdecode.stop_strings.StopStringStream`) or the token limit; finished rows leave.

Per row, this is the single-sequence loop of :mod:`specdecode.engine` by construction: each running
request is a :class:`~specdecode.serve.sequence.RunningSequence`, the engine's own
:class:`~specdecode.decode_state.DecodeState` (same invariant: the row caches every context token
but the last; same verifier, same use of randomness, same stop rules), so greedy output equals
target-only greedy decoding and sampled output follows the target's distribution, whatever the
batch and whatever k the scheduler picks. The request and event types are in
:mod:`specdecode.serve.request`; the checks a request passes before it queues (once per request,
the HTTP layer's and :meth:`Scheduler.submit`'s) in :mod:`specdecode.serve.admission`.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import traceback
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdecode import loop_steps
from specdecode.cost.serve_measure import default_batch_grid, in_own_thread, measure_draft_cost, measure_target_costs
from specdecode.cost.serve_model import INITIAL_ACCEPTANCE, CostModel, plan_speculation
from specdecode.draft_gate import DraftGate, PassCosts
from specdecode.engine import eos_token_ids, needs_features
from specdecode.logprobs import TokenLogprob
from specdecode.models.backends import backend_of, make_batched_runner
from specdecode.models.prefix_cache import PrefixCache
from specdecode.models.torch.placement import device_clock
from specdecode.pass_observers import PassObserver
from specdecode.proposers import make_proposer
from specdecode.proposers.base import DraftTokens
from specdecode.schedule import acceptance_trials, expected_tokens
from specdecode.serve.admission import Admission, available_proposers
from specdecode.serve.audit import AuditLog, audit_record
from specdecode.serve.config import ServeSettings
from specdecode.serve.prometheus import ServeMetrics
from specdecode.serve.proposer_pool import ProposerPool
from specdecode.serve.request import Event, QueueFullError, ServeRequest, usage
from specdecode.serve.sequence import RunningSequence, speculative_summary
from specdecode.stats import SpecStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger("specdecode.serve")

PRIOR_RATE = 0.01  # per position tried, how fast a proposer's running acceptance estimate moves
MAX_PREFILL_TOKENS = 4096  # padded tokens of one batched prefill pass (a longer prompt goes alone)
# Padded / real tokens of one batched prefill pass at most: prompts are right-padded to the longest,
# and padding is computed, so prompts of very different lengths are prefilled in separate passes.
MAX_PREFILL_PADDING = 1.25


class Scheduler:
    """Owns the target (and draft) model and decodes every running request in one batch per step.

    Args:
        target: the target causal LM (its weights are used by this thread only).
        tokenizer: the target's tokenizer (a private copy decodes in the scheduler thread).
        settings: :class:`~specdecode.serve.config.ServeSettings`.
        draft: the draft model for proposers that need one (weights shared by all sequences).
        metrics: where to count (a fresh :class:`ServeMetrics` if None).
        audit: the audit log, or None.
        cost: a measured :class:`CostModel`; None measures one at :meth:`start` when
            ``settings.speculation == "adaptive"``.

    Attributes:
        admission: the server's :class:`~specdecode.serve.admission.Admission` (built here, once:
            the checks of every request, :meth:`submit`'s and the HTTP layer's).

    Raises:
        InvalidRequestError: the default proposer cannot run on this server.
        ValueError: its options are not options of that proposer.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: Any,
        settings: ServeSettings,
        draft: PreTrainedModel | None = None,
        metrics: ServeMetrics | None = None,
        audit: AuditLog | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.target = target  # runners put a torch model in eval mode
        self.draft = draft
        self.backend = backend_of(target)
        self.settings = settings
        self.tokenizer = copy.deepcopy(tokenizer)  # this thread's own: fast tokenizers are not shared safely
        self.eos = eos_token_ids(target, tokenizer)
        self.runner = make_batched_runner(target, settings.max_batch_size, self._row_capacity())
        self._clock = device_clock(self.runner.device)  # synchronized off the CPU: each phase its own work
        self.metrics = metrics or ServeMetrics()
        self.metrics.kv_budget.set(settings.kv_budget_tokens)
        self.audit = audit
        self.cost = cost
        # what a one-row pass costs (measured on the steps the batch held one row): the draft gates read it
        self.pass_costs = PassCosts(
            chunk=self.runner.capabilities.greedy_stop_rows, then=self.runner.capabilities.greedy_stop_then
        )
        proposers = available_proposers(
            settings, target, draft, self.backend, returns_hidden=self.runner.capabilities.returns_hidden
        )
        self.admission = Admission(settings, self.runner.max_length, self.runner.vocab_size, proposers)
        # proposers outlive their requests (a draft model's runner, its graphs): taken at a start, given back at a leave
        self.proposer_pool = ProposerPool(
            lambda name, options: make_proposer(name, draft=self.draft, target=self.target, **options),
            settings.max_batch_size,
        )
        # what finished requests read stays in their slots for the next (a runner with kept cells)
        self.prefix_cache = PrefixCache() if settings.prefix_cache and self.runner.capabilities.prefix_cache else None
        self.active: list[RunningSequence] = []  # active[i].row == i
        self.reserved = 0
        self._prior: dict[str, float] = {}
        self._waiting: deque[ServeRequest] = deque()
        self._aborts: set[str] = set()
        self._cond = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public, any thread
    @property
    def max_length(self) -> int:
        return self.runner.max_length

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def started(self) -> bool:
        """:meth:`start` has run (with or without the thread)."""
        return self._running or self._thread is not None

    @property
    def is_alive(self) -> bool:
        """The scheduler thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def _row_capacity(self) -> int:
        """KV-cache tokens one row may need: the budget shared out over the rows (a llama.cpp context
        reserves them at creation; the torch cache starts smaller and grows)."""
        return self.settings.kv_budget_tokens // self.settings.max_batch_size

    def proposers(self) -> list[str]:
        """Names of the proposers a request may ask for (found once, at construction:
        :func:`~specdecode.serve.admission.available_proposers`)."""
        return list(self.admission.proposers)

    def check_proposer(self, name: str) -> None:
        """Raises InvalidRequestError(param="proposer") unless ``name`` can run on this server."""
        self.admission.check_proposer(name)

    def reservation(self, req: ServeRequest) -> int:
        """KV-cache tokens ``req`` reserves while it runs: ``prompt + max_tokens + k + 1``."""
        return self.admission.reservation(req)

    def validate(self, req: ServeRequest) -> None:
        """Every check of ``req`` (:meth:`Admission.admit <specdecode.serve.admission.Admission.admit>`).

        Raises:
            InvalidRequestError: the message names the request field.
        """
        self.admission.admit(req)

    def submit(self, req: ServeRequest) -> None:
        """Queue ``req``, admitted (:meth:`Admission.admit <specdecode.serve.admission.Admission.admit>`:
        checked here unless the HTTP layer admitted it already).

        Raises:
            InvalidRequestError: see :meth:`Admission.admit <specdecode.serve.admission.Admission.admit>`.
            QueueFullError: ``--max-queue`` requests are waiting already.
            RuntimeError: the scheduler is not running.
        """
        self.admission.admit(req)
        with self._cond:
            if not self._running:
                raise RuntimeError("the scheduler is not running")
            if len(self._waiting) >= self.settings.max_queue:
                raise QueueFullError(
                    f"the server is at capacity: {len(self._waiting)} requests are waiting (--max-queue "
                    f"{self.settings.max_queue}) and {len(self.active)} are running; retry later"
                )
            self._waiting.append(req)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """End ``request_id`` at the next step (client gone); its row and reservation are freed."""
        with self._cond:
            self._aborts.add(request_id)
            self._cond.notify()

    def measure_cost_model(self, cache_folder: str | Path | None = None, remeasure: bool = False) -> None:
        """Measure the cost model now if ``adaptive`` speculation needs it and none was given (else
        nothing): ``specdecode serve`` calls it before the web server starts, so that a SIGTERM or
        Ctrl-C during the minutes it may take stops the process at once (uvicorn's own handlers,
        installed later, only flag a shutdown that its start-up would wait out).

        Args:
            cache_folder: a folder of measured models (:mod:`specdecode.cost.cache`; the
                command's is :func:`~specdecode.cost.cache.default_folder`): one stored under
                this measurement's key is loaded instead of measuring, and a new measurement is
                stored there before serving refines it (a folder that cannot be written: a
                warning). None (the default; :meth:`start`'s): measure, no files.
            remeasure: measure even when ``cache_folder`` holds a model for the key (the new
                measurement replaces it).
        """
        if self.cost is not None or self.settings.speculation != "adaptive":
            return
        key = None
        if cache_folder is not None:
            from specdecode.cost.cache import cost_key, load_cost_model

            batch_sizes, tokens, k = self._calibration_grid()
            key = cost_key(
                self.target,
                self.draft,
                batch_sizes=batch_sizes,
                tokens=tokens,
                proposer=self.settings.proposer,
                proposer_options=self.settings.proposer_options,
                k=k,
            )
            cached = None if remeasure else load_cost_model(key, cache_folder)
            if cached is not None:
                log.info("cost model: loaded from %s (measured %s)", cached.path, cached.measured_at)
                self.cost = cached.cost
                return
        tic = time.perf_counter()
        self.cost = in_own_thread(self.calibrate)  # not this (long-lived) thread: see in_own_thread
        if key is not None:  # stored as measured, before serving refines it
            from specdecode.cost.cache import store_cost_model

            assert cache_folder is not None  # a key is made only for a folder
            path = store_cost_model(key, self.cost, cache_folder, time.perf_counter() - tic)
            if path is not None:
                log.info("cost model: stored in %s", path)

    def start(self, thread: bool = True) -> None:
        """Measure the cost model if needed (:meth:`measure_cost_model`), then start the scheduler thread.

        Args:
            thread: False accepts requests without starting the thread; the caller then drives
                the loop with :meth:`run_once` (tests, debugging).
        """
        self.measure_cost_model()
        with self._cond:
            self._running = True
        if thread:
            self._thread = threading.Thread(target=self._run, name="specdecode-scheduler", daemon=True)
            self._thread.start()

    def run_once(self) -> bool:
        """One iteration of the loop in the caller's thread: housekeeping, then one decode step.

        Returns:
            True while requests are running or waiting.
        """
        with self._cond:
            aborts, self._aborts = self._aborts, set()
        self._housekeeping(aborts)
        if self.active:
            self._step()
        return bool(self.active or self._waiting)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with ``"abort"``."""
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _calibration_grid(self) -> tuple[list[int], list[int], int]:
        """The measurement's batch sizes, tokens per row and the default proposer's k."""
        k = self.settings.k_for(self.settings.proposer)
        return default_batch_grid(self.settings.max_batch_size), sorted({1, 2, 3, k // 2 + 1, k + 1}), k

    def calibrate(self) -> CostModel:
        """Measure ``t_target(B, T)`` and the default proposer's draft cost (see :mod:`specdecode.cost.serve_model`).

        A change of what it (or :meth:`_calibration_grid`) measures raises
        :data:`~specdecode.cost.serve_measure.MEASUREMENT_VERSION`, so stored measurements are not reused."""
        tic = time.perf_counter()
        batch_sizes, tokens, k = self._calibration_grid()
        cost = measure_target_costs(self.target, batch_sizes, tokens)  # own cache
        name = self.settings.proposer
        if name is not None:  # other proposers are measured on their first use (CostModel.observe_draft)
            proposer, key = self.proposer_pool.take(name, self.settings.proposer_options)
            cost.draft_s_per_token[name] = measure_draft_cost(proposer, self.vocab_size, k)
            self.proposer_pool.give(key, proposer)  # the first request's, once cleared and reset
        log.info("cost model measured in %.2f s: %s", time.perf_counter() - tic, cost.to_dict())
        return cost

    # ------------------------------------------------------------------ the scheduler thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._waiting and not self.active and not self._aborts:
                    self._cond.wait()
                if not self._running:
                    break
                aborts, self._aborts = self._aborts, set()
            try:
                self._housekeeping(aborts)
                if self.active:
                    self._step()
            except Exception as error:  # a bug or out of memory: fail the batch, keep serving
                log.error("scheduler step failed: %s", traceback.format_exc())
                for s in list(self.active):
                    s.error = f"internal error: {type(error).__name__}: {error}"
                    self._finish(s, "error")
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for req in waiting:
            self._reject(req, "abort", "the server is shutting down")
        for s in list(self.active):
            s.error = "the server is shutting down"
            self._finish(s, "abort")

    def _housekeeping(self, aborts: set[str]) -> None:
        now = time.monotonic()
        with self._cond:
            gone = [r for r in self._waiting if r.request_id in aborts or r.deadline <= now]
            for r in gone:
                self._waiting.remove(r)
        for r in gone:
            if r.request_id in aborts:
                self._reject(r, "abort", "the client went away")
            else:
                self._reject(r, "timeout", self._timeout_message(r))
        for s in list(self.active):
            if s.req.request_id in aborts:
                self._finish(s, "abort")
            elif s.req.deadline <= now:
                s.error = self._timeout_message(s.req)
                self._finish(s, "timeout")
        admitted: list[ServeRequest] = []
        with self._cond:
            while self._waiting and len(self.active) + len(admitted) < self.settings.max_batch_size:
                need = self.reservation(self._waiting[0])
                if self.reserved + need > self.settings.kv_budget_tokens:
                    break  # FIFO: the head waits for room, nobody overtakes it
                self.reserved += need
                admitted.append(self._waiting.popleft())
            self.metrics.waiting.set(len(self._waiting))
        admitted.sort(key=lambda r: len(r.prompt_ids))  # similar lengths in consecutive rows: less padding
        started = [seq for seq in map(self._start, admitted) if seq is not None]  # rows added, in order
        group: list[RunningSequence] = []
        for seq in started:  # prefill groups: consecutive rows, bounded padded size and padding share
            padded = max(x.prompt_len - x.cached_tokens for x in group + [seq]) * (len(group) + 1)
            real = sum(x.prompt_len - x.cached_tokens for x in group + [seq])
            if group and (padded > MAX_PREFILL_TOKENS or padded > MAX_PREFILL_PADDING * real):
                self._prefill(group)
                group = []
            group.append(seq)
        if group:
            self._prefill(group)
        self._leave_finished()  # only now: leaving moves rows, and the groups' rows must stay put
        self.metrics.running.set(len(self.active))
        self.metrics.kv_reserved.set(self.reserved)

    def _timeout_message(self, req: ServeRequest) -> str:
        return f"the request did not finish within the server's timeout of {self.settings.request_timeout_s:g} s"

    def _start(self, req: ServeRequest) -> RunningSequence | None:
        """Give an admitted request its row, proposer, generator and text stream (None: it failed)."""
        slot, reused, continues = self._pick_slot(req)
        proposer = pooled = None
        if req.speculative and req.proposer is not None and self.admission.mode(req) != "off":
            options = self.settings.proposer_options if req.proposer == self.settings.proposer else {}
            try:  # a continued conversation keeps its proposer's cross-request state; else cleared
                proposer, key = self.proposer_pool.take(req.proposer, options, slot if continues else None)
                pooled = (key, proposer)
            except Exception as error:
                self.reserved -= self.reservation(req)
                self._reject(req, "error", f"could not build proposer {req.proposer!r}: {error}")
                return None
        constraint = None
        if req.constraint is not None:  # checked by the HTTP layer already; a fresh grammar state per request
            from specdecode.constraints.build import make_constraint_state

            try:
                constraint = make_constraint_state(req.constraint, self.tokenizer, self.vocab_size, self.eos)
            except Exception as error:
                if pooled is not None:
                    self.proposer_pool.give(*pooled)
                self.reserved -= self.reservation(req)
                self._reject(req, "error", f"could not build the constraint: {error}")
                return None
        if needs_features(proposer):  # it reads the target's features of every prompt position
            reused = 0
        seq = RunningSequence(
            req,
            self.runner.add_row(slot, reused),
            self.max_length,
            self.reservation(req),
            proposer,
            self.eos,
            self.tokenizer,
            constraint,
            device=self.runner.device,
        )
        if proposer is not None and req.sampling.greedy and self.admission.mode(req) == "adaptive":
            seq.gate = DraftGate(self.pass_costs)  # as the engine's default schedule: see _plan
        seq.pooled = pooled
        seq.cached_tokens = reused
        self.active.append(seq)
        self.metrics.queue_time.observe(max(0.0, seq.started - req.created))
        self.metrics.prompt_tokens.inc(seq.prompt_len)
        if self.prefix_cache is not None:
            self.metrics.prefix_cache_queries.inc(seq.prompt_len)
            self.metrics.prefix_cache_hits.inc(reused)
        return seq

    def _scope(self, req: ServeRequest) -> str | None:
        """The prefix cache's scope of ``req``: None (``global``), or its ``user`` (``user``; a
        request without one gets a scope of its own, so it shares with nobody)."""
        if self.settings.prefix_cache_scope == "global":
            return None
        return f"user:{req.user}" if req.user is not None else f"request:{req.request_id}"

    def _pick_slot(self, req: ServeRequest) -> tuple[int | None, int, bool]:
        """The slot a new row of ``req`` takes, the prompt tokens cached there and whether ``req``
        continues that slot's conversation (its cached prefix reused, none of it dropped for a
        stranger: :class:`~specdecode.models.prefix_cache.Pick`); ``(None, 0, False)`` without a
        prefix cache."""
        if self.prefix_cache is None:
            return None, 0, False
        pick = self.prefix_cache.pick(req.prompt_ids, self.runner.free_slots, self._scope(req))  # type: ignore[attr-defined]
        if pick.evicted is not None:
            self.metrics.prefix_cache_evictions.inc()
        return pick.slot, pick.reused, pick.reused > 0 and pick.evicted is None

    def _prefill(self, seqs: list[RunningSequence]) -> None:
        """One ragged pass over the prompts of ``seqs`` (consecutive new rows); emit each first token."""
        forward = functools.partial(self._forward, seqs)
        results, logits = loop_steps.prefill(seqs, forward, self._clock, self._pass_observers())
        for s, result, row_logits in zip(seqs, results, logits, strict=True):
            self._emit(s, result.tokens, row_logits)  # the logits: rows of log-probabilities, if asked

    def _pass_observers(self) -> list[PassObserver]:
        """Who hears of every batched target pass besides the rows' own statistics: the metrics
        (the ``prefill`` and ``target`` phases) and the cost model, once there is one."""
        return [self.metrics] if self.cost is None else [self.metrics, self.cost]

    def _plan(self) -> list[int]:
        """k per running sequence for this step (``--speculation`` and the cost model). A lone
        greedy adaptive row whose proposer copies (``copies``: prompt lookup, a prediction) is the
        engine's single sequence: it drafts its k, and its draft gate (:mod:`specdecode.draft_gate`)
        sends as much of the draft as its measured one-row pass costs and its own acceptance say
        pays (:meth:`_gated`)."""
        max_ks = [s.max_draft() for s in self.active]
        if (
            len(self.active) == 1
            and self.active[0].gate is not None
            and getattr(self.active[0].proposer, "copies", False)
        ):
            return max_ks
        modes = [self.admission.mode(s.req) for s in self.active]
        if "adaptive" not in modes or self.cost is None:  # no cost model yet: adaptive drafts as on
            return [0 if mode == "off" else m for m, mode in zip(max_ks, modes, strict=True)]
        # Rows of requests that asked for "on" draft their k whatever the plan says; the plan is
        # still made over every row, so with such rows in the batch it misprices the others a little.
        names = [s.req.proposer or "" for s in self.active]
        priors = [self._prior.get(n, INITIAL_ACCEPTANCE) for n in names]
        alphas = [s.estimate.rate(p) for s, p in zip(self.active, priors, strict=True)]
        costs = [self.cost.draft_time(n) for n in names]
        # A row whose proposer is behind (never drafted, or paused) first catches up: a one-off cost,
        # charged spread over the drafting steps the row has left (its remaining tokens / E).
        setups = []
        for s, n, a, m in zip(self.active, names, alphas, max_ks, strict=True):
            behind = s.behind()
            left = max(1.0, (s.limit - len(s.generated)) / expected_tokens(a, max(1, m)))
            setups.append(self.cost.catchup_time(n) * behind / left if behind else 0.0)
        ks = plan_speculation(alphas, max_ks, costs, self.cost.target_time, setup_costs=setups)
        for s, k, m in zip(self.active, ks, max_ks, strict=True):
            if k == 0 and m > 0:
                s.estimate.observe(0, 0)  # not drafting: forget a little, drift back to the prior
        return [m if mode == "on" else k for k, m, mode in zip(ks, max_ks, modes, strict=True)]

    def _step(self) -> None:
        seqs = list(self.active)
        phase = self.metrics.step_phase
        t0 = self._clock()
        ks = self._plan()
        t1 = self._clock()
        drafts = [self._draft(s, k) for s, k in zip(seqs, ks, strict=True)]  # 1. draft
        alone = len(seqs) == 1 and seqs[0].gate is not None
        if alone:  # the draft gate may shorten a copied draft
            drafts = [self._gated(seqs[0], drafts[0])]
        self.metrics.batch_size.observe(len(seqs))
        self.metrics.steps.inc()
        tic = self._clock()
        forward = functools.partial(self._forward, seqs)
        logits, hidden, seconds = loop_steps.score(seqs, drafts, forward, self._clock, self._pass_observers())  # 2.
        phase.labels(phase="plan").observe(t1 - t0)
        phase.labels(phase="draft").observe(tic - t1)
        for s, draft, row_logits, row_hidden in zip(seqs, drafts, logits, hidden, strict=True):
            # 3.-4. verify the drafts scored (fewer than drafted only if greedy and a draft token was wrong),
            # where the logits are (the draft was moved once by s.propose: ids CPU, probs on that device);
            # roll back to context + accepted drafts; proposer feedback and stats
            truncate = functools.partial(self.runner.truncate, s.row)
            result = loop_steps.verify_truncate(s, draft, row_logits, row_hidden, truncate)
            n = result.num_accepted
            if s.gate is not None:  # its sent draft's outcome (a lone row's); what a withheld draft would have got
                s.gate.observe(len(draft) if alone else 0, n, result.tokens)
                s.stats.gated_draft_tokens = s.gate.gated_tokens
            if len(seqs) == 1:  # a one-row pass: what it cost (the draft gates' prices)
                self.pass_costs.observe(
                    len(draft) + 1, int(row_logits.shape[0]), seconds, self._clock() - t1, whole=not draft.early_stop
                )
            if len(draft):
                s.estimate.observe(len(draft), n)
                name = s.req.proposer or ""
                prior = self._prior.get(name, INITIAL_ACCEPTANCE)
                trials = acceptance_trials(len(draft), n)  # per-position, as AcceptanceEstimate
                self._prior[name] = min(1.0, max(0.0, prior + PRIOR_RATE * (n - trials * prior)))
                self.metrics.speculating_rows.inc()
                self.metrics.observe_verification(len(draft), n)
            self._emit(s, result.tokens, row_logits)  # 5. emit, stop (rows 0 .. n: log-probabilities, if asked)
        self._leave_finished()
        toc = time.perf_counter()
        phase.labels(phase="verify").observe(toc - tic - seconds)
        phase.labels(phase="step").observe(toc - t0)

    def _forward(
        self,
        seqs: list[RunningSequence],
        inputs: list[torch.Tensor],
        num_logits: list[int],
        hints: list[torch.Tensor | None] | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One batched target pass over the rows of ``seqs`` (rows ``seqs[0].row ..``); the target's
        features per row (``[n_b, H]``) for the rows whose proposer reads them, else None. ``hints``:
        per row its greedy draft (a split pass may stop that row at a wrong draft token: fewer logits)."""
        wants = [needs_features(s.proposer) for s in seqs]
        first = seqs[0].row
        if not any(wants):
            return self.runner.forward(first, inputs, num_logits, greedy_drafts=hints), [None] * len(seqs)  # type: ignore[return-value]
        logits, hidden = self.runner.forward(first, inputs, num_logits, return_hidden=True, greedy_drafts=hints)
        return logits, [h if w else None for h, w in zip(hidden, wants, strict=True)]

    def _draft(self, s: RunningSequence, k: int) -> DraftTokens:
        """Up to ``k`` tokens from the sequence's proposer. A proposer that fails is dropped: the
        sequence goes on without speculation (its output is unchanged) and its summary says why."""
        if k <= 0 or s.proposer is None:
            return DraftTokens.empty()
        tic = self._clock()
        try:
            draft = s.propose(k)
        except Exception as error:
            log.warning("proposer %s failed for %s: %s", s.req.proposer, s.req.request_id, traceback.format_exc())
            s.proposer, s.proposer_error = None, f"{type(error).__name__}: {error}"
            return DraftTokens.empty()
        seconds = self._clock() - tic
        s.stats.draft_time_s += seconds
        # c_p is the steady cost per drafted token: a call that first caught up with more context
        # than one step adds (the proposer's prompt prefill on its first call, or the tokens of the
        # steps it did not draft) is not a sample of it.
        behind = s.behind()
        s.drafted_at = s.T
        if self.cost is not None and s.req.proposer is not None:
            if behind:
                self.cost.observe_catchup(s.req.proposer, seconds, len(draft), behind)
            else:
                self.cost.observe_draft(s.req.proposer, seconds, len(draft))
        return draft

    def _gated(self, s: RunningSequence, draft: DraftTokens) -> DraftTokens:
        """``draft`` through ``s``'s draft gate (a copied draft cut to what pays, possibly nothing;
        others unchanged), the gate's time charged to drafting."""
        assert s.gate is not None
        tic = self._clock()
        kept = s.gate.trim(draft)
        s.stats.draft_time_s += self._clock() - tic
        return kept

    def _emit(self, s: RunningSequence, tokens: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        """Append ``tokens`` to the sequence (cut at a stop) and send the client its event; ``logits``:
        the pass's rows for ``tokens`` (``[>= len(tokens), V]``), for a request with ``logprobs``."""
        before = len(s.generated)
        new_ids, new_text = s.append(tokens, logits)
        logprobs = s.logprobs[before:] if s.logprobs is not None else None
        if s.first_token is None:
            s.first_token = time.time()
            s.stats.time_to_first_token_s = s.first_token - s.req.created
            self.metrics.ttft.observe(s.stats.time_to_first_token_s)
        self.metrics.generation_tokens.inc(len(new_ids))
        if s.finish_reason is None:
            self._send(s.req, Event(new_ids, new_text, logprobs=logprobs))
        else:
            self._finish(s, s.finish_reason, new_ids, new_text, logprobs)

    def _leave_finished(self) -> None:
        for s in [s for s in self.active if s.finish_reason is not None]:
            self._free(s)

    def _free(self, s: RunningSequence) -> None:
        """Remove ``s`` from the batch: free its row (the last row moves in) and its reservation."""
        if s not in self.active:
            return
        slot = self.runner.seq_ids[s.row] if self.prefix_cache is not None else None  # type: ignore[attr-defined]
        keep = slot is not None and s.finish_reason in ("stop", "length", "abort")
        if keep:  # its cells hold context[:n]: a cached prefix for the next request
            assert self.prefix_cache is not None and slot is not None
            n = min(self.runner.lengths[s.row], s.T)
            self.prefix_cache.leave(slot, s.context[:n].tolist(), self._scope(s.req))
        moved = self.runner.remove_row(s.row, keep=True) if keep else self.runner.remove_row(s.row)
        if s.pooled is not None and s.proposer_error is None:  # a proposer that failed is not kept
            self.proposer_pool.give(*s.pooled, slot=slot if keep else None)
            s.pooled = None
        last = self.active.pop()
        if moved is not None:
            self.active[s.row] = last
            last.row = s.row
        self.reserved -= s.reserved
        self.metrics.running.set(len(self.active))
        self.metrics.kv_reserved.set(self.reserved)

    def _finish(
        self,
        s: RunningSequence,
        reason: str,
        new_ids: list[int] | None = None,
        new_text: str = "",
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        s.finish_reason = reason
        info = s.summary(self.admission.mode(s.req))
        timings = info["timings"]
        self.metrics.request_success.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(timings["e2e_s"])
        if s.first_token is not None and len(s.generated) > 1:
            self.metrics.tpot.observe((timings["finished"] - s.first_token) / (len(s.generated) - 1))
        self._audit(s.req, reason, info, s.error)
        self._send(s.req, Event(new_ids or [], new_text, reason, info, s.error, logprobs))
        if reason not in ("stop", "length"):  # aborted / timed out / failed mid-step: leave now
            self._free(s)

    def _reject(self, req: ServeRequest, reason: str, message: str) -> None:
        """End a request that never joined the batch."""
        self.metrics.request_success.labels(finished_reason=reason).inc()
        now = time.time()
        info = {
            "usage": usage(len(req.prompt_ids), 0),
            "speculative": speculative_summary(req, self.admission.mode(req), False, SpecStats()),
            "timings": {"created": req.created, "finished": now, "e2e_s": now - req.created},
        }
        self._audit(req, reason, info, message)
        self._send(req, Event([], "", reason, info, message))

    def _audit(self, req: ServeRequest, reason: str, info: dict[str, Any], error: str | None) -> None:
        if self.audit is None:
            return
        try:
            self.audit.write(audit_record(req, reason, info, error), req.audit_prompt)
        except OSError as e:
            log.error("audit log: could not write %s: %s", self.audit.path, e)

    @staticmethod
    def _send(req: ServeRequest, event: Event) -> None:
        try:
            req.on_event(event)
        except Exception as error:  # the client's loop is gone (server shutting down)
            log.debug("could not deliver an event of %s: %s", req.request_id, error)
