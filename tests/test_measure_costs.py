"""``specdecode cost-table``: a pass-cost table measured here (specdecode.cost.measure), in the
format ``bench --cost-table`` reads back."""

from __future__ import annotations

import json

import pytest
import torch

from specdecode.commands.main import main
from specdecode.cost.measure import CostSettings, measure_cost_table, pass_curve
from specdecode.cost.table import load_cost_table, parse_cost_table

from conftest import make_tiny_model

SMALL = dict(widths=(1, 3), draft_widths=(1, 2), depth=8, prefill=6, reps=2, warmups=1, step_tokens=5)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"widths": ()}, "widths"),
        ({"widths": (0, 1)}, "widths"),
        ({"draft_widths": (1.5,)}, "draft_widths"),
        ({"depth": -1}, "depth"),
        ({"prefill": 0}, "prefill"),
        ({"reps": 0}, "reps"),
        ({"warmups": -1}, "warmups"),
        ({"step_tokens": 1}, "step_tokens"),
        ({"step_tokens": -4}, "step_tokens"),
    ],
)
def test_settings_name_the_bad_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        CostSettings(**{**SMALL, **change})


def test_widths_are_sorted_and_unique() -> None:
    assert CostSettings(widths=(9, 1, 3, 1)).widths == (1, 3, 9)


class RecordingRunner:
    """A runner that records what it is asked: (tokens fed, rows scored, length before)."""

    def __init__(self) -> None:
        self.length = 0
        self.calls: list[tuple[int, int, int]] = []
        self.truncations: list[int] = []
        self.prepared: list[int] = []
        self.resets = 0
        self.device = torch.device("cpu")
        self.vocab_size = 10

    def reset(self) -> None:
        self.resets += 1
        self.length = 0

    def prepare_widths(self, widths) -> None:  # noqa: ANN001
        self.prepared = list(widths)

    def forward(self, ids: torch.Tensor, num_logits: int = 1) -> torch.Tensor:
        self.calls.append((int(ids.shape[0]), num_logits, self.length))
        self.length += int(ids.shape[0])
        return torch.zeros(num_logits, 10)

    def truncate(self, length: int) -> None:
        self.truncations.append(length)
        self.length = length


@pytest.mark.parametrize("score_all", [True, False])
def test_each_width_is_timed_at_depth_with_the_rows_decoding_scores(score_all: bool) -> None:
    """Verification passes score every row, draft passes the last; every timed pass starts at
    ``depth`` cached tokens (truncated back after it); widths are captured before timing."""
    runner = RecordingRunner()
    runner.length = 5  # a used runner: reset first
    settings = CostSettings(**SMALL)
    curve = pass_curve(runner, (1, 3), settings, score_all=score_all)
    assert list(curve) == ["1", "3"] and all(ms >= 0 for ms in curve.values())
    assert runner.prepared == [1, 3] and runner.resets == 1
    assert runner.calls[0] == (8, 1, 0)  # the cached context first
    timed = runner.calls[1:]
    per_width = settings.warmups + settings.reps
    assert len(timed) == 2 * per_width
    for i, (fed, scored, before) in enumerate(timed):
        width = 1 if i < per_width else 3
        assert (fed, before) == (width, 8)
        assert scored == (width if score_all else 1)
    assert runner.truncations == [8] * len(timed)


def test_a_table_of_tiny_models_reads_back_and_prices(tmp_path) -> None:
    target, draft = make_tiny_model(seed=0), make_tiny_model(seed=1)
    table = measure_cost_table(target, draft, CostSettings(**SMALL), command="specdecode cost-table --out x")
    parsed = parse_cost_table(table)
    assert set(table) == {"device", "source", "target", "draft", "prefill_ms_per_token", "step_ms", "measurement"}
    assert list(table["target"]) == ["1", "3"] and list(table["draft"]) == ["1", "2"]
    assert parsed.target(1) > 0 and parsed.draft is not None and parsed.draft(2) > 0
    assert "torch" in table["device"] and "eager" in table["device"]
    assert "specdecode cost-table --out x" in table["source"]
    assert table["prefill_ms_per_token"] > 0 and table["step_ms"] >= 0
    runs = table["measurement"]["step_runs"]
    assert len(runs) == 2 and all(r["steps"] == SMALL["step_tokens"] - 1 for r in runs)  # the prefill gives one
    assert table["step_ms"] == pytest.approx(
        max(0.0, min((r["seconds"] - r["passes_s"]) * 1000 / r["steps"] for r in runs)), abs=0.01
    )
    assert measure_cost_table(target, None, CostSettings(**{**SMALL, "step_tokens": 0})).keys() == {
        "device", "source", "target", "prefill_ms_per_token", "measurement"}  # fmt: skip


def test_the_command_writes_a_table_bench_reads(model_dirs, tmp_path, capsys) -> None:
    target_dir, draft_dir = model_dirs
    out = tmp_path / "tables" / "here.json"
    argv = ["cost-table", "--target", str(target_dir), "--draft", str(draft_dir), "--backend", "torch",
            "--device", "cpu", "--dtype", "float32", "--out", str(out), "--widths", "1,2", "--draft-widths", "1",
            "--depth", "4", "--prefill", "4", "--reps", "1", "--step-tokens", "3"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "## Pass costs on" in printed and f"--cost-table {out}" in printed
    table = load_cost_table(out)
    assert table.target.widths == (1, 2) and table.draft is not None and table.draft.widths == (1,)
    assert table.step_ms is not None and table.step_ms >= 0
    assert json.loads(out.read_text())["measurement"]["settings"]["reps"] == 1


def test_the_command_refuses_bad_input_before_loading(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["cost-table", "--out", str(tmp_path / "t.json"), "--widths", "1,x"])
    assert exit_.value.code == 2 and "--widths" in capsys.readouterr().err
    assert main(["cost-table", "--out", str(tmp_path), "--backend", "torch"]) == 2  # a folder
    assert "is a folder" in capsys.readouterr().err
    assert main(["cost-table", "--out", str(tmp_path / "t.json"), "--reps", "0"]) == 2
    assert "reps must be an integer >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- random weights
def test_the_default_pairs_architecture_ships_with_the_package() -> None:
    from specdecode.models.torch.hf_loading import model_config

    target, draft = model_config(None, "target"), model_config(None, "draft")
    assert (target.hidden_size, target.num_hidden_layers, target.vocab_size) == (1536, 28, 151936)
    assert (draft.hidden_size, draft.num_hidden_layers, draft.vocab_size) == (896, 24, 151936)


def test_random_weights_keep_a_folders_architecture_not_its_weights(model_dirs, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from specdecode.errors import ModelNotFoundError
    from specdecode.models.torch.hf_loading import random_model

    target_dir, _ = model_dirs
    saved = AutoModelForCausalLM.from_pretrained(target_dir)
    built = random_model(target_dir, "target", dtype="float32", seed=3)
    assert built.config.to_dict()["hidden_size"] == saved.config.hidden_size
    assert [p.shape for p in built.parameters()] == [p.shape for p in saved.parameters()]
    assert not torch.equal(built.model.embed_tokens.weight, saved.model.embed_tokens.weight)
    again = random_model(target_dir, "target", dtype="float32", seed=3)
    assert torch.equal(built.model.embed_tokens.weight, again.model.embed_tokens.weight)  # seeded
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="--draft: random weights need a Hugging Face folder"):
        random_model(tmp_path / "m.gguf", "draft")


def test_the_command_measures_random_weights_on_torch_only(model_dirs, tmp_path, capsys) -> None:
    target_dir, draft_dir = model_dirs
    out = tmp_path / "random.json"
    small = ["--widths", "1,2", "--draft-widths", "1", "--depth", "4", "--prefill", "4", "--reps", "1",
             "--step-tokens", "3", "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    assert main(["cost-table", "--random-weights", "--target", str(target_dir), "--draft", str(draft_dir),
                 "--out", str(out), *small]) == 0  # fmt: skip
    table = load_cost_table(out)
    assert "random weights" in table.source and table.draft is not None and "torch" in table.device
    assert main(["cost-table", "--random-weights", "--backend", "llamacpp", "--out", str(out), *small]) == 2
    assert "--random-weights runs on torch" in capsys.readouterr().err
