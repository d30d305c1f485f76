"""Early exit (self-speculation): the shallow view shares the target's weights and computes the
first L layers exactly; decoding with it is lossless (greedy and sampled); calibration picks,
saves and reuses an exit layer; the ``calibrate-early-exit`` command."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.calibrate import calibrate_early_exit, default_layers, load_prompts, parse_layers, predicted_speedup
from specdecode.commands.main import main
from specdecode.models.torch.runner import ModelRunner
from specdecode.proposers import PROPOSERS, DraftModelConfig, EarlyExitConfig, EarlyExitProposer, make_proposer
from specdecode.proposers.early_exit import calibration_path, early_exit_view, save_exit_layer, target_identity

from conftest import make_tiny_model
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7]]


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """No calibration file from the user's cache leaks into a test."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))


def scaled_model(exit_layer: int, factor: float, layers: int = 4, **kwargs) -> torch.nn.Module:
    """A tiny Qwen2 whose layers past ``exit_layer`` write ``factor`` times their usual update into the
    residual stream (o_proj and down_proj scaled): 0 makes them no-ops (the shallow view is exact),
    a large factor makes them dominate (the shallow view is a poor guess)."""
    model = make_tiny_model(layers=layers, **kwargs)
    with torch.no_grad():
        for layer in model.model.layers[exit_layer:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)
    return model


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(3)
    return LlamaForCausalLM(config).float().eval()


def reference_logits(target, ids: torch.Tensor, exit_layer: int) -> torch.Tensor:
    """The first ``exit_layer`` layers through the target's own norm and head, from its hidden states."""
    with torch.no_grad():
        hidden = target(ids[None], output_hidden_states=True).hidden_states[exit_layer]  # (1, T, C)
        return target.lm_head(target.model.norm(hidden))[0].float()  # (T, V)


# ---------------------------------------------------------------- the shallow view
@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama_tied"])
@pytest.mark.parametrize("exit_layer", [1, 3])
def test_view_shares_weights_and_computes_the_first_layers(arch: str, exit_layer: int) -> None:
    target = {"qwen2": lambda: make_tiny_model(layers=4), "llama": lambda: tiny_llama(False),
              "llama_tied": lambda: tiny_llama(True)}[arch]()  # fmt: skip
    view = early_exit_view(target, exit_layer)
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    view_params = list(view.parameters())
    assert all(p.data_ptr() in target_ptrs for p in view_params)  # shared storage, nothing copied
    assert not any(t.is_meta for t in (*view.parameters(), *view.buffers()))
    dropped = sum(p.numel() for layer in target.model.layers[exit_layer:] for p in layer.parameters())
    assert sum(p.numel() for p in view_params) == sum(p.numel() for p in target.parameters()) - dropped
    assert view.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
    assert view.config.num_hidden_layers == exit_layer and target.config.num_hidden_layers == 4
    assert len(getattr(view.config, "layer_types", None) or [None] * exit_layer) == exit_layer

    ids = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    expected = reference_logits(target, ids, exit_layer)
    torch.testing.assert_close(ModelRunner(view).forward(ids, num_logits=8), expected, rtol=1e-5, atol=1e-5)
    full = target(ids[None]).logits[0]
    assert not torch.allclose(expected, full, atol=1e-3)  # the reference really is shallower


def test_view_cache_rollback_equals_fresh() -> None:
    target = make_tiny_model(layers=4)
    tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    runner = ModelRunner(early_exit_view(target, 2))
    assert len(runner.cache.layers) == 2  # its own cache, one entry per shallow layer
    runner.forward(tokens[:8], num_logits=1)
    runner.truncate(5)
    rolled_back = runner.forward(tokens[5:10], num_logits=5)
    fresh = ModelRunner(early_exit_view(target, 2)).forward(tokens, num_logits=5)
    torch.testing.assert_close(rolled_back, fresh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fresh, reference_logits(target, tokens, 2)[5:], rtol=1e-5, atol=1e-5)


def test_unsupported_layout_fails_clearly() -> None:
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match="early_exit does not support GPT2LMHeadModel"):
        EarlyExitProposer(GPT2LMHeadModel(config), EarlyExitConfig(exit_layer=1))


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "x"])
def test_bad_exit_layer_type(value) -> None:
    with pytest.raises(ValueError, match="exit_layer"):
        EarlyExitConfig(exit_layer=value)
    with pytest.raises(ValueError, match="exit_layer"):
        make_proposer("early_exit", target=make_tiny_model(), exit_layer=value)


@pytest.mark.parametrize("value", [4, 9])
def test_exit_layer_out_of_range_for_the_target(value: int) -> None:
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in \[1, 3\]"):
        make_proposer("early_exit", target=make_tiny_model(layers=4), exit_layer=value)
    with pytest.raises(ValueError, match="at least 2"):
        EarlyExitProposer(make_tiny_model(layers=1), EarlyExitConfig(exit_layer=1))


def test_config_inherits_the_draft_model_options() -> None:
    assert issubclass(EarlyExitConfig, DraftModelConfig)
    assert EarlyExitConfig(exit_layer="2").exit_layer == 2  # a command-line string
    with pytest.raises(ValueError, match="draft_confidence"):
        EarlyExitConfig(exit_layer=2, draft_confidence=1.5)
    spec = PROPOSERS["early_exit"]
    assert spec.needs_draft is False and spec.config is EarlyExitConfig
    with pytest.raises(ValueError, match="needs the target"):
        make_proposer("early_exit")
    target = make_tiny_model(layers=4)
    proposer = make_proposer("early_exit", target=target, exit_layer=3, draft_confidence=0.5)
    assert proposer.name == "early_exit" and proposer.exit_layer == 3 and proposer.config.draft_confidence == 0.5
    assert proposer.vocab_size == target.lm_head.weight.shape[0]


def test_default_exit_layer_warns_once(caplog, monkeypatch) -> None:
    import specdecode.proposers.early_exit as early_exit

    monkeypatch.setattr(early_exit, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        proposer = EarlyExitProposer(make_tiny_model(layers=8))
    assert proposer.exit_layer == 2  # 8 // 4
    assert "calibrate-early-exit" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        EarlyExitProposer(make_tiny_model(layers=8))  # a server builds one per request: no second warning
    assert "calibrate-early-exit" not in caplog.text


# ---------------------------------------------------------------- lossless
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_equals_target_only(k: int) -> None:
    cases = {  # name: (target, exit layer)
        "agrees": (scaled_model(2, 0.0), 2),  # layers 3-4 are no-ops: the shallow view is the model
        "never": (scaled_model(1, 10.0), 1),  # layers 2-4 dominate: the first layer guesses wrong
        "partly": (scaled_model(2, 0.3), 2),
    }
    rates = {}
    for name, (target, exit_layer) in cases.items():
        proposer = EarlyExitProposer(target, EarlyExitConfig(exit_layer=exit_layer))
        spec = SpeculativeGenerator(target, proposer=proposer)
        drafted = accepted = 0
        for prompt in PROMPTS:
            result = spec.generate(prompt, SamplingParams(max_new_tokens=30), num_speculative_tokens=k)
            assert result.token_ids == target_only_greedy(target, prompt, 30), (name, prompt)
            drafted += result.stats.draft_tokens
            accepted += result.stats.accepted_tokens
        rates[name] = accepted / drafted
    assert rates["agrees"] == 1.0
    assert rates["never"] < 0.1, rates
    assert 0.15 < rates["partly"] < 0.95, rates


def test_confidence_cut_stays_lossless() -> None:
    target = scaled_model(2, 0.3)
    proposer = EarlyExitProposer(target, EarlyExitConfig(exit_layer=2, draft_confidence=0.6))
    result = SpeculativeGenerator(target, proposer=proposer).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=30), num_speculative_tokens=8
    )
    assert result.token_ids == target_only_greedy(target, PROMPTS[0], 30)
    assert result.stats.draft_tokens < 8 * result.stats.drafts  # some drafts were cut short


def test_reduced_draft_head_through_the_inherited_options(tmp_path) -> None:
    """DraftModelConfig's token map works for early exit too: the shallow view drafts over half the
    vocabulary; greedy output is still the target's."""
    target = scaled_model(2, 0.3)
    torch.save(torch.arange(0, 96, 2), tmp_path / "map.pt")
    config = EarlyExitConfig(exit_layer=2, token_map=str(tmp_path / "map.pt"))
    spec = SpeculativeGenerator(target, proposer=EarlyExitProposer(target, config))
    result = spec.generate(PROMPTS[0], SamplingParams(max_new_tokens=30), num_speculative_tokens=3)
    assert result.token_ids == target_only_greedy(target, PROMPTS[0], 30)
    assert 0 < result.stats.accepted_tokens < result.stats.draft_tokens


def test_sampled_tokens_follow_the_target() -> None:
    """Temperature 0.8, top-k 9, top-p 0.95, k = 2: the first three tokens with early-exit drafts
    (sampled from the shallow view, q returned) follow the exact target marginals (chi-square,
    p > P_MIN, 800 seeded samples)."""
    target = make_tiny_model(vocab_size=12, seed=5, init=0.3, layers=4)
    prompt = [3, 1, 4]
    sampling = SamplingParams(temperature=0.8, top_k=9, top_p=0.95, max_new_tokens=3)
    exact = exact_marginals(target, prompt, 3, sampling)
    spec = SpeculativeGenerator(target, proposer=EarlyExitProposer(target, EarlyExitConfig(exit_layer=2)))
    samples = [
        spec.generate(prompt, SamplingParams(**{**sampling.__dict__, "seed": s}), num_speculative_tokens=2)
        for s in range(800)
    ]
    drafted = sum(r.stats.draft_tokens for r in samples)
    accepted = sum(r.stats.accepted_tokens for r in samples)
    assert drafted >= 800 and 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, f"position {pos}"


# ---------------------------------------------------------------- calibration
def test_calibration_helpers(tmp_path) -> None:
    assert default_layers(28) == [4, 8, 12, 16, 20]
    assert default_layers(4) == [1, 2, 3] and default_layers(2) == [1]
    assert parse_layers("4, 8,4,12") == [4, 8, 12]
    with pytest.raises(ValueError, match="--layers"):
        parse_layers("4,x")
    assert predicted_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert predicted_speedup(0.5, 1, 0.0) == pytest.approx(1.5)
    builtin = load_prompts()
    assert len(builtin) >= 6 and any("def " in p or "function" in p for p in builtin)
    lines = ['{"prompt": "a"}', '"b"', '{"turns": ["c", "d"]}', ""]
    (tmp_path / "p.jsonl").write_text("\n".join(lines))
    assert load_prompts(tmp_path / "p.jsonl") == ["a", "b", "c"]
    (tmp_path / "p.txt").write_text("one\nline two\n\n\nthree\n")
    assert load_prompts(tmp_path / "p.txt") == ["one\nline two", "three"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"q": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2"):
        load_prompts(tmp_path / "bad.jsonl")


def test_calibration_picks_saves_and_is_reused(tiny_tokenizer, tmp_path, monkeypatch, caplog) -> None:
    import specdecode.proposers.early_exit as early_exit

    monkeypatch.setattr(early_exit, "_WARNED", set())
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), layers=4)
    result = calibrate_early_exit(
        target, tokenizer=tiny_tokenizer, prompts=load_prompts()[:2], max_new_tokens=6, num_speculative_tokens=2
    )
    assert [r.exit_layer for r in result.rows] == [1, 2, 3]
    assert result.exit_layer in (1, 2, 3) and result.target_tokens_per_second > 0
    best = max(result.rows, key=lambda r: r.tokens_per_second)
    assert result.exit_layer == best.exit_layer
    for r in result.rows:
        assert 0.0 <= r.acceptance_rate <= 1.0 and 1.0 <= r.mean_acceptance_length <= 3.0
        assert r.draft_cost_ratio > 0 and r.tokens_per_second > 0 and r.predicted_speedup > 0
        assert r.identical == 2  # float32: the same output as the target alone
    saved = json.loads(calibration_path().read_text())
    assert result.saved_to == str(calibration_path()) and str(calibration_path()).startswith(str(tmp_path))
    assert saved[target_identity(target)]["exit_layer"] == result.exit_layer
    assert len(saved[target_identity(target)]["rows"]) == 3
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        assert make_proposer("early_exit", target=target).exit_layer == result.exit_layer
        assert EarlyExitProposer(target, EarlyExitConfig()).exit_layer == result.exit_layer
    assert "calibrate-early-exit" not in caplog.text  # the calibrated value, no warning
    save_exit_layer(target, {"exit_layer": 3})
    assert EarlyExitProposer(target).exit_layer == 3
    other = make_tiny_model(vocab_size=len(tiny_tokenizer), layers=6)  # another config: not calibrated
    assert target_identity(other) != target_identity(target)
    with caplog.at_level(logging.WARNING, logger="specdecode"):
        assert EarlyExitProposer(other).exit_layer == 1
    assert "calibrate-early-exit" in caplog.text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("models") / "target"
    make_tiny_model(vocab_size=len(tiny_tokenizer), layers=4).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_cli_calibrate_then_generate(model_dir, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\nThe quick brown fox\n")
    args = ["calibrate-early-exit", "--target", str(model_dir), "--dtype", "float32", "--layers", "1,3",
            "--prompts", str(prompts), "--max-new-tokens", "5", "-k", "2"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["exit_layer"] for r in out["rows"]] == [1, 3] and out["exit_layer"] in (1, 3)
    assert out["num_prompts"] == 2 and out["num_speculative_tokens"] == 2
    assert json.loads(calibration_path().read_text())[out["identity"]]["exit_layer"] == out["exit_layer"]
    assert main([*args, "--no-save", "--num-prompts", "1"]) == 0
    table = capsys.readouterr().out
    assert "early-exit calibration" in table and "chosen exit layer: " in table and "not saved" in table

    gen = ["generate", "def add(a, b):", "--target", str(model_dir), "--dtype", "float32", "--proposer",
           "early_exit", "--exit-layer", "2", "--max-new-tokens", "12", "-k", "3", "--compare", "--json"]  # fmt: skip
    assert main(gen) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["proposer"] == "early_exit" and result["identical"] is True


@pytest.mark.parametrize("layers", ["1,x", "0,2", "2,4", ""])
def test_cli_bad_layers(model_dir, capsys, layers: str) -> None:
    argv = ["calibrate-early-exit", "--target", str(model_dir), "--dtype", "float32", "--layers", layers]
    assert main(argv) == 2
    assert "--layers" in capsys.readouterr().err
    assert not calibration_path().exists()
