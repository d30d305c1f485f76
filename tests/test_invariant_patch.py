"""specdecode's batch-invariance patch of llama.cpp's CPU backend (``models/llamacpp/invariant_patch.py``):
all edits or none, a clear error where the source does not fit, and a build key that follows the
patch. That the built patch is invariant is tested on the real build (``test_llamacpp.py``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specdecode.models.llamacpp import build, invariant_patch


def _fake_source(root: Path) -> dict[Path, str]:
    """A source tree holding every edit's anchor once, with text around it."""
    texts: dict[Path, str] = {}
    for edit in invariant_patch.edits():
        texts[root / edit.path] = texts.get(root / edit.path, "") + f"before\n{edit.anchor}\nafter\n"
    for path, text in texts.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return texts


def test_every_edit_lands_at_its_anchor(tmp_path: Path) -> None:
    _fake_source(tmp_path)
    invariant_patch.apply(tmp_path)
    for edit in invariant_patch.edits():
        text = (tmp_path / edit.path).read_text()
        assert text.count(edit.text) == 1, edit.path
        if edit.replace:
            assert edit.anchor not in text
        elif edit.after:
            assert edit.anchor + edit.text in text
        else:
            assert edit.text + edit.anchor in text
    kernel = (tmp_path / invariant_patch.GGML_CPU / "arch/x86/repack.cpp").read_text()
    assert "void ggml_gemv_rows_q4_K_8x8_q8_K(" in kernel
    quants = (tmp_path / invariant_patch.GGML_CPU / "arch/x86/quants.c").read_text()
    assert "void ggml_vec_dot_rows_q6_K_q8_K(" in quants
    mul_mat = (tmp_path / invariant_patch.GGML_CPU / "ggml-cpu.c").read_text()
    assert "ggml_vec_dot_rows_q6_K_q8_K(ne00" in mul_mat and "params->use_ref && type == GGML_TYPE_Q6_K" in mul_mat
    assert invariant_patch.MARKER in (tmp_path / invariant_patch.GGML_CPU / "ggml-cpu.cpp").read_text()


@pytest.mark.parametrize("damage", ["missing", "twice"])
def test_a_source_that_does_not_fit_changes_nothing(tmp_path: Path, damage: str) -> None:
    texts = _fake_source(tmp_path)
    last = invariant_patch.edits()[-1]
    path = tmp_path / last.path
    texts[path] = texts[path].replace(last.anchor, "" if damage == "missing" else last.anchor * 2)
    path.write_text(texts[path])
    with pytest.raises(invariant_patch.PatchError, match="found (0|2) times in .*ggml-cpu.cpp"):
        invariant_patch.apply(tmp_path)
    assert {p: p.read_text() for p in texts} == texts  # no file written


def test_a_tree_without_ggml_is_refused(tmp_path: Path) -> None:
    with pytest.raises(invariant_patch.PatchError, match="repack.h not in"):
        invariant_patch.apply(tmp_path)


def test_the_build_key_follows_the_patch_and_its_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    patched = build.build_spec("native", "")
    assert patched["invariant_patch"] == invariant_patch.fingerprint()
    monkeypatch.setenv(build.PATCH_OPT_OUT, "0")
    plain = build.build_spec("native", "")
    assert plain["invariant_patch"] is False
    assert build.build_key(plain) != build.build_key(patched)  # a patched wheel is never reused unpatched


def test_an_exact_cpu_model_verifies_wide_passes_only_on_a_patched_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """``options_for_build``: the patch's width where the build answers the marker, in exact mode on
    the CPU with the reference kernels (flash attention not forced off) and ``invariant_tokens`` left
    to specdecode; anything else unchanged."""
    from specdecode.models.llamacpp import kernels
    from specdecode.models.llamacpp.model import (
        INVARIANT_TOKENS,
        PATCHED_INVARIANT_TOKENS,
        LlamaCppOptions,
        options_for_build,
    )

    default = LlamaCppOptions()
    on_cpu = dataclasses.replace(default, gpu_layers=0)  # what specdecode.load makes of --device cpu
    for answer, width in ((invariant_patch.VERSION, PATCHED_INVARIANT_TOKENS), (0, INVARIANT_TOKENS[True])):
        monkeypatch.setattr(kernels, "invariant_rows", lambda answer=answer: answer)
        for options in (default, on_cpu):
            wide = options_for_build(options, on_gpu=False)
            assert wide.invariant_tokens == width and not wide.invariant_tokens_given
    monkeypatch.setattr(kernels, "invariant_rows", lambda: invariant_patch.VERSION)
    for kept in (
        LlamaCppOptions(invariant_tokens=5),
        LlamaCppOptions(exact=False),
        LlamaCppOptions(flash_attn=False),
    ):
        assert options_for_build(kept, on_gpu=False) is kept
    assert options_for_build(default, on_gpu=True) is default


@pytest.mark.parametrize("fits", [True, False])
def test_the_build_records_whether_the_patch_went_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """``build._build_wheel`` downloads the sdist (faked here), patches and builds it; a source the
    patch does not fit is built as it is, and its build.json (the installed record's source) says
    ``invariant_patch: False``."""
    import json
    import tarfile

    source = tmp_path / "fake-src"
    texts = _fake_source(source)
    cpu = source / invariant_patch.GGML_CPU / "ggml-cpu.cpp"
    if not fits:  # another llama.cpp: the last anchor is gone
        cpu.write_text(texts[cpu].replace(invariant_patch.edits()[-1].anchor, ""))

    def fake_pip(*args: str, env: dict[str, str] | None = None) -> None:
        name = f"llama_cpp_python-{build.LLAMA_CPP_PYTHON}"
        if args[0] == "download":
            with tarfile.open(Path(args[args.index("-d") + 1]) / f"{name}.tar.gz", "w:gz") as tar:
                tar.add(source, arcname=name)
        elif args[0] == "wheel":
            patched = (Path(args[-1]) / invariant_patch.GGML_CPU / "ggml-cpu.cpp").read_text()
            assert (invariant_patch.MARKER in patched) == fits
            (Path(args[args.index("-w") + 1]) / f"{name}-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_pip", fake_pip)
    wheel = build._build_wheel(build.build_spec("native", ""), "k")
    record = json.loads((wheel.parent / "build.json").read_text())
    assert record["invariant_patch"] == (invariant_patch.fingerprint() if fits else False)
    assert not (wheel.parent / "src").exists()
