"""The llama.cpp build is keyed by what it was built for, and smoke-tested in a child process
before the user's process loads it: a crashing build falls back to torch (auto) or fails with a
clear error (--backend llamacpp), never a dead process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specdecode.models.llamacpp import build, check

AMD = {"model": "AMD EPYC", "flags": ["avx2", "avx512f"], "machine": "x86_64"}
INTEL_AMX = {"model": "Intel Xeon", "flags": ["avx2", "avx512f", "amx_tile", "amx_int8"], "machine": "x86_64"}


def test_native_x86_build_leaves_amx_out_and_keeps_the_users_cmake_args_first() -> None:
    args = build.cmake_args("native", "-DGGML_CUDA=on -DCMAKE_C_FLAGS=-O3", INTEL_AMX)
    assert args[0] == "-DGGML_CUDA=on"
    assert "-DGGML_LLAMAFILE=OFF" in args
    assert "-DCMAKE_C_FLAGS=-O3 -mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in args  # merged, not repeated
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in args
    assert not any("GGML_NATIVE=OFF" in a for a in args)  # -march=native keeps every other instruction set


def test_a_user_amx_setting_is_respected_and_arm_gets_no_x86_flags() -> None:
    assert not any("amx" in a for a in build.cmake_args("native", "-DGGML_AMX_INT8=ON", INTEL_AMX)[1:] if "FLAGS" in a)
    arm = build.cmake_args("native", "", {"model": "", "flags": ["neon"], "machine": "aarch64"})
    assert arm == ["-DGGML_LLAMAFILE=OFF"]


def test_portable_build_is_x86_64_v3_without_native() -> None:
    args = build.cmake_args("portable", "", AMD)
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_FMA=ON" in args
    assert any("-mno-amx-int8" in a for a in args)
    no_avx2 = build.cmake_args("portable", "", {"model": "", "flags": ["sse4_2"], "machine": "x86_64"})
    assert "-DGGML_NATIVE=OFF" in no_avx2 and "-DGGML_AVX2=ON" not in no_avx2
    with pytest.raises(ValueError, match="flavour"):
        build.cmake_args("fastest", "", AMD)


def test_the_key_changes_with_cmake_args_cpu_compiler_and_flavour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "compiler_version", lambda: "g++ 12.2")
    monkeypatch.setattr(build, "cpu_info", lambda: dict(AMD))
    base = build.build_key(build.build_spec("native", ""))
    assert build.build_key(build.build_spec("native", "")) == base  # stable
    assert build.build_key(build.build_spec("native", "-DGGML_CUDA=on")) != base  # pip's cache missed this
    assert build.build_key(build.build_spec("portable", "")) != base
    monkeypatch.setattr(build, "cpu_info", lambda: dict(INTEL_AMX))
    assert build.build_key(build.build_spec("native", "")) != base  # a wheel for another CPU is not reused
    monkeypatch.setattr(build, "cpu_info", lambda: dict(AMD))
    monkeypatch.setattr(build, "compiler_version", lambda: "g++ 13.3")
    assert build.build_key(build.build_spec("native", "")) != base


def test_a_build_marked_failed_makes_auto_choose_portable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(build, "gpu_compute_capability", lambda: None)  # this machine's GPU, if any
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(build.sys, "prefix", str(tmp_path))
    assert build.choose_flavour() == "native"
    assert build.mark_failed() is None  # nothing installed by the set-up: nothing to mark
    native = build.build_key(build.build_spec("native"))
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({"key": native, "flavour": "native"}))
    assert build.mark_failed() == native
    assert build.choose_flavour() == "portable"


def test_the_setup_installs_the_keyed_build_and_smoke_tests_it() -> None:
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    assert "models/llamacpp/build.py install" in setup
    assert 'pip install -q "llama-cpp-python' not in setup  # no unkeyed install from pip's cache
    assert setup.count("specdecode doctor --check") == 1  # in a loop: cuda, native, portable
    assert "build.py mark-failed" in setup and "build.py flavour" in setup


# ------------------------------------------------------------------ the smoke test


def crashing_command(gguf: Path) -> list[str]:
    """A child that dies as the AMX build did: a segmentation fault, after saying what it was doing."""
    code = "import os, signal; print('phase: decoding', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"
    return [sys.executable, "-c", code]


@pytest.fixture
def fake_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``.gguf`` path (never loaded: the child is replaced) and a private cache."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_a_crashing_child_is_reported_with_its_signal_and_phase(fake_gguf: Path, monkeypatch) -> None:
    monkeypatch.setattr(check, "check_command", crashing_command)
    result = check.check_llamacpp(fake_gguf)
    assert not result.ok and result.crashed and not result.cached
    assert result.reason == "the process was killed by SIGSEGV while decoding"
    again = check.check_llamacpp(fake_gguf)  # once per build and file: cached
    assert again.cached and again.reason == result.reason


def test_auto_falls_back_to_torch_with_one_line_on_stderr(
    fake_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specdecode.models import backends

    monkeypatch.setattr(check, "check_command", crashing_command)
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    assert backends.resolve_backend("auto", fake_gguf) == "torch"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama.cpp failed its smoke test" in err[0] and "SIGSEGV" in err[0] and "torch" in err[0]
    assert backends.resolve_backend("llamacpp", fake_gguf) == "llamacpp"  # asked for: no check here, ...
    with pytest.raises(check.LlamaCppUnusableError, match="SIGSEGV.*scripts/setup.sh"):
        backends.load_llamacpp(fake_gguf, "target")  # ... but loading refuses with the reason


def test_a_hanging_child_times_out(fake_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "check_command", lambda gguf: [sys.executable, "-c", "import time; time.sleep(30)"])
    result = check.run_check(fake_gguf, timeout=1.0)
    assert not result.ok and result.reason == "no answer after 1 s"


def test_a_failing_child_names_its_last_error_and_is_no_crash(fake_gguf: Path, monkeypatch) -> None:
    """A file llama.cpp refuses (a Python exception in the child) keeps llama.cpp: loading it in
    this process raises the same error, as an exception; only a crash or a hang falls back."""
    from specdecode.models import backends

    code = "import sys; print('phase: loading the model', flush=True); sys.exit('bad magic in model.gguf')"
    monkeypatch.setattr(check, "check_command", lambda gguf: [sys.executable, "-c", code])
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    result = check.run_check(fake_gguf)
    assert result.reason == "the process exited with status 1 while loading the model: bad magic in model.gguf"
    assert not result.ok and not result.crashed and check.usable(result)
    assert backends.resolve_backend("auto", fake_gguf) == "llamacpp"


def test_the_real_build_passes_on_the_default_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed build decodes the default target in a child (a few seconds)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    from specdecode.models.backends import target_gguf

    gguf = target_gguf(None)
    if gguf is None:
        pytest.skip("default models not installed")
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))  # a fresh cache: the check runs now
    result = check.check_llamacpp(gguf)
    assert result.ok, result.reason + "\n" + result.output_tail
    assert "CPU" in result.system_info and not result.cached


def test_doctor_reports_machine_build_check_and_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from specdecode.commands.main import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "cores: " in out and "cpu flags: " in out
    assert "llama.cpp" in out
    if build.installed_record() is not None:  # the set-up's build: with the batch-invariance patch
        assert "llama.cpp batch-invariance patch: in (" in out
    assert "--backend auto: " in out.splitlines()[-2]
    assert out.splitlines()[-1].startswith("--device auto (torch): ")


def test_doctor_says_where_torch_runs(monkeypatch) -> None:
    from specdecode.commands.doctor import torch_device_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch_device_line().startswith("--device auto (torch): cpu, --dtype auto = ")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    line = torch_device_line()
    assert line.startswith("--device auto (torch): cuda:0, --dtype auto = bfloat16, static KV cache and CUDA graphs")


def test_a_later_setup_keeps_the_cmake_args_of_the_installed_build(tmp_path: Path, monkeypatch) -> None:
    """`CMAKE_ARGS=-DGGML_CUDA=on bash scripts/setup.sh`, then `bash scripts/demo.sh` (no CMAKE_ARGS):
    the CUDA build stays; a CMAKE_ARGS given again wins."""
    monkeypatch.setattr(build.sys, "prefix", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    assert build.build_spec("native")["user_cmake_args"] == ""
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({"key": "x", "user_cmake_args": "-DGGML_CUDA=on"}))
    assert build.build_spec("native")["cmake_args"][0] == "-DGGML_CUDA=on"
    monkeypatch.setenv("CMAKE_ARGS", "")
    assert "-DGGML_CUDA=on" not in build.build_spec("native")["cmake_args"]


# ------------------------------------------------------------------ the CUDA flavour
def _machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, nvcc: bool, gpu: str | None) -> None:
    """A machine with or without nvcc and an NVIDIA GPU (``gpu``: nvidia-smi's compute_cap output)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build.sys, "prefix", str(tmp_path))
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.delenv(build.CUDA_OPT_OUT, raising=False)
    monkeypatch.delenv(build.AMX_OPT_IN, raising=False)
    monkeypatch.setattr(build, "cpu_info", lambda: dict(AMD))
    monkeypatch.setattr(build, "compiler_version", lambda: "g++ 13.3")
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/local/bin/nvcc" if nvcc else None)
    monkeypatch.setattr(build, "nvcc_version", lambda nvcc=None: "cuda_13.0")
    monkeypatch.setattr(build, "libstdcxx_link_dir", lambda cxx=None: None)  # test_llamacpp_libstdcxx.py
    monkeypatch.setattr(build, "_warn_if_embedded_libstdcxx", lambda: None)
    monkeypatch.setattr(build, "cxx_runtime_line", lambda: "llama.cpp C++ runtime: (not read in these tests)")

    class Smi:
        returncode, stdout = (0, gpu) if gpu is not None else (9, "")

    def fake_run(args: list[str], **kwargs: object) -> Smi:
        if args[0] != "nvidia-smi":
            raise AssertionError(args)
        if gpu is None:
            raise FileNotFoundError("nvidia-smi")
        return Smi()

    monkeypatch.setattr(build.subprocess, "run", fake_run)


def test_nvcc_without_a_gpu_builds_for_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, tmp_path, nvcc=True, gpu=None)
    assert build.gpu_compute_capability() is None
    arch, why = build.cuda_target()
    assert arch is None and "no NVIDIA GPU" in why
    assert build.choose_flavour() == "native"
    _machine(monkeypatch, tmp_path, nvcc=False, gpu="9.0\n")
    assert build.cuda_target()[0] is None and build.choose_flavour() == "native"


def test_nvcc_and_a_gpu_build_cuda_for_that_architecture_under_another_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="9.0\n")
    assert build.gpu_compute_capability() == "90"
    assert build.choose_flavour() == "cuda"
    spec = build.build_spec("cuda")
    native = build.build_spec("native")
    assert spec["cuda_arch"] == "90" and spec["backend"] == "cuda" and "backend" not in native
    for arg in ("-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA=OFF"):
        assert arg in spec["cmake_args"] and arg not in native["cmake_args"]
    assert [a for a in spec["cmake_args"] if "CUDA" not in a] == native["cmake_args"]  # the CPU's, plus CUDA
    assert build.build_key(spec) != build.build_key(native)
    assert build.build_key(build.build_spec("cuda", cuda_arch="89")) != build.build_key(spec)
    assert build.build_backend({**spec, "key": "k"}) == "cuda" and build.build_backend(native) == "cpu"
    assert build.build_backend({"cmake_args": ["-DGGML_CUDA=ON"]}) == "cuda"  # a user's CUDA build
    assert build.build_backend(None) == "unknown"
    # two cards of different architectures: both; none parsable: no GPU
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="8.9\n9.0\n8.9\n")
    assert build.gpu_compute_capability() == "89;90"
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="No devices were found\n")
    assert build.gpu_compute_capability() is None and build.choose_flavour() == "native"
    with pytest.raises(ValueError, match="NVIDIA GPU"):
        build.build_spec("cuda")


def test_the_users_cmake_args_and_the_opt_out_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="9.0")
    monkeypatch.setenv(build.CUDA_OPT_OUT, "0")
    assert build.choose_flavour() == "native"
    monkeypatch.delenv(build.CUDA_OPT_OUT)
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=off")
    assert build.choose_flavour() == "native"  # the user decides about CUDA
    args = build.cmake_args("cuda", "-DCMAKE_CUDA_ARCHITECTURES=90a", AMD, "90")
    assert args[0] == "-DCMAKE_CUDA_ARCHITECTURES=90a" and "-DCMAKE_CUDA_ARCHITECTURES=90" not in args
    assert "-DGGML_CUDA=on" in args
    with pytest.raises(ValueError):
        build.cuda_cmake_args("9.0")


def test_a_cuda_build_that_fails_to_compile_falls_back_to_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="9.0")
    built: list[str] = []

    def fake_build(spec: dict, key: str) -> Path:
        built.append(spec["flavour"])
        if spec["flavour"] == "cuda":
            raise build.subprocess.CalledProcessError(1, ["pip", "wheel"])
        folder = build.build_folder(key)
        folder.mkdir(parents=True)
        wheel = folder / "llama_cpp_python-0.3.36-cp312-cp312-linux_x86_64.whl"
        wheel.write_bytes(b"")
        return wheel

    monkeypatch.setattr(build, "_build_wheel", fake_build)
    monkeypatch.setattr(build, "_pip", lambda *args, env=None: None)
    record = build.install()
    assert built == ["cuda", "native"] and record["flavour"] == "native"
    assert "FAILED to compile" in capsys.readouterr().err
    assert build.choose_flavour() == "native"  # marked: not tried again
    assert build.installed_record()["key"] == record["key"]
    with pytest.raises(build.subprocess.CalledProcessError):  # asked for by name: no fallback
        build.install("cuda", force=True)


def test_a_cuda_build_that_fails_its_smoke_test_is_skipped_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/setup.sh: smoke test fails -> ``mark-failed`` (the installed cuda build) -> ``install``."""
    _machine(monkeypatch, tmp_path, nvcc=True, gpu="9.0")
    spec = build.build_spec("cuda")
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({**spec, "key": build.build_key(spec)}))
    assert build.choose_flavour() == "cuda"
    assert build.mark_failed() == build.build_key(spec)
    assert build.choose_flavour() == "native"


def test_the_check_reports_gpu_offload_and_doctor_the_builds_backend(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = f"print('system_info: CUDA : ARCHS = 900', flush=True); print('gpu_offload: 1'); print({check.OK_LINE!r})"
    monkeypatch.setattr(check, "check_command", lambda gguf: [sys.executable, "-c", code])
    result = check.run_check(fake_gguf)
    assert result.ok and result.gpu_offload is True and "CUDA" in result.system_info
    assert check.CheckResult(True, "").gpu_offload is None  # a cached result of an older check

    from specdecode.commands import doctor

    _machine(monkeypatch, tmp_path, nvcc=True, gpu="9.0")
    spec = build.build_spec("cuda")
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({**spec, "key": build.build_key(spec)}))
    lines = doctor.build_lines()
    assert "llama.cpp backend: cuda, CUDA architecture 90" in lines and "built for this machine" in lines[0]
    _machine(monkeypatch, tmp_path, nvcc=True, gpu=None)  # the same record on a machine without a GPU
    lines = doctor.build_lines()
    assert "not for this machine" in lines[0] and "llama.cpp backend: cuda, CUDA architecture 90" in lines


def test_the_amx_build_only_when_asked_for_on_a_cpu_with_amx_and_native_after_it_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SPECDECODE_LLAMA_AMX=1`` on a CPU with AMX: the ``amx`` flavour first (ggml's AMX kernels in,
    no -mno-amx-*), under its own key; marked failed (its smoke test died), ``native`` with AMX out."""
    _machine(monkeypatch, tmp_path, nvcc=False, gpu=None)
    monkeypatch.setattr(build, "cpu_info", lambda: dict(INTEL_AMX))
    assert build.choose_flavour() == "native"  # not asked for
    assert "not asked for" in build.amx_target()[1]
    monkeypatch.setenv(build.AMX_OPT_IN, "1")
    assert build.amx_target()[0] and build.choose_flavour() == "amx"
    amx, native = build.build_spec("amx"), build.build_spec("native")
    assert "-DGGML_AMX_INT8=ON" in amx["cmake_args"] and not any("-mno-amx" in a for a in amx["cmake_args"])
    assert any("-mno-amx-int8" in a for a in native["cmake_args"]) and "-DGGML_AMX_INT8=ON" not in native["cmake_args"]
    assert build.build_key(amx) != build.build_key(native)
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({"key": build.build_key(amx), "flavour": "amx"}))
    assert build.mark_failed() == build.build_key(amx)
    assert build.choose_flavour() == "native"
    monkeypatch.setattr(build, "cpu_info", lambda: dict(AMD))  # asked for, but no AMX here
    ok, why = build.amx_target()
    assert not ok and "amx_tile" in why and build.choose_flavour() == "native"


def test_doctor_says_where_amx_could_be_built_and_warns_of_a_passive_openmp_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specdecode.commands import doctor

    _machine(monkeypatch, tmp_path, nvcc=False, gpu=None)
    spec = build.build_spec("native")
    (tmp_path / build.RECORD_NAME).write_text(json.dumps({**spec, "key": build.build_key(spec)}))
    assert not any("AMX" in line for line in doctor.build_lines())  # an AMD CPU: nothing to say
    monkeypatch.setattr(build, "cpu_info", lambda: dict(INTEL_AMX))
    assert any("AMX kernels: left out" in line and build.AMX_OPT_IN in line for line in doctor.build_lines())
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert doctor.openmp_line() is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY=PASSIVE" in doctor.openmp_line()
    assert doctor.openmp_line() in doctor.machine_lines()
