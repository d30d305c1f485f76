"""``specdecode bench --cost-table``: pass-cost tables, pricing recorded passes, predicted speedups."""

from __future__ import annotations

import json

import pytest

from specdecode.commands.main import main
from specdecode.cost.table import (
    PACKAGED,
    CostCurve,
    load_cost_table,
    parse_cost_table,
    predict,
    prediction_table,
    price,
    unpriced_drafts,
)

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

TABLE = {"device": "test GPU", "target": {"1": 10.0, "3": 14.0, "5": 16.0}, "draft": {"1": 2.0, "2": 3.0}}


def record(method: str, target: list[int], draft: list[int], group: str = "qa", qid: int = 1,
           wall: float = 1.0) -> dict:  # fmt: skip
    return {"question_id": qid, "group": group, "turn": 0, "repeat": 0, "method": method, "wall_time_s": wall,
            "passes": {"target": target, "draft": draft, "accepted": []}}  # fmt: skip


# ----------------------------------------------------------------------------- curves
def test_interpolation_and_extrapolation():
    curve = parse_cost_table(TABLE).target
    assert curve(1) == 10.0 and curve(3) == 14.0 and curve(5) == 16.0
    assert curve(2) == pytest.approx(12.0)  # between 1 and 3
    assert curve(4) == pytest.approx(15.0)
    assert curve(9) == pytest.approx(20.0)  # beyond 5: the line through (3, 14) and (5, 16)
    assert curve(0) == 0.0
    assert CostCurve((4,), (7.0,))(1) == 7.0 and CostCurve((4,), (7.0,))(40) == 7.0  # one point: flat
    falling = CostCurve((1, 2), (10.0, 1.0))
    assert falling(100) == 0.0  # extrapolation never goes below zero


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "expected a JSON object"),
        ({"target": {"1": 1.0}}, "'device'"),
        ({"device": "x"}, "'target' is missing"),
        ({"device": "x", "target": {}}, "'target' must be a non-empty object"),
        ({"device": "x", "target": {"one": 1.0}}, "'target' has width 'one'"),
        ({"device": "x", "target": {"0": 1.0}}, "'target' has width '0'"),
        ({"device": "x", "target": {"1": -1.0}}, "target['1']"),
        ({"device": "x", "target": {"1": "fast"}}, "target['1']"),
        ({"device": "x", "target": {"1": 1.0}, "draft": {"2": None}}, "draft['2']"),
        ({"device": "x", "target": {"1": 1.0}, "prefill_ms_per_token": -2}, "'prefill_ms_per_token'"),
        ({"device": "x", "target": {"1": 1.0}, "step_ms": -0.1}, "'step_ms'"),
        ({"device": "x", "target": {"1": 1.0}, "step_ms": "0.4"}, "'step_ms'"),
        ({"device": "x", "target": {"1": 1.0}, "targett": {}}, "unknown field(s) ['targett']"),
    ],
)
def test_validation_names_the_field(data, message):
    with pytest.raises(ValueError) as error:
        parse_cost_table(data)
    assert message in str(error.value)


def test_load_a_file_a_packaged_name_and_errors(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TABLE))
    assert load_cost_table(path).device == "test GPU"
    h100 = load_cost_table("h100-torch-eager-bf16")
    assert h100.target(1) == 15.5 and h100.target(33) == 18.8 and h100.draft is not None and h100.draft(5) == 16.0
    assert "H100" in h100.device and "README" in h100.source
    assert (PACKAGED / "h100-torch-eager-bf16.json").is_file()
    with pytest.raises(FileNotFoundError, match="h100-torch-eager-bf16"):
        load_cost_table(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_cost_table(tmp_path / "bad.json")
    (tmp_path / "invalid.json").write_text(json.dumps({"device": "x", "target": {"1": "a"}}))
    with pytest.raises(ValueError, match=r"invalid\.json: cost table: target\['1'\]"):
        load_cost_table(tmp_path / "invalid.json")


def test_every_packaged_table_loads_by_name():
    names = sorted(path.stem for path in PACKAGED.glob("*.json"))
    assert {"h100-torch-eager-bf16", "h100-torch-graphs-bf16", "h100-llamacpp-cuda-q4km"} <= set(names)
    for name in names:
        table = load_cost_table(name)
        assert table.target(1) > 0 and table.device and table.source


# ----------------------------------------------------------------------------- pricing
def test_price_of_a_hand_made_record_is_exact():
    table = parse_cost_table(TABLE)
    # prefill of 5 tokens (16 ms), passes of 3, 3 and 1 tokens (14 + 14 + 10), draft passes 2, 1, 1, 1 (3 + 2 + 2 + 2)
    r = record("m", [5, 3, 3, 1], [2, 1, 1, 1])
    assert price(r, table) == pytest.approx((16 + 14 + 14 + 10 + 3 + 2 + 2 + 2) / 1000)
    with_prefill = parse_cost_table({**TABLE, "prefill_ms_per_token": 0.5})
    assert price(r, with_prefill) == pytest.approx((2.5 + 14 + 14 + 10 + 3 + 2 + 2 + 2) / 1000)
    no_draft = parse_cost_table({"device": "x", "target": TABLE["target"]})
    assert price(r, no_draft) == pytest.approx((16 + 14 + 14 + 10) / 1000)  # draft passes cost nothing
    assert price({**r, "passes": None}, table) is None  # a peer whose passes are unknown
    assert price({k: v for k, v in r.items() if k != "passes"}, table) is None  # results saved before


def test_step_ms_prices_every_step_after_the_prefill_and_moves_the_prediction():
    """The host's work per step (``step_ms``) is added once per target pass after the prefill, never
    for the prefill or a draft pass; it shrinks a speedup made of fewer, wider passes."""
    stepped = parse_cost_table({**TABLE, "step_ms": 0.5})
    assert stepped.step_ms == 0.5 and parse_cost_table(TABLE).step_ms is None
    r = record("m", [5, 3, 3, 1], [2, 1, 1, 1])  # 3 steps after the prefill, 4 draft passes
    assert price(r, stepped) == pytest.approx(price(r, parse_cost_table(TABLE)) + 3 * 0.5 / 1000)
    assert price(record("m", [5], []), stepped) == pytest.approx(16 / 1000)  # a prefill alone: no step
    records = [record("target", [5, 1, 1, 1, 1], []), record("spec", [5, 3, 1], [1, 1])]
    free = predict(records, ["spec"], parse_cost_table(TABLE))["spec"]["all"]["predicted"]
    costly = predict(records, ["spec"], parse_cost_table({**TABLE, "step_ms": 4.0}))["spec"]["all"]["predicted"]
    assert free == pytest.approx(56 / 44) and costly == pytest.approx((56 + 4 * 4) / (44 + 2 * 4))
    assert prediction_table({"spec": {"all": {"predicted": costly, "measured": 1.0}}},
                            parse_cost_table({**TABLE, "step_ms": 4.0})).count("'step_ms'") == 1  # fmt: skip
    assert "not priced (the table has no 'step_ms')" in prediction_table({}, parse_cost_table(TABLE))


def test_draft_passes_are_priced_on_the_curve_of_their_kind():
    """A record's ``draft_kind`` picks the curve: a draft model's, an EAGLE head's, Medusa heads';
    a kind the table lacks is free and named by ``unpriced_drafts``; records without one are draft models'."""
    table = parse_cost_table({**TABLE, "eagle": {"1": 0.5, "3": 0.9}, "medusa": {"1": 0.25}})
    assert table.eagle is not None and table.eagle(2) == pytest.approx(0.7) and table.drafts("eagle") is table.eagle
    assert table.drafts("medusa") is table.medusa and table.drafts("draft") is table.draft
    assert table.drafts("early_exit") is None  # unknown kinds cost nothing
    target_ms = 16 + 14 + 14 + 10
    eagle = record("eagle", [5, 3, 3, 1], [3, 1, 2, 1])
    eagle["passes"]["draft_kind"] = "eagle"
    assert price(eagle, table) == pytest.approx((target_ms + 0.9 + 0.5 + 0.7 + 0.5) / 1000)
    medusa = record("medusa", [5, 3, 3, 1], [1, 1, 1])
    medusa["passes"]["draft_kind"] = "medusa"
    assert price(medusa, table) == pytest.approx((target_ms + 3 * 0.25) / 1000)
    old = record("draft", [5, 3, 3, 1], [2, 1])  # saved before draft_kind: a draft model's passes
    assert price(old, table) == pytest.approx((target_ms + 3 + 2) / 1000)
    plain = parse_cost_table(TABLE)  # no eagle / medusa curve: those passes are free
    assert price(eagle, plain) == pytest.approx(target_ms / 1000)
    assert unpriced_drafts([eagle, medusa, old, record("target", [5, 1], [])], plain) == {
        "eagle": ["eagle"], "medusa": ["medusa"]}  # fmt: skip
    assert unpriced_drafts([eagle, medusa, old], table) == {}
    assert unpriced_drafts([old], parse_cost_table({"device": "x", "target": {"1": 1.0}})) == {"draft": ["draft"]}
    with pytest.raises(ValueError, match=r"'eagle' has width 'x'"):
        parse_cost_table({**TABLE, "eagle": {"x": 1.0}})
    with pytest.raises(ValueError, match=r"medusa\['1'\]"):
        parse_cost_table({**TABLE, "medusa": {"1": -1.0}})
    records = [record("target", [5, 1, 1, 1, 1], [], wall=2.0), eagle]
    prediction = predict(records, ["target", "eagle"], plain)
    text = prediction_table(prediction, plain, unpriced=unpriced_drafts(records, plain))
    assert "| eagle * |" in text and "| target |" in text
    assert "* eagle: its draft passes are not priced (the table has no 'eagle' curve): an upper bound." in text
    assert "passes are not priced" not in prediction_table(prediction, table, unpriced=unpriced_drafts(records, table))


def test_predicted_speedup_per_group_and_overall():
    table = parse_cost_table(TABLE)
    records = [
        record("target", [5, 1, 1, 1, 1], [], "qa", 1, wall=2.0),  # 16 + 40 = 56 ms
        record("same", [5, 1, 1, 1, 1], [], "qa", 1, wall=1.0),  # the same passes as target-only
        record("spec", [5, 3, 1], [1, 1], "qa", 1, wall=1.0),  # 16 + 14 + 10 + 4 = 44 ms
        record("target", [5, 1, 1], [], "coding", 2, wall=3.0),  # 36 ms
        record("same", [5, 1, 1], [], "coding", 2, wall=1.5),
        record("spec", [5, 3], [2], "coding", 2, wall=1.0),  # 16 + 14 + 3 = 33 ms
        {**record("peer", [5], [], "qa", 1), "passes": None},
    ]
    out = predict(records, ["target", "same", "spec", "peer"], table)
    assert out["target"]["all"]["predicted"] == pytest.approx(1.0)
    assert out["same"]["qa"]["predicted"] == pytest.approx(1.0) and out["same"]["all"]["predicted"] == 1.0
    assert out["same"]["qa"]["measured"] == pytest.approx(2.0)  # wall times, beside
    assert out["spec"]["qa"]["predicted"] == pytest.approx(56 / 44)
    assert out["spec"]["coding"]["predicted"] == pytest.approx(36 / 33)
    assert out["spec"]["all"]["predicted"] == pytest.approx((56 + 36) / (44 + 33))
    assert out["spec"]["all"]["measured"] == pytest.approx(5.0 / 2.0)
    assert out["peer"]["qa"]["predicted"] is None and out["peer"]["qa"]["measured"] == pytest.approx(2.0)
    assert list(out["spec"]) == ["qa", "coding", "all"]


# ----------------------------------------------------------------------------- the command
def test_bench_with_a_cost_table_records_passes_and_predicts(tmp_path, capsys):
    tokenizer = make_tiny_tokenizer(vocab_size=300)
    target = make_tiny_model(vocab_size=len(tokenizer), seed=0)
    target_dir, draft_dir, out = tmp_path / "target", tmp_path / "draft", tmp_path / "out"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    perturbed_copy(target, noise=0.01).save_pretrained(draft_dir)
    questions = tmp_path / "questions.jsonl"
    rows = [{"question_id": 1, "category": "coding", "turns": ["def add(a, b):"]},
            {"question_id": 2, "category": "qa", "turns": ["The quick brown fox?"]}]  # fmt: skip
    questions.write_text("\n".join(json.dumps(q) for q in rows) + "\n")
    argv = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32", "--questions",
            str(questions), "--categories", "coding,qa", "--methods", "target,draft_model,prompt_lookup,"
            "draft_model(prompt_lookup_min=2,label=draft+lookup)", "-k", "3",
            "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--no-warmup",
            "--cost-table", "h100-torch-eager-bf16"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "## Predicted speedup over `target` on NVIDIA H100" in stdout
    saved = json.loads((out / "results.json").read_text())
    for r in saved["records"]:
        passes = r["passes"]
        assert passes["target"][0] == r["prompt_tokens"]  # the prefill first
        assert passes["draft_kind"] == "draft"  # a draft model's passes, or none
        steps = len(passes["target"]) - 1
        assert len(passes["accepted"]) == steps
        # every step's pass feeds the draft plus one token; the tokens gained add up to the answer
        assert sum(passes["accepted"]) + steps + 1 >= r["new_tokens"]
        assert sum(w - 1 for w in passes["target"][1:]) == r["stats"]["draft_tokens"]
        if r["method"] == "target":
            assert passes["target"][1:] == [1] * steps and passes["draft"] == []
        elif r["method"].startswith("prompt_lookup"):
            assert passes["draft"] == []  # no draft model
        elif r["method"].startswith("draft+lookup"):
            assert all(w >= 1 for w in passes["draft"])
        else:
            assert passes["draft"] and all(w >= 1 for w in passes["draft"])
    hybrid = [w for r in saved["records"] if r["method"].startswith("draft+lookup") for w in r["passes"]["draft"]]
    assert hybrid  # the lookup-first hybrid passes its model's forwards on
    predicted = saved["predicted"]
    assert predicted["device"].startswith("NVIDIA H100") and predicted["baseline"] == "target"
    assert predicted["speedup"]["target"]["all"]["predicted"] == pytest.approx(1.0)
    for method in saved["methods"]:
        assert set(predicted["speedup"][method]) == {"coding", "qa", "all"}
        assert predicted["speedup"][method]["all"]["predicted"] > 0

    # re-priced from the saved records, without models, with another table
    table = tmp_path / "flat.json"
    table.write_text(json.dumps({"device": "flat GPU", "target": {"1": 10.0}}))  # every pass costs the same
    assert main(["bench", "--report", str(out / "results.json"), "--out", str(tmp_path / "again"),
                 "--cost-table", str(table)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "## Predicted speedup over `target` on flat GPU" in text
    prediction = text.split("## Predicted speedup")[1]
    line = next(x for x in prediction.splitlines() if x.startswith("| draft_model[k=3] * |"))  # draft passes free
    assert "* draft_model[k=3]: its draft passes are not priced (the table has no 'draft' curve)" in prediction
    assert "| prompt_lookup[k=3] |" in prediction  # no draft passes: nothing unpriced
    fewer = [r for r in saved["records"] if r["method"] == "draft_model[k=3]"]
    base = [r for r in saved["records"] if r["method"] == "target"]
    expected = sum(len(r["passes"]["target"]) for r in base) / sum(len(r["passes"]["target"]) for r in fewer)
    assert f"{expected:.2f}x" in line.split("|")[-2]  # flat costs: the ratio of pass counts

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"device": "x"}))
    assert main([*argv[:-1], str(bad)]) == 2  # refused before any model loads
    assert "'target' is missing" in capsys.readouterr().err


def test_a_packaged_run_is_priced_by_name(tmp_path, capsys):
    """The default pair's recorded passes ship with the package: ``--report NAME`` prices them
    without the repository or any model; a gzipped results file reads too; an unknown name lists
    the packaged runs."""
    import gzip

    from specdecode.bench.report import PACKAGED_RESULTS, load_results

    name = "default-pair-coding-humaneval"
    results = load_results(name)
    assert {r["group"] for r in results["records"]} == {"coding", "humaneval"}
    assert all(r["passes"]["target"] for r in results["records"])
    assert {"target", "prompt_lookup", "draft_model", "eagle", "medusa"} <= set(results["methods"])
    copy = tmp_path / "copy.json.gz"
    copy.write_bytes((PACKAGED_RESULTS / f"{name}.json.gz").read_bytes())
    assert load_results(copy)["methods"] == results["methods"]
    (tmp_path / "plain.json").write_bytes(gzip.decompress(copy.read_bytes()))
    assert load_results(tmp_path / "plain.json")["methods"] == results["methods"]
    with pytest.raises(FileNotFoundError, match=f"packaged runs: {name}"):
        load_results("no-such-run")
    out = tmp_path / "report"
    assert main(["bench", "--report", name, "--cost-table", "h100-torch-graphs-bf16", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "## Predicted speedup over `target` on NVIDIA H100" in text and "| prompt_lookup |" in text
    assert (out / "report.md").is_file()
