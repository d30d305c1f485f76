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

Flavours, tried in this order by ``install`` (``--flavour auto``, :func:`choose_flavour`):

- ``cuda``, where BOTH a CUDA compiler is found (``nvcc``: :func:`find_nvcc`) AND an NVIDIA GPU
  answers ``nvidia-smi`` with its compute capability (:func:`gpu_compute_capability`; a machine
  with the CUDA toolkit but no GPU builds for its CPU): the native flavour's arguments plus
  :func:`cuda_cmake_args` (CUDA on, for the card's architecture only, which keeps the build short;
  flash-attention kernels not compiled: specdecode runs llama.cpp on a GPU with flash attention
  off). ``SPECDECODE_LLAMA_CUDA=0`` opts out; a user's ``CMAKE_ARGS`` naming ``GGML_CUDA`` decide
  by themselves. A CUDA build that fails to compile, or whose smoke test fails, is marked failed
  and the next flavour is built (``native``), with a message: never a dead set-up.
- ``amx``, only where the user opts in (``SPECDECODE_LLAMA_AMX=1``, :data:`AMX_OPT_IN`) on an x86-64
  CPU with AMX tiles and int8 (:func:`amx_target`): the native flavour with ggml's AMX kernels in
  (``-DGGML_AMX_INT8=ON``, no ``-mno-amx-*``). On the GPU machine's 16-core Xeon host they made
  passes of 9 and 17 tokens 1.3x and 1.55x cheaper (docs/benchmarks.md); they crash on other Xeons
  (above), so this build is never the default, and one whose smoke test fails is marked failed and
  ``native`` is built next.
- ``native``: ``-march=native``, AMX off (above).
- ``portable``, if the native build fails its smoke test (:mod:`specdecode.models.llamacpp.check`):
  ``GGML_NATIVE=OFF`` with the instruction sets llama.cpp's own release builds use (AVX2, FMA,
  F16C on x86-64 CPUs that have them), AMX off.

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
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

if __package__:
    from specdecode.models.llamacpp import invariant_patch
else:  # run as a script before specdecode is installed: this file's folder is on sys.path
    import invariant_patch  # type: ignore[no-redef]

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

FLAVOURS = ("cuda", "amx", "native", "portable")
"""In the order ``install --flavour auto`` tries them (a failed one is skipped on this machine)."""

CUDA_FLAGS = ("-DGGML_CUDA=on", "-DGGML_CUDA_FA=OFF")
"""CUDA on, its flash-attention kernels not compiled (``GGML_CUDA_FA``, llama.cpp's CMake option;
specdecode runs llama.cpp on a GPU with flash attention off, ``LlamaCppOptions.flash_attn``): a
shorter build. With :func:`cuda_cmake_args` the only definition of a CUDA build's arguments
(``lab/gpu/gpu_check.py`` uses it too)."""

PATCH_OPT_OUT = "SPECDECODE_LLAMA_PATCH"
"""``SPECDECODE_LLAMA_PATCH=0`` (or ``false``, ``no``, ``off``): build llama.cpp's source as it is,
without specdecode's batch-invariance patch (:mod:`invariant_patch`; exact mode then verifies in
chunks of 3 tokens)."""

AMX_OPT_IN = "SPECDECODE_LLAMA_AMX"
"""``SPECDECODE_LLAMA_AMX=1`` (or ``true``, ``yes``, ``on``): build the ``amx`` flavour first where the
CPU has AMX (:func:`amx_target`); off by default."""

AMX_CPU_FLAGS = ("amx_tile", "amx_int8")
"""The CPU flags (/proc/cpuinfo) ggml's AMX kernels for quantized weights need."""

AMX_CMAKE_ARGS = ("-DGGML_AMX_INT8=ON",)
"""The ``amx`` flavour's addition to the native one's arguments (it names ``GGML_AMX``, so no
:data:`NO_AMX_FLAGS` are added)."""

CUDA_OPT_OUT = "SPECDECODE_LLAMA_CUDA"
"""``SPECDECODE_LLAMA_CUDA=0`` (or ``false``, ``no``, ``off``): never build the ``cuda`` flavour."""

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


def _add_compiler_flags(
    args: list[str], flags: tuple[str, ...], variables: tuple[str, ...] = ("CMAKE_C_FLAGS", "CMAKE_CXX_FLAGS")
) -> list[str]:
    """``args`` with ``flags`` appended to each CMake variable of ``variables`` (default the C and C++
    compiler flags; merged into a value the user set, else added)."""
    out, seen = [], set()
    for arg in args:
        for var in variables:
            for prefix in (f"-D{var}=", f"-D{var}:STRING="):
                if arg.startswith(prefix):
                    arg = prefix + " ".join([arg[len(prefix) :].strip(), *flags]).strip()
                    seen.add(var)
        out.append(arg)
    for var in variables:
        if var not in seen:
            out.append(f"-D{var}={' '.join(flags)}")
    return out


LINKER_FLAG_VARIABLES = ("CMAKE_SHARED_LINKER_FLAGS", "CMAKE_MODULE_LINKER_FLAGS", "CMAKE_EXE_LINKER_FLAGS")
"""The CMake variables :func:`cmake_args` adds the shared-libstdc++ search folder to."""


def _print_file_name(cxx: str, name: str) -> str | None:
    """The absolute path ``cxx -print-file-name=<name>`` gives, if that file exists; else None
    (GCC and Clang print the bare name when their library search finds nothing)."""
    try:
        out = subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    path = out.stdout.strip()
    return path if out.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _ldconfig_path(soname: str) -> str | None:
    """Where ``ldconfig -p`` says the dynamic loader finds ``soname``, or None: the first 64-bit
    entry (a line such as ``libstdc++.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libstdc++.so.6``),
    else the first."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        entries = [
            (line.partition("(")[2].partition(")")[0], line.rsplit("=>", 1)[1].strip())
            for line in out.splitlines()
            if line.strip().startswith(soname + " ") and "=>" in line
        ]
        best = [path for tag, path in entries if "64" in tag] or [path for _, path in entries]
        if best:
            return best[0]
    return None


def libstdcxx_link_dir(cxx: str | None = None) -> Path | None:
    """A folder holding ``libstdc++.so`` (a link to the system's shared C++ runtime) for the linker,
    or None where the C++ compiler (``$CXX``, else ``c++``) finds the shared runtime itself (the usual
    case) or this is not Linux.

    Why: where a GCC installation lacks its ``libstdc++.so`` development link, ``g++`` silently links
    ``libstdc++.a`` into every shared library. llama.cpp then carries its own C++ runtime beside the
    system one that numpy (and so every specdecode process) loads; if the two come from different
    GCC releases, their locale facet indices disagree and llama.cpp segfaults at the first number it
    formats through a C++ stream (``print_info`` during the model load; GCC bug 67903, llama.cpp
    PR #22434). This was seen on the lent GPU machine's host (lab/results/issue42-h100/llamacpp-crash.md).
    Linking against the runtime the process loads anyway avoids the second copy.

    Creates ``<cache>/libstdcxx-link/libstdc++.so`` when it returns a folder (idempotent).
    """
    if not sys.platform.startswith("linux"):
        return None
    cxx = cxx or os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx or _print_file_name(cxx, "libstdc++.so") is not None:
        return None
    runtime = _print_file_name(cxx, "libstdc++.so.6") or _ldconfig_path("libstdc++.so.6")
    if runtime is None:
        return None
    folder = cache_root() / "libstdcxx-link"
    link = folder / "libstdc++.so"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (link.is_symlink() and os.readlink(link) == runtime):
            link.unlink(missing_ok=True)
            link.symlink_to(runtime)
    except OSError:
        return None
    return folder


def _defined(args: list[str]) -> set[str]:
    """The CMake variables ``args`` set (``-DNAME=value`` or ``-DNAME:TYPE=value``)."""
    return {a[2:].split("=", 1)[0].split(":", 1)[0] for a in args if a.startswith("-D") and "=" in a}


def cuda_cmake_args(arch: str) -> list[str]:
    """The CMake arguments that make a build a CUDA one: :data:`CUDA_FLAGS` and
    ``-DCMAKE_CUDA_ARCHITECTURES=<arch>``.

    Args:
        arch: CMake's CUDA architectures, e.g. ``"90"`` (an H100), or several joined by ``;``.

    Raises:
        ValueError: ``arch`` is not digits (with an optional ``a``/``f`` suffix), ``;``-separated.
    """
    if not re.fullmatch(r"\d+[af]?(;\d+[af]?)*", arch):
        raise ValueError(f"a CUDA architecture is digits such as '90' (';' between several), got {arch!r}")
    return [CUDA_FLAGS[0], f"-DCMAKE_CUDA_ARCHITECTURES={arch}", *CUDA_FLAGS[1:]]


def cmake_args(
    flavour: str = "native", user: str | None = None, cpu: dict[str, Any] | None = None, cuda_arch: str | None = None
) -> list[str]:
    """The CMake arguments of a build: the user's ``CMAKE_ARGS`` (``user``; default from the
    environment) first, then :data:`BASE_CMAKE_ARGS`, then the flavour's flags (``cuda``: the
    native flavour's and :func:`cuda_cmake_args` of ``cuda_arch``, less any variable the user set;
    ``amx``: the native flavour's and :data:`AMX_CMAKE_ARGS` unless the user set ``GGML_AMX``).
    On x86-64 with GCC or Clang, AMX is kept out (:data:`NO_AMX_FLAGS`) unless the user names a
    ``GGML_AMX`` setting. Where the compiler would link the C++ runtime statically,
    :func:`libstdcxx_link_dir`'s folder is added to the linker's search path (:data:`LINKER_FLAG_VARIABLES`).

    Raises:
        ValueError: ``flavour`` is not one of :data:`FLAVOURS`, or ``cuda`` without ``cuda_arch``.
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {list(FLAVOURS)}, got {flavour!r}")
    if flavour == "cuda" and not cuda_arch:
        raise ValueError("the cuda flavour needs a CUDA architecture (e.g. '90'): no NVIDIA GPU was found")
    cpu = cpu or cpu_info()
    args = shlex.split(os.environ.get("CMAKE_ARGS", "") if user is None else user)
    args += [a for a in BASE_CMAKE_ARGS if a not in args]
    if flavour == "cuda":
        user_vars = _defined(args)
        args += [a for a in cuda_cmake_args(str(cuda_arch)) if _defined([a]).isdisjoint(user_vars)]
    x86 = cpu["machine"].lower() in ("x86_64", "amd64", "i686", "x86")
    if flavour == "amx" and not any("GGML_AMX" in a for a in args):
        args += list(AMX_CMAKE_ARGS)
    if flavour == "portable":
        if x86 and "avx2" in cpu["flags"]:
            args += [a for a in PORTABLE_X86 if a not in args]
        elif "-DGGML_NATIVE=OFF" not in args:
            args.append("-DGGML_NATIVE=OFF")
    if x86 and sys.platform != "win32" and not any("GGML_AMX" in a for a in args):
        args = _add_compiler_flags(args, NO_AMX_FLAGS)
    if (link_dir := libstdcxx_link_dir()) is not None:  # the shared C++ runtime, never an embedded copy
        args = _add_compiler_flags(args, (f"-L{link_dir}",), LINKER_FLAG_VARIABLES)
    return args


def user_cmake_args() -> str:
    """The user's ``CMAKE_ARGS``: from the environment when set there, else those the installed
    build was made with (so a later ``bash scripts/setup.sh`` keeps a ``-DGGML_CUDA=on`` build)."""
    if "CMAKE_ARGS" in os.environ:
        return os.environ["CMAKE_ARGS"]
    return str((installed_record() or {}).get("user_cmake_args", ""))


def find_nvcc() -> str | None:
    """The CUDA compiler CMake would use: ``$CUDACXX``, else ``nvcc`` on the ``PATH``, else
    ``$CUDA_HOME``/``$CUDA_PATH``/``/usr/local/cuda``'s ``bin/nvcc``; None if there is none."""
    candidates = [os.environ.get("CUDACXX"), shutil.which("nvcc")]
    candidates += [
        os.path.join(root, "bin", "nvcc")
        for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
        if root
    ]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nvcc_version(nvcc: str | None = None) -> str:
    """The last line of ``nvcc --version`` (e.g. ``"Build cuda_13.0.r13.0/compiler..."``), or ``"unknown"``."""
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        return "unknown"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown"


def gpu_compute_capability() -> str | None:
    """The NVIDIA GPUs' compute capability as CMake's CUDA architecture (``"9.0"`` -> ``"90"``;
    distinct ones joined by ``;``), from ``nvidia-smi --query-gpu=compute_cap --format=csv,noheader``;
    None when ``nvidia-smi`` is missing, fails or prints no capability (no GPU, no driver)."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    caps = [m.group(1) + m.group(2) for m in re.finditer(r"^\s*(\d+)\.(\d)\s*$", proc.stdout, re.MULTILINE)]
    return ";".join(sorted(set(caps), key=int)) or None


def cuda_target() -> tuple[str | None, str]:
    """Whether ``install --flavour auto`` builds the ``cuda`` flavour here: ``(arch, why)``, ``arch``
    the GPU's architecture (:func:`gpu_compute_capability`) or None, ``why`` in words. None when
    :data:`CUDA_OPT_OUT` says no, the user's ``CMAKE_ARGS`` name ``GGML_CUDA`` (they decide), no
    ``nvcc`` is found or no NVIDIA GPU answers (``nvcc`` alone is not enough: a toolkit without a GPU)."""
    if os.environ.get(CUDA_OPT_OUT, "").strip().lower() in ("0", "false", "no", "off"):
        return None, f"{CUDA_OPT_OUT}={os.environ[CUDA_OPT_OUT]}"
    if "GGML_CUDA" in user_cmake_args():
        return None, "the user's CMAKE_ARGS set GGML_CUDA"
    nvcc = find_nvcc()
    if nvcc is None:
        return None, "no CUDA compiler (nvcc) found"
    arch = gpu_compute_capability()
    if arch is None:
        return None, f"{nvcc} found but no NVIDIA GPU (nvidia-smi reports no compute capability)"
    return arch, f"{nvcc} and an NVIDIA GPU of compute capability {arch}"


def amx_target(cpu: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Whether ``install --flavour auto`` builds the ``amx`` flavour here: ``(yes, why)``. Yes only
    where :data:`AMX_OPT_IN` opts in AND the CPU (``cpu``, default :func:`cpu_info`) is x86-64 with
    :data:`AMX_CPU_FLAGS`."""
    if os.environ.get(AMX_OPT_IN, "").strip().lower() not in ("1", "true", "yes", "on"):
        return False, f"not asked for ({AMX_OPT_IN}=1 asks)"
    cpu = cpu or cpu_info()
    missing = [f for f in AMX_CPU_FLAGS if f not in cpu["flags"]]
    if cpu["machine"].lower() not in ("x86_64", "amd64") or missing:
        return False, f"{AMX_OPT_IN} is set but this CPU has no AMX ({', '.join(missing) or cpu['machine']} missing)"
    return True, f"{AMX_OPT_IN} is set and this CPU has AMX"


def build_spec(flavour: str = "native", user: str | None = None, cuda_arch: str | None = None) -> dict[str, Any]:
    """Everything a build depends on: version, flavour, CMake arguments (``user``: the user's,
    default :func:`user_cmake_args`), CPU, compiler, Python; for ``cuda`` also the architecture
    (``cuda_arch``, default :func:`gpu_compute_capability`) and the CUDA compiler's version.

    Raises:
        ValueError: ``cuda`` and no architecture (no NVIDIA GPU found).
    """
    cpu = cpu_info()
    user = user_cmake_args() if user is None else user
    if flavour == "cuda" and cuda_arch is None:
        cuda_arch = gpu_compute_capability()
    spec = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "flavour": flavour,
        "user_cmake_args": user,
        "cmake_args": cmake_args(flavour, user, cpu, cuda_arch),
        "cpu_model": cpu["model"],
        "cpu_flags": cpu["flags"],
        "machine": cpu["machine"],
        "compiler": compiler_version(),
        "python": f"{sys.implementation.name}{sys.version_info[0]}{sys.version_info[1]}",
        "platform": sys.platform,
        "invariant_patch": patch_wanted() and invariant_patch.fingerprint(),
    }
    if flavour == "cuda":  # only here: a CPU build's key stays what it was
        spec.update(backend="cuda", cuda_arch=cuda_arch, nvcc=nvcc_version())
    return spec


def patch_wanted() -> bool:
    """Whether the build gets the batch-invariance patch (:mod:`invariant_patch`): unless
    :data:`PATCH_OPT_OUT` says no."""
    return os.environ.get(PATCH_OPT_OUT, "1").strip().lower() not in ("0", "false", "no", "off")


def build_backend(record: dict[str, Any] | None) -> str:
    """What a build record's llama.cpp runs on: ``"cuda"`` (the ``cuda`` flavour, or CMake
    arguments with ``GGML_CUDA`` on), ``"cpu"``, or ``"unknown"`` for no record."""
    if record is None:
        return "unknown"
    if record.get("backend") == "cuda":
        return "cuda"
    on = ("ON", "1", "TRUE", "YES", "Y")
    cuda = [a.split("=", 1)[1] for a in record.get("cmake_args", []) if re.match(r"-DGGML_CUDA(:BOOL)?=", a)]
    return "cuda" if cuda and cuda[-1].upper() in on else "cpu"


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


def failed_here(spec: dict[str, Any]) -> bool:
    """Whether the build of ``spec`` was marked failed on this machine (:data:`FAILED_MARK`)."""
    return (build_folder(build_key(spec)) / FAILED_MARK).exists()


def choose_flavour(verbose: bool = False) -> str:
    """The first flavour of :data:`FLAVOURS` for this machine not marked failed here: ``cuda``
    where :func:`cuda_target` finds nvcc and a GPU, ``amx`` where :func:`amx_target` says so, then
    ``native``, else ``portable``. ``verbose``: say why the CUDA and AMX builds are or are not made."""
    arch, why = cuda_target()
    if arch is not None:
        if not failed_here(build_spec("cuda", cuda_arch=arch)):
            if verbose:
                print(f"llama.cpp: CUDA build ({why})", flush=True)
            return "cuda"
        if verbose:
            print(f"llama.cpp: the CUDA build failed on this machine before; building for the CPU ({why})", flush=True)
    elif verbose and "nvcc" in why:
        print(f"llama.cpp: building for the CPU: {why}", flush=True)
    amx, amx_why = amx_target()
    if amx and not failed_here(build_spec("amx")):
        if verbose:
            print(f"llama.cpp: build with ggml's AMX kernels ({amx_why})", flush=True)
        return "amx"
    if verbose and (amx or AMX_OPT_IN in amx_why):
        done = "failed its smoke test here before" if amx else amx_why
        print(f"llama.cpp: no AMX build: {done}; AMX kernels left out", flush=True)
    return "portable" if failed_here(build_spec("native")) else "native"


def mark_failed(
    key: str | None = None, why: str = "failed its smoke test on this machine (scripts/setup.sh)"
) -> str | None:
    """Mark build ``key`` (default: the installed one) as failed on this machine; returns the key
    (None: no record)."""
    if key is None:
        record = installed_record()
        if record is None or not record.get("key"):
            return None
        key = str(record["key"])
    folder = build_folder(key)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILED_MARK).write_text(why + "\n")
    return key


def install(flavour: str = "auto", force: bool = False) -> dict[str, Any]:
    """Install the llama.cpp build of ``flavour`` (``auto``: :func:`choose_flavour`) for this machine
    into the running Python's environment: nothing to do if the record says it is there; a wheel of
    the same key from the cache; else build one (pip's cache off) into ``<cache>/llama-cpp-builds/<key>/``. Returns the
    record (the spec plus ``key`` and ``wheel``).

    A ``cuda`` or ``amx`` build chosen by ``auto`` that fails to compile is marked failed here and
    the next flavour is made instead, with a message (its smoke test is the set-up's, after this).

    Raises:
        subprocess.CalledProcessError: pip failed (the compiler's output is above it), for a CPU
            flavour or an explicitly asked-for ``cuda`` or ``amx``.
        ValueError: ``cuda`` asked for on a machine without an NVIDIA GPU.
    """
    auto = flavour == "auto"
    flavour = choose_flavour(verbose=True) if auto else flavour
    spec = build_spec(flavour)
    key = build_key(spec)
    record = installed_record()
    if not force and record is not None and record.get("key") == key and _importable():
        print(f"llama.cpp: build {key} ({flavour}) already installed", flush=True)
        return record
    folder = build_folder(key)
    wheels = sorted(folder.glob("llama_cpp_python-*.whl")) if folder.exists() else []
    if not wheels:
        try:
            wheels = [_build_wheel(spec, key)]
        except subprocess.CalledProcessError as error:
            if not (auto and flavour in ("cuda", "amx")):
                raise
            name, skip = ("CUDA", f"Set {CUDA_OPT_OUT}=0") if flavour == "cuda" else ("AMX", f"Unset {AMX_OPT_IN}")
            mark_failed(key, f"the {name} build failed to compile on this machine ({error})")
            print(
                f"llama.cpp: the {name} build ({key}) FAILED to compile (its output is above); building the next "
                f"flavour instead. {skip} to skip the {name} build; remove {folder} to try it again.",
                file=sys.stderr,
                flush=True,
            )
            return install("auto", force)
    else:
        print(f"llama.cpp: installing the cached build {key} ({flavour})", flush=True)
    _pip("install", "-q", "--force-reinstall", "--no-deps", str(wheels[-1]))
    _pip("install", "-q", str(wheels[-1]))  # its dependencies (numpy, diskcache, jinja2, ...)
    _warn_if_embedded_libstdcxx()
    built = folder / "build.json"  # what the build was (a patch that did not fit says so there)
    known = json.loads(built.read_text()) if built.is_file() else spec
    record = {**spec, "invariant_patch": known.get("invariant_patch"), "key": key, "wheel": str(wheels[-1])}
    (Path(sys.prefix) / RECORD_NAME).write_text(json.dumps(record, indent=1))
    return record


def _build_wheel(spec: dict[str, Any], key: str) -> Path:
    """Build the wheel of ``spec`` into ``build_folder(key)`` (pip's cache off; a CUDA build gets
    ``CUDACXX`` where ``nvcc`` is not on the ``PATH``); returns its path.

    Raises:
        subprocess.CalledProcessError: pip failed.
    """
    flavour = spec["flavour"]
    print(
        f"llama.cpp: building llama-cpp-python {LLAMA_CPP_PYTHON} ({flavour}, key {key}), "
        f"CMAKE_ARGS: {' '.join(spec['cmake_args'])} (a few minutes{'; CUDA: longer' if flavour == 'cuda' else ''})",
        flush=True,
    )
    folder = build_folder(key)
    tmp = folder.with_name(key + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = {**os.environ, "CMAKE_ARGS": " ".join(shlex.quote(a) for a in spec["cmake_args"])}
    if flavour == "cuda" and "CUDACXX" not in env and (nvcc := find_nvcc()):
        env["CUDACXX"] = nvcc
    try:
        source, patched = _source(tmp / "src", patched=bool(spec.get("invariant_patch")))
        _pip("wheel", "-q", "--no-deps", "--no-cache-dir", "-w", str(tmp), str(source), env=env)
    except subprocess.CalledProcessError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp / "src", ignore_errors=True)
    built = {**spec, "key": key}
    if not patched:  # asked for but did not fit: the record says the build lacks it
        built["invariant_patch"] = False
    (tmp / "build.json").write_text(json.dumps(built, indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return sorted(folder.glob("llama_cpp_python-*.whl"))[-1]


def _source(folder: Path, patched: bool) -> tuple[Path, bool]:
    """llama-cpp-python's source release (PyPI's sdist, ``pip download``) unpacked in ``folder``,
    with the batch-invariance patch applied when ``patched`` (:func:`invariant_patch.apply`; a
    patch that does not fit this source is left out with a message: the build goes on without it).
    Returns the source's root and whether the patch is in.

    Raises:
        subprocess.CalledProcessError: pip could not download it.
    """
    folder.mkdir(parents=True, exist_ok=True)
    _pip(
        "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(folder),
        f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
    )  # fmt: skip
    archive = sorted(folder.glob("llama_cpp_python-*.tar.gz"))[-1]
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+: refuse links and paths out of the folder
            tar.extractall(folder, filter="data")
        else:
            tar.extractall(folder)
    root = folder / archive.name.removesuffix(".tar.gz")
    if patched:
        try:
            invariant_patch.apply(root)
            print("llama.cpp: specdecode's batch-invariance patch applied (docs/llamacpp.md)", flush=True)
            return root, True
        except invariant_patch.PatchError as error:
            print(f"llama.cpp: {error}; building without it (exact mode verifies in chunks of 3)", flush=True)
    return root, False


def embedded_libstdcxx(lib_dir: str | Path) -> list[str]:
    """The C++ libraries of a llama.cpp build (``libllama``, ``libggml-base``, ``libggml-cpu``,
    ``libggml-cuda`` in ``lib_dir``) that do not load the shared ``libstdc++.so.6``: each carries its
    own C++ runtime, which can crash beside the system's (:func:`libstdcxx_link_dir`). Empty where
    all are fine, or where ``readelf`` (binutils) is missing."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return []
    found = []
    for lib in sorted(Path(lib_dir).glob("lib*.so")):
        if not lib.name.startswith(("libllama", "libggml-base", "libggml-cpu", "libggml-cuda")):
            continue
        try:
            dynamic = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if dynamic and "libstdc++" not in dynamic:
            found.append(lib.name)
    return found


def installed_lib_dir() -> Path | None:
    """The installed ``llama_cpp`` package's ``lib`` folder (its native libraries), found without
    loading them; None where llama-cpp-python is not installed."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def cxx_runtime_line() -> str:
    """One line for ``specdecode doctor``: whether the installed llama.cpp libraries load the shared
    C++ runtime or embed their own (:func:`embedded_libstdcxx`)."""
    lib_dir = installed_lib_dir()
    if lib_dir is None or not lib_dir.is_dir():
        return "llama.cpp C++ runtime: not installed"
    if shutil.which("readelf") is None:
        return "llama.cpp C++ runtime: unknown (no readelf: install binutils)"
    libs = embedded_libstdcxx(lib_dir)
    what = _embedded_warning(libs) if libs else "the shared libstdc++.so.6"
    return f"llama.cpp C++ runtime: {what}"


def _embedded_warning(libs: list[str]) -> str:
    return (
        f"WARNING: {', '.join(libs)} embed their own libstdc++ (linked statically); beside the system's "
        "runtime a model load can crash (GCC bug 67903). Install the compiler's libstdc++ development "
        "package (e.g. libstdc++-13-dev), then run bash scripts/setup.sh again"
    )


def _warn_if_embedded_libstdcxx() -> None:
    """After an install: print :func:`cxx_runtime_line`'s warning if the installed libraries carry
    their own C++ runtime (the set-up's smoke test then decides whether the build is used)."""
    lib_dir = installed_lib_dir()
    libs = embedded_libstdcxx(lib_dir) if lib_dir is not None else []
    if libs:
        print(f"llama.cpp: {_embedded_warning(libs)}", file=sys.stderr, flush=True)


def _importable() -> bool:
    """Whether ``llama_cpp`` can be found (without loading its native library)."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def main(argv: list[str] | None = None) -> int:
    """``python models/llamacpp/build.py install|key|spec|mark-failed|flavour [--flavour F] [--force]``
    (``flavour``: the installed build's, or ``none``)."""
    parser = argparse.ArgumentParser(description="the keyed llama.cpp build of the set-up")
    parser.add_argument("action", choices=["install", "key", "spec", "mark-failed", "flavour"])
    parser.add_argument("--flavour", choices=("auto", *FLAVOURS), default="auto")
    parser.add_argument("--force", action="store_true", help="install even if the record says it is there")
    args = parser.parse_args(argv)
    if args.action == "install":
        install(args.flavour, args.force)
    elif args.action == "mark-failed":
        print(f"llama.cpp: build {mark_failed()} marked as failed on this machine")
    elif args.action == "flavour":
        print((installed_record() or {}).get("flavour") or "none")
    else:
        spec = build_spec(choose_flavour() if args.flavour == "auto" else args.flavour)
        print(build_key(spec) if args.action == "key" else json.dumps(spec, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
