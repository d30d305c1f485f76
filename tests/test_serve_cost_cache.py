"""The server's start-up cost model on disk (:mod:`specdecode.cost.cache`): a JSON round trip
checked field by field, a restart with the same key loads instead of measuring, any changed
ingredient measures again, a corrupt file or an unwritable folder never stops the server, and
``--remeasure-costs`` measures anyway. Every test keeps its cache in a temporary folder."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode.cost import cache as cost_cache
from specdecode.cost.cache import CostKey, cost_key, load_cost_model, model_identity, store_cost_model
from specdecode.cost.serve_model import CostModel
from specdecode.sampling import SamplingParams
from specdecode.serve.config import ServeSettings
from specdecode.serve.request import Event, ServeRequest
from specdecode.serve.scheduler import Scheduler

from conftest import make_tiny_model


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """specdecode's cache folder is a fresh temporary one: nothing here reads or writes the user's
    (and the cost cache is its ``serve-cost`` folder, not the one conftest names for other tests)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(cost_cache.FOLDER_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts :meth:`Scheduler.calibrate` (the real one runs: tiny models measure in a moment)."""
    count: list[int] = []
    real = Scheduler.calibrate

    def calibrate(self: Scheduler) -> CostModel:
        count.append(1)
        return real(self)

    monkeypatch.setattr(Scheduler, "calibrate", calibrate)
    return count


def random_cost(seed: int) -> CostModel:
    rng = random.Random(seed)
    batch_sizes = sorted(rng.sample(range(1, 65), 4))
    tokens = sorted(rng.sample(range(1, 17), 3))
    return CostModel(
        batch_sizes,
        tokens,
        [[rng.uniform(1e-3, 1.0) for _ in tokens] for _ in batch_sizes],
        draft_s_per_token={"draft_model": rng.uniform(0, 0.1), "prompt_lookup": rng.uniform(0, 1e-4)},
        scale=[rng.uniform(0.5, 2.0) for _ in batch_sizes],
        catchup_s_per_token={"draft_model": rng.uniform(0, 0.01)},
    )


def make(chat_models: Any, tokenizer: Any, **options: Any) -> Scheduler:
    target, draft = chat_models
    settings = ServeSettings(**{"model_name": "tiny", "max_batch_size": 2, "kv_budget_tokens": 1024, **options})
    return Scheduler(target, tokenizer, settings, draft=draft)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------ CostModel.from_dict
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cost_model_round_trips_through_json(seed: int) -> None:
    cost = random_cost(seed)
    back = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert back == cost
    for b in (1, 3, 64):
        for t in (1, 5, 16):
            assert back.target_time(b, t) == cost.target_time(b, t)
    assert CostModel.from_dict({k: cost.to_dict()[k] for k in ("batch_sizes", "tokens", "target_s")}).scale == [
        1.0
    ] * len(cost.batch_sizes)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.pop("target_s"), "target_s"),
        (lambda d: d.update(batch_sizes=[2, 1]), "batch_sizes"),
        (lambda d: d.update(batch_sizes=[0, 1]), "batch_sizes"),
        (lambda d: d.update(tokens=[1, True]), "tokens"),
        (lambda d: d.update(tokens=[]), "tokens"),
        (lambda d: d.update(target_s=[[0.1, 0.2]]), "target_s"),
        (lambda d: d.update(target_s=[[0.1, 0.2], [0.3, float("nan")]]), r"target_s\[1\]\[1\]"),
        (lambda d: d.update(target_s=[[0.1, 0.0], [0.3, 0.4]]), r"target_s\[0\]\[1\]"),
        (lambda d: d.update(target_s=[[0.1, "x"], [0.3, 0.4]]), r"target_s\[0\]\[1\]"),
        (lambda d: d.update(scale=[1.0]), "scale"),
        (lambda d: d.update(scale=[1.0, -1.0]), r"scale\[1\]"),
        (lambda d: d.update(draft_s_per_token={"draft_model": -0.1}), "draft_s_per_token"),
        (lambda d: d.update(catchup_s_per_token=[0.1]), "catchup_s_per_token"),
        (lambda d: d.update(colour="red"), "colour"),
    ],
)
def test_from_dict_names_the_bad_field(change: Any, field: str) -> None:
    data = CostModel([1, 2], [1, 3], [[0.1, 0.2], [0.3, 0.4]], {"draft_model": 0.01}).to_dict()
    change(data)
    with pytest.raises(ValueError, match=field):
        CostModel.from_dict(data)
    with pytest.raises(ValueError, match="mapping"):
        CostModel.from_dict([data])


# ------------------------------------------------------------------------------ the key
def key_of(target: Any, draft: Any = None, **changes: Any) -> CostKey:
    grid = {
        "batch_sizes": [1, 2],
        "tokens": [1, 2, 3, 5],
        "proposer": "draft_model",
        "proposer_options": {},
        "k": 4,
        **changes,
    }
    return cost_key(target, draft, **grid)


def test_the_key_follows_every_ingredient(chat_models, monkeypatch) -> None:
    from specdecode.models.llamacpp import build

    target, draft = chat_models
    base = key_of(target, draft)
    assert key_of(target, draft) == base  # deterministic
    assert base.ingredients["target"]["dtype"] == "torch.float32"
    changed = {
        "grid": key_of(target, draft, batch_sizes=[1, 2, 4]),
        "tokens": key_of(target, draft, tokens=[1, 2, 3]),
        "k": key_of(target, draft, k=3),
        "proposer": key_of(target, draft, proposer="prompt_lookup"),
        "options": key_of(target, draft, proposer_options={"draft_quantization": "none"}),
        "no draft": key_of(target, None),
        "other target": key_of(make_tiny_model(vocab_size=target.config.vocab_size, layers=3), draft),
        "dtype": key_of(copy.deepcopy(target).to(torch.bfloat16), draft),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        changed["threads"] = key_of(target, draft)
    finally:
        torch.set_num_threads(before)
    with monkeypatch.context() as m:
        m.setattr("specdecode.__version__", "99.0")
        changed["version"] = key_of(target, draft)
    with monkeypatch.context() as m:
        m.setattr(build, "cpu_info", lambda: {"model": "Other CPU", "flags": [], "machine": "x86_64"})
        changed["cpu"] = key_of(target, draft)
    with monkeypatch.context() as m:
        m.setattr(cost_cache.os, "cpu_count", lambda: 1024)
        changed["cores"] = key_of(target, draft)
    from specdecode.cost import serve_measure

    assert base.ingredients["measurement"] == serve_measure.MEASUREMENT_VERSION  # a number, not the code's source
    with monkeypatch.context() as m:  # the measurement changed what it returns, and said so
        m.setattr(serve_measure, "MEASUREMENT_VERSION", serve_measure.MEASUREMENT_VERSION + 1)
        changed["measurement"] = key_of(target, draft)
    with monkeypatch.context() as m:
        m.setattr(cost_cache, "FORMAT", cost_cache.FORMAT + 1)
        changed["format"] = key_of(target, draft)
    digests = {name: key.digest for name, key in changed.items()}
    assert base.digest not in digests.values(), digests
    assert len(set(digests.values())) == len(digests), digests
    assert key_of(target, draft) == base  # everything changed back


def test_a_model_folder_is_known_by_its_files(model_dirs, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    target_dir, _ = model_dirs
    folder = tmp_path / "target"
    folder.mkdir()
    for f in Path(target_dir).iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    identity = model_identity(model)
    assert identity is not None and identity["name_or_path"] == str(folder.resolve())
    names = {Path(f["path"]).name for f in identity["files"]}
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names), names
    before = key_of(model)
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten in place, same size
    assert key_of(model).digest != before.digest


def test_a_gguf_is_known_by_its_file_options_and_the_llama_cpp_build(tmp_path, monkeypatch) -> None:
    """A llama.cpp model's ingredients, without llama.cpp: a :class:`LlamaCppModel` that never loaded."""
    from specdecode.models.llamacpp import build
    from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions

    gguf = tmp_path / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))

    def model(**options: Any) -> LlamaCppModel:
        m = LlamaCppModel.__new__(LlamaCppModel)  # no weights: only what the key reads
        m.path, m.options, m.on_gpu = gguf, LlamaCppOptions(**options), False
        return m

    monkeypatch.setattr(build, "installed_record", lambda prefix=None: {"key": "aaaa"})
    base = key_of(model())
    assert base.ingredients["backend"] == "llamacpp"
    assert base.ingredients["target"]["llama_cpp_build"] == "aaaa"
    assert base.ingredients["target"]["gguf"]["path"] == str(gguf.resolve())
    assert key_of(model()) == base
    others = [key_of(model(threads=1)), key_of(model(exact=False))]
    gguf.write_bytes(b"GGUF" + bytes(61))
    others.append(key_of(model()))
    monkeypatch.setattr(build, "installed_record", lambda prefix=None: {"key": "bbbb"})
    others.append(key_of(model()))
    assert len({k.digest for k in [base, *others]}) == len(others) + 1


# ------------------------------------------------------------------------------ files
def test_store_then_load_gives_the_measured_model(chat_models, tmp_path) -> None:
    key, cost = key_of(chat_models[0]), random_cost(7)
    path = store_cost_model(key, cost, tmp_path / "folder", measure_s=12.5)
    assert path == tmp_path / "folder" / f"{key.digest}.json"
    assert not [p for p in path.parent.iterdir() if p != path]  # no temporary file left behind
    cached = load_cost_model(key, tmp_path / "folder")
    assert cached is not None and cached.cost == cost and cached.path == path and cached.measure_s == 12.5
    assert read(path)["ingredients"] == key.ingredients  # in clear, for whoever wonders why it re-measured
    assert load_cost_model(key_of(chat_models[0], k=2), tmp_path / "folder") is None  # another key: a miss


def test_the_folder_keeps_the_most_recently_used_files(chat_models, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cost_cache, "KEEP", 2)
    keys = [key_of(chat_models[0], k=k) for k in (1, 2, 3)]
    paths = []
    for age, key in enumerate(keys):
        paths.append(store_cost_model(key, random_cost(age), tmp_path, measure_s=1.0))
        os.utime(paths[-1], ns=(10**18 + age * 10**9, 10**18 + age * 10**9))  # stored in this order
    assert [p.exists() for p in paths] == [False, True, True]
    os.utime(paths[1], ns=(10**18, 10**18))  # the oldest of the two now ...
    assert load_cost_model(keys[1], tmp_path) is not None  # ... until it is used
    store_cost_model(keys[0], random_cost(9), tmp_path, measure_s=1.0)
    assert [p.exists() for p in paths] == [True, True, False]


# ------------------------------------------------------------------------------ the scheduler
def test_a_restart_with_the_same_key_loads_instead_of_measuring(chat_models, tiny_tokenizer, tmp_path, calls, caplog):
    caplog.set_level(logging.INFO, logger="specdecode.serve")
    first = make(chat_models, tiny_tokenizer)
    first.measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 1 and first.cost is not None
    (path,) = tmp_path.glob("*.json")
    measured = CostModel.from_dict(read(path)["cost_model"])
    assert measured == first.cost and measured.batch_sizes == [1, 2]
    # serving refines the model in place; the file keeps the start-up measurement
    first.cost.observe_target(2, 1, 10 * first.cost.target_time(2, 1))
    first.cost.observe_draft("draft_model", 1.0, 1)
    assert CostModel.from_dict(read(path)["cost_model"]) == measured != first.cost

    second = make(chat_models, tiny_tokenizer)
    second.measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 1, "the second start measured again"
    assert second.cost == measured and second.cost.scale == [1.0, 1.0]
    assert f"cost model: loaded from {path} (measured {read(path)['measured_at']})" in caplog.text
    second.start(thread=False)  # the loaded model is not measured again, and it serves
    assert len(calls) == 1
    events = serve_one(second)
    assert events[-1].finish_reason in ("length", "stop") and sum(len(e.token_ids) for e in events) > 0
    assert second.cost.scale != [1.0, 1.0]  # refined online, as a measured one is


def serve_one(scheduler: Scheduler) -> list[Event]:
    events: list[Event] = []
    scheduler.submit(
        ServeRequest(
            request_id="r",
            prompt_ids=[5, 6, 7, 8],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
            speculative=True,
            proposer="draft_model",
            num_speculative_tokens=3,
            on_event=events.append,
        )
    )
    while scheduler.run_once():
        pass
    return events


@pytest.mark.parametrize(
    "change",
    [
        {"max_batch_size": 3},  # the grid of batch sizes
        {"num_speculative_tokens": 2},  # tokens per row and k
        {"proposer": "prompt_lookup", "proposer_options": {"max_ngram": 3}},
        {"proposer_options": {"draft_confidence": 0.5}},
    ],
)
def test_a_changed_ingredient_measures_again(chat_models, tiny_tokenizer, tmp_path, calls, change) -> None:
    make(chat_models, tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    other = make(chat_models, tiny_tokenizer, **change)
    other.measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    again = make(chat_models, tiny_tokenizer, **change)
    again.measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 2 and again.cost == other.cost  # and that one is cached in turn


def test_a_changed_model_measures_again(chat_models, tiny_tokenizer, tmp_path, calls) -> None:

    target, draft = chat_models
    make(chat_models, tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    deeper = make_tiny_model(vocab_size=target.config.vocab_size, layers=3)
    make((deeper, draft), tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 2
    make((target, deeper), tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 3


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: "{not json",
        lambda data: json.dumps([1, 2, 3]),
        lambda data: json.dumps({**data, "format": 0}),
        lambda data: json.dumps({**data, "cost_model": {**data["cost_model"], "target_s": [[-1.0]]}}),
        lambda data: json.dumps({**data, "ingredients": {**data["ingredients"], "k": 99}}),
        lambda data: json.dumps({**data, "measure_s": [1]}),
    ],
    ids=["not-json", "not-an-object", "other-format", "bad-table", "other-ingredients", "bad-seconds"],
)
def test_a_corrupt_file_is_a_warning_and_measured_again(
    chat_models, tiny_tokenizer, tmp_path, calls, caplog, corrupt
) -> None:
    make(chat_models, tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    (path,) = tmp_path.glob("*.json")
    good = read(path)
    path.write_text(corrupt(good))
    caplog.set_level(logging.INFO, logger="specdecode.serve")
    scheduler = make(chat_models, tiny_tokenizer)
    scheduler.measure_cost_model(cache_folder=tmp_path)
    assert len(calls) == 2 and scheduler.cost is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), caplog.text
    assert "loaded from" not in caplog.text
    assert CostModel.from_dict(read(path)["cost_model"]) == scheduler.cost  # replaced by the new measurement


def test_an_unwritable_folder_still_serves(chat_models, tiny_tokenizer, tmp_path, calls, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # root ignores permissions; nobody makes a folder under a file
    caplog.set_level(logging.INFO, logger="specdecode.serve")
    scheduler = make(chat_models, tiny_tokenizer)
    scheduler.measure_cost_model(cache_folder=blocker / "serve-cost")
    assert len(calls) == 1 and scheduler.cost is not None
    assert "could not store" in caplog.text and str(blocker / "serve-cost") in caplog.text
    scheduler.start(thread=False)
    events = serve_one(scheduler)
    assert events[-1].finish_reason in ("length", "stop") and sum(len(e.token_ids) for e in events) > 0


def test_remeasure_measures_and_replaces_the_file(chat_models, tiny_tokenizer, tmp_path, calls) -> None:
    make(chat_models, tiny_tokenizer).measure_cost_model(cache_folder=tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps({**read(path), "measured_at": "earlier"}))
    scheduler = make(chat_models, tiny_tokenizer)
    scheduler.measure_cost_model(cache_folder=tmp_path, remeasure=True)
    assert len(calls) == 2 and read(path)["measured_at"] != "earlier"
    assert CostModel.from_dict(read(path)["cost_model"]) == scheduler.cost


def test_without_a_folder_nothing_is_written(chat_models, tiny_tokenizer, private_cache, calls) -> None:
    """The library's default (tests, :meth:`Scheduler.start`): measure, no files."""
    scheduler = make(chat_models, tiny_tokenizer)
    scheduler.start(thread=False)
    assert len(calls) == 1 and scheduler.cost is not None and not private_cache.exists()
    make(chat_models, tiny_tokenizer, speculation="on").measure_cost_model(cache_folder=private_cache)
    assert len(calls) == 1 and not private_cache.exists()  # no cost model needed: nothing measured or stored


# ------------------------------------------------------------------------------ the command
def test_the_command_caches_and_remeasure_costs_measures_again(
    model_dirs, private_cache, calls, monkeypatch, capsys
) -> None:
    import uvicorn

    from specdecode.commands.main import main

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    target, draft = model_dirs
    argv = ["serve", "--target", str(target), "--draft", str(draft), "--dtype", "float32", "--max-batch-size", "2"]
    assert main(argv) == 0 and len(calls) == 1
    (path,) = (private_cache / "serve-cost").glob("*.json")
    assert main(argv) == 0 and len(calls) == 1  # loaded
    path.write_text(json.dumps({**read(path), "measured_at": "earlier"}))
    assert main([*argv, "--remeasure-costs"]) == 0 and len(calls) == 2
    assert read(path)["measured_at"] != "earlier"  # the new measurement replaced it
    assert main([*argv, "--remeasure-costs", "--speculation", "off"]) == 2
    assert "--remeasure-costs" in capsys.readouterr().err and len(calls) == 2


def test_a_replica_loads_or_measures_as_its_config_says(chat_models, tiny_tokenizer, tmp_path, calls) -> None:
    """``--replicas``: each replica's scheduler takes its cost model from the folder the command
    passes in :class:`ReplicaConfig` (stored on the first start, loaded on the next; measured again
    with ``remeasure_costs``); without a folder it is left for the app's start to measure."""
    from specdecode.serve.replicas import ReplicaConfig, prepare_cost_model

    folder = tmp_path / "costs"
    alone = make(chat_models, tiny_tokenizer)
    prepare_cost_model(alone, ReplicaConfig())
    assert alone.cost is None and calls == []  # no folder: nothing yet
    first = make(chat_models, tiny_tokenizer)
    prepare_cost_model(first, ReplicaConfig(cost_cache_folder=str(folder)))
    assert first.cost is not None and len(calls) == 1 and len(list(folder.glob("*.json"))) == 1
    again = make(chat_models, tiny_tokenizer)
    prepare_cost_model(again, ReplicaConfig(cost_cache_folder=str(folder)))
    assert len(calls) == 1 and again.cost is not None and again.cost.to_dict() == first.cost.to_dict()
    fresh = make(chat_models, tiny_tokenizer)
    prepare_cost_model(fresh, ReplicaConfig(cost_cache_folder=str(folder), remeasure_costs=True))
    assert len(calls) == 2 and fresh.cost is not None


def test_an_environment_variable_names_a_folder_of_its_own(tmp_path, monkeypatch) -> None:
    """``$SPECDECODE_SERVE_COST_CACHE`` moves the cost cache alone (tests' subprocesses use it)."""
    assert cost_cache.default_folder() == tmp_path / "cache" / cost_cache.FOLDER  # under $SPECDECODE_CACHE
    monkeypatch.setenv(cost_cache.FOLDER_ENV, str(tmp_path / "elsewhere"))
    assert cost_cache.default_folder() == tmp_path / "elsewhere"
