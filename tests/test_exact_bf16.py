"""Exact passes in bfloat16 on the CPU (specdecode.models.torch.exact): every row of a W-token pass
equals a one-token pass bit for bit (W = 1..33, trees, batched rows, hidden states), so greedy
speculative output is the target alone's token for token, for every proposer, with drafts that agree
fully, never and partly (docs/design.md §6 rule 8). Tiny random models, cast to bfloat16."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.backends import make_runner, runner_capabilities
from specdecode.models.torch.batch import TorchBatchedRunner
from specdecode.models.torch.cpu import native_bf16_matmul
from specdecode.models.torch.exact import (
    ROW_ATTENTION,
    exact_passes,
    forget_exact_passes,
    use_exact_passes,
    wants_exact_passes,
)
from specdecode.models.torch.hf_loading import load_model
from specdecode.models.torch.runner import ModelRunner
from specdecode.models.torch.static_runner import (
    CAPACITY_BLOCK,
    StaticCacheRunner,
    StaticCacheSettings,
    use_static_cache,
)
from specdecode.tree import tree_attention

from conftest import make_tiny_model, perturbed_copy
from device_cases import CHAIN_KINDS, GREEDY, TREE_KINDS, make_generator, make_models, tokens

P = 40  # prompt tokens before the passes compared
WIDTHS = range(1, 34)


def bf16(model: PreTrainedModel) -> PreTrainedModel:
    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.fixture(scope="module")
def exact_target() -> PreTrainedModel:
    return use_exact_passes(bf16(make_tiny_model(seed=0)))


def ids(n: int, seed: int, V: int = 96) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def one_token_rows(runner: Any, prompt: torch.Tensor, tokens_: torch.Tensor, hidden: bool = False) -> list:
    """Logits (and features) of decoding ``tokens_`` one per pass after ``prompt``."""
    runner.reset()
    runner.forward(prompt)
    return [runner.forward(t.view(1), return_hidden=hidden) for t in tokens_]


# ------------------------------------------------------------------ rows of one pass
@pytest.mark.parametrize("kind", ["eager", "static"])
def test_every_row_of_a_pass_equals_a_one_token_pass(exact_target, kind: str) -> None:
    """Widths 1..33, eager runner and static cache (stand-in graphs): bit for bit, logits and features."""
    if kind == "eager":
        runner = ModelRunner(exact_target)
    else:
        runner = StaticCacheRunner(exact_target, settings=StaticCacheSettings(stand_in=True))
    assert runner.capabilities.batch_invariant
    prompt, cont = ids(P, 0), ids(max(WIDTHS), 1)
    expected = one_token_rows(runner, prompt, cont, hidden=True)
    for W in WIDTHS:
        runner.truncate(P)
        logits, hidden = runner.forward(cont[:W], num_logits=W, return_hidden=True)
        for i in range(W):
            assert torch.equal(logits[i], expected[i][0][0]), f"width {W}, row {i}"
            assert torch.equal(hidden[i], expected[i][1][0]), f"width {W}, row {i} (features)"
        runner.truncate(P)
        assert torch.equal(runner.forward(cont[:W]), expected[W - 1][0])  # the last row alone (num_logits=1)


def test_tree_nodes_equal_decoding_their_branch(exact_target) -> None:
    """Each node of a tree pass (two roots' worth of branches, depth 4) equals decoding its root path
    token by token; compacting to one path and decoding on equals plain decoding."""
    runner = ModelRunner(exact_target)
    prompt = ids(P, 2)
    parents = torch.tensor([0, 0, 1, 1, 2, 3, 3, 6, 5])  # node i + 1's parent (node 0: the last context token)
    nodes = ids(len(parents) + 1, 3)
    depths, mask = tree_attention(parents)
    runner.reset()
    runner.forward(prompt)
    attend = torch.cat([torch.ones(len(nodes), P, dtype=torch.bool), mask], dim=1)
    tree = runner.forward_masked(nodes, P + depths, attend)
    for node in range(len(nodes)):
        path = [node]
        while path[-1] > 0:
            path.append(int(parents[path[-1] - 1]))
        branch = nodes[torch.tensor(path[::-1])]
        expected = one_token_rows(ModelRunner(exact_target), prompt, branch)[-1][0]
        assert torch.equal(tree[node], expected), f"node {node}"
    path = torch.tensor([0, 1, 3, 6, 8])  # a root path: keep it, decode one more token
    runner.compact(P + path)
    after = runner.forward(ids(1, 4))
    plain = one_token_rows(ModelRunner(exact_target), prompt, torch.cat([nodes[path], ids(1, 4)]))
    assert torch.equal(after, plain[-1])


def test_batched_rows_equal_one_token_passes(exact_target) -> None:
    """The server's runner: rows of different lengths and widths in one pass, each equal to the same
    runner's one-token passes of that row after the same prefill (declared batch-invariant)."""
    prompts = [ids(n, 10 + n) for n in (30, 41, 7)]
    conts = [ids(9, 20 + b) for b in range(3)]
    widths = (5, 1, 9)

    def prefilled() -> TorchBatchedRunner:
        runner = TorchBatchedRunner(exact_target, max_rows=3)
        for _ in prompts:
            runner.add_row()
        runner.forward(0, prompts, [1, 1, 1])
        return runner

    one_token = prefilled()
    assert one_token.capabilities.batch_invariant
    steps = [one_token.forward(0, [c[j : j + 1] for c in conts], [1, 1, 1]) for j in range(9)]  # a token per row
    out = prefilled().forward(0, [c[:w] for c, w in zip(conts, widths, strict=True)], list(widths))
    for b, w in enumerate(widths):
        for i in range(w):
            assert torch.equal(out[b][i], steps[i][b][0]), f"row {b}, position {i}"


# ------------------------------------------------------------------ greedy identity, end to end
@pytest.fixture(scope="module")
def bf16_models(tiny_tokenizer) -> dict[str, Any]:
    """device_cases' models in bfloat16, the target marked for exact passes."""
    models = {k: bf16(v) if isinstance(v, PreTrainedModel) else v for k, v in make_models(tiny_tokenizer).items()}
    use_exact_passes(models["target"])
    return models


@pytest.mark.parametrize(
    ("kind", "tree"), [(k, None) for k in CHAIN_KINDS if k != "none"] + [(k, "default") for k in TREE_KINDS], ids=str
)
def test_greedy_equals_target_only_for_every_proposer(bf16_models, tiny_tokenizer, kind: str, tree) -> None:
    alone = tokens(make_generator("none", bf16_models, tiny_tokenizer), GREEDY)
    generator = make_generator(kind, bf16_models, tiny_tokenizer)
    result = generator.generate(
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a",
        GREEDY,
        raw=True,
        tree=tree,
        schedule="ungated",  # every draft sent: the draft gate's choices follow measured times
    )
    assert result.token_ids == alone
    assert result.stats.draft_tokens > 0


@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_equals_target_only_with_drafts_that_agree_fully_never_partly(exact_target, draft_name, k) -> None:
    drafts = {
        "identical": exact_target,
        "unrelated": bf16(make_tiny_model(seed=123)),
        "perturbed": bf16(perturbed_copy(make_tiny_model(seed=0), noise=0.02)),
    }
    spec = SpeculativeGenerator(exact_target, drafts[draft_name])
    sampling = SamplingParams(max_new_tokens=40)
    rates = []
    for prompt in ([5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]):
        alone = spec.generate(prompt, sampling, speculative=False)
        result = spec.generate(prompt, sampling, num_speculative_tokens=k)
        assert result.token_ids == alone.token_ids
        rates.append(result.stats.acceptance_rate)
    rate = sum(rates) / len(rates)
    if not native_bf16_matmul() and draft_name != "unrelated":  # measured on AVX512-BF16 CPUs only
        pytest.skip(
            f"greedy tokens equal target-only decoding (checked); the acceptance rate ({rate:.3f}) is not "
            "checked on a CPU without native bfloat16 matmul: there a draft's own passes round otherwise "
            "than the target's (an identical draft accepted 0.86-0.98 on the AMD EPYC Zen 3, 2026-12-07)"
        )
    if draft_name == "identical":
        assert rate == 1.0
    elif draft_name == "unrelated":
        assert rate < 0.2
    else:
        assert 0.05 < rate < 0.95, rate  # accepted in part (k = 16 drafts past the first miss too)


# ------------------------------------------------------------------ the mark
def test_marking_loading_and_capabilities(model_dirs) -> None:
    """load_model(exact=True) marks a bfloat16 CPU model (not a float32 one); the runners declare it;
    forget_exact_passes restores the attention and removes the hooks; the mark is idempotent."""
    target_dir, _ = model_dirs
    model = load_model(target_dir, "target", "bfloat16", exact=True)
    assert exact_passes(model) and model.config._attn_implementation == ROW_ATTENTION
    assert runner_capabilities(model).batch_invariant and make_runner(model).capabilities.batch_invariant
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    assert use_exact_passes(model) is model and sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks
    forget_exact_passes(model)
    assert not exact_passes(model) and model.config._attn_implementation == "sdpa"
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert not runner_capabilities(model).batch_invariant and not make_runner(model).capabilities.batch_invariant
    assert not exact_passes(load_model(target_dir, "target", "float32", exact=True))
    assert not exact_passes(load_model(target_dir, "target", "bfloat16", exact=False))
    assert wants_exact_passes(model) and not wants_exact_passes(make_tiny_model())


def test_flash_attention_is_refused() -> None:
    model = bf16(make_tiny_model())
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa or eager"):
        use_exact_passes(model)


# ------------------------------------------------------------------ fixed-width passes (exact mode on a GPU)
# On CUDA every pass after the prefill has one width (StaticCacheSettings.exact_width), replayed from one
# graph. The same rule holds on the CPU's kernels (stock attention, a fixed number of query rows over the
# whole cache), so the runner's logic is checked here through the stand-in graphs.
FIXED = StaticCacheSettings(stand_in=True, exact_width=9)


def fixed_width_model(seed: int = 0) -> PreTrainedModel:
    model = bf16(make_tiny_model(seed=seed))
    model.config.max_position_embeddings = 4 * CAPACITY_BLOCK  # room to grow the cache (default rope: no table)
    use_static_cache(model, FIXED)
    return model


@pytest.mark.parametrize("prompt_length", [P, CAPACITY_BLOCK - 20])  # the second crosses a capacity growth
def test_fixed_width_rows_equal_one_token_passes(prompt_length: int) -> None:
    model = fixed_width_model()
    runner = make_runner(model)
    assert isinstance(runner, StaticCacheRunner) and runner.capabilities.batch_invariant
    assert not runner.capabilities.trees and not runner_capabilities(model).trees
    prompt, cont = ids(prompt_length, 5), ids(max(WIDTHS), 6)
    expected = one_token_rows(runner, prompt, cont, hidden=True)
    for W in WIDTHS:
        fresh = make_runner(model)  # its cache grows during this pass, where the one-token passes' grew earlier
        fresh.forward(prompt)
        logits, hidden = fresh.forward(cont[:W], num_logits=W, return_hidden=True)
        for i in range(W):
            assert torch.equal(logits[i], expected[i][0][0]), f"width {W}, row {i}"
            assert torch.equal(hidden[i], expected[i][1][0]), f"width {W}, row {i} (features)"
    assert sorted(runner.graphs) == sorted(fresh.graphs) == [9]  # one captured width: every pass after the prefill
    with pytest.raises(ValueError, match="not exact on a fixed-width runner"):
        attend = torch.ones(2, runner.length + 2, dtype=torch.bool)
        runner.forward_masked(cont[:2], torch.tensor([runner.length, runner.length]), attend)


@pytest.mark.parametrize("kind", [k for k in CHAIN_KINDS if k != "none"])
def test_fixed_width_greedy_equals_target_only(tiny_tokenizer, kind: str) -> None:
    models = {k: bf16(v) if isinstance(v, PreTrainedModel) else v for k, v in make_models(tiny_tokenizer).items()}
    use_static_cache(models["target"], FIXED)
    alone = make_generator("none", models, tiny_tokenizer)
    expected = tokens(alone, GREEDY)
    generator = make_generator(kind, models, tiny_tokenizer)
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a"
    result = generator.generate(prompt, GREEDY, raw=True, schedule="ungated")  # every draft sent
    assert result.token_ids == expected and result.stats.draft_tokens > 0
    assert sorted(generator.target.graphs) == sorted(alone.target.graphs) == [9]


def test_fixed_width_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="exact_width"):
        use_static_cache(bf16(make_tiny_model()), StaticCacheSettings(exact_width=65))


def test_exact_mode_is_on_by_default_except_torch_on_a_gpu(model_dirs) -> None:
    """Where no one says: on for llama.cpp and torch on the CPU (bf16 exact passes cost at most 15% of
    plain decoding there), off for torch on a GPU (fixed-width passes cost more); --no-exact wins."""
    from specdecode.load import default_exact, plan_models

    assert default_exact("llamacpp", "cpu") and default_exact("llamacpp", "cuda:0") and default_exact("torch", "cpu")
    assert not default_exact("torch", "cuda:0")
    target, _ = model_dirs
    assert plan_models(target, None, None, backend="torch", device="cpu").exact
    assert not plan_models(target, None, None, backend="torch", device="cpu", exact=False).exact


# ------------------------------------------------------------------ the real pair, bf16, CPU (slow)
EXACT_TURNS = int(os.environ.get("SPECDECODE_EXACT_TURNS", "3"))
"""First turns of Spec-Bench dev prompts (one group after another) the real-pair test decodes; the
issue's check is 30 (``SPECDECODE_EXACT_TURNS=30 SPECDECODE_EXACT_TOKENS=32``, minutes: see
docs/usage.md#exactness); the default keeps scripts/test.sh inside its budget."""
EXACT_TOKENS = int(os.environ.get("SPECDECODE_EXACT_TOKENS", "24"))


@pytest.fixture(scope="module")
def real_bf16(real_bf16_pair: Any) -> Any:
    """The session's default pair on torch in bf16 on the CPU (exact mode: the default there;
    conftest's ``real_bf16_pair``), the prompts (first turns of Spec-Bench dev prompts, one group
    after another) and the target alone's greedy tokens."""
    from specdecode.bench.prompts import encode_chat, load_prompts

    loaded = real_bf16_pair
    groups = "translation,summarization,qa,math_reasoning,rag,mt_bench"
    chosen = load_prompts(None, groups, -(-EXACT_TURNS // 6), shortest=True)[:EXACT_TURNS]
    prompts = [encode_chat(loaded.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in chosen]
    alone = SpeculativeGenerator(loaded.target, tokenizer=loaded.tokenizer)
    sampling = SamplingParams(max_new_tokens=EXACT_TOKENS)
    expected = [alone.generate(p, sampling, speculative=False).token_ids for p in prompts]
    return loaded, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "prompt_lookup", "eagle"])
def test_real_pair_bf16_greedy_equals_target_only(real_bf16, method: str) -> None:
    from specdecode.proposers import PROPOSERS

    loaded, prompts, expected = real_bf16
    target, tokenizer = loaded.target, loaded.tokenizer
    assert exact_passes(target) and target.dtype == torch.bfloat16
    proposer = PROPOSERS[method].build(PROPOSERS[method].config(), target, loaded.draft)
    generator = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=proposer)
    sampling = SamplingParams(max_new_tokens=EXACT_TOKENS)
    drafted = 0
    for prompt, alone in zip(prompts, expected, strict=True):
        result = generator.generate(prompt, sampling)
        assert result.token_ids == alone, f"{method}: {tokenizer.decode(prompt)[-80:]!r}"
        drafted += result.stats.draft_tokens
    assert drafted > 0
