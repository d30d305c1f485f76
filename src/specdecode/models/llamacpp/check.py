"""A smoke test of the installed llama.cpp build, run in a subprocess before the user's process
trusts it.

llama.cpp is native code compiled on the user's machine: a build can crash the whole process (a
segmentation fault in AMX kernels on Intel CPUs, llama.cpp #20824; a crash at load seen on a
16-core Xeon with GCC 13). Python cannot catch that. So before ``--backend auto`` loads a GGUF file
into the user's process, :func:`check_llamacpp` loads the same file in a child process and decodes
with it the way the runner does (a prefill, a one-token pass and a four-token verification pass,
greedy, exact mode). A child that dies, hangs or fails leaves a :class:`CheckResult` naming the
cause; ``auto`` then runs torch instead (one line on stderr), and ``--backend llamacpp`` stops with
:class:`LlamaCppUnusableError` instead of a dead process.

The result is cached on disk per installed build and model file
(``<cache>/llamacpp-checks/<key>.json``, key: the native libraries' sizes and times, the CPU, the
file's path, size and time), so the check costs a few seconds once, not per run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.models.llamacpp.build import cache_root, cpu_info, installed_record

CHECK_TIMEOUT_S = 300.0
"""The longest a smoke test may take (loading a multi-GB file from a cold disk included)."""

OK_LINE = "specdecode-llamacpp-check: ok"


class LlamaCppUnusableError(SpecDecodeError, RuntimeError):
    """The installed llama.cpp build failed its smoke test on this machine (the message says how)."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one smoke test.

    Attributes:
        ok: the child loaded the file and decoded with it.
        reason: why not (``""`` when ok): e.g. ``"killed by SIGSEGV while decoding"``.
        system_info: llama.cpp's ``llama_print_system_info()`` in the child (what the build uses).
        output_tail: the child's last lines of output (for ``specdecode doctor`` and bug reports).
        seconds: how long the check took.
        cached: read from the cache rather than run now.
        crashed: the child died (a signal) or hung: the build is unusable here. A child that
            failed with a Python exception (a file llama.cpp cannot load, say) is not a crash:
            loading the file in the user's process raises the same error, as an exception.
        gpu_offload: ``llama_supports_gpu_offload()`` in the child (a CUDA build: the check ran with
            every layer on the GPU); None when the child did not get that far.
    """

    ok: bool
    reason: str
    crashed: bool = False
    system_info: str = ""
    output_tail: str = ""
    seconds: float = 0.0
    cached: bool = False
    gpu_offload: bool | None = None


def native_libraries() -> list[Path]:
    """The installed llama-cpp-python's native libraries (found without loading them), or []."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        return []
    lib = Path(spec.origin).parent / "lib"
    return sorted(p for p in lib.glob("*") if p.suffix in (".so", ".dylib", ".dll") or ".so." in p.name)


def check_key(gguf: Path) -> str:
    """The cache key of a check of ``gguf``: the build (its libraries' names, sizes and times, the
    set-up's record), the CPU and the file."""

    def stamp(path: Path) -> list[Any]:
        st = path.stat()
        return [str(path), st.st_size, st.st_mtime_ns]

    record = installed_record() or {}
    parts = {
        "libs": [stamp(p) for p in native_libraries()],
        "build": record.get("key"),
        "cpu": cpu_info(),
        "python": sys.executable,
        "gguf": stamp(gguf.resolve()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def check_command(gguf: Path) -> list[str]:
    """The child's command line: this module run as a script on ``gguf``."""
    return [sys.executable, "-m", "specdecode.models.llamacpp.check", str(gguf)]


def _describe_exit(code: int, phase: str) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the process was killed by {name} while {phase}"
    return f"the process exited with status {code} while {phase}"


def run_check(gguf: Path, timeout: float = CHECK_TIMEOUT_S) -> CheckResult:
    """Run the smoke test of ``gguf`` in a child process now (no cache).

    Returns:
        :class:`CheckResult`; never raises for a failing child.
    """
    tic = time.perf_counter()
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a native crash prints the Python stack
    try:
        proc = subprocess.run(check_command(gguf), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as error:
        raw = error.stdout or b""
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        return CheckResult(False, f"no answer after {timeout:.0f} s", True, "", out[-2000:], time.perf_counter() - tic)
    except OSError as error:
        return CheckResult(False, f"could not start the check: {error}", True, "", "", time.perf_counter() - tic)
    output = proc.stdout + proc.stderr
    phase, info, offload = "starting", "", None
    for line in proc.stdout.splitlines():
        if line.startswith("phase: "):
            phase = line[len("phase: ") :]
        elif line.startswith("system_info: "):
            info = line[len("system_info: ") :]
        elif line.startswith("gpu_offload: "):
            offload = line[len("gpu_offload: ") :].strip() == "1"
    seconds = time.perf_counter() - tic
    if proc.returncode == 0 and OK_LINE in proc.stdout:
        return CheckResult(True, "", False, info, output[-2000:], seconds, gpu_offload=offload)
    reason = _describe_exit(proc.returncode, phase) if proc.returncode else f"no result while {phase}"
    last = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    if proc.returncode > 0 and last:
        reason += f": {last[-1].strip()}"
    return CheckResult(False, reason, proc.returncode < 0, info, output[-2000:], seconds, gpu_offload=offload)


def check_llamacpp(gguf: str | Path, fresh: bool = False) -> CheckResult:
    """The smoke test of the installed llama.cpp build on ``gguf``, from the cache or run now.

    Args:
        gguf: the GGUF file the caller is about to load.
        fresh: run it even if a result is cached (the set-up does, after a build).

    Returns:
        :class:`CheckResult` (``ok`` False also when llama-cpp-python is not installed).
    """
    path = Path(gguf)
    if importlib.util.find_spec("llama_cpp") is None:
        return CheckResult(False, "llama-cpp-python is not installed", True)
    if not path.is_file():
        return CheckResult(False, f"no such file: {path}")
    cache = cache_root() / "llamacpp-checks" / f"{check_key(path)}.json"
    if not fresh and cache.exists():
        try:
            return CheckResult(**{**json.loads(cache.read_text()), "cached": True})
        except (OSError, ValueError, TypeError):
            pass
    result = run_check(path)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(asdict(result), indent=1))
    except OSError:  # a read-only cache: check again next time
        pass
    return result


def failure_message(result: CheckResult, gguf: Path) -> str:
    """What to tell a user whose build failed: the cause and what to try."""
    return (
        f"llama.cpp failed its smoke test on this machine ({result.reason}; file {gguf}). "
        "Rebuild it with `bash scripts/setup.sh` (it builds for this CPU and tries a portable build "
        "if the native one fails), see `specdecode doctor`, or run --backend torch"
    )


def usable(result: CheckResult) -> bool:
    """Whether the build may be loaded into this process: it passed, or its child failed with a
    Python exception (which loading here raises too), not a crash."""
    return result.ok or not result.crashed


def require_llamacpp(gguf: str | Path) -> None:
    """Raise if the smoke test of ``gguf`` (cached) crashed or hung.

    Raises:
        LlamaCppUnusableError: it did (the message names the cause and what to try).
    """
    result = check_llamacpp(gguf)
    if not usable(result):
        raise LlamaCppUnusableError(failure_message(result, Path(gguf)))


def _child(gguf: str) -> int:
    """The child: load ``gguf`` as the runner does and decode (prints its phases)."""
    import torch

    from specdecode.models.llamacpp.model import LlamaCppModel, LlamaCppOptions, _lib

    def phase(name: str) -> None:
        print(f"phase: {name}", flush=True)

    phase("loading llama.cpp")
    info = _lib().llama_print_system_info().decode(errors="replace").strip()
    print(f"system_info: {info}", flush=True)
    print(f"gpu_offload: {int(bool(_lib().llama_supports_gpu_offload()))}", flush=True)  # every layer, if 1
    phase("loading the model")
    model = LlamaCppModel(gguf, LlamaCppOptions(n_ctx=64))
    runner = model.make_runner()
    phase("decoding")
    ids = torch.arange(8, dtype=torch.int64) + 100  # any ids of the vocabulary
    first = runner.forward(ids)  # (1, V): a prefill
    nxt = int(first.argmax(-1)[0])
    runner.forward(torch.tensor([nxt]))  # a one-token pass
    logits = runner.forward(torch.tensor([nxt, 101, 102, 103]), num_logits=4)  # a verification pass
    if not torch.isfinite(logits).all():
        phase("checking the logits")
        print("the logits are not finite", file=sys.stderr)
        return 1
    print(OK_LINE, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
