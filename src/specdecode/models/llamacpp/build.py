"""The llama.cpp build the set-up makes, keyed by what it was built for.

PyPI has llama-cpp-python's source only, so every machine compiles llama.cpp itself. Two things
went wrong with a plain ``pip install``:

- ``-march=native`` on an Intel CPU with AMX compiles in ggml's AMX kernels; the weights of a
  Q4_K_M model go to the AMX buffer type and the first matrix product crashes the process
  (llama.cpp issue #20824). The build here keeps ``-march=native`` and adds
  ``-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`` (:data:`NO_AMX_FLAGS`): without ``__AMX_INT8__``
  ggml compiles no AMX kernels; every other instruction set of the machine stays in. On a CPU
  without AMX the flags change nothing.
- pip keys its wheel cache on the source, not on ``CMAKE_ARGS`` or the CPU: a second install with
  ``-DGGML_CUDA=on``, or on another CPU where a cache travels, silently reused the first wheel.
  Here a wheel is built with pip's cache off and kept under a key of the version, the final CMake
  arguments, the CPU (model and flags), the machine, the compiler and the Python ABI
  (:func:`build_key`); another machine or backend gets another key and builds anew.

If the native build fails its smoke test (:mod:`specdecode.models.llamacpp.check`), the set-up
builds the ``portable`` flavour: ``GGML_NATIVE=OFF`` with the instruction sets llama.cpp's own
release builds use (AVX2, FMA, F16C on x86-64 CPUs that have them), AMX off.

Standard library only: ``scripts/setup.sh`` runs this file with the virtualenv's Python before
specdecode is installed (``python src/specdecode/models/llamacpp/build.py install``), and
``specdecode doctor`` imports it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
"""The llama-cpp-python release the set-up builds (pinned: the runner uses its low-level API)."""

BASE_CMAKE_ARGS = ("-DGGML_LLAMAFILE=OFF",)
"""Always passed: llamafile's sgemm off, so that short passes can be batch-invariant (docs/llamacpp.md)."""

NO_AMX_FLAGS = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
"""Compiler flags that keep ggml's AMX kernels out of a ``-march=native`` build (llama.cpp #20824)."""

PORTABLE_X86 = (
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON"
)  # fmt: skip
"""The ``portable`` flavour on an x86-64 CPU with AVX2 (x86-64-v3, as llama.cpp's ``haswell`` variant)."""

FLAVOURS = ("native", "portable")

FAILED_MARK = "FAILED"
"""A file in a build's folder: that build failed its smoke test on this machine (``mark-failed``);
``install --flavour auto`` then takes the portable build."""

RECORD_NAME = "specdecode-llama-build.json"
"""The record of the installed build, in the virtualenv's root (``sys.prefix``)."""


def cache_root() -> Path:
    """specdecode's on-disk cache: ``$SPECDECODE_CACHE``, else ``$XDG_CACHE_HOME/specdecode``, else
    ``~/.cache/specdecode`` (:func:`specdecode.models.default.cache_dir` is this)."""
    if env := os.environ.get("SPECDECODE_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def cpu_info() -> dict[str, Any]:
    """The CPU: ``{"model": str, "flags": sorted list of str, "machine": str}`` (Linux: /proc/cpuinfo;
    elsewhere the platform's processor string and no flags)."""
    model, flags = "", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:  # x86 / Arm; the first core's
                flags = set(value.split())
    if not model and sys.platform == "darwin":
        try:
            model = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except OSError:
            pass
    return {"model": model or platform.processor(), "flags": sorted(flags), "machine": platform.machine()}


def compiler_version() -> str:
    """The first line of ``$CXX --version`` (``c++`` by default), or ``"unknown"``."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0].strip() if out else "unknown"


def _add_compiler_flags(args: list[str], flags: tuple[str, ...]) -> list[str]:
    """``args`` with ``flags`` appended to ``CMAKE_C_FLAGS`` and ``CMAKE_CXX_FLAGS`` (merged into a
    value the user set, else added)."""
    out, seen = [], set()
    for arg in args:
        for var in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
            for prefix in (f"-D{var}=", f"-D{var}:STRING="):
                if arg.startswith(prefix):
                    arg = prefix + " ".join([arg[len(prefix) :].strip(), *flags]).strip()
                    seen.add(var)
        out.append(arg)
    for var in ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS"):
        if var not in seen:
            out.append(f"-D{var}={' '.join(flags)}")
    return out


def cmake_args(flavour: str = "native", user: str | None = None, cpu: dict[str, Any] | None = None) -> list[str]:
    """The CMake arguments of a build: the user's ``CMAKE_ARGS`` (``user``; default from the
    environment) first, then :data:`BASE_CMAKE_ARGS`, then the flavour's flags. On x86-64 with GCC
    or Clang, AMX is kept out (:data:`NO_AMX_FLAGS`) unless the user names a ``GGML_AMX`` setting.

    Raises:
        ValueError: ``flavour`` is not one of :data:`FLAVOURS`.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {list(FLAVOURS)}, got {flavour!r}")
    cpu = cpu or cpu_info()
    args = shlex.split(os.environ.get("CMAKE_ARGS", "") if user is None else user)
    args += [a for a in BASE_CMAKE_ARGS if a not in args]
    x86 = cpu["machine"].lower() in ("x86_64", "amd64", "i686", "x86")
    if flavour == "portable":
        if x86 and "avx2" in cpu["flags"]:
            args += [a for a in PORTABLE_X86 if a not in args]
        elif "-DGGML_NATIVE=OFF" not in args:
            args.append("-DGGML_NATIVE=OFF")
    if x86 and sys.platform != "win32" and not any("GGML_AMX" in a for a in args):
        args = _add_compiler_flags(args, NO_AMX_FLAGS)
    return args


def user_cmake_args() -> str:
    """The user's ``CMAKE_ARGS``: from the environment when set there, else those the installed
    build was made with (so a later ``bash scripts/setup.sh`` keeps a ``-DGGML_CUDA=on`` build)."""
    if "CMAKE_ARGS" in os.environ:
        return os.environ["CMAKE_ARGS"]
    return str((installed_record() or {}).get("user_cmake_args", ""))


def build_spec(flavour: str = "native", user: str | None = None) -> dict[str, Any]:
    """Everything a build depends on: version, flavour, CMake arguments (``user``: the user's,
    default :func:`user_cmake_args`), CPU, compiler, Python."""
    cpu = cpu_info()
    user = user_cmake_args() if user is None else user
    return {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "flavour": flavour,
        "user_cmake_args": user,
        "cmake_args": cmake_args(flavour, user, cpu),
        "cpu_model": cpu["model"],
        "cpu_flags": cpu["flags"],
        "machine": cpu["machine"],
        "compiler": compiler_version(),
        "python": f"{sys.implementation.name}{sys.version_info[0]}{sys.version_info[1]}",
        "platform": sys.platform,
    }


def build_key(spec: dict[str, Any]) -> str:
    """A 16-hex-digit key of :func:`build_spec`'s dict (a change of any field changes it)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def installed_record(prefix: str | Path | None = None) -> dict[str, Any] | None:
    """The record of the build installed in the virtualenv ``prefix`` (default ``sys.prefix``), or None."""
    path = Path(prefix or sys.prefix) / RECORD_NAME
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def build_folder(key: str) -> Path:
    """Where the wheel of build ``key`` is kept."""
    return cache_root() / "llama-cpp-builds" / key


def choose_flavour() -> str:
    """``native``, unless this machine's native build was marked failed (then ``portable``)."""
    return "portable" if (build_folder(build_key(build_spec("native"))) / FAILED_MARK).exists() else "native"


def mark_failed() -> str | None:
    """Mark the installed build as failed on this machine; returns its key (None: no record)."""
    record = installed_record()
    if record is None or not record.get("key"):
        return None
    folder = build_folder(str(record["key"]))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED_MARK).write_text("failed its smoke test on this machine (scripts/setup.sh)\n")
    return str(record["key"])


def install(flavour: str = "auto", force: bool = False) -> dict[str, Any]:
    """Install the llama.cpp build of ``flavour`` (``auto``: :func:`choose_flavour`) for this machine
    into the running Python's environment: nothing to do if the record says it is there; a wheel of
    the same key from the cache; else build one (pip's cache off) into ``<cache>/llama-cpp-builds/<key>/``. Returns the
    record (the spec plus ``key`` and ``wheel``).

    Raises:
        subprocess.CalledProcessError: pip failed (the compiler's output is above it).
    """
    flavour = choose_flavour() if flavour == "auto" else flavour
    spec = build_spec(flavour)
    key = build_key(spec)
    record = installed_record()
    if not force and record is not None and record.get("key") == key and _importable():
        print(f"llama.cpp: build {key} ({flavour}) already installed", flush=True)
        return record
    folder = build_folder(key)
    wheels = sorted(folder.glob("llama_cpp_python-*.whl")) if folder.exists() else []
    if not wheels:
        print(f"llama.cpp: building llama-cpp-python {LLAMA_CPP_PYTHON} ({flavour}, key {key}), "
              f"CMAKE_ARGS: {' '.join(spec['cmake_args'])} (a few minutes)", flush=True)
        tmp = folder.with_name(key + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        env = {**os.environ, "CMAKE_ARGS": " ".join(shlex.quote(a) for a in spec["cmake_args"])}
        _pip("wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary", "llama-cpp-python",
             "-w", str(tmp), f"llama-cpp-python=={LLAMA_CPP_PYTHON}", env=env)
        (tmp / "build.json").write_text(json.dumps({**spec, "key": key}, indent=1))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    else:
        print(f"llama.cpp: installing the cached build {key} ({flavour})", flush=True)
    _pip("install", "-q", "--force-reinstall", "--no-deps", str(wheels[-1]))
    _pip("install", "-q", str(wheels[-1]))  # its dependencies (numpy, diskcache, jinja2, ...)
    record = {**spec, "key": key, "wheel": str(wheels[-1])}
    (Path(sys.prefix) / RECORD_NAME).write_text(json.dumps(record, indent=1))
    return record


def _importable() -> bool:
    """Whether ``llama_cpp`` can be found (without loading its native library)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def main(argv: list[str] | None = None) -> int:
    """``python models/llamacpp/build.py install|key|spec|mark-failed [--flavour F] [--force]``."""
    parser = argparse.ArgumentParser(description="the keyed llama.cpp build of the set-up")
    parser.add_argument("action", choices=["install", "key", "spec", "mark-failed"])
    parser.add_argument("--flavour", choices=("auto", *FLAVOURS), default="auto")
    parser.add_argument("--force", action="store_true", help="install even if the record says it is there")
    args = parser.parse_args(argv)
    if args.action == "install":
        install(args.flavour, args.force)
    elif args.action == "mark-failed":
        print(f"llama.cpp: build {mark_failed()} marked as failed on this machine")
    else:
        spec = build_spec(choose_flavour() if args.flavour == "auto" else args.flavour)
        print(build_key(spec) if args.action == "key" else json.dumps(spec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
