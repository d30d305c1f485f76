"""The int8 draft (``draft_quantization="int8"``): the quantized copy itself, and losslessness of
drafting with it (greedy float32 equality, chains and trees; sampled marginals)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.commands.main import main
from specdecode.models.torch import quant
from specdecode.models.torch.quant import count_int8_linears, quantize_int8, resolve_draft_quantization
from specdecode.proposers import get_spec
from specdecode.proposers.draft_model import DraftModelConfig, DraftModelProposer
from specdecode.proposers.early_exit import EarlyExitConfig, EarlyExitProposer

from conftest import constant_target, make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]
NEW = 40
INT8 = DraftModelConfig(draft_quantization="int8")


@pytest.fixture(scope="module")
def greedy_outputs(tiny_pair) -> list[list[int]]:
    return [target_only_greedy(tiny_pair["target"], p, NEW) for p in PROMPTS]


# ---------------------------------------------------------------- the quantized copy
def test_quantize_int8_copies_and_keeps_down_proj_and_the_source() -> None:
    model = make_tiny_model(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantized = quantize_int8(model)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    kinds = {name: type(m) for name, m in quantized.named_modules()}
    layers = model.config.num_hidden_layers
    assert count_int8_linears(quantized) == layers * 6 + 1  # q, k, v, o, gate, up per layer, and the head
    assert all(kinds[f"model.layers.{i}.mlp.down_proj"] is torch.nn.Linear for i in range(layers))
    assert kinds["lm_head"] is dynamic
    assert count_int8_linears(quantize_int8(model, keep_float=("down_proj", "lm_head"))) == layers * 6
    assert count_int8_linears(quantize_int8(model, keep_float=())) == layers * 7 + 1
    assert count_int8_linears(model) == 0  # the source is not touched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        a, b = model(ids).logits, quantized(ids).logits
    assert b.dtype == torch.float32 and b.shape == a.shape
    assert not torch.equal(a, b)  # int8 arithmetic, not a float copy
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())  # but close to it


def test_quantize_int8_converts_a_bfloat16_draft_and_refuses_other_devices() -> None:
    model = make_tiny_model(seed=0).to(torch.bfloat16)
    quantized = quantize_int8(model)
    assert model.dtype == torch.bfloat16 and quantized.dtype == torch.float32
    with torch.inference_mode():
        assert quantized(torch.tensor([[1, 2, 3]])).logits.dtype == torch.float32
    with pytest.raises(ValueError, match="CPU only"):
        quantize_int8(make_tiny_model(seed=0).to("meta"))
    with pytest.raises(ValueError, match="no linear layer"):
        quantize_int8(torch.nn.Sequential(torch.nn.Linear(4, 4)), keep_float=("0",))


def _tied_bf16_model() -> torch.nn.Module:
    """A tiny Qwen2 with tied input and output embeddings, in bfloat16 (as the default draft loads
    where the CPU multiplies bfloat16 natively)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(3)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def test_the_int8_copy_keeps_a_16_bit_embedding_table_and_looks_it_up_exactly() -> None:
    """The embedding table stays bfloat16 (a buffer: the copy's dtype is float32) and is looked up
    into float32: the copy's logits equal, bit for bit, those of the same copy with a float32 table."""
    model = make_tiny_model(seed=0).to(torch.bfloat16)
    quantized = quantize_int8(model, float_dtype=torch.float32)
    table = quantized.get_input_embeddings()
    assert table.weight.dtype == torch.bfloat16 and quantized.dtype == torch.float32
    assert "weight" in dict(table.named_buffers()) and torch.equal(table.weight, model.get_input_embeddings().weight)
    reference = copy.deepcopy(quantized)
    reference.set_input_embeddings(torch.nn.Embedding.from_pretrained(table.weight.float()))
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        assert torch.equal(quantized(ids).logits, reference(ids).logits)
    # a float32 draft whose table holds only bfloat16 values (loaded from bfloat16 files) gets it too
    assert (
        quantize_int8(copy.deepcopy(model).float(), float_dtype=torch.float32).get_input_embeddings().weight.dtype
        == torch.bfloat16
    )
    # a float32 table with values bfloat16 cannot hold stays float32, an nn.Embedding
    assert type(quantize_int8(make_tiny_model(seed=0)).get_input_embeddings()) is torch.nn.Embedding


def test_layers_left_out_of_int8_in_bfloat16_and_tied_heads() -> None:
    model = _tied_bf16_model()
    ids = torch.tensor([[5, 17, 33, 2, 9]])
    with torch.inference_mode():
        as32 = quantize_int8(model, float_dtype=torch.float32)
        as16 = quantize_int8(model, float_dtype=torch.bfloat16)
        down16 = as16.get_submodule("model.layers.0.mlp.down_proj")
        assert down16.weight.dtype == torch.bfloat16 and "weight" in dict(down16.named_buffers())
        assert as32.get_submodule("model.layers.0.mlp.down_proj").weight.dtype == torch.float32
        a, b = as32(ids).logits, as16(ids).logits
        assert a.dtype == b.dtype == torch.float32 and as16.dtype == torch.float32
        assert not torch.equal(a, b) and float((a - b).abs().max()) < 0.05 * float(a.abs().max())
        # tied table and a head kept for a token map: shared, in the kept dtype
        kept32 = quantize_int8(model, keep_float=("down_proj", "lm_head"), float_dtype=torch.float32)
        assert kept32.lm_head.weight is kept32.get_input_embeddings().weight  # float32 for the float32 head
        assert kept32.lm_head.weight.dtype == torch.float32
        kept16 = quantize_int8(model, keep_float=("down_proj", "lm_head"), float_dtype=torch.bfloat16)
        table = kept16.get_input_embeddings().weight
        assert table.dtype == kept16.lm_head.weight.dtype == torch.bfloat16
        assert table.untyped_storage().data_ptr() == kept16.lm_head.weight.untyped_storage().data_ptr()
        # an int8 head, the table on its own in bfloat16
        assert isinstance(as16.lm_head, torch.ao.nn.quantized.dynamic.Linear)
        assert as16.get_input_embeddings().weight.dtype == torch.bfloat16
    assert model.dtype == torch.bfloat16 and count_int8_linears(model) == 0  # the source is untouched
    with pytest.raises(ValueError, match="float_dtype"):
        quantize_int8(model, float_dtype=torch.float16)


def test_the_dtype_of_layers_left_out_of_int8_follows_the_cpu(monkeypatch) -> None:
    model = make_tiny_model(seed=0)
    monkeypatch.setattr(quant, "native_bf16_matmul", lambda: True)
    assert quant.int8_float_dtype(copy.deepcopy(model).to(torch.bfloat16)) == torch.bfloat16
    assert quant.int8_float_dtype(model) == torch.float32  # a float32 draft keeps float32 (oneDNN)
    down = quantize_int8(copy.deepcopy(model).to(torch.bfloat16)).get_submodule("model.layers.0.mlp.down_proj")
    assert down.weight.dtype == torch.bfloat16
    monkeypatch.setattr(quant, "native_bf16_matmul", lambda: False)  # bfloat16 row by row: slow, so float32
    assert quant.int8_float_dtype(copy.deepcopy(model).to(torch.bfloat16)) == torch.float32


@pytest.mark.parametrize("tree", [None, "dynamic:8"])
def test_greedy_equals_the_target_alone_with_a_bf16_int8_draft(
    tmp_path, tiny_pair, greedy_outputs, monkeypatch, tree
) -> None:
    """A draft loaded in bfloat16: int8 layers, bfloat16 table and ``down_proj`` (as on a CPU with
    native bfloat16), drafting for the float32 target, with the full head and with a token map (whose
    int8 reduced head copies rows of the bfloat16 head)."""
    monkeypatch.setattr(quant, "native_bf16_matmul", lambda: True)
    draft = copy.deepcopy(tiny_pair["perturbed"]).to(torch.bfloat16)
    proposer = DraftModelProposer(draft, INT8)
    model = proposer.runner.model
    assert model.get_submodule("model.layers.0.mlp.down_proj").weight.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    from specdecode.token_map import save_token_map

    path = str(save_token_map(torch.arange(60), tmp_path / "map.npy"))
    mapped = DraftModelProposer(draft, DraftModelConfig(draft_quantization="int8", token_map=path))
    assert isinstance(mapped.runner.head_module, torch.ao.nn.quantized.dynamic.Linear)  # rows of the bf16 head
    for each in (proposer, mapped):
        spec = SpeculativeGenerator(tiny_pair["target"], proposer=each)
        accepted = 0
        for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
            result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3, tree=tree)
            assert result.token_ids == expected
            accepted += result.stats.accepted_tokens
        assert accepted > 0


def test_the_option_is_checked_and_taken_from_the_command_line() -> None:
    spec = get_spec("draft_model")
    assert spec.make_config().draft_quantization == "auto"
    for value in ("auto", "none", "int8", None):
        assert spec.make_config(draft_quantization=value).draft_quantization == value
    for bad in ("int4", "", 8):
        with pytest.raises(ValueError, match="draft_quantization"):
            spec.make_config(draft_quantization=bad)
    assert EarlyExitConfig().draft_quantization == "none"  # early exit shares the target's weights by default
    assert EarlyExitConfig(exit_layer=1, draft_quantization="int8").draft_quantization == "int8"


def test_auto_quantizes_large_float32_and_bfloat16_cpu_drafts_only(monkeypatch) -> None:
    model = make_tiny_model(seed=0)
    size = sum(p.numel() for p in model.parameters())
    assert resolve_draft_quantization("auto", model) == "none"  # tiny: left alone
    assert resolve_draft_quantization("int8", model) == "int8"
    assert resolve_draft_quantization(None, model) == resolve_draft_quantization("none", model) == "none"
    monkeypatch.setattr(quant, "INT8_AUTO_MIN_PARAMETERS", size)
    assert resolve_draft_quantization("auto", model) == "int8"  # as large as the threshold, float32, CPU
    assert resolve_draft_quantization("auto", copy.deepcopy(model).to(torch.bfloat16)) == "int8"
    assert resolve_draft_quantization("auto", copy.deepcopy(model).to(torch.float16)) == "none"  # not measured
    assert resolve_draft_quantization("auto", copy.deepcopy(model).to("meta")) == "none"  # off the CPU: as loaded
    proposer = DraftModelProposer(make_tiny_model(seed=0))  # the default config is "auto"
    assert proposer.quantization == "int8" and count_int8_linears(proposer.runner.model) > 0
    with pytest.raises(ValueError, match="draft_quantization"):
        resolve_draft_quantization("int4", model)


# ---------------------------------------------------------------- lossless: greedy, chains and trees
@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_chain_equals_the_target_alone(tiny_pair, greedy_outputs, draft_name, k) -> None:
    proposer = DraftModelProposer(tiny_pair[draft_name], INT8)
    assert count_int8_linears(proposer.runner.model) > 0
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=proposer)
    accepted = drafted = 0
    for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
        assert result.token_ids == expected
        accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.draft_tokens
    if draft_name == "unrelated":
        assert accepted < 0.2 * drafted
    else:  # an int8 copy of the target (or of a near copy) agrees on many tokens
        assert 0.25 * drafted < accepted <= drafted


@pytest.mark.parametrize("tree", ["tree8", "dynamic:8"])
@pytest.mark.parametrize("draft_name", ["identical", "unrelated", "perturbed"])
def test_greedy_trees_equal_the_target_alone(tiny_pair, greedy_outputs, draft_name, tree) -> None:
    spec = SpeculativeGenerator(tiny_pair["target"], proposer=DraftModelProposer(tiny_pair[draft_name], INT8))
    accepted = 0
    for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
        result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), tree=tree)
        assert result.token_ids == expected
        accepted += result.stats.accepted_tokens
    if draft_name != "unrelated":
        assert accepted > 0


def test_a_fully_agreeing_int8_draft_is_always_accepted() -> None:
    """The constant target's logits are exactly 0 (zeroed final norm), so its int8 copy's are too:
    every drafted 0 is accepted. (Chains only: with all logits tied, a tree's ranking of the
    candidates is arbitrary; trees are checked with the partly agreeing drafts above.)"""
    target = constant_target()
    spec = SpeculativeGenerator(target, proposer=DraftModelProposer(target, INT8))
    for k in (1, 4):
        result = spec.generate([3, 4, 5], SamplingParams(max_new_tokens=NEW), num_speculative_tokens=k)
        assert result.token_ids == [0] * NEW
        stats = result.stats
        assert stats.accepted_per_position == stats.drafted_per_position and stats.accepted_tokens > 0


def test_int8_with_a_token_map_and_the_early_exit_proposer(tmp_path, tiny_pair, greedy_outputs) -> None:
    from specdecode.token_map import save_token_map

    path = str(save_token_map(torch.arange(60), tmp_path / "map.npy"))
    target = tiny_pair["target"]
    config = DraftModelConfig(draft_quantization="int8", token_map=path)
    mapped = DraftModelProposer(tiny_pair["perturbed"], config)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    full = mapped.runner.model.lm_head  # the copy keeps no float head: the reduced head is rows of the int8 one
    assert (
        isinstance(full, dynamic)
        and mapped.runner.model is DraftModelProposer(tiny_pair["perturbed"], INT8).runner.model
    )
    head = mapped.runner.head_module  # ... one per draft and map
    assert isinstance(head, dynamic) and head.out_features == 60
    assert torch.equal(head.weight().int_repr(), full.weight().int_repr()[:60])
    assert DraftModelProposer(tiny_pair["perturbed"], config).runner.head_module is head
    early = EarlyExitProposer(target, EarlyExitConfig(exit_layer=1, draft_quantization="int8"))
    assert count_int8_linears(early.runner.model) > 0 and count_int8_linears(target) == 0
    for proposer in (mapped, early):
        spec = SpeculativeGenerator(target, proposer=proposer)
        for prompt, expected in zip(PROMPTS, greedy_outputs, strict=True):
            for tree in (None, "dynamic:6"):
                result = spec.generate(prompt, SamplingParams(max_new_tokens=NEW), num_speculative_tokens=3, tree=tree)
                assert result.token_ids == expected


# ---------------------------------------------------------------- lossless: sampling
V_SMALL = 12
SAMPLING = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)


@pytest.mark.parametrize(
    ("tree", "mapped"),
    [(None, False), ("tree8", False), (None, True)],
)
def test_sampled_tokens_follow_the_target(tmp_path, tree, mapped) -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, k = 2 (or the tree8 shape, width > 1; or an int8
    reduced head over 9 of the 12 tokens, q zero outside them): the first three tokens drafted by
    an int8 near-copy of the target follow the exact target marginals (chi-square p > P_MIN,
    1,000 seeded samples), with part of the drafts accepted."""
    from specdecode.token_map import save_token_map

    target = make_tiny_model(vocab_size=V_SMALL, seed=5, init=0.3)
    draft = perturbed_copy(target, noise=0.1, seed=6)
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, SAMPLING)
    config = INT8
    if mapped:
        config = DraftModelConfig(
            draft_quantization="int8", token_map=str(save_token_map(torch.arange(9), tmp_path / "m.npy"))
        )
    spec = SpeculativeGenerator(target, proposer=DraftModelProposer(draft, config))
    samples = [
        spec.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": s}), num_speculative_tokens=2, tree=tree)
        for s in range(1_000)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    steps = sum(r.stats.drafts for r in samples)
    assert drafted >= 1_000 and 0.2 * steps < accepted < drafted, (accepted, steps, drafted)
    for pos in range(3):
        tokens = [r.token_ids[pos] for r in samples]
        assert chi_square_p(tokens, exact[pos]) > P_MIN, f"position {pos} differs from the target's"


# ---------------------------------------------------------------- command line
def test_cli_generates_exactly_with_an_int8_draft(model_dirs, capsys) -> None:
    target, draft = model_dirs
    args = ["generate", "def add(a, b):", "--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    args += ["--max-new-tokens", "16", "-k", "3", "--json", "--compare", "--draft-quantization", "int8"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] is True and out["accepted_tokens"] > 0
    assert main([*args[:-1], "int4"]) == 2
    assert "draft_quantization" in capsys.readouterr().err


def test_int8_linear_approximates_the_layer_and_refuses_other_modules() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 300)
    x = torch.randn(5, 64)  # (rows, in)
    q = quant.int8_linear(layer)
    assert isinstance(q, torch.ao.nn.quantized.dynamic.Linear) and type(layer) is torch.nn.Linear
    error = (q(x) - layer(x)).abs().max() / layer(x).abs().max()
    assert 0 < error < 0.05, error
    with pytest.raises(ValueError, match="int8_linear"):
        quant.int8_linear(torch.nn.Conv1d(2, 2, 1))  # type: ignore[arg-type]


def test_int8_rows_are_the_int8_linear_of_the_float_rows() -> None:
    """Per-row scales: the rows of an int8 layer are exactly the int8 layer of the float rows."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(64, 300)
    rows = torch.tensor([7, 0, 299, 42, 100])
    picked = quant.int8_rows(quant.int8_linear(layer), rows)
    float_rows = torch.nn.Linear(64, 5)
    with torch.no_grad():
        float_rows.weight.copy_(layer.weight[rows])
        float_rows.bias.copy_(layer.bias[rows])
    direct = quant.int8_linear(float_rows)
    assert torch.equal(picked.weight().int_repr(), direct.weight().int_repr())
    assert torch.equal(picked.weight().q_per_channel_scales(), direct.weight().q_per_channel_scales())
    x = torch.randn(3, 64)
    assert torch.equal(picked(x), direct(x))
    with pytest.raises(ValueError, match="int8_rows"):
        quant.int8_rows(layer, rows)  # a float layer
    with pytest.raises(ValueError, match="int8_rows"):
        quant.int8_rows(quant.int8_linear(layer), torch.tensor([300]))


def test_proposers_of_one_draft_share_its_int8_copy(tiny_pair) -> None:
    """A server builds a proposer per request: the draft is quantized once, the caches are separate."""
    draft = tiny_pair["perturbed"]
    a, b = DraftModelProposer(draft, INT8), DraftModelProposer(draft, INT8)
    assert a.runner.model is b.runner.model and a.runner is not b.runner
    assert DraftModelProposer(make_tiny_model(seed=9), INT8).runner.model is not a.runner.model
