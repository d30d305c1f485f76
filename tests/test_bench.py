"""``specdecode bench`` on tiny random models: end to end, metrics by hand, exactness, skipped peers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specdecode.bench import metrics
from specdecode.bench.methods import METHODS, BenchModels, BenchSettings, Method, MethodOutput, expand
from specdecode.bench.prompts import GROUPS, load_prompts, load_spec_bench, select, take_per_group
from specdecode.bench.report import ACCEPTANCE_PNG, SPEEDUP_PNG, load_results, markdown, render
from specdecode.bench.runner import run_bench, save_results
from specdecode.commands.main import main
from specdecode.stats import SpecStats

from conftest import make_tiny_model, make_tiny_tokenizer, perturbed_copy

QUESTIONS = [
    {"question_id": 1, "category": "coding", "turns": ["def add(a, b):", "Now for three numbers."]},
    {"question_id": 2, "category": "qa", "turns": ["The quick brown fox?"]},
]
SETTINGS = BenchSettings(max_new_tokens=12)


@pytest.fixture(scope="module")
def models() -> BenchModels:
    tokenizer = make_tiny_tokenizer(vocab_size=300)
    target = make_tiny_model(vocab_size=len(tokenizer), seed=0)
    return BenchModels(target, perturbed_copy(target, noise=0.01), tokenizer)


@pytest.fixture()
def questions(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return path


def run(models, questions, names, ks=(3,)):
    prompts = load_prompts(questions, "mt_bench,qa", None)
    return run_bench(models, prompts, expand(names, ks), SETTINGS, progress=False)


# ----------------------------------------------------------------------------- end to end
def test_end_to_end_results_table_plots_and_report(models, questions, tmp_path, capsys):
    results = run(models, questions, ["target", "draft_model"])
    results["settings"] = {"max_new_tokens": SETTINGS.max_new_tokens}
    path = save_results(results, tmp_path / "out")
    text = render(load_results(path), tmp_path / "out")

    saved = json.loads(path.read_text())
    assert saved["methods"] == ["target", "draft_model[k=3]"] and saved["skipped"] == {}
    assert len(saved["records"]) == 2 * 3  # 2 methods x (2 + 1 turns)
    keys = {"question_id", "group", "turn", "method", "settings", "new_tokens", "wall_time_s", "stats", "token_ids"}
    for r in saved["records"]:
        assert keys <= set(r) and r["settings"]["max_new_tokens"] == SETTINGS.max_new_tokens
        assert r["new_tokens"] == len(r["token_ids"]) > 0 and r["wall_time_s"] > 0
        assert r["stats"]["target_forward_passes"] >= 1
    assert {(r["group"], r["turn"]) for r in saved["records"]} == {("mt_bench", 0), ("mt_bench", 1), ("qa", 0)}
    assert "| method | mt_bench | qa | all |" in text and "draft_model[k=3]" in text
    for png in (SPEEDUP_PNG, ACCEPTANCE_PNG):
        assert (tmp_path / "out" / png).stat().st_size > 1000
    summary = metrics.summarize(saved["records"], saved["methods"], greedy=True)
    assert summary["draft_model[k=3]"]["all"]["exact"] == 1.0  # lossless under greedy decoding
    assert summary["target"]["all"]["speedup"] == 1.0
    draft_bytes = sum(t.untyped_storage().nbytes() for t in [*models.draft.parameters(), *models.draft.buffers()])
    assert summary["target"]["all"]["proposer_mb"] == 0.0  # the weights a method adds to the target
    assert summary["draft_model[k=3]"]["all"]["proposer_mb"] == pytest.approx(draft_bytes / 1e6)
    assert "proposer weights (MB)" in text

    assert main(["bench", "--report", str(path), "--out", str(tmp_path / "again")]) == 0
    assert "| method | mt_bench | qa | all |" in capsys.readouterr().out
    assert (tmp_path / "again" / SPEEDUP_PNG).exists() and (tmp_path / "again" / ACCEPTANCE_PNG).exists()


def test_cli_on_saved_tiny_models(models, questions, tmp_path, capsys, monkeypatch):
    target_dir, draft_dir, out = tmp_path / "target", tmp_path / "draft", tmp_path / "out"
    models.target.save_pretrained(target_dir)
    models.tokenizer.save_pretrained(target_dir)
    models.draft.save_pretrained(draft_dir)
    # untrained (identity / random) drafters where medusa and eagle look by default, so the default
    # method list includes them; without them the bench skips both (checked below)
    from specdecode.drafters import DrafterConfig, build_drafter, default_drafter_dir, save_drafter
    from specdecode.models.torch.hf_loading import load_model

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    saved_target = load_model(target_dir, "target", "float32")
    V = saved_target.config.vocab_size
    for kind in ("medusa", "eagle"):
        config = DrafterConfig.for_target(kind, saved_target, V)
        save_drafter(build_drafter(config, torch.arange(V)), default_drafter_dir(kind, target_dir))
    argv = ["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--dtype", "float32", "--questions",
            str(questions), "--categories", "coding,qa", "-k", "2,3", "--max-new-tokens", "8", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    saved = json.loads((out / "results.json").read_text())
    from specdecode.proposers import PROPOSERS

    ours = [f"{name}[k={k}]" for name in PROPOSERS for k in (2, 3)]  # every library proposer, automatically
    labels = ["target", *ours, "hf_generate", "hf_assisted", "hf_prompt_lookup[k=2]", "hf_prompt_lookup[k=3]"]
    assert saved["methods"] == labels and saved["skipped"] == {}
    assert {r["group"] for r in saved["records"]} == {"coding", "qa"}  # a category selector names its column
    assert saved["environment"]["torch"] and saved["settings"]["num_speculative_tokens"] == [2, 3]
    for label in labels:
        assert label in stdout
    summary = metrics.summarize(saved["records"], saved["methods"], greedy=True)
    for label in labels:
        assert summary[label]["all"]["exact"] == 1.0, label  # greedy: every method reproduces the target
    assert summary["hf_generate"]["all"]["mean_acceptance_length"] is None  # peers have no statistics

    from specdecode.commands.bench import default_methods

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "empty-cache"))
    names = default_methods(str(target_dir))
    assert "medusa" not in names and "eagle" not in names and "draft_model" in names
    assert "specdecode train-drafter --kind medusa" in capsys.readouterr().err


def test_sampled_run_reports_distributional_exactness(models, questions, tmp_path):
    prompts = load_prompts(questions, "qa", None)
    variants = expand(["target", "draft_model", "hf_generate", "hf_assisted"], [2])
    results = run_bench(models, prompts, variants, BenchSettings(temperature=0.8, max_new_tokens=6), progress=False)
    assert results["greedy"] is False and results["skipped"] == {}
    summary = metrics.summarize(results["records"], results["methods"], greedy=False)
    assert all(by_group["all"]["exact"] is None for by_group in summary.values())
    assert "exactness is distributional" in render(results, tmp_path)


def test_quick_fills_only_unset_options():
    from specdecode.commands.bench import _options
    from specdecode.commands.main import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--max-new-tokens", "32"])
    quick = {"max_new_tokens": 32, "prompts_per_category": 1, "methods": "target,draft_model,hf_assisted"}
    assert _options(args, "torch") == quick
    assert _options(args, "llamacpp") == {**quick, "methods": "target,prompt_lookup(min_ngram=3,max_ngram=8),llamacpp"}
    drafted = build_parser().parse_args(["bench", "--quick", "--draft", "some.gguf"])
    assert _options(drafted, "llamacpp")["methods"] == "target,draft_model,llamacpp"  # a named draft drafts
    given = build_parser().parse_args(["bench", "--quick", "--methods", "target"])
    assert _options(given, "llamacpp")["methods"] == "target"
    assert _options(build_parser().parse_args(["bench"]))["max_new_tokens"] == 128
    with pytest.raises(ValueError, match="temperature"):
        BenchSettings(temperature=-1.0)


@pytest.mark.parametrize("backend", ["torch", "llamacpp"])
def test_quick_methods_run_on_their_backend(backend):
    """``bench --quick`` must not stop at once: every method it picks runs on the resolved backend."""
    from specdecode.bench.methods import split_methods
    from specdecode.commands.bench import quick_methods

    variants = expand(split_methods(quick_methods(backend)), [None])
    assert len(variants) == 3 and variants[0].label == "target"
    assert all(backend in v.method.backends for v in variants), [v.label for v in variants]
    assert sum(v.method.peer for v in variants) == 1  # one peer engine beside ours


# ----------------------------------------------------------------------------- metrics by hand
def record(method, qid, wall, token_ids=(1, 2), stats=None, k=None, turn=0, group="qa"):
    return {"question_id": qid, "group": group, "turn": turn, "repeat": 0, "method": method, "wall_time_s": wall,
            "new_tokens": len(token_ids), "token_ids": list(token_ids), "stats": stats,
            "settings": {"num_speculative_tokens": k}}  # fmt: skip


def test_metrics_from_hand_made_steps():
    stats = SpecStats(num_speculative_tokens=3)
    for accepted in (2, 0, 3):
        stats.observe(3, accepted)
    stats.new_tokens, stats.target_forward_passes = 9, 4  # prefill + 3 verification passes
    stats.draft_time_s, stats.target_time_s = 0.9, 3.0  # 0.1 s per draft token, 1 s per pass
    out = metrics.stats_metrics([stats.to_dict()], k=3)
    assert out["mean_acceptance_length"] == pytest.approx(1 + 5 / 3)
    assert out["acceptance_per_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert out["acceptance_rate"] == pytest.approx(5 / 9)
    assert out["target_passes_per_token"] == pytest.approx(4 / 9)
    assert out["cost_per_token_ms"] == pytest.approx(1e3 * 3.9 / 8)
    assert out["draft_cost_ratio"] == pytest.approx(0.1)
    a = 5 / 9
    assert out["predicted_speedup"] == pytest.approx((1 - a**4) / ((1 - a) * (3 * 0.1 + 1)))
    assert metrics.predicted_speedup(1.0, 4, 0.0) == 5.0
    assert metrics.predicted_speedup(0.0, 4, 0.25) == 0.5


def test_speedup_sum_and_mean_of_ratios():
    base = [record("target", 1, 4.0), record("target", 2, 1.0)]
    mine = [record("m", 1, 1.0), record("m", 2, 1.0)]
    total, mean = metrics.speedups(mine, base)
    assert total == pytest.approx(5 / 2) and mean == pytest.approx((4 + 1) / 2)
    stats = SpecStats(num_speculative_tokens=2)
    stats.observe(2, 2)
    stats.new_tokens, stats.target_forward_passes, stats.draft_time_s, stats.target_time_s = 3, 2, 0.0, 1.0
    mine = [record("m", 1, 2.0, stats=stats.to_dict(), k=2), record("m", 2, 0.5, stats=stats.to_dict(), k=2)]
    summary = metrics.summarize(base + mine, ["target", "m"], greedy=True)["m"]
    assert summary["all"]["speedup"] == pytest.approx(2.0)
    assert summary["all"]["predicted_speedup"] == pytest.approx(3.0)  # alpha = 1, c = 0: k + 1
    assert summary["all"]["efficiency"] == pytest.approx(2 / 3)
    assert summary["all"]["tokens_per_s"] == pytest.approx(4 / 2.5)  # 2 tokens per record
    assert metrics.summarize(base + mine, ["target", "m"], greedy=False)["m"]["all"]["exact"] is None


def test_greedy_repeats_count_once_per_turn_by_their_median_and_exactness_checks_every_repeat():
    """Three greedy repeats per turn: the metrics take each turn's median repeat (a 10 s spike in one
    repeat of ``m`` moves nothing), pairing methods whichever repeat was the median; ``exact`` fails
    if any repeat differs. Sampled repeats are all summed."""
    base = [{**record("target", 1, t), "repeat": r} for r, t in enumerate((4.0, 4.2, 3.9))]
    mine = [{**record("m", 1, t), "repeat": r} for r, t in enumerate((2.1, 12.0, 2.0))]
    summary = metrics.summarize(base + mine, ["target", "m"], greedy=True)["m"]["all"]
    assert summary["speedup"] == pytest.approx(4.0 / 2.1) and summary["turns"] == 1
    assert summary["wall_time_s"] == pytest.approx(2.1) and summary["exact"] == 1.0
    picked = metrics.median_repeats(base + mine)
    assert [(r["method"], r["wall_time_s"], r["repeat"], r["repeats"]) for r in picked] == [
        ("target", 4.0, 0, 3),
        ("m", 2.1, 0, 3),
    ]
    mine[1]["token_ids"] = [1, 3]  # the spike's repeat decoded other tokens
    assert metrics.summarize(base + mine, ["target", "m"], greedy=True)["m"]["all"]["exact"] == 0.0
    sampled = metrics.summarize(base + mine, ["target", "m"], greedy=False)["m"]["all"]
    assert sampled["speedup"] == pytest.approx(12.1 / 16.1) and sampled["turns"] == 3


def test_a_turn_of_another_length_counts_at_the_baselines_length():
    """A peer whose output differs from ours in length (llama-cpp-python against exact mode) is
    compared per token: twice the tokens in twice the time is the same speed, not half of it; turns
    of equal length keep their measured seconds; the time after the first token is scaled by the
    tokens after the first."""
    base = [record("target", 1, 4.0, token_ids=(1, 2, 3, 4)), record("target", 2, 2.0, token_ids=(1, 2))]
    longer = [record("peer", 1, 8.0, token_ids=tuple(range(8))), record("peer", 2, 1.0, token_ids=(5, 6))]
    total, mean = metrics.speedups(longer, base)
    assert total == pytest.approx(6.0 / (4.0 + 1.0)) and mean == pytest.approx((1.0 + 2.0) / 2)
    assert metrics.speedup_interval(longer, base) is None  # 2 prompts: too few for an interval
    timed = [{**record("peer", 1, 7.0, token_ids=tuple(range(7))), "time_to_first_token_s": 1.0}]
    first = [{**record("target", 1, 4.0, token_ids=(1, 2, 3, 4)), "time_to_first_token_s": 1.0}]
    assert metrics.decode_speedup(timed, first) == pytest.approx(1.0)  # 1 s a token after the first, both
    equal = base[1:] + [record("target", 1, 4.0, token_ids=(1, 2))]
    slower = [record("peer", 1, 8.0, token_ids=(9, 9)), record("peer", 2, 4.0, token_ids=(1, 2))]
    assert metrics.speedups(slower, equal)[0] == pytest.approx(6.0 / 12.0)  # equal lengths: as measured


def test_decode_speedup_leaves_the_shared_prefill_out():
    """Prefill 3 s in both; decoding 4 s (target) against 1 s: 4x after the first token, 7 / 4 end to end;
    a turn without a time to first token (a peer's) counts in neither."""
    base = [record("target", 1, 7.0, stats={"time_to_first_token_s": 3.0}), record("target", 2, 5.0)]
    mine = [record("m", 1, 4.0, stats={"time_to_first_token_s": 3.0}), record("m", 2, 1.0)]
    assert metrics.decode_speedup(mine, base) == pytest.approx(4.0)
    assert metrics.speedups(mine[:1], base)[0] == pytest.approx(7 / 4)
    assert metrics.decode_speedup([record("peer", 1, 2.0)], base) is None
    streamed = {**record("peer", 1, 5.0), "time_to_first_token_s": 3.0}  # llama-cpp-python's first token
    assert metrics.decode_speedup([streamed], base) == pytest.approx(2.0)
    summary = metrics.summarize(base + mine, ["target", "m"], greedy=True)
    table = markdown({"records": base + mine, "methods": ["target", "m"]}, summary)
    assert "decode speedup (TPOT)" in table and "4.00x" in table


def test_speedup_interval_is_a_paired_bootstrap_of_the_speedup():
    """Prompts from 1 s to 90 s, each about 2x faster: paired, the interval is narrow around 2 whatever
    the prompts' lengths (unpaired, the lengths would swamp it); the ratio of sums of any resample is a
    weighted mean of per-prompt ratios, so the interval lies between the smallest and largest of them."""
    lengths = [1.0, 3.0, 10.0, 30.0, 90.0, 5.0, 20.0, 60.0]
    ratios = [1.9, 2.1, 2.0, 1.95, 2.05, 2.2, 1.85, 2.0]
    base = [record("target", i, t) for i, t in enumerate(lengths)]
    mine = [record("m", i, t / r) for i, (t, r) in enumerate(zip(lengths, ratios, strict=True))]
    speedup = metrics.speedups(mine, base)[0]
    low, high = metrics.speedup_interval(mine, base)
    assert min(ratios) <= low < speedup < high <= max(ratios)
    assert high - low < 0.2  # paired: the 90x spread of lengths does not enter
    assert metrics.speedup_interval(mine, base) == [low, high]  # seeded: reproducible
    narrower = metrics.speedup_interval(mine, base, confidence=0.5)
    assert low < narrower[0] < narrower[1] < high
    assert metrics.speedup_interval(mine[:2], base) is None  # fewer than 3 prompts: no interval
    same = [record("m", i, t / 2) for i, t in enumerate(lengths)]
    assert metrics.speedup_interval(same, base) == pytest.approx([2.0, 2.0])  # no spread
    with pytest.raises(ValueError, match="confidence"):
        metrics.speedup_interval(mine, base, confidence=1.0)
    summary = metrics.summarize(base + mine, ["target", "m"], greedy=True)
    assert summary["m"]["all"]["speedup_ci95"] == [low, high]
    assert summary["target"]["all"]["speedup_ci95"] == pytest.approx([1.0, 1.0])


def test_another_baseline_gives_a_paired_ab_comparison(tmp_path, capsys):
    base = [record("target", i, 4.0, token_ids=(1, 2)) for i in range(4)]
    a = [record("a", i, 2.0, token_ids=(1, 2)) for i in range(4)]
    b = [record("b", i, 1.0 + 0.1 * i, token_ids=(1, 2) if i else (1, 3)) for i in range(4)]
    records, methods = base + a + b, ["target", "a", "b"]
    over_a = metrics.summarize(records, methods, greedy=True, baseline="a")
    assert over_a["b"]["all"]["speedup"] == pytest.approx(8.0 / 4.6)  # a's seconds over b's
    assert over_a["target"]["all"]["speedup"] == pytest.approx(0.5)
    assert over_a["b"]["all"]["exact"] == pytest.approx(3 / 4)  # token ids compared with a's
    low, high = over_a["b"]["all"]["speedup_ci95"]
    assert low <= 8.0 / 4.6 <= high
    with pytest.raises(ValueError, match="baseline must be one of the methods"):
        metrics.summarize(records, methods, greedy=True, baseline="c")
    no_target = metrics.summarize(a + b, ["a", "b"], greedy=True)  # default baseline absent: no speedups
    assert no_target["b"]["all"]["speedup"] is None and no_target["b"]["all"]["speedup_ci95"] is None

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"records": records, "methods": methods, "greedy": True}))
    assert main(["bench", "--report", str(path), "--baseline", "a", "--out", str(tmp_path / "ab")]) == 0
    report = (tmp_path / "ab" / "report.md").read_text()
    assert "## Speedup over `a`" in report and "speedup 95% CI" in report and "1.74x" in report
    capsys.readouterr()
    assert main(["bench", "--report", str(path), "--baseline", "c"]) == 2
    err = capsys.readouterr().err
    assert "--baseline must be one of the methods ['target', 'a', 'b'], got 'c'" in err
    argv = ["bench", "--target", str(tmp_path / "no-such-model"), "--methods", "target,draft_model(k=2,label=d2)",
            "--baseline", "draft_model"]  # fmt: skip
    assert main(argv) == 2  # checked against the run's labels before any model loads
    assert "--baseline must be one of the methods ['target', 'd2'], got 'draft_model'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- exactness, skipped peers
def test_wrong_method_is_flagged_not_exact(models, questions, monkeypatch):
    def wrong(models, prompt_ids, settings, k, prediction=None, continues=False):
        return MethodOutput([5] * settings.max_new_tokens, 0.01)

    monkeypatch.setitem(METHODS, "wrong", Method("wrong", wrong, peer=True))
    results = run(models, questions, ["target", "wrong"])
    summary = metrics.summarize(results["records"], results["methods"], greedy=True)
    assert summary["wrong"]["all"]["exact"] == 0.0


def test_peer_that_raises_is_skipped_with_reason(models, questions, monkeypatch, capsys, tmp_path):
    def broken(models, prompt_ids, settings, k, prediction=None, continues=False):
        raise RuntimeError("no such feature")

    monkeypatch.setitem(METHODS, "broken", Method("broken", broken, peer=True))
    no_draft = BenchModels(models.target, None, models.tokenizer)  # hf_assisted fails: no draft
    prompts = load_prompts(questions, "qa", None)
    results = run_bench(no_draft, prompts, expand(["target", "broken", "hf_assisted"], [3]), SETTINGS, progress=False)
    assert "RuntimeError" in results["skipped"]["broken"] and "no such feature" in results["skipped"]["broken"]
    assert "draft" in results["skipped"]["hf_assisted"]
    assert {r["method"] for r in results["records"]} == {"target"}
    text = render(results, tmp_path)
    assert "skipped `broken`" in text and "no such feature" in text


def test_our_method_errors_propagate(models, questions, monkeypatch):
    def bug(models, prompt_ids, settings, k, prediction=None, continues=False):
        raise RuntimeError("engine bug")

    monkeypatch.setitem(METHODS, "bug", Method("bug", bug))
    with pytest.raises(RuntimeError, match="engine bug"):
        run(models, questions, ["target", "bug"])


# ----------------------------------------------------------------------------- prompts
def test_prompt_selection_and_grouping(questions):
    prompts = load_spec_bench(questions)
    assert [p.group for p in prompts] == ["mt_bench", "qa"]
    assert [p.group for p in select(prompts, ["coding"])] == ["coding"]
    many = [p for p in load_spec_bench(questions) for _ in range(2)]
    assert len(take_per_group(many, 1)) == 2
    with pytest.raises(ValueError, match="unknown categories"):
        load_prompts(questions, "poetry", None)


def test_humaneval_prompts():
    prompts = load_prompts(None, "humaneval", 2)
    assert len(prompts) == 2 and prompts[0].question_id == "HumanEval/0"
    assert prompts[0].turns[0].startswith("Complete the following Python function:\n```python\n")


def test_default_questions_file_groups(tmp_path, monkeypatch):
    import specdecode
    from specdecode.bench.prompts import default_questions_path

    monkeypatch.chdir(tmp_path)  # nothing beside the working directory: the file ships in the package
    path = default_questions_path()
    assert path.is_file() and path.is_relative_to(Path(specdecode.__file__).resolve().parent)
    assert (path.parent / "LICENSE").is_file() and "fd2c1cd" in (path.parent / "README.md").read_text()
    assert len(load_spec_bench(path)) == 240
    prompts = load_prompts(None, "mt_bench,translation", 8)
    assert math.isclose(len(prompts), 16)
    assert len({p.category for p in prompts if p.group == "mt_bench"}) == 8  # round-robin over MT-bench categories


def test_a_questions_file_means_its_questions(questions):
    assert [p.question_id for p in load_prompts(questions, None, None)] == [1, 2]  # no HumanEval added
    named = load_prompts(questions, "qa,humaneval", 1)
    assert [p.group for p in named] == ["qa", "humaneval"]  # unless asked for
    assert {p.group for p in load_prompts(None, None, 1)} == {*GROUPS}  # the default questions: every group


def test_cli_without_questions_runs_the_packaged_prompts(models, tmp_path, capsys, monkeypatch):
    import copy

    target, target_dir = copy.deepcopy(models.target), tmp_path / "target"
    target.config.max_position_embeddings = 8192  # rotary positions: Spec-Bench's prompts fit
    target.save_pretrained(target_dir)
    models.tokenizer.save_pretrained(target_dir)
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--target", str(target_dir), "--dtype", "float32", "--methods", "target", "--quick",
            "--out", str(tmp_path / "out"), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["group"] for r in saved["records"]} == {*GROUPS}  # the shortest prompt of every group
    assert saved["settings"]["questions"] is None


# ----------------------------------------------------------------------------- method specs
def test_methods_with_options_and_schedules(models, questions):
    from specdecode.bench.methods import split_methods

    names = split_methods("target, prompt_lookup(max_ngram=2,min_ngram=1)+adaptive,draft_model+heuristic")
    assert names == ["target", "prompt_lookup(max_ngram=2,min_ngram=1)+adaptive", "draft_model+heuristic"]
    results = run(models, questions, names)
    assert results["methods"] == [
        "target",
        "prompt_lookup(max_ngram=2,min_ngram=1)+adaptive[k=3]",
        "draft_model+heuristic[k=3]",
    ]
    by_method: dict[str, list] = {}
    for r in results["records"]:
        by_method.setdefault(r["method"], []).append(r)
    schedules = {m: {r["stats"]["schedule"] for r in rs} for m, rs in by_method.items()}
    assert schedules["prompt_lookup(max_ngram=2,min_ngram=1)+adaptive[k=3]"] == {"adaptive"}
    assert schedules["draft_model+heuristic[k=3]"] == {"heuristic"}
    for rs in by_method.values():  # greedy: every method's tokens equal the target's
        assert [r["token_ids"] for r in rs] == [r["token_ids"] for r in by_method["target"]]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("prompt_lookup(max_ngram=0)", "max_ngram"),
        ("prompt_lookup(colour=red)", "does not take"),
        ("prompt_lookup+sometimes", "schedule"),
        ("prompt_lookup(max_ngram)", "key=value"),
        ("hydra", "unknown method"),
    ],
)
def test_bad_method_specs(name, message):
    with pytest.raises(ValueError, match=message):
        expand([name], [3])


def test_the_order_of_methods_rotates_per_prompt_and_repeat(models, questions):
    """Each method takes each place in the round equally often (a cyclic Latin square): no method
    always runs first, after another prompt's last method; each record says its place."""
    from specdecode.bench.runner import method_order

    variants = expand(["target", "prompt_lookup", "suffix"], [None])
    labels = [v.label for v in variants]
    rounds = [[v.label for v in method_order(variants, p, r)] for p in range(2) for r in range(3)]
    assert rounds[0] == labels and rounds[1] == labels[1:] + labels[:1]
    for place in range(3):
        assert sorted(order[place] for order in rounds[:3]) == sorted(labels)
    prompts = load_prompts(questions, "qa", None)[:1]
    results = run_bench(models, prompts, variants, BenchSettings(max_new_tokens=4), repeats=3, progress=False)
    seen = {(r["repeat"], r["position"]): r["method"] for r in results["records"]}
    assert seen == {(r, place): rounds[r][place] for r in range(3) for place in range(3)}


@pytest.mark.parametrize("reset", [True, False])
def test_suffix_cache_is_cleared_before_every_prompt(models, questions, reset):
    """Repeat 1 of a prompt finds repeat 0's answer in the suffix cache only when the bench keeps
    cross-request state (``reset_proposer_caches=False``); by default both repeats, and the warm-up
    before them, start from an empty cache, so greedy repeats draft and accept exactly alike."""
    prompts = load_prompts(questions, "qa", None)
    settings = BenchSettings(max_new_tokens=24, reset_proposer_caches=reset)
    results = run_bench(models, prompts, expand(["suffix"], [4]), settings, repeats=2, progress=False)
    first, second = (
        {k: r["stats"][k] for k in ("drafts", "draft_tokens", "accepted_tokens")} for r in results["records"]
    )
    assert (first == second) is reset
    if not reset:
        assert second["accepted_tokens"] > first["accepted_tokens"]
    models.generator("suffix").proposer.clear_cache()
    assert models.generator("suffix").proposer.cache.num_tokens == 0


def test_hf_assisted_with_another_draft_is_parsed_and_checked(models, tmp_path):
    from specdecode.bench.methods import parse_method
    from specdecode.errors import ModelNotFoundError

    draft_dir = tmp_path / "draft"
    models.draft.save_pretrained(draft_dir)
    method = parse_method(f"hf_assisted(draft={draft_dir})")
    assert method.peer and method.name == f"hf_assisted(draft={draft_dir})"
    with pytest.raises(ValueError, match="draft=NAME_OR_PATH"):
        parse_method("hf_assisted(num_tokens=3)")
    with pytest.raises((ModelNotFoundError, ValueError)):
        parse_method(f"hf_assisted(draft={tmp_path / 'missing'})")


def test_without_a_sweep_each_method_runs_at_its_proposers_default_k(models, questions):
    """No ``-k``: plain column names, each proposer's default k used and recorded (prompt lookup 8,
    a draft model 4, a draft behind lookup 8, EAGLE would be 2), and a fixed ``k=`` still wins."""
    names = [
        "target",
        "prompt_lookup",
        "prompt_lookup(k=2)",
        "draft_model",
        "draft_model(prompt_lookup_min=2,label=dl)",
    ]
    results = run(models, questions, names, ks=(None,))
    assert results["methods"] == ["target", "prompt_lookup", "prompt_lookup(k=2)", "draft_model", "dl"]
    ks = {r["method"]: r["settings"]["num_speculative_tokens"] for r in results["records"]}
    assert ks == {"target": None, "prompt_lookup": 8, "prompt_lookup(k=2)": 2, "draft_model": 4, "dl": 8}
    longest = {
        m: max(len(r["stats"]["drafted_per_position"]) for r in results["records"] if r["method"] == m)
        for m in ks
        if m != "target"
    }
    assert longest["draft_model"] == 4 and longest["prompt_lookup(k=2)"] <= 2 and longest["prompt_lookup"] <= 8


def test_a_method_can_fix_its_own_k(models, questions):
    """``prompt_lookup(k=2)`` drafts at most 2 tokens per step while the sweep's k is 5, in one
    column; a bad k or a k on a tree is refused before anything runs."""
    results = run(models, questions, ["target", "prompt_lookup(k=2)", "prompt_lookup"], ks=(5,))
    assert results["methods"] == ["target", "prompt_lookup(k=2)", "prompt_lookup[k=5]"]
    drafted = {}
    for r in results["records"]:
        drafted.setdefault(r["method"], []).append(len(r["stats"]["drafted_per_position"]))
    assert max(drafted["prompt_lookup(k=2)"]) <= 2 and max(drafted["prompt_lookup[k=5]"]) > 2
    ks = {r["method"]: r["settings"]["num_speculative_tokens"] for r in results["records"]}
    assert ks == {"target": None, "prompt_lookup(k=2)": 2, "prompt_lookup[k=5]": 5}
    for bad in ("prompt_lookup(k=0)", "prompt_lookup(k=65)", "prompt_lookup(k=two)", "draft_model(k=2)@tree8"):
        with pytest.raises(ValueError, match="k= must be"):
            expand([bad], [3])


def test_a_label_names_a_method_with_options(models):
    from specdecode.bench.methods import METHODS, parse_method

    method = parse_method("draft_model(prompt_lookup_min=2,label=draft+lookup)")
    assert method.name == "draft+lookup" and method.uses_k
    assert "draft+lookup" not in METHODS  # parsing registers nothing
    proposer = method.factory(models)
    assert proposer.name == "draft_model+lookup" and proposer.min_ngram == 2
    # a label keeps the schedule and the tree in the method's name (a chain and its tree stay apart)
    tree = parse_method("draft_model(draft_quantization=int8,label=draft_int8)@tree8")
    adaptive = parse_method("draft_model(draft_quantization=int8,label=draft_int8)+adaptive")
    assert (tree.name, tree.uses_k, adaptive.name) == ("draft_int8@tree8", False, "draft_int8+adaptive")
    assert tree.factory(models).quantization == "int8" and adaptive.factory(models).quantization == "int8"
    for bad in ("a;b", "target", "x/y"):
        with pytest.raises(ValueError, match="label="):
            parse_method(f"prompt_lookup(max_ngram=2,label={bad})")


def test_the_plan_and_an_estimate_go_to_stderr_before_the_run_ends(models, questions, capsys):
    prompts = load_prompts(questions, "mt_bench,qa", None)
    assert len(prompts) >= 2
    turns = sum(len(p.turns) for p in prompts)
    run_bench(models, prompts, expand(["target", "prompt_lookup"], [2]), SETTINGS, progress=False)
    err = capsys.readouterr().err
    assert f"{len(prompts)} prompts ({turns} turns) x 2 methods x 1 repeats = {2 * turns} generations" in err
    assert "the first prompt took" in err and "the whole run about" in err


def test_a_method_with_options_of_a_proposer_without_draft_runs_without_a_draft(models, questions) -> None:
    """``prompt_lookup(min_ngram=3)`` needs no draft model: it runs when none was loaded (it asked
    for one before, so such a method failed unless a draft-model method was in the same run)."""
    no_draft = BenchModels(models.target, None, models.tokenizer)
    prompts = load_prompts(questions, "qa", None)
    methods = expand(["target", "prompt_lookup(min_ngram=3)"], [3])
    results = run_bench(no_draft, prompts, methods, SETTINGS, progress=False)
    ran = {r["method"] for r in results["records"]}
    assert "target" in ran and any(m.startswith("prompt_lookup(min_ngram=3)") for m in ran), ran
    assert not results.get("skipped"), results.get("skipped")
    from specdecode.bench.methods import parse_method

    with pytest.raises(ValueError, match="needs a draft model"):
        parse_method("draft_model(draft_confidence=0.5)").factory(no_draft)  # a draft proposer still asks


# ----------------------------------------------------------------------------- code edits, predictions
def test_code_edit_prompts_carry_the_original_file_as_prediction():
    from specdecode.bench.code_edit import EDIT_KINDS, make_edit

    prompts = load_prompts(None, "code_edit", 6)
    assert [p.category for p in prompts] == list(EDIT_KINDS) * 2  # round-robin over the three kinds
    for p in prompts:
        assert p.group == "code_edit" and len(p.turns) == 1 and p.prediction
        assert f"```python\n{p.prediction}```" in p.turns[0]
    assert "code_edit" not in {p.group for p in load_prompts(None, None, 1)}  # only when named
    edit = make_edit("t/0", 1, "def f():\n", "    return 1\n", "f")  # no parameter: renames the function
    assert edit.kind == "rename_function" and "`f_v2`" in edit.instruction


def test_prediction_method_drafts_from_the_prompt_prediction(models, tmp_path):
    """The ``prediction`` method drafts from a prompt's prediction (here: the target's own answer),
    its output equals the target alone's, and the other methods ignore the prediction."""
    from specdecode.bench.prompts import Prompt

    plain = run_bench(models, [Prompt(1, "coding", "coding", ("def add(a, b):",))], expand(["target"], [None]),
                      SETTINGS, progress=False, warmup=False)  # fmt: skip
    answer = models.tokenizer.decode(plain["records"][0]["token_ids"], skip_special_tokens=True)
    prompt = Prompt(1, "rename_function", "code_edit", ("def add(a, b):",), prediction=answer)
    results = run_bench(models, [prompt], expand(["target", "prompt_lookup", "prediction"], [None]), SETTINGS,
                        progress=False, warmup=False)  # fmt: skip
    by_method = {r["method"]: r for r in results["records"]}
    assert {r["method"] for r in results["records"]} == {"target", "prompt_lookup", "prediction"}
    assert len({tuple(r["token_ids"]) for r in results["records"]}) == 1
    stats = by_method["prediction"]["stats"]  # gated: what it sends follows measured times, so counts only
    assert stats["accepted_prediction_tokens"] + stats["rejected_prediction_tokens"] == stats["prediction_tokens"]
    assert by_method["prediction"]["settings"]["num_speculative_tokens"] == 16
    assert "accepted_prediction_tokens" not in by_method["prompt_lookup"]["stats"]
    variant = run_bench(models, [prompt], expand(["prediction(k=4)+ungated"], [None]), SETTINGS, progress=False,
                        warmup=False)["records"][0]  # fmt: skip
    assert variant["stats"]["accepted_prediction_tokens"] > 0 and variant["settings"]["num_speculative_tokens"] == 4


def test_the_llamacpp_peer_stops_at_eos_or_the_limit_and_times_its_first_token():
    """llama-cpp-python's plain generation as the bench drives it (a stand-in ``Llama``): from an
    empty cache, greedy as temp 0, stopped at EOS or max_new_tokens, its first token timed as it
    arrives (the peer's decode speedup needs it)."""
    from types import SimpleNamespace

    from specdecode.bench.methods import METHODS

    class FakeLlama:
        def __init__(self) -> None:
            self.calls: list[tuple[list[int], float]] = []
            self.resets = 0

        def reset(self) -> None:
            self.resets += 1

        def generate(self, tokens, temp, **kwargs):
            self.calls.append((list(tokens), temp))
            yield from (5, 6, 7, 2, 9)  # 2: EOS

    llm = FakeLlama()
    models = SimpleNamespace(llama=lambda pred: llm, eos_token_ids=[2])
    run = METHODS["llamacpp"].run
    out = run(models, [1, 1], BenchSettings(max_new_tokens=8), None, None)
    assert out.token_ids == [5, 6, 7, 2] and llm.calls == [([1, 1], 0.0)] and llm.resets == 1
    assert 0 <= out.time_to_first_token_s <= out.wall_time_s
    assert run(models, [1], BenchSettings(max_new_tokens=2), None, None).token_ids == [5, 6]


def test_multi_turn_prompts_continue_their_history(models, questions, monkeypatch):
    """``multi_turn``: the coding session on colorsys.py (six turns) and the file's two-turn MT-bench
    questions; every turn after a prompt's first is run with ``continues`` (the method may reuse
    what the earlier turns read), the first from an empty cache; our engine's tokens are those it
    gives with every prompt prefilled whole."""
    from specdecode.bench.prompts import CODING_SESSION

    prompts = load_prompts(questions, "multi_turn", None)
    assert [(p.question_id, len(p.turns), p.keeps_history) for p in prompts] == [("colorsys", 6, True), (1, 2, True)]
    assert "def rgb_to_hsv" in prompts[0].turns[0] and prompts[0].turns[1:] == CODING_SESSION[1:]
    assert not any(p.keeps_history for p in load_prompts(questions, "mt_bench", None))
    seen: list[bool] = []
    target = METHODS["target"]

    def recording(models, prompt_ids, settings, k, prediction=None, continues=False):
        seen.append(continues)
        return target.run(models, prompt_ids, settings, k, prediction, continues)

    monkeypatch.setitem(METHODS, "recording", Method("recording", recording))
    short = [prompts[1]]  # the MT-bench question: two short turns
    with_history = run_bench(models, short, expand(["recording"], [3]), SETTINGS, progress=False)
    assert seen[-2:] == [False, True]  # after the warm-up (a first turn)
    whole = run_bench(
        models, load_prompts(questions, "mt_bench", None), expand(["target"], [3]), SETTINGS, progress=False
    )
    assert [r["token_ids"] for r in with_history["records"]] == [r["token_ids"] for r in whole["records"]]
