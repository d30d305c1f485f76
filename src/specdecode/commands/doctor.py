"""``specdecode doctor``: what this machine is, what llama.cpp build is installed and whether it
works here, which backend ``--backend auto`` picks and why."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

from specdecode.commands.common import add_command_parser

FLAGS_OF_INTEREST = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni",
    "amx_tile", "amx_int8", "amx_bf16", "neon", "asimd", "sve",
)  # fmt: skip
"""The CPU flags that decide llama.cpp's and torch's kernels, in the order printed."""


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``doctor`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = add_command_parser(
        subparsers,
        "doctor",
        "print the machine (CPU, cores, CUDA), the llama.cpp build and its smoke test on the default "
        "target, and which backend --backend auto picks and why",
    )
    p.add_argument("--target", help="the model to check and pick a backend for (default: the default target)")
    p.add_argument("--fresh", action="store_true", help="run llama.cpp's smoke test now, even if a result is cached")
    p.add_argument(
        "--check", action="store_true", help="exit 1 if llama.cpp's smoke test fails (scripts/setup.sh uses it)"
    )
    p.set_defaults(func=cmd_doctor)
    return p


def _cores() -> str:
    from specdecode.models.llamacpp.model import default_threads  # the cores this process may use

    return f"{default_threads()} usable of {os.cpu_count()}"


def openmp_line() -> str | None:
    """A warning when ``OMP_WAIT_POLICY`` asks OpenMP's threads to sleep between parallel regions
    (``passive``): llama.cpp's CPU build runs its threads through OpenMP, and every pass then
    waits for them to wake (one-token passes 33 -> 50 ms on the project's 2-core AMD EPYC,
    lab/notebook/2026-11-28-rotated-repeats.md); None otherwise."""
    policy = os.environ.get("OMP_WAIT_POLICY", "")
    if policy.strip().lower() != "passive":
        return None
    return (
        f"environment: OMP_WAIT_POLICY={policy}: llama.cpp's threads sleep between passes "
        "(measured 1.5x slower decoding on a 2-core CPU); unset it for speed"
    )


def machine_lines() -> list[str]:
    """The CPU (model, cores, the flags of :data:`FLAGS_OF_INTEREST`), the OS, Python, torch and CUDA,
    and a warning from :func:`openmp_line` where it has one."""
    import torch

    from specdecode.models.llamacpp.build import cpu_info

    cpu = cpu_info()
    flags = [f for f in FLAGS_OF_INTEREST if f in cpu["flags"]]
    lines = [
        f"cpu: {cpu['model'] or 'unknown'} ({cpu['machine']}), cores: {_cores()}",
        f"cpu flags: {' '.join(flags) or 'none of ' + ' '.join(FLAGS_OF_INTEREST)}",
        f"os: {platform.platform()}; python {platform.python_version()}; torch {torch.__version__}",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i}: {props.name}, {props.total_memory / 2**30:.0f} GiB (CUDA {torch.version.cuda})")
    else:
        lines.append("cuda: no CUDA device")
    if (warning := openmp_line()) is not None:
        lines.append(warning)
    return lines


def build_lines() -> list[str]:
    """The installed llama.cpp build: version, the set-up's record (CMake arguments, key), whether
    that key is this machine's, and which C++ runtime its libraries load."""
    import importlib.metadata

    from specdecode.models.llamacpp.build import (
        AMX_CPU_FLAGS,
        amx_target,
        build_backend,
        build_key,
        build_spec,
        cpu_info,
        cxx_runtime_line,
        failed_here,
        installed_record,
    )

    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return ["llama.cpp: llama-cpp-python is not installed (bash scripts/setup.sh builds it)"]
    record = installed_record()
    if record is None:
        return [
            f"llama.cpp: llama-cpp-python {version}, not built by scripts/setup.sh (no record in {sys.prefix})",
            cxx_runtime_line(),
        ]
    backend = build_backend(record)
    try:  # a cuda build: for this machine's GPU
        here = build_key(build_spec(record.get("flavour", "native")))
        same = "built for this machine" if record.get("key") == here else f"built elsewhere: this machine's is {here}"
    except ValueError as error:  # a cuda record on a machine without a GPU
        same = f"not for this machine: {error}"
    arch = f", CUDA architecture {record['cuda_arch']}" if record.get("cuda_arch") else ""
    lines = [
        f"llama.cpp: llama-cpp-python {version}, {record.get('flavour')} build {record.get('key')} ({same})",
        f"llama.cpp backend: {backend}{arch}",
        f"llama.cpp CMAKE_ARGS: {' '.join(record.get('cmake_args', []))}",
        f"llama.cpp built with: {record.get('compiler')}" + (f", {record['nvcc']}" if record.get("nvcc") else ""),
        _patch_line(record),
        cxx_runtime_line(),
    ]
    cpu = cpu_info()
    if all(f in cpu["flags"] for f in AMX_CPU_FLAGS) and record.get("flavour") != "amx":
        asked, why = amx_target(cpu)
        why = f"{why}, but the amx build failed here" if asked and failed_here(build_spec("amx")) else why
        lines.append(f"llama.cpp AMX kernels: left out; this CPU has AMX ({why}; docs/llamacpp.md#set-up)")
    return lines


def _patch_line(record: dict[str, Any]) -> str:
    """Whether the build carries specdecode's batch-invariance patch (its record says)."""
    if record.get("invariant_patch"):
        return (
            f"llama.cpp batch-invariance patch: in ({record['invariant_patch']}): exact mode verifies "
            "a draft in one pass (docs/llamacpp.md#exact-mode-greedy-output-equal-to-plain-decoding)"
        )
    return (
        "llama.cpp batch-invariance patch: not in (SPECDECODE_LLAMA_PATCH=0, an older set-up, or a source it "
        "did not fit): exact mode verifies in chunks of 3 tokens; rerun scripts/setup.sh to build it"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the report; with ``--check``, exit 1 when the smoke test fails (or cannot run)."""
    from specdecode.models.backends import explain_backend, llamacpp_available, target_gguf
    from specdecode.models.llamacpp.check import check_llamacpp, failure_message

    for line in machine_lines() + build_lines():
        print(line)
    status = 0
    gguf = target_gguf(args.target)
    if llamacpp_available() and gguf is not None:
        result = check_llamacpp(gguf, fresh=args.fresh)
        when = "cached" if result.cached else f"ran now, {result.seconds:.1f} s"
        verdict = "passed" if result.ok else "CRASHED" if result.crashed else "FAILED"
        print(f"llama.cpp smoke test on {Path(gguf).name}: {verdict} ({when})")
        if result.system_info:
            print(f"llama.cpp system info: {result.system_info}")
        if result.gpu_offload is not None:
            print(f"llama.cpp GPU offload: {'yes: every layer on the GPU' if result.gpu_offload else 'no (CPU)'}")
        if not result.ok:
            print(failure_message(result, gguf))
            print("its last output:\n" + result.output_tail.rstrip())
            status = 1 if args.check else 0
    else:
        print("llama.cpp smoke test: not run (llama-cpp-python or a GGUF target is missing)")
        status = 1 if args.check else 0
    backend, reason = explain_backend("auto", args.target)
    print(f"--backend auto: {backend} ({reason})")
    print(torch_device_line())
    return status


def torch_device_line() -> str:
    """Where the torch backend runs under ``--device auto``, in which dtype, and whether CUDA graphs
    replay its passes (:mod:`specdecode.models.torch.placement`)."""
    from specdecode.models.torch.cpu import auto_dtype
    from specdecode.models.torch.placement import resolve_device

    device = resolve_device("auto")
    graphs = ", static KV cache and CUDA graphs (--no-cuda-graphs: eager)" if device.type == "cuda" else ""
    return f"--device auto (torch): {device}, --dtype auto = {auto_dtype(device)}{graphs}"
