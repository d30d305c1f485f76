"""The draft gate (specdecode.draft_gate): measured pass costs, the expected cost of a chunked pass
that stops early, the decision per match length learned within a request, and lossless decoding
with the gate on (greedy identity; sampled requests are never gated)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.draft_gate import DraftGate, GateConfig, PassCosts
from specdecode.proposers.base import DraftTokens
from specdecode.proposers.prompt_lookup import PromptLookupProposer
from specdecode.schedule import SpeculationSchedule

from reference import target_only_greedy


def costs(per_row: list[float], step_ms: float = 0.0, chunk: int | None = None) -> PassCosts:
    """Costs with ``per_row[w - 1]`` ms measured for a pass of w rows."""
    measured = PassCosts()
    for w, ms in enumerate(per_row, 1):
        measured.ms[w] = ms
    measured.step_ms, measured.chunk = step_ms, chunk
    return measured


def opened(**fields: object) -> GateConfig:
    """A :class:`GateConfig` whose sources draft from a request's first step (``shadow_until_hit``
    off): the tests of the estimates and costs; the rule itself has its own test."""
    return GateConfig(**{"shadow_until_hit": False, **fields})  # type: ignore[arg-type]


def draft(n: int, d: int = 8, source: str = "prompt_lookup") -> DraftTokens:
    return DraftTokens(torch.arange(d, dtype=torch.int64), None, (source, n))


def test_pass_costs_measure_interpolate_and_learn_the_chunk() -> None:
    measured = PassCosts(ema=0.5)
    assert measured.cost(1, 0.6) is None  # nothing measured yet
    measured.observe(1, 1, 0.010, 0.012)
    assert measured.cost(1, 0.6) == pytest.approx(10.0) and measured.step_ms == pytest.approx(2.0)
    assert measured.cost(3, 0.6) == pytest.approx(10.0 + 10.0 * 0.6 * 2)  # the prior line from c(1)
    measured.observe(5, 5, 0.030, 0.030)
    assert measured.cost(3, 0.6) == pytest.approx(20.0)  # between the measured 1 and 5
    measured.observe(1, 1, 0.020, 0.020)
    assert measured.cost(1, 0.6) == pytest.approx(15.0)  # a moving average
    assert measured.chunk is None
    measured.observe(9, 6, 0.025, 0.025)  # 9 tokens fed, 6 rows computed: it stopped early
    measured.observe(9, 3, 0.015, 0.015)
    assert measured.chunk == 3


def test_wide_costs_follow_the_one_token_pass_as_the_context_changes() -> None:
    """Costs measured at a long context (c(1) 60 ms, 6 rows 300 ms), then only one-token passes at
    a short one (c(1) -> 30 ms): the 6-row cost follows c(1) (-> 150 ms), and a gate that found
    drafting unprofitable with the stale costs drafts again."""
    measured = PassCosts(ema=1.0)
    measured.chunk = 3
    measured.observe(1, 1, 0.060, 0.060)
    measured.observe(3, 3, 0.160, 0.160)
    measured.observe(6, 6, 0.300, 0.300)
    stale = PassCosts(ema=1.0, ms=list(measured.ms), chunk=3, step_ms=0.0)
    stale.ms[1] = 30.0  # what the costs were before rescaling: c(1) new, the wide widths old
    measured.observe(1, 1, 0.030, 0.030)
    assert measured.cost(1, 0.6) == pytest.approx(30.0)
    assert measured.cost(6, 0.6) == pytest.approx(150.0) and measured.cost(3, 0.6) == pytest.approx(80.0)
    config = opened(prior_first=(0.9,) * 5, prior_next=0.95)
    assert len(DraftGate(measured, config).trim(draft(5))) > 0
    assert len(DraftGate(stale, config).trim(draft(5))) == 0


@pytest.mark.parametrize("chunk, then", [(3, None), (2, 64)])
def test_expected_cost_of_a_chunked_pass_equals_enumeration(chunk: int, then: int | None) -> None:
    """With chunks of 3 (llama.cpp's exact mode unpatched), or a first chunk of 2 and the rest in one
    pass (patched), a pass of w rows stops after the first chunk holding a wrong draft: the gate's
    expected cost equals the sum over every accept/reject pattern of the drafts."""
    per_row = [10.0, 17.0, 23.0, 31.0, 38.0, 44.0, 52.0, 59.0, 66.0]
    measured = costs(per_row, step_ms=1.0, chunk=chunk)
    measured.then = then
    gate = DraftGate(measured)
    a1, q = 0.7, 0.8
    for d in range(1, 9):
        tokens, ms = gate.expected(a1, q, d)
        want_tokens = want_ms = 0.0
        for pattern in itertools.product([True, False], repeat=d):
            p = 1.0
            for i, ok in enumerate(pattern):
                chance = a1 if i == 0 else (q if pattern[i - 1] else 0.5)  # after a rejection: irrelevant
                p *= chance if ok else 1 - chance
            accepted = next((i for i, ok in enumerate(pattern) if not ok), d)
            ends = [chunk, *range(chunk + (then or chunk), d + 1, then or chunk), d + 1] if chunk < d + 1 else [d + 1]
            rows = d + 1 if accepted == d else next(e for e in ends if e > accepted)
            want_tokens += p * (accepted + 1)
            want_ms += p * per_row[rows - 1]
        assert tokens == pytest.approx(want_tokens) and ms == pytest.approx(want_ms + 1.0), d


def test_the_gate_follows_costs_and_the_request_evidence() -> None:
    cheap = costs([10.0] * 17)  # a GPU-like curve: any draft pays
    assert len(DraftGate(cheap, opened()).trim(draft(1))) == 8
    dear = costs([10.0 * w for w in range(1, 18)])  # every row costs a one-token pass: nothing pays
    gate = DraftGate(dear, opened())
    assert len(gate.trim(draft(5))) == 0 and gate.gated_tokens == 8
    two_core = costs([26.0, 49.0, 66.0, 88.0, 112.0, 131.0, 150.0, 169.0, 188.0], step_ms=2.5, chunk=3)  # the EPYC's
    gate = DraftGate(two_core, opened())
    assert len(gate.trim(draft(1))) == 0  # a 1-token match is right 0.3 of the time: not worth a pass
    assert len(gate.trim(draft(5))) > 0  # a 5-token match is
    for _ in range(6):  # in this request, 5-token matches keep failing at once
        kept = gate.trim(draft(5))
        gate.observe(len(kept), 0)
    assert len(gate.trim(draft(5))) == 0
    assert len(gate.trim(draft(5, source="prompt_lookup_other"))) > 0  # another source: its own evidence


def test_drafts_without_evidence_and_sampled_requests_are_never_gated() -> None:
    dear = costs([10.0 * w for w in range(1, 18)])
    model_draft = DraftTokens(torch.arange(4, dtype=torch.int64))
    assert DraftGate(dear).trim(model_draft) is model_draft
    assert SpeculationSchedule(8, "constant", dear, greedy=False).gate is None
    assert SpeculationSchedule(8, "ungated", dear, greedy=True).gate is None
    assert SpeculationSchedule(8, "adaptive", dear, greedy=True).gate is None
    assert SpeculationSchedule(8, "constant", dear, greedy=True).gate is not None
    with pytest.raises(ValueError, match="prior_first"):
        GateConfig(prior_first=(0.5,))


PROMPTS = [[5, 17, 33, 2, 9, 60, 11, 5, 17, 40, 2, 9, 77, 5, 88, 6, 5, 14], [40, 41, 42, 40, 41, 43]]


@pytest.mark.parametrize("curve", ["cheap", "dear", "measured"])
def test_greedy_with_the_gate_equals_target_only(tiny_target, curve: str) -> None:
    """Whatever the gate decides (costs that make every draft pay, none, or the ones measured in
    the run), the greedy output is the target alone's; with dear passes it keeps drafts back."""
    generator = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer())
    if curve != "measured":
        per_row = [1.0] * 17 if curve == "cheap" else [float(w) for w in range(1, 18)]
        generator.pass_costs = costs(per_row)
        generator.pass_costs.ema = 1e-9  # the run's own timings barely move them
    gated = 0
    for prompt in PROMPTS:
        result = generator.generate(prompt, SamplingParams(max_new_tokens=40), num_speculative_tokens=8)
        assert result.token_ids == target_only_greedy(tiny_target, prompt, 40)
        gated += result.stats.gated_draft_tokens
    if curve == "dear":
        assert gated > 0
    if curve == "cheap":
        assert gated == 0


def test_a_chunked_pass_is_priced_by_its_chunks() -> None:
    """Where the runner computes a pass in chunks (llama.cpp's exact mode declares
    ``greedy_stop_rows``), an unmeasured width costs its whole chunks and the rest."""
    measured = costs([26.0, 49.0, 66.0], chunk=3)
    assert [measured.cost(w, 0.6) for w in (4, 6, 7, 9)] == [92.0, 132.0, 158.0, 198.0]
    measured.chunk = None  # one pass: the prior line beyond the widest measured
    assert measured.cost(6, 0.6) == pytest.approx(66.0 + 26.0 * 0.6 * 3)


def test_the_llamacpp_runner_declares_its_chunk(tiny_target) -> None:
    """The engine gives the gate the runner's chunk: None on torch (every row computed)."""
    generator = SpeculativeGenerator(tiny_target, proposer=PromptLookupProposer())
    assert generator.target.capabilities.greedy_stop_rows is None
    generator.generate(PROMPTS[0], SamplingParams(max_new_tokens=4))
    assert generator.pass_costs.chunk is None


def replay_gate(gate: DraftGate, answer: list[int], drafts) -> tuple[int, int]:
    """Decode ``answer`` through ``gate`` as the engine does, one step at a time: at position p the
    proposer offers ``drafts(p)`` (a 3-token match), the gate trims it, the target accepts the
    kept tokens that equal the answer and adds one of its own. Returns (drafted tokens sent,
    steps)."""
    p = sent = steps = 0
    while p < len(answer):
        kept = gate.trim(DraftTokens(torch.tensor(drafts(p), dtype=torch.int64), None, ("prompt_lookup", 3)))
        ids = kept.ids.tolist()
        accepted = next((i for i, t in enumerate(ids) if p + i >= len(answer) or t != answer[p + i]), len(ids))
        tokens = answer[p : p + accepted + 1]
        gate.observe(len(ids), accepted, tokens)
        sent, steps, p = sent + len(ids), steps + 1, p + len(tokens)
    return sent, steps


def test_a_shut_gate_learns_from_the_drafts_it_withheld() -> None:
    """With a pessimistic prior the gate first sends nothing; the drafts it withholds are scored
    against the tokens decoded next (the shadow check), and when they keep being right it opens;
    when they keep being wrong it stays shut, and a partly right draft counts its right tokens."""
    two_core = costs([26.0, 49.0, 66.0, 88.0, 112.0, 131.0, 150.0, 169.0, 188.0], step_ms=2.5, chunk=3)
    pessimistic = GateConfig(prior_first=(0.1,) * 5, prior_next=0.5)
    answer = list(range(200))
    right = DraftGate(two_core, pessimistic)
    assert len(right.trim(draft(3))) == 0  # shut by the prior
    right = DraftGate(two_core, pessimistic)
    sent, steps = replay_gate(right, answer, lambda p: answer[p : p + 8] or [0])
    assert right.shadow_trials >= 1 and sent > 100 and steps < 100  # it opened and copied
    assert right.acceptance("prompt_lookup", 3)[0] > 0.8

    wrong = DraftGate(two_core, pessimistic)
    sent, steps = replay_gate(wrong, answer, lambda p: [999] * 8)
    assert sent == 0 and steps == 200 and wrong.shadow_trials == 200  # one trial per step, all wrong
    assert wrong.acceptance("prompt_lookup", 3)[0] < 0.01

    partly = DraftGate(two_core, pessimistic)
    partly.trim(DraftTokens(torch.tensor([7, 8, 9, 1, 1]), None, ("prompt_lookup", 3)))
    partly.trim(DraftTokens(torch.tensor([5, 5]), None, ("prompt_lookup", 3)))  # one withheld draft at a time
    partly.observe(0, 0, [7])
    partly.observe(0, 0, [8])
    assert partly.shadow_trials == 0  # still matching
    partly.observe(2, 0, [9, 4])  # another draft's step decoded 9 (right) then 4 (the draft said 1)
    assert partly.shadow_trials == 1
    a1, q = partly.acceptance("prompt_lookup", 3)
    assert a1 == pytest.approx((0.1 * 2 + 1) / 3) and q == pytest.approx((0.5 * 4 + 2) / (4 + 3))


def patched_costs() -> PassCosts:
    """The patched llama.cpp build's exact mode on the 2-core EPYC (2026-11-28): a call of n rows
    costs ~20.9 + 12.1 n ms; a greedy pass stops after its first 2 rows (``chunk``), else computes the
    rest in one more call (``then`` 64), so a completed pass of w rows costs c(2) + c(w - 2)."""

    def call(n: int) -> float:
        return 20.9 + 12.1 * n

    measured = costs([call(1), call(2)] + [call(2) + call(w - 2) for w in range(3, 18)], chunk=2)
    measured.then = 64
    return measured


def test_a_whole_pass_is_possible_only_where_it_saves_a_call() -> None:
    patched = patched_costs()
    assert [patched.whole_possible(w) for w in (1, 2, 3, 17, 64, 65)] == [False, False, True, True, True, False]
    unpatched = costs([26.0, 49.0, 66.0], chunk=3)
    unpatched.then = 3  # calls of 3 with or without the early stop
    assert not any(unpatched.whole_possible(w) for w in range(1, 18))
    assert not costs([10.0] * 17).whole_possible(5)  # torch: every row in one pass anyway
    # a whole pass costs the early-stop pass less one call's fixed part (2 c(1) - c(2) = 20.9)
    assert patched.whole_cost(9, 0.6) == pytest.approx(patched.ms[9] - 20.9)
    patched.observe(9, 9, 0.100, 0.101, whole=True)  # measured whole passes are kept apart
    assert patched.whole_cost(9, 0.6) == pytest.approx(100.0) and patched.ms[9] == pytest.approx(20.9 * 2 + 12.1 * 9)


def test_the_gate_sends_a_likely_draft_whole_and_an_unlikely_one_with_the_early_stop() -> None:
    """With a first token right 0.95 of the time a whole pass of a few tokens beats the early stop's
    extra call; with 0.5 the early stop pays. Either way the gate keeps drafts that pay. The first
    draft of a source in a request keeps the early stop until one of them was right
    (``whole_needs_hit``); a shadow check's hit counts as one."""
    likely = DraftGate(patched_costs(), opened(prior_first=(0.95,) * 5, prior_next=0.9, whole_needs_hit=False))
    kept = likely.trim(draft(5))
    assert len(kept) > 0 and not kept.early_stop
    earned = DraftGate(patched_costs(), opened(prior_first=(0.95,) * 5, prior_next=0.9))
    for decoded in ([999], [0, 1, 2]):  # a miss, then a hit
        kept = earned.trim(draft(5))
        assert len(kept) > 0 and kept.early_stop
        earned.observe(len(kept), len(decoded) - 1, decoded)
    assert not earned.trim(draft(5)).early_stop
    shadowed = DraftGate(patched_costs(), opened(prior_first=(0.95,) * 5, prior_next=0.9, margin=100.0))
    assert len(shadowed.trim(draft(5))) == 0  # withheld (the margin): a shadow check
    shadowed.observe(0, 0, [0])  # its first token decoded: a hit
    shadowed.config = opened(prior_first=(0.95,) * 5, prior_next=0.9)
    assert not shadowed.trim(draft(5)).early_stop
    with pytest.raises(ValueError, match="whole_needs_hit"):
        GateConfig(whole_needs_hit=1)  # type: ignore[arg-type]
    unlikely = DraftGate(patched_costs(), opened(prior_first=(0.5,) * 5, prior_next=0.9))
    kept = unlikely.trim(draft(5))
    assert len(kept) > 0 and kept.early_stop
    unpatched = costs([26.0, 49.0, 66.0, 88.0, 112.0, 131.0, 150.0, 169.0, 188.0], step_ms=2.5, chunk=3)
    unpatched.then = 3
    assert DraftGate(unpatched, opened(prior_first=(0.95,) * 5, prior_next=0.9)).trim(draft(5)).early_stop


def test_a_source_that_keeps_missing_is_withheld_until_a_shadow_check_hits() -> None:
    """max_misses 2: after two drafts of a request missed at their first token, the source's drafts
    are withheld where the estimate alone would still send them (a prediction's optimistic priors and
    16-token drafts), and a withheld draft whose first token the target then decodes reopens it at
    once; where a miss costs nothing (a flat curve) nothing is withheld. A prediction's draft is sent
    whole or not at all, and its trials leave prompt lookup's estimates alone."""
    gate = DraftGate(patched_costs(), opened())
    for _ in range(2):
        kept = gate.trim(draft(5, 16, "prediction"))
        assert len(kept) == 16  # never shortened
        gate.observe(16, 0, [999])
    assert gate.acceptance("prediction", 5)[0] > 0.4  # the estimate alone would still send it
    assert len(gate.trim(draft(5, 16, "prediction"))) == 0  # withheld: a shadow check
    assert len(gate.trim(draft(5, 8))) > 0  # prompt lookup: another source
    gate.observe(8, 8, list(range(9)))  # decodes 0 .. 8: the withheld prediction draft's first token was right
    assert gate.shadow_trials == 0  # still matching, but the source reopened
    assert len(gate.trim(draft(5, 16, "prediction"))) == 16
    gate.observe(16, 16, list(range(17)))
    assert gate.acceptance("prompt_lookup", 5)[1] == pytest.approx((0.8 * 4 + 7) / (4 + 7))  # its own 8 only
    # the prediction's: its 15 later tokens and the shadow check's 8 of 9 (decoded 0 .. 8, then 0 for its 9)
    assert gate.acceptance("prediction", 5)[1] == pytest.approx((0.95 * 4 + 15 + 8) / (4 + 15 + 9))

    flat = DraftGate(costs([10.0] * 17))
    for _ in range(3):
        assert len(flat.trim(draft(5, 16, "prediction"))) == 16
        flat.observe(16, 0, [999])
    with pytest.raises(ValueError, match="max_misses"):
        GateConfig(max_misses=0)


def test_misses_per_hit_shuts_a_source_again_after_a_reopening_hit() -> None:
    """misses_per_hit: a source is withheld once its misses reach max_misses * (1 + hits), so a
    shadow hit reopens it for a draft or two, not for the rest of the request; without it, one hit
    opens it for good."""
    for per_hit, shut_again in ((False, False), (True, True)):
        gate = DraftGate(patched_costs(), GateConfig(misses_per_hit=per_hit))
        for _ in range(2):
            assert len(gate.trim(draft(5, 16, "prediction"))) == 16
            gate.observe(16, 0, [999])
        assert len(gate.trim(draft(5, 16, "prediction"))) == 0  # shut: a shadow check
        gate.observe(0, 0, list(range(17)))  # the withheld draft all right: a hit, the source reopens
        for _ in range(2):  # two more misses: 4 = 2 * (1 + 1 hit)
            assert len(gate.trim(draft(5, 16, "prediction"))) == 16
            gate.observe(16, 0, [999])
        assert (len(gate.trim(draft(5, 16, "prediction"))) == 0) is shut_again
    with pytest.raises(ValueError, match="misses_per_hit"):
        GateConfig(misses_per_hit=1)  # type: ignore[arg-type]


def test_a_prediction_draft_without_the_early_stop_stays_so() -> None:
    """The prediction proposer asks for one whole pass where its copy goes on; the gate keeps that
    choice (it only decides whether to send the draft)."""
    whole = DraftTokens(torch.arange(16, dtype=torch.int64), None, ("prediction", 5), early_stop=False)
    kept = DraftGate(patched_costs()).trim(whole)
    assert len(kept) == 16 and not kept.early_stop


def test_a_slow_wide_pass_barely_moves_its_cost() -> None:
    """A timing spike of a wide pass (300 ms where 2 rows cost 45) is clipped at 1.2 rows c(1) and
    raises the cost at a quarter of the moving average's weight, so a likely draft still goes; a
    first measurement is clipped too; one-token passes and falling costs move as before."""
    measured = patched_costs()
    measured.ms[1], measured.ms[2] = 33.0, 45.0
    measured.observe(2, 2, 0.300, 0.300)
    assert measured.ms[2] == pytest.approx(0.95 * 45.0 + 0.05 * 1.2 * 2 * 33.0)
    measured.observe(2, 2, 0.040, 0.040)
    assert measured.ms[2] == pytest.approx(0.8 * (0.95 * 45.0 + 0.05 * 79.2) + 0.2 * 40.0)
    fresh = PassCosts()
    fresh.observe(1, 1, 0.033, 0.033)
    fresh.observe(5, 5, 1.0, 1.0)
    assert fresh.ms[5] == pytest.approx(1.2 * 5 * 33.0)
    gate = DraftGate(measured, opened(prior_first=(0.9,) * 5, prior_next=0.9))
    assert len(gate.trim(draft(5))) > 0


def test_an_unmeasured_whole_call_is_priced_from_the_measured_ones() -> None:
    """Live on the 2-core EPYC: whole calls of 3 rows measured (54.9 ms), of 4 not; the early-stop
    pass of 4 (two calls of 2) 101.5 ms. From the whole calls and c(1) a call of 4 costs 66.4 ms
    (measured elsewhere: 64), not 101.5 - 13.7 = 87.8, and right drafts go 3 at a time, not 2."""
    live = patched_costs()
    live.ms[1], live.ms[2], live.ms[4] = 31.9, 50.1, 101.5
    live.whole_ms[3] = 54.9
    assert live.whole_cost(4, 0.6) == pytest.approx(54.9 + (54.9 - 31.9) / 2)
    assert live.whole_cost(3, 0.6) == pytest.approx(54.9)
    live.whole_ms[9] = 130.0
    assert live.whole_cost(6, 0.6) == pytest.approx(54.9 + (130.0 - 54.9) / 2)
    config = opened(prior_first=(0.97,) * 5, prior_next=0.96, prior_next_weight=100.0, whole_needs_hit=False)
    gate = DraftGate(live, config)
    kept = gate.trim(draft(5, 3))
    assert len(kept) == 3 and not kept.early_stop


def test_a_source_is_shadow_checked_until_one_of_its_drafts_is_right() -> None:
    """shadow_until_hit (the default): where a miss costs something, prompt lookup's drafts are
    withheld from a request's start and scored against the decoded tokens; a wrong one keeps the
    source shut, the first right one opens it. A client's prediction drafts at once; where a miss
    costs nothing (a flat curve), or with the rule off, so does prompt lookup."""
    gate = DraftGate(patched_costs())
    assert len(gate.trim(draft(5))) == 0 and gate.gated_tokens == 8  # withheld: a shadow check
    gate.observe(0, 0, [999])  # its first token wrong
    assert gate.shadow_trials == 1 and len(gate.trim(draft(5))) == 0  # still shut
    gate.observe(0, 0, [0])  # this withheld draft's first token right: a hit
    kept = gate.trim(draft(5))
    assert len(kept) > 0 and kept.evidence == ("prompt_lookup", 5)
    assert len(DraftGate(patched_costs()).trim(draft(5, 16, "prediction"))) == 16
    assert len(DraftGate(costs([10.0] * 17)).trim(draft(5))) == 8
    assert len(DraftGate(patched_costs(), GateConfig(shadow_until_hit=False)).trim(draft(5))) > 0
    with pytest.raises(ValueError, match="shadow_until_hit"):
        GateConfig(shadow_until_hit=1)  # type: ignore[arg-type]
