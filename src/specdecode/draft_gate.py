"""The draft gate: send a copied draft to the target only as far as it is expected to pay.

Prompt lookup and a prediction draft what followed an earlier occurrence of the context's last n
tokens (:attr:`~specdecode.proposers.base.DraftTokens.evidence`: the source and n). Whether that
pays depends on the machine and on the request: on a 2-core CPU a verification pass of 3 tokens
costs 2-2.5 one-token passes, so a draft whose first token is accepted less than about half the
time loses to plain decoding, while on a GPU almost any draft pays; and a 3-token match is right
0.96 of the time in a HumanEval answer but far less in a math answer. The gate decides per step,
from this request's own evidence and this machine's own measured pass costs:

- **acceptance**: per source and match length (1, 2, 3, 4, 5+ tokens), a Beta estimate of the
  probability that the draft's first token is accepted, and one (per request) of each later token
  being accepted after the one before it; priors from the measurements below, worth a few trials;
- **cost**: milliseconds of a target pass by the rows it computed (:class:`PassCosts`, kept per
  generator: measured on every pass, before that ``c(1) * (1 + prior_slope * (w - 1))``), and the
  host's work per step; where a greedy pass stops early at a wrong draft (llama.cpp's exact mode
  verifies in chunks and stops after the first chunk whose argmax disagrees), the expected cost
  counts only the chunks expected to run (the runner declares its chunk: ``greedy_stop_rows``);
- **decision**: keep the first d drafted tokens, d in 0 .. len(draft), maximizing expected tokens
  per expected millisecond; d = 0 (a plain step) unless that beats plain decoding's rate. Where the
  runner's early stop costs a call of its own (llama.cpp's patched exact mode: 2 rows, then the rest
  in a second call; :meth:`PassCosts.whole_possible`), each d is also priced as one whole call
  without the early stop, and the better is kept (``DraftTokens.early_stop``): a draft likely right
  saves the extra call's fixed part (~21 ms on the 2-core EPYC), an unlikely one keeps the stop
  (and a source's drafts keep it until one of the request's drafts from it was right:
  ``whole_needs_hit``);
- **shadow check**: a draft the gate kept back entirely is still scored, free, against the tokens
  the target then decodes (greedy decoding is deterministic, so the tokens it emits are exactly
  what verifying the draft would have accepted): one withheld draft at a time, counted as a trial
  of its match length like a verified one. Without it a gate that shut learned nothing more and
  stayed shut (live on HumanEval/0 on the 2-core EPYC: 64 drafted tokens, then none;
  lab/notebook/2026-11-27-heldout-gate.md).

- **misses**: where a miss costs something (a draft's smallest pass over 2% dearer than a one-token
  pass), a source whose first ``max_misses`` drafts of a request all missed (not one token
  accepted) is withheld until a shadow check finds its first token right (scored as soon as that
  token is decoded, not after the whole draft), and again whenever its misses reach ``max_misses``
  per hit plus ``max_misses`` (``misses_per_hit``: a source right less than a third of the time stays
  shut between the shadow hits that reopen it): the Beta estimates learn one bucket at a time and,
  for a client's prediction, price a right draft at up to 16 tokens, so they would keep an
  unrelated prediction's drafts for a dozen misses (~12 ms each on the 2-core EPYC). A source other
  than a client's prediction starts a request shut (``shadow_until_hit``): its drafts are
  shadow-checked until one would have had its first token right, so a turn whose copies are never
  right pays for no draft at all (before, one or two misses per turn: reasoning and qa ~0.99x).

A client's prediction (``("prediction", n)``, :mod:`specdecode.proposers.prediction`) has priors of
its own (an edit's answer copies it) and is never shortened: sent whole (with the early stop, or
without where the proposer says the copy goes on) or withheld. Drafts without evidence (a draft
model's, EAGLE's) pass unchanged. Only greedy requests are gated:
the gate reads the clock, and a seeded sampled request must draw the same tokens every run (the
draws it consumes depend on what is drafted). Lossless either way: the gate only shortens a
deterministic draft, from what earlier steps showed.

Measured (``lab/scripts/lookup_gate_replay.py``: prompt lookup's drafts on the target's recorded
answers to 30 turns of every Spec-Bench category and HumanEval, priced with measured cost tables;
lab/notebook/2026-11-27-draft-gate.md): on the 2-core EPYC in exact mode, prompt lookup after
3-token matches (n-grams up to 4) ran at 0.93-1.20x of plain decoding per category, gated with
n-grams up to 8 at 0.99-1.21x (1.03x -> 1.06x overall); on the
16-core Xeon's exact-mode table 0.98-1.53x, gated 0.98-1.54x (1.14x -> 1.15x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.proposers.base import PREDICTION, DraftTokens

SPIKE_ROWS = 1.2
"""A pass of w rows is taken to cost at most ``SPIKE_ROWS * w * c(1)`` (CPUs: at most ~w one-token
passes; GPUs far less): beyond it, a timing spike."""

MAX_ROWS = 128
"""Widths (rows computed per pass) whose cost is tracked."""


@dataclass(frozen=True)
class GateConfig:
    """Options of :class:`DraftGate`.

    Attributes:
        prior_first: prior probability that a draft's first token is accepted, by match length
            (1 .. 5, 5 standing for 5 or more).
        prior_weight: trials of evidence behind each ``prior_first`` (> 0).
        prior_next: prior probability that a drafted token after an accepted one is accepted.
        prior_next_weight: trials behind ``prior_next`` (> 0).
        prior_first_prediction, prior_next_prediction: as ``prior_first`` and ``prior_next``, for a
            client's prediction (source :data:`PREDICTION`; the answer's start counts as a match of
            4, a copy going on as 16, so 5+).
        max_misses: a source's drafts are withheld (shadow checks only) once this many of a request's
            drafts from it had no token accepted and none had one (>= 1); None: never. 2 by replay
            (lab/scripts/gate_replay_split.py): a prediction unrelated to the answer then costs 1.2%
            over prompt lookup alone on 22 held-out turns (1.9% with 4), the code edits lose nothing.
        misses_per_hit: where ``max_misses`` is set, a source is also withheld once its misses
            reach ``max_misses * (1 + hits)`` of this request (a hit: a draft, sent or
            shadow-checked, whose first token was right): a source right less than once in
            ``max_misses + 1`` drafts stays shut between the shadow hits that reopen it. False:
            one hit opens it for the rest of the request. On by replay (lab/scripts/gate_replay_split.py,
            2026-11-28): the held-out math turn whose shadow hits kept reopening prompt lookup for
            misses 0.964 -> 0.973 of plain decoding (0.952 -> 0.976 with an unrelated prediction),
            all held-out turns 1.126 -> 1.128, the 30-turn corpus and the code edits unchanged.
        whole_needs_hit: a draft other than a prediction goes as one whole call (no early stop) only
            once one of this request's drafts from its source had its first token right (sent or
            shadow-checked): before that the priors alone (0.7 after a 3-token match) would send a
            request's first draft whole, and a miss then costs the whole pass (replayed on the
            held-out turns, lab/scripts/gate_replay_split.py: the worst turn 0.953 -> 0.964 of plain
            decoding, the worst category 0.981 -> 0.993, all turns 1.135 -> 1.126).
        shadow_until_hit: where a miss costs something (as ``max_misses``), a source other than a
            client's prediction is withheld (shadow checks only) until one of this request's drafts
            from it had its first token right; then ``max_misses`` and ``misses_per_hit`` apply (the
            shadow checks' misses count). Replayed (lab/scripts/gate_replay_split.py, patch v3's
            costs, 2026-11-28): 22 held-out turns, worst turn 0.973 -> 0.993 of plain decoding,
            reasoning 0.994 -> 1.000, qa 0.993 -> 1.000, all 1.128 -> 1.134; the 30-turn corpus
            worst turn 0.966 -> 0.991, all 1.205 -> 1.215; the code edits 2.10 -> 2.06 with a
            prediction (its fallback's first right copy waits for a shadow hit), 2.02 -> 2.00 without.
        prior_slope: before a width is measured, a pass of w rows costs ``c(1) * (1 + prior_slope *
            (w - 1))`` (2-core CPU: 0.55-0.9; a GPU: ~0.05). >= 0.
        margin: draft only when the expected rate beats plain decoding's by this fraction (>= 0).
        ema: weight of the newest pass in the moving average of its width's cost, in (0, 1].

    Raises:
        ValueError: a value outside its range (the message names it).
    """

    prior_first: tuple[float, float, float, float, float] = (0.3, 0.5, 0.7, 0.8, 0.85)
    prior_weight: float = 2.0
    prior_next: float = 0.8
    prior_next_weight: float = 4.0
    prior_first_prediction: tuple[float, float, float, float, float] = (0.6, 0.7, 0.8, 0.9, 0.95)
    prior_next_prediction: float = 0.95
    max_misses: int | None = 2
    misses_per_hit: bool = True
    whole_needs_hit: bool = True
    shadow_until_hit: bool = True
    prior_slope: float = 0.6
    margin: float = 0.0
    ema: float = 0.2

    def __post_init__(self) -> None:
        for name in ("prior_first", "prior_first_prediction"):
            value = getattr(self, name)
            if len(value) != 5 or not all(0.0 <= p <= 1.0 for p in value):
                raise ValueError(f"{name} must be 5 probabilities, got {value!r}")
        for name in ("prior_next", "prior_next_prediction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        for name in ("prior_weight", "prior_next_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.prior_slope < 0 or self.margin < 0:
            raise ValueError(f"prior_slope and margin must be >= 0, got {self.prior_slope!r}, {self.margin!r}")
        if self.max_misses is not None and (not isinstance(self.max_misses, int) or self.max_misses < 1):
            raise ValueError(f"max_misses must be None or an integer >= 1, got {self.max_misses!r}")
        for name in ("whole_needs_hit", "misses_per_hit", "shadow_until_hit"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema!r}")


@dataclass
class PassCosts:
    """What a target pass costs on this machine, measured on the passes decoding makes.

    Attributes:
        ms: moving average of milliseconds per pass by rows computed (index = rows), 0 = unmeasured.
        step_ms: moving average of the host's work per step beyond the target pass (proposing,
            verifying, Python), milliseconds; None before a step was measured.
        chunk: rows a greedy pass computes before it can stop early (the runner's
            ``capabilities.greedy_stop_rows``: llama.cpp's exact mode's invariant chunk, set by the
            engine), else learned from passes that stopped early; None: a pass computes all its rows.
        then: rows of each later chunk (``capabilities.greedy_stop_then``); None: as ``chunk``.
        whole_ms: as ``ms``, for passes of 2+ rows the gate sent whole (``DraftTokens.early_stop``
            False: one call where the early stop would have made two, see :meth:`whole_possible`).
    """

    ema: float = 0.2
    ms: list[float] = field(default_factory=lambda: [0.0] * (MAX_ROWS + 1))
    step_ms: float | None = None
    chunk: int | None = None
    then: int | None = None
    whole_ms: list[float] = field(default_factory=lambda: [0.0] * (MAX_ROWS + 1))

    def whole_possible(self, width: int) -> bool:
        """Whether a greedy pass of ``width`` rows can skip its early stop and save a call: the
        runner stops after ``chunk`` rows, then computes the rest in one call (``width <= chunk +
        then``: llama.cpp's patched exact mode, first chunk 2, then up to 64), and without the
        early stop computes all ``width`` in one (``width <= then``). Not where ``then`` is the
        invariant chunk itself (an unpatched build's 3: calls of 3 either way)."""
        chunk, then = self.chunk, self.then
        return chunk is not None and then is not None and then > chunk and chunk < width <= then

    def whole_cost(self, width: int, prior_slope: float) -> float | None:
        """ms of a pass of ``width`` rows in one call: measured; else interpolated between the
        measured whole calls and ``c(1)`` (a one-token pass is one call too), or beyond the widest
        one W at the mean share per row from ``c(1)`` to it, ``(w(W) - c(1)) / (W - 1)``; with no
        whole call measured yet, the early-stop pass's cost (:meth:`cost`) less one call's fixed part
        ``2 c(1) - c(2)`` (passes cost a fixed part plus a share per row); None while ``c(1)`` or
        ``c(2)`` is unmeasured.

        The gate measures a width's whole call only when it sends one, so an estimate that starts
        too dear is never corrected: on the 2-core EPYC the early-stop pass of 4 rows (two calls of
        2, 101.5 ms) less 13.7 ms priced a whole call of 4 rows at 88 ms where it costs 64, and the
        gate sent HumanEval's right drafts 2 tokens at a time instead of 3 (the held-out run of
        ``aeb349c``, 1.26x of llama.cpp where 1.53x before)."""
        if self.whole_ms[width]:
            return self.whole_ms[width]
        one = self.ms[1]
        points = [w for w in range(2, MAX_ROWS + 1) if self.whole_ms[w]]
        if one and points:
            below = max((w for w in points if w < width), default=1)
            above = min((w for w in points if w > width), default=None)
            at_below = self.whole_ms[below] if below > 1 else one
            if above is None:
                widest = points[-1]
                return at_below + (self.whole_ms[widest] - one) / (widest - 1) * (width - below)
            t = (width - below) / (above - below)
            return (1 - t) * at_below + t * self.whole_ms[above]
        split = self.cost(width, prior_slope)
        if split is None or not self.ms[1] or not self.ms[2]:
            return None
        return split - max(0.0, 2 * self.ms[1] - self.ms[2])

    def chunk_ends(self, width: int) -> list[int]:
        """Where a greedy pass of ``width`` rows ends its chunks: ``chunk`` rows, then ``then``."""
        chunk = self.chunk
        if chunk is None or chunk >= width:
            return [width]
        then = self.then or chunk
        return [chunk, *range(chunk + then, width, then), width]

    def observe(self, width: int, rows: int, target_s: float, step_s: float, whole: bool = False) -> None:
        """One step: a pass fed ``width`` tokens, computed ``rows`` of them (fewer when it stopped
        early) in ``target_s`` seconds, the whole step taking ``step_s``.

        A pass of 2+ rows is taken at most at :data:`SPIKE_ROWS` ``* rows * c(1)``, and raises its
        width's cost at a quarter of ``ema``: the gate measures a width only when it sends a draft
        of it, so one slow pass (a hiccup of the host) would otherwise keep drafts back for many
        steps (live once on the 2-core EPYC: a code edit's prediction withheld for 27 steps, 433
        tokens). Costs that rise for good (a longer context) follow ``c(1)`` (below).

        A one-token pass also rescales every wider width's cost by the change of ``c(1)``: passes
        cost more as the context grows (attention), and the gate, once it stops sending wide drafts,
        measures only one-token passes; without the rescaling the wide widths kept what they cost
        at the longest context seen (a generator's earlier requests). This alone does not reopen a
        gate that shut: on the 2-core EPYC in exact mode drafting sits at its break-even point, and
        a shut gate learns nothing more (lab/notebook/2026-11-27-heldout-gate.md)."""
        if rows < 1 or rows > MAX_ROWS or target_s <= 0:
            return
        extra = 1000 * max(0.0, step_s - target_s)
        self.step_ms = extra if self.step_ms is None else (1 - self.ema) * self.step_ms + self.ema * extra
        table = self.whole_ms if whole and rows > 1 else self.ms  # a whole call is priced apart
        old, ms = table[rows], 1000 * target_s
        if rows > 1 and self.ms[1]:  # a wide pass's timing spike (the host, another process) is damped
            ms = min(ms, SPIKE_ROWS * rows * self.ms[1])
            weight = self.ema if ms <= old else self.ema / 4
        else:
            weight = self.ema
        table[rows] = ms if old == 0 else (1 - weight) * old + weight * ms
        if table is self.whole_ms:
            return
        if rows == 1 and old > 0:  # keep every width's cost relative to c(1) as measured
            scale = self.ms[1] / old
            for w in range(2, MAX_ROWS + 1):
                if self.ms[w]:
                    self.ms[w] *= scale
                if self.whole_ms[w]:
                    self.whole_ms[w] *= scale
        if rows < width:
            self.chunk = rows if self.chunk is None else min(self.chunk, rows)

    def cost(self, rows: int, prior_slope: float) -> float | None:
        """ms of a pass computing ``rows`` rows: measured; else, for a pass computed in chunks, its
        chunks' costs; else interpolated between measured widths, else the prior line from ``c(1)``;
        None before a one-token pass was measured."""
        rows = max(1, min(rows, MAX_ROWS))
        if self.ms[rows]:
            return self.ms[rows]
        chunk = self.chunk
        if chunk is not None and rows > chunk and self.ms[chunk]:  # the first chunk, then the rest
            if self.then is None or self.then == chunk:  # whole chunks, then what is left
                rest = rows % chunk
                tail = self.cost(rest, prior_slope) if rest else 0.0
                return None if tail is None else (rows // chunk) * self.ms[chunk] + tail
            tail = self.cost(rows - chunk, prior_slope)
            return None if tail is None else self.ms[chunk] + tail
        one = self.ms[1]
        if not one:
            return None
        below = max((w for w in range(1, rows) if self.ms[w]), default=1)
        above = min((w for w in range(rows + 1, MAX_ROWS + 1) if self.ms[w]), default=None)
        if above is None:  # beyond the widest measured: the prior's slope from there
            return self.ms[below] + one * prior_slope * (rows - below)
        t = (rows - below) / (above - below)
        return (1 - t) * self.ms[below] + t * self.ms[above]


def _expected_tokens(a1: float, q: float, d: int) -> float:
    """Tokens a step of d drafted tokens is expected to emit: the accepted drafts (draft i with
    probability ``a1 q^(i-1)``) and the target's own token."""
    return 1.0 + sum(a1 * q ** (i - 1) for i in range(1, d + 1))


def _bucket(source: str, n: int) -> tuple[str, int]:
    """The estimate a draft of ``source`` after an ``n``-token match counts in (5: 5 or more)."""
    return source, max(1, min(5, int(n)))


class DraftGate:
    """The gate of one greedy request (see the module docstring).

    Args:
        costs: the generator's :class:`PassCosts` (shared by its requests: a property of the machine).
        config: :class:`GateConfig`.

    Attributes:
        gated_tokens: drafted tokens this request's gate kept from the target.
        shadow_trials: withheld drafts scored against the tokens decoded after them.
    """

    def __init__(self, costs: PassCosts, config: GateConfig | None = None) -> None:
        self.costs = costs
        self.config = config or GateConfig()
        self._first: dict[tuple[str, int], list[float]] = {}
        self._next: dict[str, list[float]] = {}  # per source: [successes, trials] of a token after an accepted one
        self._bucket: tuple[str, int] | None = None
        self._shadow: tuple[tuple[str, int], list[int]] | None = None  # a withheld draft, its bucket
        self._shadow_matched = 0  # its tokens the target has decoded so far
        self._hits: dict[str, list[int]] = {}  # per source: [drafts with a token accepted, drafts without]
        self.gated_tokens = 0
        self.shadow_trials = 0

    def _estimate(self, bucket: tuple[str, int]) -> list[float]:
        c = self.config
        if bucket not in self._first:
            prior = c.prior_first_prediction if bucket[0] == PREDICTION else c.prior_first
            self._first[bucket] = [prior[bucket[1] - 1] * c.prior_weight, c.prior_weight]
        return self._first[bucket]

    def _estimate_next(self, source: str) -> list[float]:
        c = self.config
        if source not in self._next:
            prior = c.prior_next_prediction if source == PREDICTION else c.prior_next
            self._next[source] = [prior * c.prior_next_weight, c.prior_next_weight]
        return self._next[source]

    def acceptance(self, source: str, n: int) -> tuple[float, float]:
        """(a1, q) as this request's evidence stands: the probability that a draft of ``source``
        after an ``n``-token match (5 standing for 5 or more) has its first token accepted, and that
        a drafted token after an accepted one is."""
        successes, trials = self._estimate(_bucket(source, n))
        later, tried = self._estimate_next(source)
        return successes / trials, later / tried

    def expected(self, a1: float, q: float, d: int) -> tuple[float, float] | None:
        """(expected tokens, expected ms) of a step drafting d tokens whose first is accepted with
        probability ``a1`` and each later one, after an accepted one, with ``q``; None while the
        cost of a one-token pass is unknown.

        A pass of ``w = d + 1`` rows that stops early runs its chunks in turn
        (:meth:`PassCosts.chunk_ends`: ends ``e_1 < e_2 < .. < w``), chunk j only when drafts 1 .. e_(j-1)
        were all accepted (probability ``A(e_(j-1))``, ``A(m) = a1 q^(m-1)``, ``A(0) = 1``); so it
        ends after chunk j with probability ``A(e_(j-1)) - A(e_j)`` (the last chunk: ``A(e_(j-1))``),
        having computed ``e_j`` rows."""

        def accepted_through(m: int) -> float:
            return 1.0 if m == 0 else a1 * q ** (m - 1)

        tokens = _expected_tokens(a1, q, d)
        width, slope = d + 1, self.config.prior_slope
        ends = self.costs.chunk_ends(width)
        cost, start = 0.0, 0
        for j, end in enumerate(ends):
            ms = self.costs.cost(end, slope)
            if ms is None:
                return None
            last = j == len(ends) - 1
            cost += (accepted_through(start) - (0.0 if last else accepted_through(end))) * ms
            start = end
        return tokens, cost + (self.costs.step_ms or 0.0)

    def expected_whole(self, a1: float, q: float, d: int) -> tuple[float, float] | None:
        """As :meth:`expected`, for the pass of ``d + 1`` rows in one call, without the early stop
        (:meth:`PassCosts.whole_possible`): the same expected tokens, the whole pass's cost."""
        ms = self.costs.whole_cost(d + 1, self.config.prior_slope)
        return None if ms is None else (_expected_tokens(a1, q, d), ms + (self.costs.step_ms or 0.0))

    def trim(self, draft: DraftTokens) -> DraftTokens:
        """The draft cut to the length with the best expected rate (possibly empty); a draft without
        ``evidence`` unchanged."""
        self._bucket = None
        if draft.evidence is None or not len(draft):
            return draft
        source, n = draft.evidence
        bucket = _bucket(source, n)
        plain = self.expected(0.0, 0.0, 0)
        if plain is None:  # no one-token pass measured yet: draft as proposed
            return draft
        a1, q = self.acceptance(source, n)
        best_d, best, best_whole = 0, (1 + self.config.margin) * plain[0] / plain[1], False
        if self._shut(source) and self._misses_cost():
            best = float("inf")  # withheld: only shadow checks until one would have been accepted
        whole_only = source == PREDICTION and not draft.early_stop  # the proposer's own choice stands
        for d in [len(draft)] if source == PREDICTION else range(1, len(draft) + 1):
            found = None if whole_only else self.expected(a1, q, d)
            if found is not None and found[0] / found[1] > best:
                best_d, best, best_whole = d, found[0] / found[1], False
            whole_allowed = whole_only or (
                source != PREDICTION and self.costs.whole_possible(d + 1) and self._whole_earned(source)
            )
            whole = self.expected_whole(a1, q, d) if whole_allowed else None
            if whole is not None and whole[0] / whole[1] > best:  # one call beats the early stop
                best_d, best, best_whole = d, whole[0] / whole[1], True
        self.gated_tokens += len(draft) - best_d
        if best_d == 0:
            if self._shadow is None:  # score it against the tokens decoded next (:meth:`observe`)
                self._shadow, self._shadow_matched = (bucket, [int(t) for t in draft.ids.tolist()]), 0
            return DraftTokens.empty()
        self._bucket = bucket
        if best_d == len(draft) and not best_whole:
            return draft
        return DraftTokens(draft.ids[:best_d], None, draft.evidence, early_stop=not best_whole)

    def observe(self, drafted: int, accepted: int, tokens: torch.Tensor | Sequence[int] = ()) -> None:
        """After a step: ``accepted`` of the ``drafted`` tokens the gate sent were kept, and the step
        decoded ``tokens`` (int64 ``[accepted + 1]`` or a list: the accepted ones and the target's
        own, in order), which also score a withheld draft (the module docstring's shadow check; read
        only while one is pending)."""
        if self._bucket is not None and drafted > 0:
            self._count(self._bucket, drafted, accepted)
        self._bucket = None
        if self._shadow is None:
            return
        for token in tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens:
            if self._shadow is None:
                break
            bucket, ids = self._shadow
            if token == ids[self._shadow_matched]:
                self._shadow_matched += 1
                if self._shadow_matched == 1:  # a hit: a shut source reopens now, not after the whole draft
                    self._hits.setdefault(bucket[0], [0, 0])[0] += 1
                if self._shadow_matched < len(ids):
                    continue
            self._count(bucket, len(ids), self._shadow_matched, tally=self._shadow_matched == 0)
            self._shadow = None
            self.shadow_trials += 1

    def _shut(self, source: str) -> bool:
        """Whether ``source``'s drafts are withheld and scored by shadow checks only: none of its
        drafts in this request was right yet (``shadow_until_hit``, not a prediction), or it has had
        ``max_misses`` drafts and none had a token accepted, or (``misses_per_hit``) ``max_misses *
        (1 + hits)`` misses."""
        hits, misses = self._hits.get(source, (0, 0))
        if self.config.shadow_until_hit and source != PREDICTION and hits == 0:
            return True
        most = self.config.max_misses
        if most is None:
            return False
        return misses >= most * (1 + hits) if self.config.misses_per_hit else hits == 0 and misses >= most

    def _whole_earned(self, source: str) -> bool:
        """Whether a draft of ``source`` may go as one whole call: always, or (``whole_needs_hit``)
        once one of this request's drafts from it had its first token right (sent or shadow-checked)."""
        return not self.config.whole_needs_hit or self._hits.get(source, (0, 0))[0] > 0

    def _misses_cost(self) -> bool:
        """Whether a miss costs anything: the smallest pass a draft makes (the runner's first chunk,
        else 2 rows) costs over 2% more than a one-token pass."""
        one, least = self.costs.cost(1, self.config.prior_slope), self.costs.cost(self.costs.chunk or 2, 0.0)
        return one is not None and least is not None and least > 1.02 * one

    def _count(self, bucket: tuple[str, int], drafted: int, accepted: int, tally: bool = True) -> None:
        """One trial of a draft from ``bucket``: ``accepted`` of its ``drafted`` tokens right (``tally``:
        also in the source's hits and misses, unless a shadow check counted its hit already)."""
        if tally:
            self._hits.setdefault(bucket[0], [0, 0])[0 if accepted > 0 else 1] += 1
        first = self._estimate(bucket)
        first[0] += accepted > 0
        first[1] += 1
        if accepted > 0 and drafted > 1:
            later = self._estimate_next(bucket[0])
            later[0] += accepted - 1
            later[1] += min(accepted, drafted - 1)  # later positions tried: up to the first rejection
