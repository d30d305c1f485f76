"""CPU compute paths (specdecode.models.torch.cpu): oneDNN linears equal torch's, speculation through them
stays lossless (greedy float32 equality, chains and trees; sampled marginals), ``--dtype auto``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.bench.methods import parse_method
from specdecode.models.torch import cpu
from specdecode.models.torch.cpu import auto_dtype, native_bf16_matmul, use_onednn_linears
from specdecode.models.torch.hf_loading import parse_dtype
from specdecode.proposers.prompt_lookup import PromptLookupConfig, PromptLookupProposer

from conftest import make_tiny_model, perturbed_copy
from reference import exact_marginals, target_only_greedy
from stat_checks import P_MIN, chi_square_p

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")

PROMPTS = [[5, 17, 33, 2, 9, 60, 11], [40, 41, 42], [7, 8, 7, 8, 7]]


@pytest.fixture
def every_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny models' layers are far below the size threshold: route all of them."""
    monkeypatch.setattr(cpu, "ONEDNN_MIN_WEIGHTS", 0)


def routed(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    assert use_onednn_linears(model) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return model


@pytest.mark.parametrize("rows", [1, 5, 17, cpu.ONEDNN_MAX_ROWS, cpu.ONEDNN_MAX_ROWS + 1])
def test_onednn_linear_equals_torch_linear(every_linear: None, rows: int) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(1, rows, 48)  # (B, T, C)
    expected = F.linear(x, layer.weight, layer.bias)
    assert use_onednn_linears(layer) == 1
    assert use_onednn_linears(layer) == 0  # idempotent
    out = layer(x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, 5, 17, cpu.ONEDNN_MAX_ROWS])
def test_prepacked_weight_equals_torch_linear_and_follows_weight_changes(every_linear: None, rows: int) -> None:
    """Multi-row calls go through a prepacked copy of the weight: same result as F.linear, the copy
    is made once, remade after an in-place change or a new weight, absent from the state dict and
    not carried by deepcopy; one-row calls use the plain weight and calls that need gradients
    F.linear (oneDNN's op has no backward: it used to drop the weight's gradient silently)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80)
    x = torch.randn(1, rows, 48)  # (B, T, C)
    assert use_onednn_linears(layer) == 1 and cpu.packed_layers(layer) == 0
    with torch.no_grad():
        layer(x[:, :1])  # one row: no copy
        assert cpu.packed_layers(layer) == 0
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert cpu.packed_layers(layer) == 1
        first = layer._specdecode_packed.weight
        layer(x)
        assert layer._specdecode_packed.weight is first  # made once
        layer.weight.mul_(-2.0)  # in place: the version changes
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.randn(80, 48))  # a new tensor
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert set(layer.state_dict()) == {"weight", "bias"}
    twin = copy.deepcopy(layer)
    assert cpu.packed_layers(twin) == 0 and cpu.packed_layers(layer) == 1
    with torch.no_grad():
        torch.testing.assert_close(twin(x), layer(x), rtol=1e-5, atol=1e-5)
    out = layer(x)  # gradients wanted: F.linear, so backward works
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(dim=(0, 1)).expand(80, 48))


def test_packing_can_be_left_off(every_linear: None) -> None:
    layer = torch.nn.Linear(48, 80)
    assert use_onednn_linears(layer, pack=False) == 1
    with torch.no_grad():
        layer(torch.randn(5, 48))
    assert cpu.packed_layers(layer) == 0


def test_no_packed_copy_without_memory_to_spare(every_linear: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing is decided once per model, all layers or none: copies that would leave less than
    pack_reserve() bytes available are not made (here one layer's copy would fit, both do not),
    and the layers compute the same on their plain weights. A deepcopy decides afresh."""
    real = cpu.available_memory()
    assert real is None or real > 0
    assert cpu.pack_reserve() >= cpu.ONEDNN_PACK_RESERVE
    model = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Linear(80, 48))
    one_copy = 80 * 48 * 4  # bytes of one layer's weight
    monkeypatch.setattr(cpu, "available_memory", lambda: cpu.pack_reserve() + one_copy + 100)
    x = torch.randn(5, 48)
    assert use_onednn_linears(model) == 2
    with torch.no_grad():
        expected = F.linear(F.linear(x, model[0].weight, model[0].bias), model[1].weight, model[1].bias)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert cpu.packed_layers(model) == 0
    twin = copy.deepcopy(model)
    monkeypatch.setattr(cpu, "available_memory", lambda: cpu.pack_reserve() + 2 * one_copy)
    with torch.no_grad():
        twin(x), model(x)
    assert cpu.packed_layers(twin) == 2 and cpu.packed_layers(model) == 0  # the original keeps its decision


def test_prepack_lets_the_target_take_its_copies_before_a_draft(
    every_linear: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory for one model's copies only. Lazily, whichever model makes the first multi-row call
    decides first: a draft that does leaves its target unpacked (what the bench did). prepack() takes
    the target's decision at once; the draft then finds the memory gone; the target's prepacked layers
    compute what F.linear does; a second prepack() changes nothing."""
    target = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Linear(80, 48))
    draft = torch.nn.Sequential(torch.nn.Linear(48, 48))
    target_bytes = 2 * 80 * 48 * 4
    x = torch.randn(5, 48)

    def memory(free: int) -> None:
        monkeypatch.setattr(cpu, "available_memory", lambda: cpu.pack_reserve() + free)

    lazy_target, lazy_draft = copy.deepcopy(target), copy.deepcopy(draft)
    use_onednn_linears(lazy_target), use_onednn_linears(lazy_draft)
    memory(target_bytes)
    with torch.no_grad():
        lazy_draft(x)  # the draft's first multi-row call: it fits, so it takes the memory
        memory(target_bytes - 48 * 48 * 4)
        lazy_target(x)
    assert cpu.packed_layers(lazy_draft) == 1 and cpu.packed_layers(lazy_target) == 0

    use_onednn_linears(target), use_onednn_linears(draft)
    memory(target_bytes)
    assert cpu.prepack(target) == 2  # decided and packed now, before any forward
    memory(100)  # the target's copies took the memory
    with torch.no_grad():
        draft(x)
        expected = F.linear(F.linear(x, target[0].weight, target[0].bias), target[1].weight, target[1].bias)
        torch.testing.assert_close(target(x), expected, rtol=1e-5, atol=1e-5)
    assert cpu.packed_layers(draft) == 0 and cpu.packed_layers(target) == 2
    assert cpu.prepack(target) == 2 and cpu.prepack(torch.nn.Linear(4, 4)) == 0  # idempotent; unrouted: none


def test_targets_are_prepacked_when_loaded_for_speculation(
    every_linear: None, model_dirs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_model(prepack_now=True) packs at load; from_pretrained does for a speculating target (not
    without a proposer) and the bench for its target, each before the draft loads (which stays lazy)."""
    import argparse

    from specdecode.commands.bench import _load_models
    from specdecode.models.torch.hf_loading import load_model

    target_dir, draft_dir = model_dirs
    monkeypatch.setattr(cpu, "available_memory", lambda: None)  # unknown memory: packing allowed
    assert cpu.packed_layers(load_model(target_dir, "target", "float32")) == 0  # lazy by default
    assert cpu.packed_layers(load_model(target_dir, "target", "float32", prepack_now=True)) > 0
    spec = SpeculativeGenerator.from_pretrained(target_dir, draft_dir, dtype="float32")
    assert cpu.packed_layers(spec.target.model) > 0 and cpu.packed_layers(spec.proposer.runner.model) == 0
    plain = SpeculativeGenerator.from_pretrained(target_dir, dtype="float32", proposer=None)
    assert cpu.packed_layers(plain.target.model) == 0
    models = _load_models(argparse.Namespace(target=str(target_dir), draft=str(draft_dir), dtype="float32"), True)
    assert cpu.packed_layers(models.target) > 0 and cpu.packed_layers(models.draft) == 0


def test_size_and_dtype_limits_leave_layers_alone() -> None:
    small = torch.nn.Linear(16, 16)
    assert use_onednn_linears(small) == 0  # under ONEDNN_MIN_WEIGHTS
    assert "forward" not in vars(small)
    big = torch.nn.Linear(1024, 1024, bias=False).bfloat16()
    assert use_onednn_linears(big) == 0  # not float32
    assert use_onednn_linears(torch.nn.Linear(1024, 1024)) == 1


def test_routed_model_logits_equal_the_model(every_linear: None) -> None:
    model = make_tiny_model(seed=3)
    fast = routed(model)
    ids = torch.tensor([PROMPTS[0]])  # (1, T)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_a_dropped_routed_model_frees_its_weights_without_the_cycle_collector(every_linear: None) -> None:
    """Routed layers form no reference cycle: with the cycle collector off, deleting the model frees
    every weight at once (a bound method stored on its own layer kept them until ``gc.collect``)."""
    import gc
    import weakref

    model = routed(make_tiny_model(seed=3))
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]))  # packed copies made too
    refs = [weakref.ref(p) for p in model.parameters()]
    gc.disable()
    try:
        del model
        assert sum(r() is not None for r in refs) == 0
    finally:
        gc.enable()


def test_a_copied_routed_model_computes_with_its_own_weights(every_linear: None) -> None:
    """``copy.deepcopy`` of a routed model: the copy's layers run on the copy's weights (not the
    original's), and the original is unchanged."""
    model = routed(make_tiny_model(seed=3))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    ids = torch.tensor([PROMPTS[0]])  # (1, T)
    reference = make_tiny_model(seed=3)  # plain layers, the same weights scaled alike
    with torch.no_grad():
        for p in reference.parameters():
            p.mul_(1.5)
        torch.testing.assert_close(twin(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, make_tiny_model(seed=3)(ids).logits, rtol=1e-5, atol=1e-5)
    layer = twin.model.layers[0].mlp.up_proj
    assert layer.forward.layer() is layer  # bound to the copy's layer


@pytest.mark.parametrize("draft_kind", ["identical", "unrelated", "perturbed"])
def test_greedy_speculation_through_onednn_equals_target_only(every_linear: None, draft_kind: str) -> None:
    """Greedy float32 equality with target-only decoding when target and draft run on oneDNN
    linears: drafts that agree fully, never and partly; chains (k = 3) and a token tree."""
    target = make_tiny_model(seed=0)
    draft = {
        "identical": copy.deepcopy(target),
        "unrelated": make_tiny_model(seed=123),
        "perturbed": perturbed_copy(target, noise=0.01),
    }[draft_kind]
    target, draft = routed(target), routed(draft)
    spec = SpeculativeGenerator(target, draft)
    sampling = SamplingParams(max_new_tokens=30)
    accepted = drafted = 0
    for prompt in PROMPTS:
        expected = target_only_greedy(target, prompt, 30)
        assert spec.generate(prompt, sampling, speculative=False).token_ids == expected
        chain = spec.generate(prompt, sampling, num_speculative_tokens=3)
        assert chain.token_ids == expected
        assert spec.generate(prompt, sampling, tree="tree8").token_ids == expected
        accepted, drafted = accepted + chain.stats.accepted_tokens, drafted + chain.stats.draft_tokens
    assert cpu.packed_layers(target) > 0  # the verification passes ran on prepacked weights
    rate = accepted / drafted
    assert {"identical": rate == 1.0, "unrelated": rate < 0.2, "perturbed": 0.2 < rate < 0.95}[draft_kind], rate


def test_prompt_lookup_through_onednn_equals_target_only(every_linear: None) -> None:
    target = routed(make_tiny_model(seed=0))
    spec = SpeculativeGenerator(target, proposer=PromptLookupProposer(PromptLookupConfig(max_ngram=3, min_ngram=1)))
    for prompt in PROMPTS:
        expected = target_only_greedy(target, prompt, 30)
        assert spec.generate(prompt, SamplingParams(max_new_tokens=30), num_speculative_tokens=4).token_ids == expected


def test_sampled_tokens_through_onednn_follow_the_target(every_linear: None) -> None:
    """The first three sampled tokens (temperature 0.8, k = 2) follow the exact target-only
    marginals of the routed target: chi-square p > P_MIN over 1,200 seeded samples per position."""
    sampling = SamplingParams(temperature=0.8, max_new_tokens=3)
    target = routed(make_tiny_model(vocab_size=12, seed=5, init=0.3))
    draft = routed(perturbed_copy(make_tiny_model(vocab_size=12, seed=5, init=0.3), noise=0.1, seed=6))
    prompt = [3, 1, 4]
    exact = exact_marginals(target, prompt, 3, sampling)
    spec = SpeculativeGenerator(target, draft)
    samples = [
        spec.generate(prompt, SamplingParams(temperature=0.8, max_new_tokens=3, seed=s), num_speculative_tokens=2)
        for s in range(1_200)
    ]
    rate = sum(r.stats.accepted_tokens for r in samples) / sum(r.stats.draft_tokens for r in samples)
    assert 0.3 < rate < 0.95, rate
    for pos in range(3):
        assert chi_square_p([r.token_ids[pos] for r in samples], exact[pos]) > P_MIN, pos


def test_auto_dtype_follows_the_cpu() -> None:
    expected = "bfloat16" if native_bf16_matmul() else "float32"
    assert auto_dtype("cpu") == expected
    assert parse_dtype("auto") == {"bfloat16": torch.bfloat16, "float32": torch.float32}[expected]
    assert auto_dtype("cuda") == "bfloat16"
    with pytest.raises(ValueError, match="auto"):
        parse_dtype("float16")


def test_bench_target_in_another_dtype_method() -> None:
    method = parse_method("target(dtype=bfloat16)")
    assert method.name == "target(dtype=bfloat16)" and not method.uses_k
    for bad in ("target(dtype=float16)", "target(precision=bfloat16)"):
        with pytest.raises(ValueError, match="dtype="):
            parse_method(bad)


def test_bench_target_in_its_own_dtype_loads_no_second_copy(tiny_target, tiny_tokenizer, monkeypatch) -> None:
    from specdecode.bench.methods import BenchModels
    from specdecode.models.torch import hf_loading

    def no_load(*args, **kwargs):
        raise AssertionError("a second copy of the target was loaded")

    monkeypatch.setattr(hf_loading, "load_model", no_load)
    models = BenchModels(tiny_target, None, tiny_tokenizer)  # a float32 target
    assert models.target_in("float32") is models.generator(None)
    assert models.target_in("float32").target.model is tiny_target
    with pytest.raises(AssertionError, match="second copy"):
        models.target_in("bfloat16")


def test_cli_dtype_choices_are_the_loader_choices() -> None:
    import argparse

    from specdecode.commands.common import add_dtype_arg
    from specdecode.commands.train_drafter import add_train_parser
    from specdecode.models.torch.hf_loading import DTYPE_CHOICES

    parser = argparse.ArgumentParser()
    add_dtype_arg(parser)
    train = add_train_parser(argparse.ArgumentParser().add_subparsers())  # train-drafter collects features too
    for p in (parser, train):
        action = next(a for a in p._actions if a.dest == "dtype")
        assert tuple(action.choices) == DTYPE_CHOICES and action.default == "auto"
