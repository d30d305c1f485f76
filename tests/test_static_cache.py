"""The static KV cache runner and its captured-pass logic, on the CPU (docs/design.md §2c).

CUDA graphs need a GPU; here the runner replays through :class:`~specdecode.models.torch.graphs.CapturedPass`'s
CPU stand-in (``stand_in=True``): the same fixed input and output buffers, eager kernels. So the
buffer logic (inputs copied before each replay, outputs copied before the next, one capture per width,
graphs dropped when the cache grows) and the static cache (rollback as a length change, trees,
compaction) are checked here; ``tests/test_cuda.py`` runs the real graphs on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.backends import make_runner
from specdecode.models.torch import graphs as graphs_module
from specdecode.models.torch.runner import ModelRunner
from specdecode.models.torch.static_runner import (
    CAPACITY_BLOCK,
    StaticCacheRunner,
    StaticCacheSettings,
    static_cache_settings,
    torch_runner,
    use_static_cache,
)
from specdecode.proposers.base import DraftTokens, ProposerBase
from specdecode.verify import VerifyResult

from conftest import make_tiny_model
from device_cases import CHAIN_KINDS, GREEDY, PROMPT, SAMPLED, TREE_KINDS, make_generator, make_models, place, tokens

STAND_IN = StaticCacheSettings(stand_in=True)


@pytest.fixture(scope="module")
def models(tiny_tokenizer) -> dict[str, Any]:
    return make_models(tiny_tokenizer)


@pytest.fixture(scope="module")
def eager_greedy(models, tiny_tokenizer) -> list[int]:
    """Target-only greedy tokens with the eager runner."""
    return tokens(make_generator("none", models, tiny_tokenizer), GREEDY)


def pairs(model: Any, **kwargs: Any) -> tuple[ModelRunner, StaticCacheRunner]:
    return ModelRunner(model, **kwargs), StaticCacheRunner(model, settings=STAND_IN, **kwargs)


# ------------------------------------------------------------------ the runner itself
@pytest.mark.parametrize("stand_in", [True, False], ids=["replayed", "eager"])
def test_logits_equal_the_eager_runner_through_passes_and_rollbacks(stand_in: bool) -> None:
    model = make_tiny_model(seed=0)
    eager = ModelRunner(model)
    static = StaticCacheRunner(model, settings=StaticCacheSettings(stand_in=stand_in))
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=torch.Generator().manual_seed(0))
    steps = [(0, 20, 3), (20, 1, 1), (21, 5, 5), (26, 1, 1), ("truncate", 23, 0), (30, 3, 3), (33, 9, 2)]
    for start, n, num_logits in steps:
        if start == "truncate":
            eager.truncate(n)
            static.truncate(n)
            continue
        a = eager.forward(ids[start : start + n], num_logits=num_logits)
        b = static.forward(ids[start : start + n], num_logits=num_logits)
        assert b.shape == a.shape and b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
        assert static.length == eager.length
    la, ha = eager.forward(ids[40:44], num_logits=2, return_hidden=True)
    lb, hb = static.forward(ids[40:44], num_logits=2, return_hidden=True)
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)
    torch.testing.assert_close(hb, ha, rtol=0, atol=1e-4)
    assert sorted(static.graphs) == ([1, 3, 4, 5, 9] if stand_in else [])  # the prefill runs eagerly


def test_a_reduced_head_gives_the_eager_runners_rows() -> None:
    model = make_tiny_model(seed=2)
    head_ids = torch.tensor([3, 17, 5, 91, 64])
    eager, static = pairs(model, head_ids=head_ids)
    ids = torch.arange(12) * 7 % model.config.vocab_size
    for a, b in (
        (eager.forward(ids[:8], 2), static.forward(ids[:8], 2)),
        (eager.forward(ids[8:9]), static.forward(ids[8:9])),
    ):
        assert b.shape == (a.shape[0], 5)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


def test_returned_logits_are_copies_not_the_replay_buffers() -> None:
    """A caller keeps logits across passes (the verifier keeps the last row): the next replay of the
    same width must not change them."""
    model = make_tiny_model(seed=0)
    runner = StaticCacheRunner(model, settings=STAND_IN)
    runner.forward(torch.tensor([1, 2, 3, 4]))
    first = runner.forward(torch.tensor([5]))
    kept = first.clone()
    runner.forward(torch.tensor([9]))  # same width: the same captured pass
    assert torch.equal(first, kept)
    assert not any(first.data_ptr() == p.logits.data_ptr() for p in runner.graphs.values())


def test_each_width_is_captured_once_and_replayed_with_fresh_inputs(monkeypatch) -> None:
    captures: list[int] = []
    original = graphs_module.CapturedPass.__init__

    def counting(self, fn, width, *args, **kwargs):  # noqa: ANN001, ANN202
        captures.append(width)
        original(self, fn, width, *args, **kwargs)

    monkeypatch.setattr(graphs_module.CapturedPass, "__init__", counting)
    model = make_tiny_model(seed=0)
    eager, static = pairs(model)
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(1))
    position = 0
    for width in (10, 1, 1, 1, 4, 4, 1, 4):
        a = eager.forward(ids[position : position + width], num_logits=width)
        b = static.forward(ids[position : position + width], num_logits=width)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)  # stale ids or positions would differ
        position += width
    assert captures == [1, 4]  # the 10-token prefill runs eagerly


def test_wide_passes_run_eagerly() -> None:
    model = make_tiny_model(seed=0)
    runner = StaticCacheRunner(model, settings=StaticCacheSettings(stand_in=True, max_graph_width=4))
    runner.forward(torch.arange(30) % model.config.vocab_size)
    runner.forward(torch.tensor([7, 8, 9, 10, 11]))
    runner.forward(torch.tensor([7, 8]))
    assert sorted(runner.graphs) == [2]


def test_the_cache_grows_and_drops_the_captured_passes() -> None:
    model = make_tiny_model(seed=3)
    model.config.max_position_embeddings = 4 * CAPACITY_BLOCK
    eager, static = pairs(model)
    ids = torch.randint(0, model.config.vocab_size, (CAPACITY_BLOCK + 40,), generator=torch.Generator().manual_seed(2))
    n = CAPACITY_BLOCK - 2
    torch.testing.assert_close(static.forward(ids[:n]), eager.forward(ids[:n]), rtol=0, atol=1e-4)
    torch.testing.assert_close(static.forward(ids[n : n + 1]), eager.forward(ids[n : n + 1]), rtol=0, atol=1e-4)
    assert static.cache.capacity == CAPACITY_BLOCK and 1 in static.graphs
    a = eager.forward(ids[n + 1 : n + 6], num_logits=5)  # crosses the capacity
    b = static.forward(ids[n + 1 : n + 6], num_logits=5)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    assert static.cache.capacity == 2 * CAPACITY_BLOCK
    assert sorted(static.graphs) == [5]  # the old ones read the old buffers: dropped, recaptured on use
    torch.testing.assert_close(static.forward(ids[n + 6 : n + 7]), eager.forward(ids[n + 6 : n + 7]), rtol=0, atol=1e-4)


def test_a_sequence_longer_than_the_model_takes_is_refused() -> None:
    model = make_tiny_model(seed=0)
    runner = StaticCacheRunner(model, settings=STAND_IN)
    with pytest.raises(ValueError, match="longer than the model's 512"):
        runner.forward(torch.zeros(513, dtype=torch.int64))


def test_a_failed_capture_falls_back_to_eager_passes(monkeypatch, capsys) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr("specdecode.models.torch.static_runner.CapturedPass", broken)
    model = make_tiny_model(seed=0)
    eager, static = pairs(model)
    ids = torch.arange(6) * 11 % model.config.vocab_size
    torch.testing.assert_close(static.forward(ids[:5]), eager.forward(ids[:5]), rtol=0, atol=1e-4)
    torch.testing.assert_close(static.forward(ids[5:6]), eager.forward(ids[5:6]), rtol=0, atol=1e-4)
    assert not static.uses_graphs and "stream is capturing" in (static.graphs_failed or "")
    assert capsys.readouterr().err.count("CUDA graph capture failed") == 1


def test_graphs_are_not_used_on_a_cpu_without_the_stand_in() -> None:
    runner = StaticCacheRunner(make_tiny_model(seed=0))
    assert not runner.uses_graphs
    runner.forward(torch.tensor([1, 2, 3]))
    runner.forward(torch.tensor([4]))
    assert runner.graphs == {}


def test_use_static_cache_marks_the_model_for_every_runner_made_of_it() -> None:
    model = make_tiny_model(seed=0)
    assert static_cache_settings(model) is None and type(make_runner(model)) is ModelRunner
    assert use_static_cache(model, STAND_IN) is model
    assert static_cache_settings(model) == STAND_IN
    assert isinstance(make_runner(model), StaticCacheRunner)
    assert isinstance(torch_runner(model, head_ids=torch.tensor([1, 2])), StaticCacheRunner)
    with pytest.raises(ValueError, match="max_graph_width"):
        use_static_cache(model, StaticCacheSettings(max_graph_width=0))


# ------------------------------------------------------------------ lossless through the engine
@pytest.mark.parametrize(
    ("kind", "tree"), [(k, None) for k in CHAIN_KINDS] + [(k, "default") for k in TREE_KINDS], ids=str
)
def test_greedy_equals_eager_target_only_for_every_proposer(models, tiny_tokenizer, eager_greedy, kind, tree) -> None:
    placed = place(models, "cpu", STAND_IN)
    generator = make_generator(kind, placed, tiny_tokenizer)
    assert isinstance(generator.target, StaticCacheRunner)
    result = generator.generate(
        PROMPT, GREEDY, raw=True, tree=tree, speculative=kind != "none", schedule="ungated"  # every draft sent
    )
    assert result.token_ids == eager_greedy
    assert (result.stats.draft_tokens > 0) == (kind != "none")
    assert tree is not None or generator.target.graphs, "no chain pass was replayed"  # tree passes run eagerly


@pytest.mark.parametrize("tree", [None, "default"], ids=["chain", "tree"])
def test_a_seed_gives_the_eager_runners_tokens(models, tiny_tokenizer, tree) -> None:
    """Sampling: the same seed gives the same tokens as the eager runner (same probabilities to
    rounding, same uniforms), so the static path inherits the eager path's chi-square tests."""
    eager = tokens(make_generator("draft_model", models, tiny_tokenizer), SAMPLED, tree=tree)
    static = tokens(make_generator("draft_model", place(models, "cpu", STAND_IN), tiny_tokenizer), SAMPLED, tree=tree)
    assert static == eager


class Scripted(ProposerBase):
    """Drafts from a known continuation: ``agree`` tokens of each draft right (None: all, 0: none),
    the rest wrong by one id."""

    name = "scripted"

    def __init__(self, prompt_len: int, continuation: list[int], agree: int | None, vocab: int) -> None:
        self.prompt_len, self.continuation, self.agree, self.vocab = prompt_len, continuation, agree, vocab

    def reset(self) -> None:
        pass

    def propose(self, context, num_tokens, sampling, generator) -> DraftTokens:  # noqa: ANN001
        start = int(context.shape[0]) - self.prompt_len
        right = self.continuation[start : start + num_tokens]
        ids = [t if self.agree is None or i < self.agree else (t + 1) % self.vocab for i, t in enumerate(right)]
        return DraftTokens(torch.tensor(ids, dtype=torch.int64))

    def observe(self, result: VerifyResult) -> None:
        pass


@pytest.mark.parametrize("agree", [None, 0, 2], ids=["fully", "never", "partly"])
@pytest.mark.parametrize("k", [3, 8])
def test_drafts_that_agree_fully_never_partly(models, tiny_tokenizer, eager_greedy, agree, k) -> None:
    target = place(models, "cpu", STAND_IN)["target"]
    prompt_len = int(SpeculativeGenerator(target, tokenizer=tiny_tokenizer).encode_prompt(PROMPT, raw=True).shape[0])
    proposer = Scripted(prompt_len, eager_greedy + [0] * 16, agree, target.config.vocab_size)
    generator = SpeculativeGenerator(target, tokenizer=tiny_tokenizer, proposer=proposer)
    result = generator.generate(PROMPT, SamplingParams(max_new_tokens=24), raw=True, num_speculative_tokens=k)
    assert result.token_ids == eager_greedy
    rate = result.stats.acceptance_rate
    assert rate > 0.95 if agree is None else (rate == 0.0 if agree == 0 else 0.1 < rate < 0.95), rate
    assert k + 1 in generator.target.graphs  # the verification width was captured


def test_a_compiled_pass_gives_the_eager_runners_logits() -> None:
    """``compile=True`` traces the captured pass with ``torch.compile`` (here the ``eager`` backend:
    dynamo's tracing, with the cache's in-place writes and the runner's state, without code
    generation); the logits stay the eager runner's."""
    model = make_tiny_model(seed=4)
    settings = StaticCacheSettings(stand_in=True, compile=True, compile_backend="eager")
    eager, static = ModelRunner(model), StaticCacheRunner(model, settings=settings)
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    for start, n in ((0, 12), (12, 1), (13, 4), (17, 1), (18, 4)):
        a = eager.forward(ids[start : start + n], num_logits=n)
        b = static.forward(ids[start : start + n], num_logits=n)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    eager.truncate(15)
    static.truncate(15)
    torch.testing.assert_close(
        static.forward(ids[30:34], num_logits=4), eager.forward(ids[30:34], num_logits=4), rtol=0, atol=1e-4
    )
    assert sorted(static.graphs) == [1, 4]


def test_a_compile_mode_with_inductors_own_graphs_is_refused() -> None:
    """The runner captures its own CUDA graphs: ``reduce-overhead`` (inductor's) is refused by name."""
    settings = StaticCacheSettings(stand_in=True, compile=True, compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile_mode"):
        StaticCacheRunner(make_tiny_model(seed=4), settings=settings)


def test_the_verification_widths_are_captured_after_the_prefill(models, tiny_tokenizer, eager_greedy) -> None:
    """The engine asks the target to prepare widths 1 .. k + 1 right after the prefill, so that no
    capture falls inside the decoding steps; the placeholder passes change no token."""
    placed = place(models, "cpu", STAND_IN)
    generator = make_generator("prompt_lookup", placed, tiny_tokenizer)
    result = generator.generate(PROMPT, GREEDY, raw=True, num_speculative_tokens=6)
    assert result.token_ids == eager_greedy
    assert sorted(generator.target.graphs) == list(range(1, 8))
    alone = make_generator("none", place(models, "cpu", STAND_IN), tiny_tokenizer)
    assert tokens(alone, GREEDY) == eager_greedy and sorted(alone.target.graphs) == [1]


def test_prepare_widths_keeps_the_sequence() -> None:
    model = make_tiny_model(seed=5)
    eager, static = pairs(model)
    ids = torch.randint(0, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    eager.forward(ids[:10])
    static.forward(ids[:10])
    static.prepare_widths([1, 3, 5, 200])  # 200: wider than max_graph_width, not captured
    assert static.length == 10 and sorted(static.graphs) == [1, 3, 5]
    for start, n in ((10, 3), (13, 1), (14, 5)):
        torch.testing.assert_close(
            static.forward(ids[start : start + n], n), eager.forward(ids[start : start + n], n), rtol=0, atol=1e-4
        )
