"""The scheduler driven step by step in the test's thread (``start(thread=False)`` + ``run_once``):
continuous batching with joins and leaves, per-row speculation and rollback, stops, aborts,
timeouts, the KV budget and the queue bound. Greedy output must equal target-only decoding."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from specdecode.cost.serve_model import CostModel
from specdecode.sampling import SamplingParams
from specdecode.serve.config import ServeSettings
from specdecode.serve.request import Event, InvalidRequestError, QueueFullError, ServeRequest
from specdecode.serve.scheduler import Scheduler

from conftest import make_tiny_model
from reference import target_only_greedy

FLAT = CostModel([1, 8], [1, 9], [[1.0, 1.0], [1.0, 1.0]])  # memory-bound: speculation always pays
STEEP = CostModel([1, 8], [1, 9], [[1.0, 9.0], [8.0, 72.0]])  # compute-bound: it never does
_ids = itertools.count()


def make(chat_models, tokenizer, cost: CostModel | None = FLAT, **options) -> Scheduler:
    target, draft = chat_models
    settings = ServeSettings(**{"model_name": "tiny", "max_batch_size": 4, "kv_budget_tokens": 4096, **options})
    cost = copy.deepcopy(cost)  # serving refines c_p in place: FLAT and STEEP stay as written
    scheduler = Scheduler(target, tokenizer, settings, draft=draft, cost=cost)
    scheduler.start(thread=False)
    return scheduler


class Client:
    """One request and the events it received."""

    def __init__(self, prompt: list[int], max_tokens: int, **options) -> None:
        self.events: list[Event] = []
        sampling = SamplingParams(
            temperature=options.pop("temperature", 0.0),
            seed=options.pop("seed", None),
            max_new_tokens=max_tokens,
            stop=options.pop("stop", ()),
        )
        speculative = options.pop("speculative", True)
        proposer = options.pop("proposer", "draft_model")
        self.req = ServeRequest(
            request_id=f"req-{next(_ids)}",
            prompt_ids=prompt,
            sampling=sampling,
            speculative=speculative,
            proposer=proposer if speculative else None,
            num_speculative_tokens=options.pop("k", 3),
            on_event=self.events.append,
            **options,
        )

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def final(self) -> Event | None:
        return self.events[-1] if self.events and self.events[-1].finish_reason else None


def run(scheduler: Scheduler, limit: int = 2000) -> int:
    """Run until idle; returns the largest batch seen."""
    peak = 0
    for _ in range(limit):
        busy = scheduler.run_once()
        peak = max(peak, len(scheduler.active))
        if not busy:
            return peak
    raise AssertionError("the scheduler did not finish")


def reference(target, tokenizer, prompt: list[int], n: int) -> list[int]:
    """Greedy target-only tokens, cut after the first EOS (the server stops there)."""
    out = target_only_greedy(target, prompt, n)
    eos = tokenizer.eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


def prompts(tokenizer) -> list[list[int]]:
    texts = ["def add(a, b):", "for i in range(10):", "The quick brown fox", "class Stack:", "def is_prime(n):"]
    return [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize(
    ("speculation", "cost", "drafts"),
    [("on", None, True), ("adaptive", FLAT, True), ("adaptive", STEEP, False), ("off", None, False)],
)
def test_continuous_batching_is_exact(chat_models, tiny_tokenizer, speculation, cost, drafts, monkeypatch) -> None:
    target, _ = chat_models
    scheduler = make(chat_models, tiny_tokenizer, cost=cost, speculation=speculation)
    if cost is STEEP:  # a row left alone prices prompt lookup's copies with the draft gate: passes as steep
        monkeypatch.setattr(scheduler.pass_costs, "observe", lambda *args, **kwargs: None)
        scheduler.pass_costs.ms[:10] = [0.0] + [10.0 * w for w in range(1, 10)]
    ps = prompts(tiny_tokenizer)
    first = [
        Client(ps[0], 30),
        Client(ps[1], 10, speculative=False),
        Client(ps[2], 20, k=2),
    ]
    for c in first:
        scheduler.submit(c.req)
    for _ in range(3):
        scheduler.run_once()
    assert len(scheduler.active) == 3
    later = [Client(ps[3], 15, proposer="prompt_lookup"), Client(ps[4], 25, k=5), Client(ps[0], 12, k=1)]
    for c in later:  # join a running batch (4 rows at most: one waits for a leave)
        scheduler.submit(c.req)
    peak = run(scheduler)
    assert peak == 4
    for c in first + later:
        assert c.final is not None and c.final.finish_reason in ("stop", "length")
        want = reference(target, tiny_tokenizer, c.req.prompt_ids, c.req.sampling.max_new_tokens)
        assert c.tokens == want
        spec = c.final.summary["speculative"]
        assert spec["lossless"] is True
        assert spec["draft_tokens"] >= spec["accepted_tokens"] >= 0
    assert first[1].final.summary["speculative"]["draft_tokens"] == 0  # speculative=False
    drafted = sum(c.final.summary["speculative"]["draft_tokens"] for c in first + later)
    assert (drafted > 0) == drafts
    assert scheduler.reserved == 0 and scheduler.runner.num_rows == 0


def test_a_request_may_ask_for_its_own_speculation_mode(chat_models, tiny_tokenizer) -> None:
    """On an adaptive server whose cost model never drafts, a request with ``speculation="on"``
    drafts its k every step (exactly), its neighbours in the batch do not; requests cannot ask for
    a mode the server cannot run."""
    target, _ = chat_models
    scheduler = make(chat_models, tiny_tokenizer, cost=STEEP, speculation="adaptive")
    ps = prompts(tiny_tokenizer)
    on, adaptive, off = Client(ps[0], 20, speculation="on"), Client(ps[1], 20), Client(ps[2], 20, speculation="off")
    for c in (on, adaptive, off):
        scheduler.submit(c.req)
    run(scheduler)
    for c, mode in ((on, "on"), (adaptive, "adaptive"), (off, "off")):
        want = reference(target, tiny_tokenizer, c.req.prompt_ids, c.req.sampling.max_new_tokens)
        assert c.tokens == want
        spec = c.final.summary["speculative"]
        assert spec["mode"] == mode
        assert (spec["draft_tokens"] > 0) == (mode == "on")
    for speculation, allowed in (
        ("on", {"on", "off", None}),
        ("off", {"off", None}),
        ("adaptive", {"on", "off", "adaptive", None}),
    ):
        server = make(
            chat_models, tiny_tokenizer, cost=STEEP if speculation == "adaptive" else None, speculation=speculation
        )
        for mode in ("on", "off", "adaptive", None):
            req = Client(ps[0], 5, speculation=mode).req
            if mode in allowed:
                server.validate(req)
            else:
                with pytest.raises(InvalidRequestError, match=f"speculation '{mode}'") as error:
                    server.validate(req)
                assert error.value.param == "speculation"


def test_the_draft_cost_ignores_calls_that_catch_up(chat_models, tiny_tokenizer, monkeypatch) -> None:
    """c_p is refined only with calls right after the sequence's previous draft: not with its first
    call (the draft model prefills the prompt) nor with one after steps without a draft."""
    cost = CostModel([1, 8], [1, 9], [[1.0, 1.0], [1.0, 1.0]], {"draft_model": 0.01})
    observed: list[int] = []
    behind: list[int] = []
    scheduler = make(chat_models, tiny_tokenizer, cost=cost, speculation="on")
    monkeypatch.setattr(scheduler.cost, "observe_draft", lambda name, seconds, tokens: observed.append(tokens))
    monkeypatch.setattr(scheduler.cost, "observe_catchup", lambda name, seconds, tokens, n: behind.append(n))
    client = Client(prompts(tiny_tokenizer)[0], 30, ignore_eos=True)
    scheduler.submit(client.req)
    run(scheduler)
    drafts = client.final.summary["speculative"]["drafts"]
    assert drafts >= 3 and len(observed) == drafts - 1  # every call but the first
    assert behind == [len(client.req.prompt_ids) + 1]  # the first: the prompt and the prefill's token
    s = scheduler  # a gap: a row that drafts, skips two steps, then drafts again is not sampled then
    observed.clear()
    behind.clear()
    client = Client(prompts(tiny_tokenizer)[1], 30, ignore_eos=True)
    s.submit(client.req)
    s.run_once()  # prefill
    plans = iter([[3], [0], [0]])
    monkeypatch.setattr(s, "_plan", lambda: next(plans, [3]))
    run(s)
    drafts = client.final.summary["speculative"]["drafts"]
    assert drafts >= 3 and len(observed) == drafts - 2  # not the first call, not the one after the gap
    assert len(behind) == 2 and behind[1] > 3 + 1  # after the gap: more than one step's tokens


def test_sampled_output_does_not_depend_on_the_batch(chat_models, tiny_tokenizer) -> None:
    scheduler = make(chat_models, tiny_tokenizer, speculation="on")
    ps = prompts(tiny_tokenizer)
    alone = Client(ps[0], 20, temperature=0.8, seed=7)
    scheduler.submit(alone.req)
    run(scheduler)
    crowd = [Client(p, 20, temperature=1.0, seed=i) for i, p in enumerate(ps[1:])]
    again = Client(ps[0], 20, temperature=0.8, seed=7)
    for c in crowd[:2] + [again] + crowd[2:]:
        scheduler.submit(c.req)
    run(scheduler)
    assert again.tokens == alone.tokens
    assert len(set(map(tuple, [c.tokens for c in crowd]))) == len(crowd)


def test_stop_string_ends_the_text_before_it(chat_models, tiny_tokenizer) -> None:
    scheduler = make(chat_models, tiny_tokenizer, speculation="on")
    prompt = prompts(tiny_tokenizer)[3]
    full = Client(prompt, 30)
    scheduler.submit(full.req)
    run(scheduler)
    text = full.text
    assert len(text) > 8
    stop = text[4:7]
    cut = Client(prompt, 30, stop=(stop,))
    scheduler.submit(cut.req)
    run(scheduler)
    assert cut.text == text[: text.find(stop)]
    assert cut.final.finish_reason == "stop"


def test_abort_frees_the_row_and_the_reservation(chat_models, tiny_tokenizer) -> None:
    scheduler = make(chat_models, tiny_tokenizer)
    ps = prompts(tiny_tokenizer)
    long, short = Client(ps[0], 200), Client(ps[1], 5)
    scheduler.submit(long.req)
    scheduler.submit(short.req)
    scheduler.run_once()
    scheduler.run_once()
    scheduler.abort(long.req.request_id)
    scheduler.run_once()
    assert long.final.finish_reason == "abort"
    assert len(long.tokens) < 200
    assert [s.req.request_id for s in scheduler.active] in ([short.req.request_id], [])
    run(scheduler)
    assert short.final.finish_reason in ("stop", "length")
    assert scheduler.reserved == 0


def test_kv_budget_bounds_the_batch_and_the_queue_bounds_the_waiting(chat_models, tiny_tokenizer) -> None:
    ps = prompts(tiny_tokenizer)
    clients = [Client(p, 10) for p in ps[:3]]
    probe = make(chat_models, tiny_tokenizer)
    budget = probe.reservation(clients[0].req) + probe.reservation(clients[1].req)
    scheduler = make(chat_models, tiny_tokenizer, kv_budget_tokens=budget, max_queue=4)
    for c in clients:
        scheduler.submit(c.req)
    extra = Client(ps[3], 10)
    scheduler.submit(extra.req)
    with pytest.raises(QueueFullError, match="max-queue"):
        scheduler.submit(Client(ps[4], 10).req)
    scheduler.run_once()
    assert len(scheduler.active) == 2 and scheduler.reserved <= budget
    assert run(scheduler) == 2
    assert all(c.final.finish_reason in ("stop", "length") for c in clients + [extra])


def test_timeout_ends_the_request(chat_models, tiny_tokenizer) -> None:
    scheduler = make(chat_models, tiny_tokenizer)
    c = Client(prompts(tiny_tokenizer)[0], 50, deadline=-math.inf)
    scheduler.submit(c.req)
    run(scheduler)
    assert c.final.finish_reason == "timeout" and "timeout" in c.final.error


def test_a_proposer_that_fails_to_build_fails_its_request_only(chat_models, tiny_tokenizer, monkeypatch) -> None:
    import specdecode.serve.scheduler as module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    scheduler = make(chat_models, tiny_tokenizer)
    monkeypatch.setattr(module, "make_proposer", broken)
    bad, good = Client(prompts(tiny_tokenizer)[0], 5), Client(prompts(tiny_tokenizer)[1], 5, speculative=False)
    scheduler.submit(bad.req)
    scheduler.submit(good.req)
    run(scheduler)
    assert bad.final.finish_reason == "error" and "boom" in bad.final.error
    assert good.final.finish_reason in ("stop", "length")
    assert scheduler.reserved == 0


def test_validation_names_the_field(chat_models, tiny_tokenizer) -> None:
    scheduler = make(chat_models, tiny_tokenizer, kv_budget_tokens=64)
    cases = [
        (Client([1] * 600, 5), "prompt"),
        (Client([], 5), "prompt"),
        (Client([10_000], 5), "prompt"),
        (Client([5, 6], 100), "max_tokens"),
        (Client([5, 6], 5, proposer="no_such"), "proposer"),
    ]
    for client, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            scheduler.submit(client.req)
        assert info.value.param == param


def test_drafts_and_verification_use_the_row_generators(chat_models, tiny_tokenizer) -> None:
    """Same seed, same k per step (speculation on): the same sample whatever the seed of others."""
    scheduler = make(chat_models, tiny_tokenizer, speculation="on")
    p = prompts(tiny_tokenizer)[2]
    a, b = Client(p, 15, temperature=0.9, seed=3), Client(p, 15, temperature=0.9, seed=3)
    scheduler.submit(a.req)
    scheduler.submit(Client(p, 15, temperature=0.9, seed=4).req)
    run(scheduler)
    scheduler.submit(b.req)
    run(scheduler)
    assert a.tokens == b.tokens
    assert torch.tensor(a.tokens).numel() > 0


def test_a_proposer_that_fails_mid_generation_is_dropped_and_the_output_stays_exact(
    chat_models, tiny_tokenizer
) -> None:
    target, _ = chat_models
    scheduler = make(chat_models, tiny_tokenizer, speculation="on")
    c = Client(prompts(tiny_tokenizer)[0], 20)
    scheduler.submit(c.req)
    scheduler.run_once()

    def broken(*args, **kwargs):
        raise RuntimeError("draft exploded")

    scheduler.active[0].proposer.propose = broken
    run(scheduler)
    assert c.tokens == reference(target, tiny_tokenizer, c.req.prompt_ids, 20)
    spec = c.final.summary["speculative"]
    assert spec["enabled"] is True and "draft exploded" in spec["proposer_error"]
    assert scheduler.proposer_pool.idle() == 0  # a proposer that failed is not given back for another request


def test_prefill_in_groups_with_requests_that_end_at_their_first_token(
    chat_models, tiny_tokenizer, monkeypatch
) -> None:
    import specdecode.serve.scheduler as module

    monkeypatch.setattr(module, "MAX_PREFILL_TOKENS", 12)  # every prompt its own group
    target, _ = chat_models
    scheduler = make(chat_models, tiny_tokenizer)
    clients = [Client(p, n) for p, n in zip(prompts(tiny_tokenizer), [1, 6, 1, 9], strict=False)]
    for c in clients:
        scheduler.submit(c.req)
    scheduler.run_once()
    assert [len(c.tokens) for c in clients if c.final] == [1, 1]  # left after their first token
    run(scheduler)
    for c in clients:
        assert c.tokens == reference(target, tiny_tokenizer, c.req.prompt_ids, c.req.sampling.max_new_tokens)


def test_a_draft_with_another_vocabulary_only_drafts_through_cross_tokenizer(chat_models, tiny_tokenizer) -> None:
    target, _ = chat_models
    foreign = make_tiny_model(vocab_size=len(tiny_tokenizer) + 7, seed=3)  # another vocabulary size
    settings = ServeSettings(model_name="tiny", max_batch_size=2, kv_budget_tokens=1024, proposer=None)
    scheduler = Scheduler(target, tiny_tokenizer, settings, draft=foreign, cost=copy.deepcopy(FLAT))
    names = scheduler.proposers()
    assert "cross_tokenizer" in names and "draft_model" not in names and "prompt_lookup" in names
    with pytest.raises(InvalidRequestError) as info:
        scheduler.check_proposer("draft_model")
    assert info.value.param == "proposer"


def test_trained_drafters_read_the_batched_targets_features(chat_models, tiny_tokenizer, tmp_path, monkeypatch) -> None:
    """Medusa (from the target's default drafter folder) and EAGLE (the server's ``drafter`` option)
    next to draft_model and plain requests in one batch: greedy output equals target-only decoding,
    and each drafter accepts exactly as many tokens as it does alone in the engine, which reads the
    features of a one-sequence pass (features at the wrong positions would change what it drafts)."""
    from specdecode import SpeculativeGenerator
    from specdecode.cost.serve_measure import measure_draft_cost
    from specdecode.drafters import default_drafter_dir, save_drafter
    from specdecode.proposers import make_proposer
    from test_drafters import distill, make_drafter

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    target, _ = chat_models
    folders = {"medusa": default_drafter_dir("medusa", target), "eagle": tmp_path / "eagle"}
    for kind, folder in folders.items():
        save_drafter(distill(make_drafter(kind, target, seed=1), target, steps=30), folder)
    scheduler = make(  # "on": every row drafts its k every step, as the engine's constant schedule does
        chat_models,
        tiny_tokenizer,
        proposer="eagle",
        proposer_options={"drafter": str(folders["eagle"])},
        speculation="on",
    )
    assert {"medusa", "eagle"} <= set(scheduler.proposers())
    kinds = ["eagle", "medusa", "draft_model", None, "eagle"]
    clients = [
        Client(p, 24, proposer=kind, speculative=kind is not None, k=3, ignore_eos=True)
        for p, kind in zip(prompts(tiny_tokenizer), kinds, strict=True)
    ]
    for c in clients:
        scheduler.submit(c.req)
    assert run(scheduler) == 4  # max_batch_size: the fifth joined when one left
    accepted = dict.fromkeys(folders, 0)
    for c, kind in zip(clients, kinds, strict=True):
        assert c.tokens == target_only_greedy(target, c.req.prompt_ids, 24), kind
        spec = c.final.summary["speculative"]
        if kind in folders:
            options = {"drafter": str(folders[kind])}
            alone = SpeculativeGenerator(target, proposer=make_proposer(kind, target=target, **options))
            alone.eos_token_ids = frozenset()  # as ignore_eos
            result = alone.generate(c.req.prompt_ids, SamplingParams(max_new_tokens=24), 3)
            assert spec["draft_tokens"] > 0 and "proposer_error" not in spec
            assert spec["accepted_tokens"] == result.stats.accepted_tokens, kind
            accepted[kind] += spec["accepted_tokens"]
            assert measure_draft_cost(make_proposer(kind, target=target, **options), target.config.vocab_size, 3) > 0
    assert min(accepted.values()) > 0, accepted  # the drafters agree in part: the check above can fail
    # Requests share one loaded drafter per kind and folder, whichever kind was loaded in between.
    first = make_proposer("eagle", target=target, drafter=str(folders["eagle"])).drafter
    medusa = make_proposer("medusa", target=target).drafter
    assert make_proposer("eagle", target=target, drafter=str(folders["eagle"])).drafter is first
    assert make_proposer("medusa", target=target).drafter is medusa
    # EAGLE behind prompt lookup, as the server's default proposer: the same tokens and acceptances as alone
    options = {"drafter": str(folders["eagle"]), "prompt_lookup_min": 2}
    assert measure_draft_cost(make_proposer("eagle", target=target, **options), target.config.vocab_size, 3) > 0
    scheduler = make(chat_models, tiny_tokenizer, proposer="eagle", proposer_options=options, speculation="on")
    clients = [Client(p, 24, proposer="eagle", k=3, ignore_eos=True) for p in prompts(tiny_tokenizer)[:2]]
    for c in clients:
        scheduler.submit(c.req)
    run(scheduler)
    for c in clients:
        assert c.tokens == target_only_greedy(target, c.req.prompt_ids, 24)
        alone = SpeculativeGenerator(target, proposer=make_proposer("eagle", target=target, **options))
        alone.eos_token_ids = frozenset()
        result = alone.generate(c.req.prompt_ids, SamplingParams(max_new_tokens=24), 3)
        assert result.stats.proposer == "eagle+lookup"
        assert c.final.summary["speculative"]["accepted_tokens"] == result.stats.accepted_tokens
        assert alone.proposer.lookup_steps > 0 and alone.proposer.model_steps > 0  # type: ignore[union-attr]
        assert c.final.summary["speculative"]["accepted_tokens"] == result.stats.accepted_tokens


def test_feature_proposers_without_a_drafter_are_not_offered(
    chat_models, tiny_tokenizer, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "empty"))
    scheduler = make(chat_models, tiny_tokenizer)
    assert "medusa" not in scheduler.proposers() and "eagle" not in scheduler.proposers()
    with pytest.raises(InvalidRequestError, match="train-drafter --kind eagle") as info:
        scheduler.check_proposer("eagle")
    assert info.value.param == "proposer"
    with pytest.raises(InvalidRequestError, match="train-drafter --kind medusa"):
        make(chat_models, tiny_tokenizer, proposer="medusa")


def test_prefill_groups_similar_lengths_and_avoids_padding(chat_models, tiny_tokenizer, monkeypatch) -> None:
    """Admitted together, prompts of 3, 40, 4 and 38 tokens are prefilled as [3, 4] and [38, 40]
    (sorted by length; one pass over all four would be 75% padding), and decode as they would alone."""
    target, _ = chat_models
    scheduler = make(chat_models, tiny_tokenizer)
    passes: list[list[int]] = []
    forward = scheduler.runner.forward

    def spy(first, inputs, num_logits, **kwargs):
        passes.append([int(x.shape[0]) for x in inputs])
        return forward(first, inputs, num_logits, **kwargs)

    monkeypatch.setattr(scheduler.runner, "forward", spy)
    g = torch.Generator().manual_seed(0)
    lengths = [3, 40, 4, 38]
    clients = [Client(torch.randint(3, 200, (n,), generator=g).tolist(), 5, speculative=False) for n in lengths]
    for c in clients:
        scheduler.submit(c.req)
    scheduler.run_once()
    assert passes[:2] == [[3, 4], [38, 40]]
    run(scheduler)
    for c in clients:
        assert c.tokens == reference(target, tiny_tokenizer, c.req.prompt_ids, 5)


def test_in_own_thread_returns_raises_and_leaves_no_thread_behind() -> None:
    """Calibration passes run in a thread that ends (libgomp keeps a worker pool per live thread
    that ran a pass: see ``in_own_thread``); the result and errors reach the caller."""
    import threading

    from specdecode.cost.serve_measure import in_own_thread

    before = threading.active_count()
    seen: list[threading.Thread] = []
    assert in_own_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ZeroDivisionError):
        in_own_thread(lambda: 1 / 0)
    assert threading.active_count() == before


def test_a_lone_greedy_adaptive_request_drafts_through_its_draft_gate(chat_models, tiny_tokenizer, monkeypatch) -> None:
    """A greedy ``adaptive`` request alone in the batch is the engine's single sequence: it drafts
    its k whatever the cost model's plan (STEEP: never), through its own draft gate, which prices a
    copied draft with the server's one-row pass costs; with two rows the plan decides and nobody is
    gated; a sampled request has no gate. Output equals target-only decoding throughout."""
    from specdecode.draft_gate import DraftGate

    target, _ = chat_models
    ps = prompts(tiny_tokenizer)
    trims: list[int] = []
    real_trim = DraftGate.trim

    def spy(self: DraftGate, draft):
        trims.append(len(draft))
        return real_trim(self, draft)

    monkeypatch.setattr(DraftGate, "trim", spy)

    def check(client: Client) -> dict:
        want = reference(target, tiny_tokenizer, client.req.prompt_ids, client.req.sampling.max_new_tokens)
        if client.req.sampling.greedy:
            assert client.tokens == want
        return client.final.summary["speculative"]

    for cost, drafts in (
        (STEEP, False),
        (FLAT, True),
    ):  # a draft model's drafts: the plan decides, the gate passes them
        scheduler = make(chat_models, tiny_tokenizer, cost=cost, speculation="adaptive")
        trims.clear()
        alone = Client(ps[0], 20, ignore_eos=True)
        scheduler.submit(alone.req)
        run(scheduler)
        spec = check(alone)
        assert (spec["draft_tokens"] > 0) == drafts and spec["gated_draft_tokens"] == 0
        assert len(trims) == spec["target_forward_passes"] - 1  # the gate saw every step after the prefill
        assert scheduler.pass_costs.ms[1] > 0 or scheduler.pass_costs.ms[4] > 0  # measured on its one-row steps
    scheduler = make(chat_models, tiny_tokenizer, cost=STEEP, speculation="adaptive")

    trims.clear()
    pair = [Client(ps[1], 12, ignore_eos=True), Client(ps[2], 12, ignore_eos=True)]  # together to the end
    sampled = Client(ps[3], 12, ignore_eos=True, temperature=0.8, seed=3)
    for c in pair:
        scheduler.submit(c.req)
    run(scheduler)
    scheduler.submit(sampled.req)
    run(scheduler)
    assert [check(c)["draft_tokens"] for c in (*pair, sampled)] == [0, 0, 0] and trims == []

    # a prediction (a copied draft) drafts whatever the plan (STEEP): it is sent where the gate's one-row
    # passes cost alike at every width, withheld where a wide one is dear
    monkeypatch.setattr(scheduler.pass_costs, "observe", lambda *args, **kwargs: None)
    prediction = ps[4] * 6
    for slope, sent in ((0.0, True), (100.0, False)):
        scheduler.pass_costs.ms[:10] = [0.0] + [10.0 + slope * (w - 1) for w in range(1, 10)]
        client = Client(ps[4], 16, ignore_eos=True, proposer="prompt_lookup", prediction=prediction)
        scheduler.submit(client.req)
        run(scheduler)
        spec = check(client)
        assert (spec["draft_tokens"] > 0) == sent and (spec["gated_draft_tokens"] > 0) == (not sent)


@pytest.mark.parametrize("proposer", ["draft_model", "suffix"])
def test_a_pooled_proposer_drafts_what_a_new_one_would(chat_models, tiny_tokenizer, proposer) -> None:
    """A request's proposer comes from the pool (built once) and drafts exactly what one built for
    it alone drafts: nothing of the earlier request leaks into it (the draft's cache; suffix
    decoding's store of earlier outputs, which would draft the repeated prompt's whole answer)."""
    target, _ = chat_models
    ps = prompts(tiny_tokenizer)
    alone = make(chat_models, tiny_tokenizer, speculation="on")
    first = Client(ps[1], 20, proposer=proposer)
    alone.submit(first.req)
    run(alone)
    pooled = make(chat_models, tiny_tokenizer, speculation="on")
    for client in (Client(ps[1], 20, proposer=proposer), Client(ps[3], 25, proposer=proposer)):
        pooled.submit(client.req)
        run(pooled)
    again = Client(ps[1], 20, proposer=proposer)
    pooled.submit(again.req)
    run(pooled)
    assert (pooled.proposer_pool.built, pooled.proposer_pool.reused) == (1, 2)
    assert again.tokens == first.tokens == reference(target, tiny_tokenizer, ps[1], 20)
    fields = ("drafts", "draft_tokens", "accepted_tokens", "target_forward_passes")
    spec_alone, spec_pooled = first.final.summary["speculative"], again.final.summary["speculative"]
    assert spec_alone["drafts"] > 0
    assert {f: spec_pooled[f] for f in fields} == {f: spec_alone[f] for f in fields}
