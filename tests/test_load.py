"""The one load path (:mod:`specdecode.load`): the plan picks the backend and proposer as before
for the default pair, a ``.gguf`` file and a Hugging Face folder; a proposer llama.cpp cannot serve
runs on torch under ``auto`` for the library and the server alike; a draft of another vocabulary
switches to ``cross_tokenizer`` with the vocabulary rule asked once; ``resolve_backend`` runs once
per ``generate`` / ``serve`` load; bad input fails before any weights load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import SpeculativeGenerator
from specdecode.commands.main import main
from specdecode.load import LoadPlan, choose, load_models, plan_models
from specdecode.models import backends
from specdecode.models.backends import llamacpp_available
from specdecode.proposers import vocabulary

from conftest import make_tiny_model, make_tiny_tokenizer

no_llamacpp_default = not llamacpp_available() or torch.cuda.is_available()


def _count(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count calls of ``module.name`` (still calling it); returns the one-element counter."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading any weights fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights loaded")

    from specdecode.models.torch import hf_loading

    monkeypatch.setattr(hf_loading, "load_model", refuse)
    monkeypatch.setattr(backends, "load_llamacpp", refuse)


@pytest.fixture(scope="module")
def other_vocabulary(tmp_path_factory) -> Path:
    """A draft folder with another tokenizer (and vocabulary size) than conftest's ``model_dirs``."""
    tokenizer = make_tiny_tokenizer(vocab_size=280)
    folder = tmp_path_factory.mktemp("other") / "draft"
    make_tiny_model(vocab_size=len(tokenizer), seed=3).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------- the plan as before
@pytest.mark.skipif(no_llamacpp_default, reason="the default pair runs on llama.cpp on a CPU with llama-cpp-python")
def test_the_default_pair_and_a_gguf_file_plan_llamacpp_and_prompt_lookup(monkeypatch) -> None:
    from specdecode.models.default import DEFAULT_TARGET, packaged_gguf

    _no_weights(monkeypatch)
    plan = plan_models()
    expected = ("llamacpp", "prompt_lookup", {"min_ngram": 3, "max_ngram": 8})
    assert (plan.backend, plan.proposer, plan.options) == expected
    assert plan.target == packaged_gguf(None, "target") and plan.draft is None
    assert plan.name == DEFAULT_TARGET.name and plan.config.min_ngram == 3
    gguf = plan_models(str(plan.target), proposer="auto", min_ngram=2)  # options given win over auto's
    assert (gguf.backend, gguf.proposer) == ("llamacpp", "prompt_lookup")
    assert gguf.options == {"min_ngram": 2, "max_ngram": 8}
    draft_file = packaged_gguf(None, "draft")
    drafted = plan_models(draft=str(draft_file))  # a draft named: draft_model
    assert (drafted.backend, drafted.proposer, drafted.draft) == (
        "llamacpp",
        "draft_model",
        packaged_gguf(None, "draft"),
    )
    # options of the draft model's only ask for it, in the library as on the command line
    assert plan_models(prompt_lookup_min=2).proposer == "draft_model"


def test_a_hugging_face_folder_plans_torch(model_dirs, monkeypatch) -> None:
    target, draft = model_dirs
    _no_weights(monkeypatch)
    plan = plan_models(target, draft, dtype="float32")
    assert isinstance(plan, LoadPlan)
    assert (plan.backend, plan.proposer, plan.target, plan.draft) == ("torch", "draft_model", target, draft)
    assert plan.name == target.name and not plan.server
    alone = plan_models(target, proposer="prompt_lookup", max_ngram=4)
    assert (alone.backend, alone.proposer, alone.draft, alone.config.max_ngram) == ("torch", "prompt_lookup", None, 4)
    served = plan_models(target, draft, proposer="prompt_lookup", server=True)  # the server loads a draft given
    assert served.draft == draft and served.server


# ------------------------------------------------------------------------- one policy
def test_a_proposer_llamacpp_cannot_serve_runs_on_torch_under_auto_for_library_and_server(
    model_dirs, monkeypatch
) -> None:
    target, _ = model_dirs
    monkeypatch.setattr(
        backends, "resolve_backend", lambda backend, *a, **k: "llamacpp" if backend == "auto" else backend
    )
    _no_weights(monkeypatch)
    for server in (False, True):
        plan = plan_models(target, proposer="early_exit", server=server)
        assert (plan.backend, plan.proposer) == ("torch", "early_exit")
    # the server's batched llama.cpp runner returns no hidden states: eagle / medusa run on torch there
    assert choose("eagle", "auto")[0] == "llamacpp"  # generate runs them on llama.cpp
    assert choose("eagle", "auto", server=True)[0] == "torch"
    assert choose("medusa", "auto", server=True)[0] == "torch"
    # named, the backend refuses, naming both
    with pytest.raises(ValueError, match="'early_exit' is not available on the llamacpp backend"):
        plan_models(target, proposer="early_exit", backend="llamacpp")
    with pytest.raises(ValueError, match="--proposer eagle: the llamacpp server's batched runner"):
        plan_models(target, proposer="eagle", backend="llamacpp", server=True)


# ------------------------------------------------------------------------- the vocabulary rule once
def test_a_draft_of_another_vocabulary_switches_to_cross_tokenizer_asking_once(
    model_dirs, other_vocabulary, monkeypatch, capsys
) -> None:
    target, _ = model_dirs
    asked = _count(monkeypatch, vocabulary, "draft_proposer")
    compared = _count(monkeypatch, vocabulary, "shares_vocabulary")
    plan = plan_models(target, other_vocabulary, dtype="float32")
    assert (plan.backend, plan.proposer) == ("torch", "cross_tokenizer") and asked[0] == 1
    assert "using --proposer cross_tokenizer" in capsys.readouterr().err
    asked[0] = compared[0] = 0
    generator = SpeculativeGenerator.from_pretrained(target, other_vocabulary, dtype="float32")
    assert generator.proposer.name == "cross_tokenizer"
    # the rule once (the folders, before anything loads); the constructor's check once more, as for
    # every generator (the runner's and the built proposer's sizes: no file read)
    assert (asked[0], compared[0]) == (1, 2)
    asked[0] = compared[0] = 0
    same = SpeculativeGenerator.from_pretrained(target, model_dirs[1], dtype="float32")
    assert same.proposer.name == "draft_model" and (asked[0], compared[0]) == (1, 2)


# ------------------------------------------------------------------------- resolve_backend once per load
def test_generate_resolves_the_backend_and_asks_the_vocabulary_rule_once(model_dirs, monkeypatch, capsys) -> None:
    target, draft = model_dirs
    resolved = _count(monkeypatch, backends, "resolve_backend")
    asked = _count(monkeypatch, vocabulary, "draft_proposer")
    argv = ["generate", "def add", "--target", str(target), "--draft", str(draft), "--dtype", "float32"]
    assert main([*argv, "--max-new-tokens", "4", "--json", "--raw"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["proposer"] == "draft_model" and (resolved[0], asked[0]) == (1, 1)


def test_serve_resolves_the_backend_and_asks_the_vocabulary_rule_once(
    model_dirs, other_vocabulary, monkeypatch
) -> None:
    import uvicorn

    from specdecode.serve import server

    target, _ = model_dirs
    resolved = _count(monkeypatch, backends, "resolve_backend")
    decisions: list[str | None] = []  # the proposer the load asked about: the rule's decision, with a notice
    real = vocabulary.draft_proposer

    def draft_proposer(proposer: Any, target: Any, draft: Any, announce: str | None = None) -> Any:
        if announce is not None:  # not the admission's list of the proposers requests may name (no notice)
            decisions.append(proposer)
        return real(proposer, target, draft, announce=announce)

    monkeypatch.setattr(vocabulary, "draft_proposer", draft_proposer)
    asked_by_app = _count(monkeypatch, server, "draft_proposer")
    served: dict[str, Any] = {}
    real_build_app = server.build_app

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app, scheduler = real_build_app(*args, **kwargs)
        served["settings"] = scheduler.settings
        return app, scheduler

    monkeypatch.setattr(server, "build_app", build_app)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    argv = ["serve", "--target", str(target), "--draft", str(other_vocabulary), "--dtype", "float32"]
    assert main(argv) == 0
    assert (resolved[0], decisions, asked_by_app[0]) == (1, ["draft_model"], 0)
    assert served["settings"].proposer == "cross_tokenizer"


def test_serve_runs_a_proposer_llamacpp_cannot_serve_on_torch_under_auto(model_dirs, monkeypatch) -> None:
    """Before: ``specdecode serve --proposer early_exit`` on a llama.cpp target was refused; now it
    runs on torch, as ``generate`` and ``from_pretrained`` do."""
    import uvicorn

    from specdecode.load import ModelSource, load_server_models

    target, _ = model_dirs
    monkeypatch.setattr(
        backends, "resolve_backend", lambda backend, *a, **k: "llamacpp" if backend == "auto" else backend
    )
    loaded = load_server_models(ModelSource(target=str(target), dtype="float32"), "early_exit")
    assert (loaded.backend, loaded.proposer, loaded.built) == ("torch", "early_exit", None)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert main(["serve", "--target", str(target), "--dtype", "float32", "--proposer", "early_exit"]) == 0


# ------------------------------------------------------------------------- errors before any weights
def test_bad_input_fails_before_any_weights_load(model_dirs, monkeypatch, capsys) -> None:
    target, draft = model_dirs
    _no_weights(monkeypatch)
    with pytest.raises(ValueError, match="max_ngram"):
        plan_models(target, proposer="prompt_lookup", max_ngram=0)
    with pytest.raises(ValueError, match=r"--min-ngram is an option of --proposer prompt_lookup"):
        plan_models(target, proposer="suffix", min_ngram=2)
    with pytest.raises(ValueError, match="does not take"):
        SpeculativeGenerator.from_pretrained(target, proposer="prompt_lookup", colour="red")
    with pytest.raises(ValueError, match="given without a proposer"):
        plan_models(target, proposer=None, max_ngram=3)
    with pytest.raises(ValueError, match="proposer must be one of"):
        plan_models(target, proposer="psychic")
    with pytest.raises(ValueError, match="dtype"):
        plan_models(target, dtype="float8")
    with pytest.raises(ValueError, match="threads"):
        plan_models(backend="llamacpp", threads=0, proposer="prompt_lookup")
    for argv in (
        ["--proposer", "suffix", "--min-ngram", "2"],
        ["-k", "0"],
        ["--tree", "no-such-tree"],
        ["--logprobs", "21", "--json"],
    ):
        assert main(["generate", "x", "--target", str(target), "--draft", str(draft), *argv]) == 2
        assert "error" in capsys.readouterr().err
    assert main(["generate", "", "--target", str(target)]) == 2
    assert "prompt must not be empty" in capsys.readouterr().err


def test_load_models_builds_the_proposer_for_the_library_not_for_the_server(model_dirs) -> None:
    target, draft = model_dirs
    loaded = load_models(plan_models(target, draft, dtype="float32"))
    assert loaded.built is not None and loaded.built.name == "draft_model" and loaded.backend == "torch"
    served = load_models(plan_models(target, draft, dtype="float32", server=True))
    assert served.built is None and served.proposer == "draft_model" and served.draft is not None
