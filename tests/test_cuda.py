"""The engine on a real GPU (docs/design.md §2b, "Device policy"): float32 tiny models on CUDA.

Skipped where ``torch.cuda.is_available()`` is False. ``SPECDECODE_TEST_DEVICE`` picks another
device for a dry run of this module's logic: ``cpu``, or ``stand-in`` (the stand-in accelerator of
``fake_device.py``, which raises where CUDA would)::

    SPECDECODE_TEST_DEVICE=cpu pytest tests/test_cuda.py

Checks: greedy identity with target-only decoding on the device for every proposer (chains, and
trees where the proposer drafts them), and the same tokens as the CPU; the sampled distribution of
the first three tokens (chi-square against the exact target-only marginals, as in
``test_lossless.py``); log-probabilities equal to the CPU's within 1e-4; a constraint; the
server's batched scheduler; the trained drafters' greedy drafts replayed as CUDA graphs (EAGLE's
chain, Medusa's heads); exact mode in bf16 (fixed-width passes): rows of the default target's
architecture equal one-token passes at widths 1..9, greedy identity with tiny models.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import Regex
from specdecode.models.torch.static_runner import StaticCacheSettings, use_static_cache
from specdecode.proposers import DraftModelProposer

from conftest import make_tiny_model, perturbed_copy
from device_cases import CHAIN_KINDS, GREEDY, HEADS, PROMPT, TREE_KINDS, make_generator, make_models, place, tokens
from reference import exact_marginals
from stat_checks import P_MIN, chi_square_p

REQUESTED = os.environ.get("SPECDECODE_TEST_DEVICE", "cuda")
if REQUESTED == "stand-in":
    from fake_device import STAND_IN, stand_in_device

    DEVICE = STAND_IN
else:
    DEVICE = torch.device(REQUESTED)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device (SPECDECODE_TEST_DEVICE=cpu runs this module on the CPU)", allow_module_level=True)


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """The block where device tensors may exist (the stand-in device needs its mode; a real one nothing)."""
    if REQUESTED == "stand-in":
        with stand_in_device():
            yield
    else:
        yield


@pytest.fixture(scope="module")
def models(tiny_tokenizer) -> dict[str, Any]:
    return make_models(tiny_tokenizer)


def on(models: dict[str, Any]) -> dict[str, Any]:
    placed = place(models, DEVICE)
    assert placed["target"].device.type == DEVICE.type  # cuda:0 for a model placed on "cuda"
    return placed


@pytest.fixture(scope="module")
def cpu_greedy(models, tiny_tokenizer) -> list[int]:
    """Target-only greedy tokens on the CPU."""
    return tokens(make_generator("none", models, tiny_tokenizer), GREEDY)


# ------------------------------------------------------------------ greedy: every proposer
@pytest.mark.parametrize(
    ("kind", "tree"), [(k, None) for k in CHAIN_KINDS] + [(k, "default") for k in TREE_KINDS], ids=str
)
def test_greedy_equals_target_only_on_the_device(models, tiny_tokenizer, cpu_greedy, kind: str, tree) -> None:
    with on_device():
        placed = on(models)
        alone = tokens(make_generator("none", placed, tiny_tokenizer), GREEDY)
        generator = make_generator(kind, placed, tiny_tokenizer)
        result = generator.generate(
            PROMPT, GREEDY, raw=True, tree=tree, speculative=kind != "none", schedule="ungated"  # every draft
        )
    assert result.token_ids == alone
    assert alone == cpu_greedy  # float32, clear maxima: the device's rounding changes no argmax
    assert (result.stats.draft_tokens > 0) == (kind != "none")  # the speculative path really ran
    if kind in ("draft_model", "early_exit", "hybrid", "prompt_lookup"):
        assert result.stats.accepted_tokens > 0


# ------------------------------------------------------------------ sampled: the distribution
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
SAMPLES = 1_000


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    return target, perturbed_copy(target, noise=0.1, seed=6)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_sampled_tokens_follow_the_target(small_vocab_pair, tree, graphs: bool) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, a partly agreeing draft: the first three tokens on
    the device follow the exact target-only marginals (computed on the CPU in float64; chi-square
    p > P_MIN, 1,000 seeded samples), with a chain (k = 2) and a tree, eager and with CUDA graphs."""
    target, draft = small_vocab_pair
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLING)
    with on_device():
        placed = place({"target": target, "draft": draft}, DEVICE, GRAPHS if graphs else None)
        spec = SpeculativeGenerator(placed["target"], proposer=DraftModelProposer(placed["draft"]))
        samples = [
            spec.generate(
                prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=2, tree=tree
            )
            for s in range(SAMPLES)
        ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    assert drafted > 0 and 0 < sum(r.stats.accepted_tokens for r in samples) < drafted
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"


def test_a_seed_gives_the_cpu_tokens_on_the_device(models, tiny_tokenizer) -> None:
    """The randomness lives on the CPU generator: the same seed draws the same uniforms on every
    device, so the tokens agree with the CPU's (all but rare ties at a cumulative-mass boundary:
    at most one prompt of eight may differ)."""
    sampling = [SamplingParams(temperature=0.9, max_new_tokens=16, seed=s) for s in range(8)]
    cpu = [tokens(make_generator("draft_model", models, tiny_tokenizer), s) for s in sampling]
    with on_device():
        generator = make_generator("draft_model", on(models), tiny_tokenizer)
        device = [tokens(generator, s) for s in sampling]
    assert sum(a != b for a, b in zip(cpu, device, strict=True)) <= 1


# ------------------------------------------------------------------ static KV cache and CUDA graphs
# On a GPU the runners capture and replay CUDA graphs; in a dry run on the CPU they replay through the
# stand-in (tests/test_static_cache.py), on the stand-in device they find no CUDA and fall back to eager.
GRAPHS = StaticCacheSettings(stand_in=REQUESTED == "cpu")


@pytest.mark.parametrize(
    ("kind", "tree"), [(k, None) for k in CHAIN_KINDS] + [(k, "default") for k in TREE_KINDS], ids=str
)
def test_graphs_greedy_equals_target_only(models, tiny_tokenizer, cpu_greedy, kind: str, tree) -> None:
    """Static KV cache and CUDA graphs per width: greedy output equals target-only decoding (on the
    same path and the CPU's eager path) for every proposer; the target really replayed graphs."""
    with on_device():
        placed = place(models, DEVICE, GRAPHS)
        alone = make_generator("none", placed, tiny_tokenizer)
        alone_tokens = tokens(alone, GREEDY)
        generator = make_generator(kind, placed, tiny_tokenizer)
        result = generator.generate(
            PROMPT, GREEDY, raw=True, tree=tree, speculative=kind != "none", schedule="ungated"  # every draft
        )
    assert result.token_ids == alone_tokens == cpu_greedy
    assert (result.stats.draft_tokens > 0) == (kind != "none")
    if REQUESTED != "stand-in":
        assert generator.target.graphs_failed is None, generator.target.graphs_failed
        assert tree is not None or generator.target.graphs  # chain widths were replayed (trees run eagerly)
        assert 1 in alone.target.graphs


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("k", [2, 4])
def test_graphed_drafters_greedy_equals_target_only(models, tiny_tokenizer, cpu_greedy, kind: str, k: int) -> None:
    """The EAGLE chain and Medusa heads replayed as CUDA graphs beside the target's (drafters/graphs.py,
    issue 49): greedy output equals target-only decoding and the CPU's, each step accepts what the eager
    drafter's step accepts (float32: the drafts agree), and the drafter's graphs were really captured
    (on the stand-in device, which has no CUDA, the capture fails and the drafter runs eagerly)."""
    with on_device():
        placed = place(models, DEVICE, GRAPHS)
        alone = tokens(make_generator("none", placed, tiny_tokenizer), GREEDY)
        generator = make_generator(kind, placed, tiny_tokenizer)
        result = generator.generate(PROMPT, GREEDY, raw=True, num_speculative_tokens=k, schedule="ungated")
        eager = make_generator(kind, on(models), tiny_tokenizer)  # an unmarked target: the eager drafter
        reference = eager.generate(PROMPT, GREEDY, raw=True, num_speculative_tokens=k, schedule="ungated")
    assert result.token_ids == alone == cpu_greedy and result.stats.draft_tokens > 0
    assert result.stats.accepted_per_step == reference.stats.accepted_per_step
    graphed = generator.proposer.graphed
    assert graphed is not None and eager.proposer.graphed is None
    if REQUESTED == "stand-in":
        assert graphed.graphs_failed is not None
        return
    assert graphed.graphs_failed is None, graphed.graphs_failed
    assert (("chain", k) if kind == "eagle" else min(k, HEADS)) in graphed.graphs
    assert all((g.graph is not None) == (REQUESTED == "cuda") for g in graphed.graphs.values())  # real graphs


@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_graphs_a_seed_gives_the_eager_tokens(models, tiny_tokenizer, tree) -> None:
    """Sampled: the same seed gives the eager runner's tokens on the device (at most one of eight
    prompts may differ by a tie at a cumulative-mass boundary)."""
    sampling = [SamplingParams(temperature=0.9, max_new_tokens=16, seed=s) for s in range(8)]
    with on_device():
        eager = make_generator("draft_model", on(models), tiny_tokenizer)
        static = make_generator("draft_model", place(models, DEVICE, GRAPHS), tiny_tokenizer)
        a = [tokens(eager, s, tree=tree) for s in sampling]
        b = [tokens(static, s, tree=tree) for s in sampling]
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 1


# ------------------------------------------------------------------ log-probabilities, constraint, server
@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_logprobs_equal_the_cpu(models, tiny_tokenizer, tree) -> None:
    def run(placed: dict[str, Any]) -> list:
        generator = make_generator("draft_model", placed, tiny_tokenizer)
        return generator.generate(PROMPT, GREEDY, raw=True, tree=tree, logprobs=3).logprobs

    cpu = run(models)
    with on_device():
        device = run(on(models))
    assert [e.token_id for e in device] == [e.token_id for e in cpu]
    for a, b in zip(device, cpu, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-4)


@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_a_constraint_on_the_device(models, tiny_tokenizer, tree) -> None:
    """Constrained greedy decoding with speculation equals constrained target-only decoding on the
    device and the CPU's, and matches the pattern."""
    constraint = Regex(r"(def|class) [a-z]{1,8}\(\):")
    cpu = make_generator("none", models, tiny_tokenizer).generate(
        PROMPT, GREEDY, raw=True, speculative=False, constraint=constraint
    )
    with on_device():
        generator = make_generator("draft_model", on(models), tiny_tokenizer)
        alone = generator.generate(PROMPT, GREEDY, raw=True, speculative=False, constraint=constraint)
        got = generator.generate(PROMPT, GREEDY, raw=True, tree=tree, constraint=constraint)
    assert got.token_ids == alone.token_ids == cpu.token_ids
    assert got.text.startswith(("def ", "class "))


def test_the_batched_scheduler_on_the_device(models, tiny_tokenizer) -> None:
    """The server's path: greedy rows (draft model, prompt lookup, none) equal target-only decoding;
    a sampled row runs; rows join mid-run."""
    from test_serve_scheduler import Client, make, reference, run

    ps = [tiny_tokenizer.encode(t) for t in ("def add(a, b):", "for i in range(10):", "class Stack:", PROMPT)]
    with on_device():
        placed = on(models)
        scheduler = make((placed["target"], placed["draft"]), tiny_tokenizer, speculation="on")
        assert scheduler.runner.device.type == DEVICE.type
        greedy = [Client(ps[0], 16), Client(ps[1], 12, speculative=False), Client(ps[3], 16, proposer="prompt_lookup")]
        sampled = Client(ps[2], 14, temperature=0.9, seed=5, logprobs=2)
        scheduler.submit(greedy[0].req)
        scheduler.run_once()
        for c in greedy[1:] + [sampled]:
            scheduler.submit(c.req)
        run(scheduler)
    target = models["target"]
    for c in greedy:
        assert c.tokens == reference(target, tiny_tokenizer, c.req.prompt_ids, c.req.sampling.max_new_tokens)
    assert sampled.final is not None and len(sampled.tokens) > 0


# ------------------------------------------------------------------ exact mode in bf16: fixed-width passes
# exact=True on a GPU: every pass after the prefill replays one graph of width 9 (StaticCacheSettings.exact_width),
# so every row of a verification pass is what a one-token pass computes, bit for bit (docs/design.md §2c).
EXACT = StaticCacheSettings(stand_in=REQUESTED == "cpu", exact_width=9)


@pytest.mark.skipif(REQUESTED != "cuda", reason="the default target's architecture: a GPU's work (1.5B parameters)")
def test_exact_rows_of_the_default_target_equal_one_token_passes() -> None:
    """Random weights of the default target's architecture in bf16, graphs, exact mode: after 8 contexts
    (7 of 400 tokens; one of 1,010, where the one-token passes grow the cache from 1,024 to 2,048
    positions at token 1,016 and a pass of up to 9 tokens does not), every row of passes of 1..9 tokens
    equals a one-token pass: 72/72 rows at width 9, 360/360 in all."""
    from specdecode.models.backends import make_runner
    from specdecode.models.torch.hf_loading import random_model

    model = random_model(None, "target", dtype="bfloat16", device=str(DEVICE), exact=True)
    V = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    identical = {W: 0 for W in range(1, 10)}
    for c, length in enumerate([400] * 7 + [1010]):
        prompt = torch.randint(0, V, (length,), generator=generator)
        cont = torch.randint(0, V, (9,), generator=generator)
        runner = make_runner(model)
        runner.forward(prompt)
        expected = [runner.forward(t.view(1)) for t in cont]  # (1, V) each
        for W in identical:
            if c == 7 or W == 1:  # a fresh runner (the last context: its cache has not grown)
                runner = make_runner(model)
            runner.reset()
            runner.forward(prompt)
            rows = runner.forward(cont[:W], num_logits=W)
            identical[W] += sum(bool(torch.equal(rows[i], expected[i][0])) for i in range(W))
        assert runner.graphs_failed is None and sorted(runner.graphs) == [9]
    assert identical == {W: 8 * W for W in identical}, identical  # 72/72 rows at width 9


@pytest.mark.parametrize("kind", [k for k in CHAIN_KINDS if k != "none"])
def test_exact_bf16_greedy_equals_target_only_with_graphs(models, tiny_tokenizer, kind: str) -> None:
    """Tiny models in bf16, the target in exact mode with graphs: greedy output equals the target alone's
    on the device for every chain proposer (trees are refused in that mode)."""
    bf16 = {k: v.to(torch.bfloat16) if isinstance(v, torch.nn.Module) else v for k, v in models.items()}
    with on_device():
        placed = place(bf16, DEVICE, GRAPHS)
        use_static_cache(placed["target"], EXACT)
        alone = tokens(make_generator("none", placed, tiny_tokenizer), GREEDY)
        generator = make_generator(kind, placed, tiny_tokenizer)
        result = generator.generate(PROMPT, GREEDY, raw=True, schedule="ungated")  # every draft sent
    assert result.token_ids == alone and result.stats.draft_tokens > 0
    assert generator.target.capabilities.batch_invariant and not generator.target.capabilities.trees
    if REQUESTED != "stand-in":
        assert generator.target.graphs_failed is None and sorted(generator.target.graphs) == [9]
