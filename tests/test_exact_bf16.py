"""Exact passes in bfloat16 on the CPU (specdecode.models.torch.exact): every row of a W-token pass
equals a one-token pass bit for bit (W = 1..33, trees, batched rows, hidden states), so greedy
speculative output is the target alone's token for token, for every proposer, with drafts that agree
fully, never and partly (docs/design.md §6 rule 8). Tiny random models, cast to bfloat16."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.models.backends import make_runner, runner_capabilities
from specdecode.models.torch.batch import TorchBatchedRunner
from specdecode.models.torch.exact import (
    ROW_ATTENTION,
    exact_passes,
    forget_exact_passes,
    use_exact_passes,
    wants_exact_passes,
)
from specdecode.models.torch.hf_loading import load_model
from specdecode.models.torch.runner import ModelRunner
from specdecode.models.torch.static_runner import StaticCacheRunner, StaticCacheSettings
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
    """The server's runner: rows of different lengths and widths in one pass, each equal to its own
    sequence decoded token by token (declared batch-invariant)."""
    batched = TorchBatchedRunner(exact_target, max_rows=3)
    assert batched.capabilities.batch_invariant
    prompts = [ids(n, 10 + n) for n in (30, 41, 7)]
    conts = [ids(w, 20 + w) for w in (5, 1, 9)]
    for _ in prompts:
        batched.add_row()
    batched.forward(0, prompts, [1, 1, 1])
    out = batched.forward(0, conts, [len(c) for c in conts])
    for prompt, cont, rows in zip(prompts, conts, out, strict=True):
        expected = one_token_rows(ModelRunner(exact_target), prompt, cont)
        for i in range(len(cont)):
            assert torch.equal(rows[i], expected[i][0]), f"row of {len(prompt)} tokens, position {i}"


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
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a", GREEDY, raw=True, tree=tree
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
