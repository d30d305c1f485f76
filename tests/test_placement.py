"""``--device``: where torch runs the models, and what a CUDA placement turns on (static cache, graphs)."""

from __future__ import annotations

import pytest
import torch

from specdecode.commands.main import main
from specdecode.load import load_models, plan_models
from specdecode.models.torch.hf_loading import parse_dtype
from specdecode.models.torch.placement import place_model, resolve_device
from specdecode.models.torch.static_runner import static_cache_settings

from conftest import make_tiny_model


def pretend_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_the_cpu_without_a_gpu_and_the_gpu_with_one(monkeypatch) -> None:
    pretend_gpus(monkeypatch, 0)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device(None)
    pretend_gpus(monkeypatch, 2)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("device", "gpus", "message"),
    [
        ("cuda", 0, "'cuda' was asked for, but"),
        ("cuda:2", 1, "only 1 CUDA device"),
        ("banana", 1, "device must be one of"),
        ("tpu", 1, "device must be one of"),
    ],
)
def test_a_device_this_torch_cannot_use_is_refused_by_name(monkeypatch, device, gpus, message) -> None:
    pretend_gpus(monkeypatch, gpus)
    with pytest.raises(ValueError, match=message):
        resolve_device(device)


def test_auto_dtype_is_bfloat16_on_a_gpu() -> None:
    assert parse_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert parse_dtype("float32", torch.device("cuda", 0)) == torch.float32


def test_a_cuda_placement_moves_the_model_and_marks_it_for_graphs(monkeypatch) -> None:
    moved: list[torch.device] = []
    model = make_tiny_model(seed=0)
    monkeypatch.setattr(model, "to", lambda device: moved.append(device) or model)
    assert place_model(model, torch.device("cpu")) is model and moved == []
    assert static_cache_settings(model) is None
    place_model(model, torch.device("cuda", 0), cuda_graphs=False)
    assert moved == [torch.device("cuda", 0)] and static_cache_settings(model) is None
    place_model(model, torch.device("cuda", 0))
    assert static_cache_settings(model) is not None


def test_the_plan_resolves_the_device_before_any_path_or_weight(model_dirs, monkeypatch) -> None:
    pretend_gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="'cuda' was asked for"):
        plan_models("/no/such/folder", device="cuda")  # the device first: no ModelNotFoundError
    target, _ = model_dirs
    plan = plan_models(target, proposer=None, backend="torch")
    assert plan.device == "cpu" and plan.cuda_graphs
    loaded = load_models(plan)
    assert loaded.target.device == torch.device("cpu") and static_cache_settings(loaded.target) is None


def test_the_plan_puts_the_models_where_the_device_says(model_dirs, monkeypatch) -> None:
    """With a (pretended) GPU, ``auto`` plans cuda:0 and the load places every model through
    place_model with the plan's cuda_graphs."""
    pretend_gpus(monkeypatch, 1)
    placed: list[tuple[str, bool, bool]] = []
    monkeypatch.setattr(
        "specdecode.models.torch.hf_loading.place_model",
        lambda model, device, graphs, exact=False: placed.append((str(device), graphs, exact)) or model,
    )
    target, draft = model_dirs
    plan = plan_models(target, draft, "draft_model", backend="torch", cuda_graphs=False, dtype="float32")
    assert plan.device == "cuda:0" and not plan.exact  # exact mode is opt-in for torch on a GPU
    load_models(plan)
    assert placed == [("cuda:0", False, False), ("cuda:0", False, False)]
    placed.clear()  # opted in, bf16: the target (only) gets fixed-width passes; float32 would run as it is
    load_models(plan_models(target, draft, "draft_model", backend="torch", dtype="bfloat16", exact=True))
    assert placed == [("cuda:0", True, True), ("cuda:0", True, False)]


def test_the_command_line_refuses_a_device_it_cannot_use(model_dirs, capsys) -> None:
    target, _ = model_dirs
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["generate", "hi", "--target", str(target), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda' was asked for" in err and "Traceback" not in err

