"""A llama.cpp build never carries its own C++ runtime: where the compiler would link libstdc++
statically (no ``libstdc++.so`` development link), the set-up points the linker at the shared
runtime, and a build whose libraries embed one is named (lab/results/issue42-h100/llamacpp-crash.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.models.llamacpp import build

AMD = {"model": "AMD EPYC", "flags": ["avx2", "avx512f"], "machine": "x86_64"}


def fake_compiler(tmp_path: Path, dev_link: bool, runtime: Path) -> Path:
    """A ``c++`` that answers ``-print-file-name`` as GCC does: the path where it finds the file,
    else the bare name (``dev_link``: whether it finds ``libstdc++.so``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    dev = tmp_path / "gcc" / "libstdc++.so"
    if dev_link:
        dev.parent.mkdir(parents=True, exist_ok=True)
        dev.symlink_to(runtime)
    script = tmp_path / "fake-c++"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  -print-file-name=libstdc++.so) {"echo " + str(dev) if dev_link else "echo libstdc++.so"} ;;\n'
        f"  -print-file-name=libstdc++.so.6) echo {runtime} ;;\n"
        '  --version) echo "g++ (fake) 13.3.0" ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return script


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    path = tmp_path / "sys" / "libstdc++.so.6"
    path.parent.mkdir()
    path.write_bytes(b"\x7fELF")
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux linker layout")
def test_a_compiler_without_the_dev_link_gets_the_shared_runtime_on_its_link_path(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, dev_link=False, runtime=runtime)))
    folder = build.libstdcxx_link_dir()
    assert folder == tmp_path / "cache" / "libstdcxx-link"
    assert (folder / "libstdc++.so").resolve() == runtime.resolve()
    assert build.libstdcxx_link_dir() == folder  # idempotent
    args = build.cmake_args("native", "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-O1", AMD)
    assert f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-O1 -L{folder}" in args  # merged into the user's value
    for var in ("CMAKE_MODULE_LINKER_FLAGS", "CMAKE_EXE_LINKER_FLAGS"):
        assert f"-D{var}=-L{folder}" in args
    assert not any("-L" in a for a in args if "C_FLAGS" in a or "CXX_FLAGS" in a)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux linker layout")
def test_the_compiler_asked_is_the_argument_then_cxx(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path / "a", dev_link=True, runtime=runtime)))
    assert build.libstdcxx_link_dir() is None
    static_default = fake_compiler(tmp_path / "b", dev_link=False, runtime=runtime)
    assert build.libstdcxx_link_dir(str(static_default)) == tmp_path / "cache" / "libstdcxx-link"


def test_ldconfig_gives_the_64_bit_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = (
        "1234 libs found in cache `/etc/ld.so.cache'\n"
        "\tlibstdc++.so.6 (libc6) => /usr/lib32/libstdc++.so.6\n"
        "\tlibstdc++.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libstdc++.so.6\n"
        "\tlibstdc++fs.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libstdc++fs.so.1\n"
    )

    class Done:
        stdout = listing

    monkeypatch.setattr(build.subprocess, "run", lambda *args, **kwargs: Done())
    assert build._ldconfig_path("libstdc++.so.6") == "/lib/x86_64-linux-gnu/libstdc++.so.6"
    assert build._ldconfig_path("libfoo.so.1") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux linker layout")
def test_a_compiler_with_the_dev_link_changes_nothing(
    tmp_path: Path, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(fake_compiler(tmp_path, dev_link=True, runtime=runtime)))
    assert build.libstdcxx_link_dir() is None
    assert not any("LINKER_FLAGS" in a for a in build.cmake_args("native", "", AMD))  # the build key stays
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("readelf") is None, reason="needs g++ and readelf"
)
def test_a_library_that_embeds_libstdcxx_is_named(tmp_path: Path) -> None:
    source = tmp_path / "t.cpp"
    source.write_text('#include <sstream>\nextern "C" int f() { std::stringstream s; s << 28; return 0; }\n')
    shared, static = tmp_path / "libllama.so", tmp_path / "libggml-base.so"
    subprocess.run(["g++", "-O0", "-fPIC", "-shared", str(source), "-o", str(shared)], check=True)
    subprocess.run(
        ["g++", "-O0", "-fPIC", "-shared", "-static-libstdc++", "-static-libgcc", str(source), "-o", str(static)],
        check=True,
    )
    (tmp_path / "libmtmd.so").write_bytes(static.read_bytes())  # not one of the libraries looked at
    assert build.embedded_libstdcxx(tmp_path) == ["libggml-base.so"]


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("readelf") is None, reason="needs g++ and readelf"
)
def test_doctor_names_libraries_that_embed_libstdcxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "t.cpp"
    source.write_text('extern "C" int f() { return 0; }\n#include <string>\nstd::string g() { return "x"; }\n')
    lib = tmp_path / "lib"
    lib.mkdir()
    subprocess.run(["g++", "-fPIC", "-shared", str(source), "-o", str(lib / "libllama.so")], check=True)
    monkeypatch.setattr(build, "installed_lib_dir", lambda: lib)
    assert build.cxx_runtime_line() == "llama.cpp C++ runtime: the shared libstdc++.so.6"
    subprocess.run(
        ["g++", "-fPIC", "-shared", "-static-libstdc++", str(source), "-o", str(lib / "libggml-cuda.so")], check=True
    )
    line = build.cxx_runtime_line()
    assert "WARNING: libggml-cuda.so embed their own libstdc++" in line and "scripts/setup.sh" in line
    monkeypatch.setattr(build, "installed_lib_dir", lambda: None)
    assert build.cxx_runtime_line() == "llama.cpp C++ runtime: not installed"
