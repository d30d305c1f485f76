"""The loop reports each pass to observers (specdecode.pass_observers), the engine and the server's
scheduler share one prefill and one verify -> truncate (specdecode.loop_steps), and the proposer
protocol carries no bookkeeping (docs/design.md §2)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from specdecode import loop_steps
from specdecode.cost.serve_model import CostModel
from specdecode.decode_state import DecodeState
from specdecode.engine import SpeculativeGenerator
from specdecode.pass_observers import (
    NO_DRAFT_PASSES,
    NO_PROPOSER,
    DraftPasses,
    PassObserver,
    ProposerInfo,
    StatsObserver,
    TargetPass,
    describe,
)
from specdecode.proposers import make_proposer
from specdecode.proposers.base import DraftTokens, Proposer, ProposerBase, check_proposer
from specdecode.proposers.draft_model import DraftModelProposer
from specdecode.proposers.hybrid import LookupFirstProposer
from specdecode.proposers.prediction import PredictionProposer
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.sampling import SamplingParams
from specdecode.serve.config import ServeSettings
from specdecode.serve.prometheus import ServeMetrics
from specdecode.serve.request import ServeRequest
from specdecode.serve.scheduler import Scheduler
from specdecode.stats import SpecStats


class Heard(PassObserver):
    """Keeps every report."""

    def __init__(self) -> None:
        self.targets: list[TargetPass] = []
        self.drafts: list[tuple[str, int]] = []

    def target_pass(self, p: TargetPass) -> None:
        self.targets.append(p)

    def draft_pass(self, kind: str, width: int) -> None:
        self.drafts.append((kind, width))


# ------------------------------------------------------------------ the protocol lost its bookkeeping
def test_the_protocol_has_no_bookkeeping_members() -> None:
    for gone in ("quantization", "pass_kind", "take_pass_widths"):
        assert gone not in Proposer.__annotations__ and not hasattr(Proposer, gone), gone
        assert not hasattr(ProposerBase, gone), gone
    assert not hasattr(ProposerBase, "record_pass")
    assert ProposerBase().describe() is NO_PROPOSER == ProposerInfo("none", "draft")
    assert ProposerBase.passes is NO_DRAFT_PASSES and describe(None) is NO_PROPOSER

    class Described:  # a duck-typed proposer: the members the loop reads, and describe()
        name, supports_tree, needs_target_features, default_num_speculative_tokens = "d", False, False, 4

        def reset(self) -> None: ...
        def clear_cache(self) -> None: ...
        def describe(self) -> ProposerInfo:
            return ProposerInfo("int8", "eagle")

        def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:  # noqa: ANN001
            return DraftTokens.empty()

        def observe(self, result) -> None: ...  # noqa: ANN001
        def observe_features(self, hidden) -> None: ...  # noqa: ANN001

    check_proposer(Described())  # no quantization, pass_kind or take_pass_widths needed
    del Described.describe
    with pytest.raises(TypeError, match="lacks describe"):
        check_proposer(Described())


# ------------------------------------------------------------------ a proposer's own forwards
def test_a_draft_models_forwards_are_reported_with_their_widths(tiny_pair) -> None:
    """The draft model reports each forward (tokens fed) to its sink as it makes it: the catch-up
    feed of the context it has not cached, then one token per further draft."""
    proposer = DraftModelProposer(tiny_pair["identical"])
    heard = Heard()
    proposer.reset()
    proposer.passes = DraftPasses("draft", [heard])
    greedy = SamplingParams()
    context = torch.arange(5, 10)  # (5,)
    draft = proposer.propose(context, 3, greedy, None)
    assert heard.drafts == [("draft", 5), ("draft", 1), ("draft", 1)]  # all 5 tokens, then 2 of the 3 drafts
    heard.drafts.clear()
    longer = torch.cat([context, draft.ids, torch.tensor([3])])  # every draft kept, then the bonus token
    proposer.propose(longer, 2, greedy, None)
    assert heard.drafts == [("draft", 2), ("draft", 1)]  # the last draft (never fed) and the bonus token
    proposer.passes = NO_DRAFT_PASSES
    proposer.propose(torch.cat([longer, torch.tensor([4])]), 2, greedy, None)  # heard by nobody
    assert heard.drafts == [("draft", 2), ("draft", 1)]


def test_wrappers_hand_passes_and_describe_on(tiny_pair) -> None:
    model = DraftModelProposer(tiny_pair["identical"])
    model.quantization = "int8"  # as a quantized draft would say
    sink = DraftPasses("draft", [Heard()])
    lookup_first = LookupFirstProposer(model, min_ngram=2)
    lookup_first.passes = sink
    assert model.passes is sink and lookup_first.passes is sink
    assert lookup_first.describe() == ProposerInfo("int8", "draft")
    prediction = PredictionProposer(torch.tensor([1, 2, 3]), lookup_first)
    other = DraftPasses("draft", [])
    prediction.passes = other
    assert model.passes is other and prediction.describe() == ProposerInfo("int8", "draft")
    alone = PredictionProposer(torch.tensor([1, 2, 3]))
    alone.passes = sink  # no fallback: nothing to hand on, nothing reported
    assert alone.passes is NO_DRAFT_PASSES and alone.describe() is NO_PROPOSER
    assert PromptLookupProposer().describe() is NO_PROPOSER


# ------------------------------------------------------------------ stats as an observer
def test_the_stats_observer_fills_the_pass_fields() -> None:
    stats = SpecStats(num_speculative_tokens=3)
    observer = StatsObserver(stats, ProposerInfo("int8-head", "medusa"))
    assert (stats.draft_pass_kind, stats.draft_quantization) == ("medusa", "int8-head")
    observer.target_pass(TargetPass((7,), 0.5, prefill=True))
    observer.target_pass(TargetPass((4,), 0.25))
    observer.target_pass(TargetPass((1,), 0.125))
    observer.draft_pass("medusa", 1)
    assert stats.target_forward_passes == 3 and stats.target_pass_widths == [7, 4, 1]
    assert stats.prefill_time_s == 0.5 and stats.target_time_s == 0.375
    assert stats.draft_pass_widths == [1]
    assert StatsObserver(SpecStats()).stats.draft_pass_kind == "draft"


def test_the_engine_records_the_draft_models_forwards(tiny_pair) -> None:
    """Through the engine: a draft that always agrees drafts k = 3 a step; its first step feeds
    the whole context (prompt + first token), each later one the two tokens it had not fed (the
    last draft and the bonus token), each step then two single-token forwards. Every target pass
    is counted with its width; the sink is taken back after the request."""
    proposer = DraftModelProposer(tiny_pair["identical"])
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=proposer)
    prompt = [5, 6, 7, 8, 9, 10]
    result = spec.generate(prompt, SamplingParams(max_new_tokens=13), num_speculative_tokens=3)
    stats = result.stats
    steps = len(stats.accepted_per_step)
    assert stats.accepted_per_step == [3] * steps and steps == 3  # 1 + 3 x 4 = 13 tokens
    assert stats.draft_pass_widths == [len(prompt) + 1, 1, 1] + [2, 1, 1] * (steps - 1)
    assert stats.target_pass_widths == [len(prompt)] + [4] * steps
    assert stats.target_forward_passes == 1 + steps
    assert (stats.draft_pass_kind, stats.draft_quantization) == ("draft", "none")
    assert stats.prefill_time_s > 0 and stats.target_time_s > 0
    assert proposer.passes is NO_DRAFT_PASSES  # its forwards after the request are no one's


# ------------------------------------------------------------------ the shared steps
def rows_forward(target: Any, reported: list[tuple[list[int], bool]]) -> loop_steps.RowsForward:
    """A batch of one-row passes through a plain torch model, each a fresh full pass (no cache):
    the logits of ``inputs[b]``'s last ``num_logits[b]`` positions after ``history[b]``."""
    history: list[torch.Tensor] = []

    def forward(inputs, num_logits, hints):  # noqa: ANN001, ANN202
        reported.append(([int(x.shape[0]) for x in inputs], hints is None))
        if hints is None:
            history[:] = [x.clone() for x in inputs]
        else:
            history[:] = [torch.cat([h, x]) for h, x in zip(history, inputs, strict=True)]
        with torch.no_grad():
            out = [target(h.view(1, -1)).logits[0, -n:].float() for h, n in zip(history, num_logits, strict=True)]
        return out, [None] * len(inputs)

    forward.history = history  # type: ignore[attr-defined]
    return forward


def test_the_shared_steps_report_each_pass_to_rows_and_loop(tiny_pair) -> None:
    """prefill / score / verify_truncate over two rows: each row's observers hear their own width,
    the loop's observers every row's; truncate gets the context plus the accepted drafts."""
    target = tiny_pair["target"]
    states = [
        DecodeState(prompt, SamplingParams(max_new_tokens=8), 64, 3, stats=SpecStats(num_speculative_tokens=3))
        for prompt in ([1, 2, 3], [4, 5])
    ]
    rows = [Heard(), Heard()]
    for s, heard in zip(states, rows, strict=True):
        s.observers.append(heard)
    loop = Heard()
    ticks = iter(range(100))

    def clock() -> float:  # each pass takes one "second"
        return float(next(ticks))

    calls: list[tuple[list[int], bool]] = []
    forward = rows_forward(target, calls)
    results, logits = loop_steps.prefill(states, forward, clock, [loop])
    assert calls == [([3, 2], True)] and [r.num_accepted for r in results] == [0, 0]
    assert [x.shape[0] for x in logits] == [1, 1]
    assert loop.targets == [TargetPass((3, 2), 1.0, prefill=True)]
    assert rows[0].targets == [TargetPass((3,), 1.0, True)] and rows[1].targets == [TargetPass((2,), 1.0, True)]
    for s, r in zip(states, results, strict=True):
        s.append(r.tokens)
    drafts = [DraftTokens(torch.tensor([7, 8])), DraftTokens.empty()]
    logits, hidden, seconds = loop_steps.score(states, drafts, forward, clock, [loop])
    assert calls[-1] == ([3, 1], False) and seconds == 1.0 and hidden == [None, None]
    assert loop.targets[-1] == TargetPass((3, 1), 1.0) and rows[1].targets[-1] == TargetPass((1,), 1.0)
    for s, d, row_logits in zip(states, drafts, logits, strict=True):
        kept: list[int] = []
        result = loop_steps.verify_truncate(s, d, row_logits, None, kept.append)
        assert kept == [s.T + result.num_accepted] and s.stats.accepted_per_step == [result.num_accepted]
    assert [s.stats.target_pass_widths for s in states] == [[3, 3], [2, 1]]
    assert [s.stats.target_forward_passes for s in states] == [2, 2]


def test_server_metrics_and_cost_model_are_observers() -> None:
    metrics = ServeMetrics()
    metrics.target_pass(TargetPass((5, 3), 0.5, prefill=True))
    metrics.target_pass(TargetPass((2, 4), 0.25))
    phase = metrics.step_phase
    assert phase.labels(phase="prefill")._sum.get() == 0.5 and phase.labels(phase="target")._sum.get() == 0.25
    cost = CostModel([1, 2], [1, 4], [[1.0, 1.0], [1.0, 1.0]])
    seen: list[tuple[int, int, float]] = []
    cost.observe_target = lambda b, t, s: seen.append((b, t, s))  # type: ignore[method-assign]
    cost.target_pass(TargetPass((5, 3), 0.5, prefill=True))  # a prefill is not a sample of t_target
    cost.target_pass(TargetPass((2, 4), 0.25))
    assert seen == [(2, 4, 0.25)]  # rows, the widest row, seconds


class CountedSteps:
    """Wraps loop_steps' functions and counts the calls (who calls them is the point)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {"prefill": 0, "score": 0, "verify_truncate": 0}
        for name in self.calls:
            original = getattr(loop_steps, name)

            def counted(*args, _name=name, _original=original, **kwargs):  # noqa: ANN002, ANN003, ANN202
                self.calls[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(loop_steps, name, counted)


def test_engine_and_scheduler_run_the_same_steps_with_the_same_records(chat_models, tiny_tokenizer, monkeypatch):
    """One request through the engine and through the server: both call loop_steps' prefill, score and
    verify_truncate (once per pass), and give the same tokens and the same records: pass widths,
    the draft's forwards, acceptance per step, draft_pass_kind, draft_quantization."""
    target, draft = chat_models
    prompt = tiny_tokenizer.encode("def add(a, b):")
    new = 24
    counted = CountedSteps(monkeypatch)
    spec = SpeculativeGenerator(target, proposer=make_proposer("draft_model", draft=draft, target=target))
    engine = spec.generate(prompt, SamplingParams(max_new_tokens=new), num_speculative_tokens=3)
    steps = len(engine.stats.accepted_per_step)
    assert steps > 2 and 0 < engine.stats.accepted_tokens < 3 * steps  # part of the drafts accepted
    assert counted.calls == {"prefill": 1, "score": steps, "verify_truncate": steps}

    counted.calls.update(prefill=0, score=0, verify_truncate=0)
    settings = ServeSettings(model_name="tiny", max_batch_size=2, kv_budget_tokens=4096, speculation="on")
    scheduler = Scheduler(target, tiny_tokenizer, settings, draft=draft)
    scheduler.start(thread=False)
    started: list[Any] = []
    start = scheduler._start
    scheduler._start = lambda req: started.append(start(req)) or started[-1]  # type: ignore[method-assign]
    events: list[Any] = []
    scheduler.submit(ServeRequest(
        request_id="r", prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=new), speculative=True,
        proposer="draft_model", num_speculative_tokens=3, on_event=events.append,
    ))
    while scheduler.run_once():
        pass
    served = started[0].stats
    assert [t for e in events for t in e.token_ids] == engine.token_ids
    assert counted.calls == {"prefill": 1, "score": steps, "verify_truncate": steps}
    for name in ("target_pass_widths", "draft_pass_widths", "accepted_per_step", "draft_pass_kind",
                 "draft_quantization", "target_forward_passes", "drafts", "draft_tokens", "accepted_tokens"):
        assert getattr(served, name) == getattr(engine.stats, name), name
    assert copy.copy(served.draft_pass_widths)  # the draft's forwards reached the server's stats too
