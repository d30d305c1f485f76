"""The trained drafters' greedy drafts replayed as CUDA graphs, on the CPU stand-in (issue 49, item 1).

A drafter attached to a target marked for the static cache with ``stand_in=True`` drafts through
:mod:`specdecode.drafters.graphs`: the EAGLE head over a static KV cache, its feed of new pairs
captured per width and its greedy chain per k; Medusa's heads, logits and argmax per k. The
stand-in runs the captured functions eagerly through the same fixed buffers, so these tests check
what a GPU's graphs must also get right: drafts token for token equal to the eager path's
(``DynamicCache``) across steps with rejections between them (the head cache cut back to the true
entries), fresh inputs at every replay, one capture per width and per k, the eager fallback when a
capture fails, the CPU default unchanged, and greedy output equal to the target alone through the
engine. ``tests/test_cuda.py`` runs the real graphs on a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from specdecode import SpeculativeGenerator
from specdecode.drafters import graphs as graphs_module
from specdecode.drafters.graphs import EagleHeadGraphs, MedusaGraphs, graph_settings
from specdecode.models.torch.static_runner import StaticCacheSettings, use_static_cache
from specdecode.proposers import EagleProposer, MedusaProposer
from specdecode.proposers.base import DraftTokens, ProposerBase

from conftest import make_tiny_model
from device_cases import (
    GREEDY,
    HEADS,
    PROMPT,
    SAMPLED,
    make_drafter,
    make_generator,
    make_models,
    make_proposer,
    place,
    tokens,
)

STAND_IN = StaticCacheSettings(stand_in=True)
PROPOSERS = {"eagle": EagleProposer, "medusa": MedusaProposer}


def pair(kind: str, seed: int = 0) -> tuple[Any, Any, Any]:
    """(target, eager proposer, graphed proposer): the same drafter weights, one attached to the
    unmarked target, one to a copy marked for the stand-in's graphs."""
    target = make_tiny_model(seed=0)
    marked = use_static_cache(copy.deepcopy(target), STAND_IN)
    eager = PROPOSERS[kind](make_drafter(kind, target, seed=seed))
    graphed = PROPOSERS[kind](make_drafter(kind, marked, seed=seed))
    assert eager.graphed is None and graphed.graphed is not None
    return target, eager, graphed


def scripted_steps(proposers: list[Any], target: Any, k_of: list[int], accepted: list[int], seed: int = 0) -> list:
    """Drive proposers through the same steps by hand: a 9-token prompt, then per step ``k`` drafts
    and ``n`` accepted (the context grows by ``n + 1`` tokens, the features of as many positions
    arrive); random tokens and features. Returns each proposer's drafts, ``[[ids per step]]``."""
    g = torch.Generator().manual_seed(seed)
    V, H = target.config.vocab_size, target.config.hidden_size
    context = torch.randint(0, V, (9,), generator=g)
    features = torch.randn(8, H, generator=g)  # f_0 .. f_{T-2}
    drafts: list[list[list[int]]] = [[] for _ in proposers]
    for p in proposers:
        p.reset()
        p.observe_features(features)
    for k, n in zip(k_of, accepted, strict=True):
        for p, out in zip(proposers, drafts, strict=True):
            out.append(p.propose(context, k, GREEDY, None).ids.tolist())
        new = torch.randint(0, V, (n + 1,), generator=g)
        context = torch.cat([context, new])
        features = torch.randn(n + 1, H, generator=g)
        for p in proposers:
            p.observe_features(features)
    return drafts


# ------------------------------------------------------------------ drafts equal the eager path's
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_drafts_equal_the_eager_path_across_steps_and_rollbacks(kind: str, k: int) -> None:
    """Eight steps, each accepting 0 .. k drafts (the rest rejected: the head cache is cut back to
    the true entries and the next feed has 1 .. k + 1 pairs): every draft equals the eager path's."""
    target, eager, graphed = pair(kind)
    accepted = [0, k, 1 % (k + 1), 0, k, 0, (k + 1) // 2, 0]
    a, b = scripted_steps([eager, graphed], target, [k] * 8, accepted)
    assert b == a and all(len(d) == min(k, HEADS) for d in b)
    assert len({tuple(d) for d in b}) > 1  # the steps drafted different tokens
    if kind == "eagle":
        assert ("chain", k) in graphed.graphed.graphs
        assert {key for key in graphed.graphed.graphs if key[0] == "sync"} == {
            ("sync", n + 1) for n in accepted[:-1]
        }  # the first feed (the prompt's 8 pairs) ran eagerly
        assert graphed.graphed.length == graphed._cached  # the true pairs only, as the DynamicCache path
    else:
        assert sorted(graphed.graphed.graphs) == [min(k, HEADS)]


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_each_k_and_width_is_captured_once(kind: str, monkeypatch) -> None:
    """One capture per chain k and per feed width, reused by every later step; a new k captures anew."""
    captures: list[Any] = []
    original = graphs_module.CapturedFunction.__init__

    def counting(self, fn, inputs, *args, **kwargs):  # noqa: ANN001, ANN202
        captures.append(tuple(tuple(t.shape) for t in inputs))
        original(self, fn, inputs, *args, **kwargs)

    monkeypatch.setattr(graphs_module.CapturedFunction, "__init__", counting)
    target, eager, graphed = pair(kind)
    k_of = [2, 2, 2, 2, 3, 3, 2]
    accepted = [0, 0, 1, 0, 0, 3, 0]
    a, b = scripted_steps([eager, graphed], target, k_of, accepted)
    assert b == a
    keys = sorted(graphed.graphed.graphs, key=str)
    if kind == "eagle":
        assert keys == sorted([("chain", 2), ("chain", 3), ("sync", 1), ("sync", 2), ("sync", 4)], key=str)
    else:
        assert keys == [2, 3]
    assert len(captures) == len(keys)  # each once


def test_a_replay_reads_the_new_start_feature_and_position() -> None:
    """Stale inputs would repeat the last chain: replays of one captured chain from other features
    and at other lengths each give a fresh eager chain's tokens; the drafts handed over are copies,
    not the graph's output buffer."""
    target = make_tiny_model(seed=0)
    marked = use_static_cache(copy.deepcopy(target), STAND_IN)
    drafter = make_drafter("eagle", marked, seed=2)
    graphed = EagleHeadGraphs(drafter, STAND_IN)
    reference = EagleHeadGraphs(drafter, STAND_IN)
    g = torch.Generator().manual_seed(5)
    H, V = target.config.hidden_size, target.config.vocab_size
    prompt = torch.randn(12, H, generator=g)
    tokens_ = torch.randint(0, V, (12,), generator=g)
    results = []
    for length, seed in ((12, 0), (7, 1), (12, 2), (9, 3)):
        feature = torch.randn(H, generator=torch.Generator().manual_seed(seed))
        for head in (graphed, reference):
            head.reset()
            head.forward(prompt[:length], tokens_[:length], torch.arange(1, length + 1))
        got = graphed.chain(feature, 3).clone()
        reference.table.graphs.clear()  # a fresh capture (its first call) every time
        want = reference.chain(feature, 3)
        assert torch.equal(got, want), (length, seed)
        results.append(got.tolist())
    assert len({tuple(r) for r in results}) > 1
    assert list(graphed.graphs) == [("chain", 3)]


def test_proposer_drafts_are_copies_of_the_replay_buffers() -> None:
    target, _, graphed = pair("medusa")
    H = target.config.hidden_size
    graphed.reset()
    graphed.observe_features(torch.randn(4, H, generator=torch.Generator().manual_seed(0)))
    first = graphed.propose(torch.arange(5), 3, GREEDY, None)
    kept = first.ids.clone()
    graphed.observe_features(torch.randn(1, H, generator=torch.Generator().manual_seed(1)))
    second = graphed.propose(torch.arange(6), 3, GREEDY, None)
    assert torch.equal(first.ids, kept) and not torch.equal(first.ids, second.ids)
    buffer = graphed.graphed.graphs[3].outputs[0]
    assert first.ids.data_ptr() != buffer.data_ptr() and second.ids.data_ptr() != buffer.data_ptr()


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_failed_capture_drafts_eagerly_and_keeps_why(kind: str, monkeypatch, capsys) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module, "CapturedFunction", broken)
    target, eager, graphed = pair(kind)
    a, b = scripted_steps([eager, graphed], target, [3] * 5, [0, 2, 1, 3, 0])
    assert b == a
    assert "stream is capturing" in (graphed.graphed.graphs_failed or "") and not graphed.graphed.graphs
    assert capsys.readouterr().err.count("CUDA graph capture failed") == 1


# ------------------------------------------------------------------ who gets graphs
def test_the_cpu_default_is_unchanged() -> None:
    """No mark, or a mark for CUDA graphs on a CPU device: no graphs, the head keeps a DynamicCache."""
    target = make_tiny_model(seed=0)
    for kind in ("eagle", "medusa"):
        assert graph_settings(make_drafter(kind, target)) is None
        assert PROPOSERS[kind](make_drafter(kind, target)).graphed is None
    assert isinstance(EagleProposer(make_drafter("eagle", target)).cache, DynamicCache)
    use_static_cache(target, StaticCacheSettings())  # cuda_graphs=True, but the model is on the CPU
    assert graph_settings(make_drafter("eagle", target)) is None
    use_static_cache(target, STAND_IN)
    proposer = EagleProposer(make_drafter("eagle", target))
    assert graph_settings(proposer.drafter) == STAND_IN and isinstance(proposer.graphed, EagleHeadGraphs)
    assert isinstance(MedusaProposer(make_drafter("medusa", target)).graphed, MedusaGraphs)


# ------------------------------------------------------------------ through the engine
class Recorder(ProposerBase):
    """Wraps a proposer and keeps its drafts."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.drafts = inner, []
        for name in ("name", "supports_tree", "needs_target_features", "vocab_size"):
            setattr(self, name, getattr(inner, name))

    def reset(self) -> None:
        self.inner.reset()

    def describe(self) -> Any:
        return self.inner.describe()

    @property
    def passes(self) -> Any:  # the inner proposer's forwards are the ones the loop hears of
        return self.inner.passes

    @passes.setter
    def passes(self, sink: Any) -> None:
        self.inner.passes = sink

    def observe_features(self, hidden: torch.Tensor) -> None:
        self.inner.observe_features(hidden)

    def observe(self, result: Any) -> None:
        self.inner.observe(result)

    def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:  # noqa: ANN001
        draft = self.inner.propose(context, num_tokens, sampling, generator)
        self.drafts.append(draft.ids.tolist())
        return draft

    def propose_tree(self, context, tree, sampling, generator):  # noqa: ANN001
        draft = self.inner.propose_tree(context, tree, sampling, generator)
        self.drafts.append((draft.ids.tolist(), draft.parents.tolist()))
        return draft


@pytest.fixture(scope="module")
def models(tiny_tokenizer) -> dict[str, Any]:
    return make_models(tiny_tokenizer)


@pytest.fixture(scope="module")
def alone(models, tiny_tokenizer) -> list[int]:
    """Target-only greedy tokens, eager runner."""
    return tokens(make_generator("none", models, tiny_tokenizer), GREEDY)


def recorded(kind: str, models: dict[str, Any], tiny_tokenizer: Any, **options: Any) -> tuple[Any, Recorder, Any]:
    proposer = make_proposer(kind, models, tiny_tokenizer)
    recorder = Recorder(proposer)
    spec = SpeculativeGenerator(models["target"], tokenizer=tiny_tokenizer, proposer=recorder)
    sampling = options.pop("sampling", GREEDY)
    result = spec.generate(PROMPT, sampling, raw=True, schedule="ungated", **options)
    return result, recorder, proposer


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equals_the_target_alone_with_the_eager_drafts(models, tiny_tokenizer, alone, kind, k) -> None:
    """The target on the stand-in's graphs, the drafter's chain graphed: the output is the target
    alone's, and every step's draft the eager proposer's (on the eager runner)."""
    eager, eager_drafts, _ = recorded(kind, models, tiny_tokenizer, num_speculative_tokens=k)
    result, drafts, proposer = recorded(kind, place(models, "cpu", STAND_IN), tiny_tokenizer, num_speculative_tokens=k)
    assert result.token_ids == eager.token_ids == alone
    assert drafts.drafts == eager_drafts.drafts and len(drafts.drafts) > 3
    assert proposer.graphed is not None and proposer.graphed.graphs_failed is None
    assert ("chain", k) in proposer.graphed.graphs if kind == "eagle" else min(k, HEADS) in proposer.graphed.graphs


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
@pytest.mark.parametrize("mode", ["tree", "sampled"])
def test_trees_and_sampled_requests_stay_eager_with_the_eager_drafts(models, tiny_tokenizer, kind, mode) -> None:
    """Trees and sampled chains keep the eager loop (EAGLE's over the static head cache): the same
    drafts and tokens as the eager proposer's, no chain captured."""
    options: dict[str, Any] = {"tree": "default"} if mode == "tree" else {"sampling": SAMPLED}
    eager, eager_drafts, _ = recorded(kind, models, tiny_tokenizer, **dict(options))
    result, drafts, proposer = recorded(kind, place(models, "cpu", STAND_IN), tiny_tokenizer, **dict(options))
    assert result.token_ids == eager.token_ids and drafts.drafts == eager_drafts.drafts
    assert proposer.graphed is not None
    if kind == "medusa":
        assert not proposer.graphed.graphs
    else:
        assert all(key[0] == "sync" for key in proposer.graphed.graphs)
        assert proposer.graphed.length == proposer._cached  # only the true pairs held


def test_the_head_cache_grows_and_drops_its_graphs() -> None:
    """Crossing the static cache's capacity (1,024 entries) moves its buffers: the captured passes,
    which read the old ones, are dropped and captured again; the drafts stay those of a head whose
    cache was large enough from the start."""
    target = make_tiny_model(seed=0)
    drafter = make_drafter("eagle", use_static_cache(copy.deepcopy(target), STAND_IN), seed=3)
    small = EagleHeadGraphs(drafter, STAND_IN)
    large = EagleHeadGraphs(drafter, StaticCacheSettings(stand_in=True, capacity=2048))
    g = torch.Generator().manual_seed(9)
    H, V = target.config.hidden_size, target.config.vocab_size
    n = 1018
    features, ids = torch.randn(n + 12, H, generator=g), torch.randint(0, V, (n + 12,), generator=g)
    for head in (small, large):
        head.forward(features[:n], ids[:n], torch.arange(1, n + 1))
    drafts = {}
    for name, head in (("small", small), ("large", large)):
        out = []
        for start, m in ((n, 1), (n + 1, 2), (n + 3, 1), (n + 4, 1)):  # the second chain crosses 1,024
            feature = head.sync(features[start : start + m], ids[start : start + m])
            out.append(head.chain(feature, 4).tolist())
        drafts[name] = out
    assert drafts["small"] == drafts["large"]
    assert small.cache.capacity == 2048 and large.cache.capacity == 2048
    assert sorted(small.graphs, key=str) == [("chain", 4), ("sync", 1)]  # ("sync", 2): dropped with the old buffers
