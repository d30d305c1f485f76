"""Backend selection and the front door's checks: no model is loaded here."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeGenerator
from specdecode.commands.main import main
from specdecode.models import backends
from specdecode.models.backends import default_proposer, resolve_backend


@pytest.fixture
def cpu_with_llamacpp(monkeypatch):
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "llamacpp_available", lambda: True)


def test_auto_picks_llamacpp_for_gguf_and_the_default_pair_on_a_cpu(cpu_with_llamacpp, tmp_path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "hf"
    folder.mkdir()
    assert resolve_backend("auto") == "llamacpp"
    assert resolve_backend("auto", gguf) == "llamacpp"
    assert resolve_backend("auto", folder) == "torch"
    assert resolve_backend("auto", None, "float32") == "torch"  # a torch dtype asks for torch
    assert resolve_backend("torch", gguf) == "torch" and resolve_backend("llamacpp", folder) == "llamacpp"


def test_auto_picks_torch_on_a_gpu_or_without_llama_cpp(monkeypatch) -> None:
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == "torch"
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "llamacpp_available", lambda: False)
    assert resolve_backend("auto") == "torch"


def test_a_bad_backend_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("onnx")


def test_the_default_proposer_follows_the_backend_and_a_named_draft() -> None:
    assert default_proposer("llamacpp") == ("prompt_lookup", {"min_ngram": 3, "max_ngram": 8})
    assert default_proposer("torch") == ("draft_model", {})
    assert default_proposer("llamacpp", draft="d.gguf") == ("draft_model", {})


def test_llamacpp_options_are_checked_and_pick_the_invariant_pass() -> None:
    from specdecode.models.llamacpp.model import INVARIANT_TOKENS, LlamaCppOptions

    assert LlamaCppOptions(repack=True).invariant_tokens == INVARIANT_TOKENS[True] == 3
    assert LlamaCppOptions(repack=False).invariant_tokens == INVARIANT_TOKENS[False] == 7
    with pytest.raises(ValueError, match="threads"):
        LlamaCppOptions(threads=0)
    with pytest.raises(ValueError, match="n_ctx"):
        LlamaCppOptions(n_ctx=0)


def test_a_proposer_llamacpp_cannot_serve_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="'early_exit' is not available on the llamacpp backend"):
        SpeculativeGenerator.from_pretrained(backend="llamacpp", proposer="early_exit")


def test_cli_rejects_bad_threads_and_torch_only_bench_methods(capsys) -> None:
    assert main(["generate", "hi", "--backend", "llamacpp", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
    assert main(["bench", "--backend", "llamacpp", "--methods", "target,hf_generate", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "hf_generate" in err and "llamacpp backend" in err


def test_an_option_of_several_proposers_gets_each_ones_help() -> None:
    from specdecode.commands.main import build_parser

    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    text = next(a.help for a in generate._actions if "--draft-quantization" in a.option_strings)
    assert "draft_model: auto" in text and "early_exit: none" in text
    proposer = next(a for a in generate._actions if "--proposer" in a.option_strings)
    assert proposer.default == "auto" and "auto" in proposer.choices


def test_the_llamacpp_server_refuses_proposers_that_read_features_naming_both() -> None:
    """``specdecode serve --backend llamacpp``: its batched runner returns no hidden states, so EAGLE
    and Medusa (which ``generate`` runs on llama.cpp) are refused before any model loads."""
    from specdecode.load import ModelSource, load_server_models
    from specdecode.models.llamacpp.batch import LlamaCppBatchedRunner

    assert LlamaCppBatchedRunner.capabilities.returns_hidden is False
    for name in ("eagle", "medusa"):
        with pytest.raises(ValueError, match=f"--proposer {name}: the llamacpp server's batched runner"):
            load_server_models(ModelSource(backend="llamacpp"), name)


# ------------------------------------------------------------------ a CUDA build of llama.cpp
@pytest.fixture
def gpu_with_llamacpp(monkeypatch, tmp_path):
    """A CUDA GPU, llama-cpp-python installed, a smoke test that passes (no child is started)."""
    from specdecode.models.llamacpp import check

    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "llamacpp_available", lambda: True)
    monkeypatch.setattr(check, "check_llamacpp", lambda gguf, fresh=False: check.CheckResult(True, "", False))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def test_auto_runs_a_gguf_on_llamacpp_on_a_gpu_where_the_build_offloads(gpu_with_llamacpp, monkeypatch, tmp_path):
    monkeypatch.setattr(backends, "llamacpp_gpu_offload", lambda: True)
    folder = tmp_path / "hf"
    folder.mkdir()
    chosen, reason = backends.explain_backend("auto", gpu_with_llamacpp)
    assert chosen == "llamacpp" and "CUDA GPU" in reason and "every layer on the GPU" in reason
    assert resolve_backend("auto", folder) == "torch"  # a Hugging Face folder still runs on torch
    assert resolve_backend("auto", gpu_with_llamacpp, "bfloat16") == "torch"  # a torch dtype asks for torch
    from specdecode.models.llamacpp.model import LlamaCppOptions

    assert LlamaCppOptions().gpu_layers == -1  # every layer offloaded (999 where the build offloads)


def test_auto_keeps_torch_on_a_gpu_with_a_cpu_build(gpu_with_llamacpp, monkeypatch):
    monkeypatch.setattr(backends, "llamacpp_gpu_offload", lambda: False)
    chosen, reason = backends.explain_backend("auto", gpu_with_llamacpp)
    assert chosen == "torch" and "CPU-only" in reason
    assert resolve_backend("auto") == "torch"


def test_gpu_offload_reads_the_record_before_loading_the_library(monkeypatch, tmp_path):
    from specdecode.models.llamacpp import build, model

    class Lib:
        @staticmethod
        def llama_supports_gpu_offload() -> bool:
            return True

    def no_library():
        raise AssertionError("a CPU build's record: the library is not loaded")

    monkeypatch.setattr(build.sys, "prefix", str(tmp_path))
    (tmp_path / build.RECORD_NAME).write_text('{"flavour": "native", "cmake_args": ["-DGGML_LLAMAFILE=OFF"]}')
    monkeypatch.setattr(model, "_lib", no_library)
    assert backends.llamacpp_gpu_offload() is False
    (tmp_path / build.RECORD_NAME).write_text('{"flavour": "cuda", "backend": "cuda", "cmake_args": []}')
    monkeypatch.setattr(model, "_lib", lambda: Lib)
    assert backends.llamacpp_gpu_offload() is True
    (tmp_path / build.RECORD_NAME).unlink()  # a build the set-up did not make: the library says
    assert backends.llamacpp_gpu_offload() is True
    monkeypatch.setattr(model, "_lib", lambda: (_ for _ in ()).throw(OSError("no libllama.so")))
    assert backends.llamacpp_gpu_offload() is False
