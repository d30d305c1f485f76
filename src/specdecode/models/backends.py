"""Which backend runs a model, and loading a model on it (docs/design.md §2b).

Two backends implement the runner contract: ``torch`` (Hugging Face ``transformers`` models,
:class:`~specdecode.models.torch.runner.ModelRunner`) and ``llamacpp`` (GGUF files on llama.cpp's
kernels, :class:`~specdecode.models.llamacpp.LlamaCppRunner`). A loaded model of either kind
becomes a runner (:mod:`specdecode.models.contract`) through :func:`make_runner`, and says what
its runners can do through :func:`runner_capabilities`; nothing above that branches on the backend.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from specdecode.errors import ModelNotFoundError
from specdecode.models.contract import BatchedRunner, Runner, RunnerCapabilities

BACKENDS = ("auto", "torch", "llamacpp")
"""What ``--backend`` accepts."""

DEFAULT_PROPOSER: dict[str, tuple[str, dict[str, Any]]] = {
    "torch": ("draft_model", {}),
    "llamacpp": ("prompt_lookup", {"min_ngram": 3, "max_ngram": 8}),
}
"""The proposer (and its options) that runs when none is named (``proposer="auto"``), per backend,
measured best on the reference CPU (docs/llamacpp.md): on llama.cpp with 2 threads the 0.5B draft
costs 0.55 of a target pass and loses to plain decoding, and a drafted token costs half a one-token
pass, so prompt lookup drafts only after a match of 3+ tokens (accepted 0.72-0.96 at the first
position against 0.34-0.62 for 1-token matches), up to 8 (a longer match drafts further: up to k
= 8 tokens from a 4-token match on); the draft gate (:mod:`specdecode.draft_gate`) then sends a
greedy request's drafts only where this request's acceptance per match length and the machine's
measured pass costs say they pay (replayed on 30 turns of every category: 1.03x -> 1.06x of plain
decoding on the 2-core EPYC's exact-mode costs, no category below 0.99x;
lab/notebook/2026-11-27-draft-gate.md)."""


def default_proposer(backend: str, draft: str | Path | None = None) -> tuple[str, dict[str, Any]]:
    """The proposer and options for ``proposer="auto"`` on ``backend`` (a resolved one):
    ``draft_model`` whenever a draft is named, else :data:`DEFAULT_PROPOSER`."""
    if draft is not None:
        return "draft_model", {}
    name, options = DEFAULT_PROPOSER.get(backend, ("draft_model", {}))
    return name, dict(options)


def llamacpp_available() -> bool:
    """Whether llama-cpp-python is installed (without loading its native library); False also where
    looking it up raises (a broken install, an import hook that hides it)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except (ImportError, ValueError):
        return False


def llamacpp_gpu_offload() -> bool:
    """Whether the installed llama.cpp build runs layers on a GPU: False without loading its native
    library when the set-up's record says a CPU build (:func:`~specdecode.models.llamacpp.build.build_backend`),
    else ``llama_cpp.llama_supports_gpu_offload()`` (loads it; False if that fails)."""
    from specdecode.models.llamacpp.build import build_backend, installed_record

    if build_backend(installed_record()) == "cpu":
        return False
    try:
        from specdecode.models.llamacpp.model import _lib

        return bool(_lib().llama_supports_gpu_offload())
    except Exception:  # noqa: BLE001 - a library that does not load offloads nothing
        return False


def resolve_backend(backend: str, target: str | Path | None = None, dtype: Any = "auto", device: str = "auto") -> str:
    """The backend that runs ``target`` (None: the default target) for ``backend``.

    ``"auto"``: ``llamacpp`` for a ``.gguf`` file, the default pair and packaged models on a machine
    without a CUDA GPU, or on a CUDA GPU where the llama.cpp build offloads to it
    (:func:`llamacpp_gpu_offload`: a CUDA build; every layer then runs on the GPU,
    ``LlamaCppOptions.gpu_layers=-1``), where llama-cpp-python is installed and its build passed
    the smoke test on that file (:mod:`specdecode.models.llamacpp.check`; a failed one prints one
    line on stderr and takes torch); ``torch`` for Hugging Face folders, on a CUDA GPU with a
    CPU-only llama.cpp build, and whenever a ``dtype`` other than ``"auto"`` is asked for (a torch
    setting). ``device="cpu"`` (``--device cpu``) counts as a machine without a GPU.
    :func:`explain_backend` says why.

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    chosen, reason = explain_backend(backend, target, dtype, device)
    if reason.startswith(FALLBACK_PREFIX):
        print(f"specdecode: {reason}", file=sys.stderr)
    return chosen


FALLBACK_PREFIX = "llama.cpp failed its smoke test"


def explain_backend(
    backend: str, target: str | Path | None = None, dtype: Any = "auto", device: str = "auto"
) -> tuple[str, str]:
    """:func:`resolve_backend`'s choice and the reason for it, in words (``specdecode doctor``).

    Raises:
        ValueError: ``backend`` is not one of :data:`BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend != "auto":
        return backend, f"--backend {backend} was asked for"
    on_gpu = torch.cuda.is_available() and (device == "auto" or torch.device(device).type == "cuda")
    if not llamacpp_available():
        why = "a CUDA GPU is present: torch runs the models on it" if on_gpu else "llama-cpp-python is not installed"
        return "torch", why
    if dtype != "auto":  # a dtype is a torch setting
        return "torch", f"dtype {dtype!r} is a torch setting"
    if target is not None:
        from specdecode.models.default import NAMED_MODELS

        path = Path(target).expanduser()
        packaged = str(target) in NAMED_MODELS and not path.exists()
        if not packaged and path.suffix != ".gguf":
            return "torch", f"{target} is not a .gguf file (a Hugging Face folder runs on torch)"
    if on_gpu and not llamacpp_gpu_offload():
        return "torch", "a CUDA GPU is present and the llama.cpp build is CPU-only: torch runs the models on it"
    where = (
        "on a CUDA GPU: llama.cpp's CUDA kernels, every layer on the GPU" if on_gpu else "on a CPU: llama.cpp's kernels"
    )
    gguf = target_gguf(target)
    if gguf is None:  # not installed or missing: loading says so
        return "llamacpp", f"a GGUF model {where}"
    from specdecode.models.llamacpp.check import check_llamacpp, usable

    result = check_llamacpp(gguf)
    if not usable(result):  # a crash or a hang; a file llama.cpp refuses fails as it loads
        return "torch", f"{FALLBACK_PREFIX} ({result.reason}); running on torch instead (see `specdecode doctor`)"
    return "llamacpp", f"a GGUF model {where} (its build passed the smoke test)"


def gguf_path(spec: str | Path | None, role: str) -> Path:
    """The GGUF file for ``spec`` (a ``.gguf`` path, a packaged name such as ``"smollm2"``, or None
    for the default ``role`` model), SHA-256-checked where packaged.

    Raises:
        ModelNotFoundError: no such file, not a ``.gguf`` file (a Hugging Face folder runs on the
            torch backend), or a packaged model that is not installed.
    """
    from specdecode.models.default import packaged_gguf

    packaged = packaged_gguf(None if spec is None else str(spec), role)
    if packaged is not None:
        return packaged
    path = Path(str(spec)).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"--{role}: no such file or folder: {path}")
    if not path.is_file() or path.suffix != ".gguf":
        raise ModelNotFoundError(
            f"--{role}: the llamacpp backend runs .gguf files; {path} is not one (use --backend torch)"
        )
    return path


def target_gguf(spec: str | Path | None) -> Path | None:
    """The target's GGUF file as :func:`gguf_path` finds it, or None when ``spec`` is not one (a
    Hugging Face folder, a missing file, a packaged model not installed): for the llama.cpp peers."""
    try:
        return gguf_path(spec, "target")
    except (OSError, ValueError):  # ModelNotFoundError is a FileNotFoundError
        return None


def load_llamacpp(spec: str | Path | None, role: str, options: Any = None) -> Any:
    """A :class:`~specdecode.models.llamacpp.LlamaCppModel` of ``spec`` (see :func:`gguf_path`),
    with :class:`~specdecode.models.llamacpp.LlamaCppOptions` ``options``.

    Raises:
        ModelNotFoundError: see :func:`gguf_path`.
        LlamaCppUnusableError: the build failed its smoke test on this file (cached;
            :mod:`specdecode.models.llamacpp.check`).
    """
    from specdecode.models.llamacpp.check import require_llamacpp
    from specdecode.models.llamacpp.model import LlamaCppModel

    path = gguf_path(spec, role)
    require_llamacpp(path)  # a build that crashes dies in a child process, not in this one
    return LlamaCppModel(path, options)


def load_llamacpp_tokenizer(model: Any) -> Any:
    """The tokenizer (with chat template) of a llama.cpp model's GGUF file, as ``transformers`` reads it."""
    from transformers import AutoTokenizer

    from specdecode.models.default import gguf_tokenizer_dir

    return AutoTokenizer.from_pretrained(gguf_tokenizer_dir(model.path))


def _is_llamacpp(model: Any) -> bool:
    """``model`` is a :class:`~specdecode.models.llamacpp.LlamaCppModel` (an isinstance check; the
    module imports without llama-cpp-python, whose native library loads on first use)."""
    from specdecode.models.llamacpp.model import LlamaCppModel

    return isinstance(model, LlamaCppModel)


def make_runner(model: Any) -> Runner:
    """The runner (:class:`~specdecode.models.contract.Runner`) of a loaded model: a llama.cpp
    model's own (:meth:`~specdecode.models.llamacpp.LlamaCppModel.make_runner`), else a
    :class:`~specdecode.models.torch.runner.ModelRunner` over a ``transformers`` model (a
    :class:`~specdecode.models.torch.static_runner.StaticCacheRunner`, static KV cache and CUDA graphs,
    for a model :func:`~specdecode.models.torch.static_runner.use_static_cache` marked)."""
    if _is_llamacpp(model):
        return model.make_runner()
    from specdecode.models.torch.static_runner import torch_runner

    return torch_runner(model)


def make_batched_runner(model: Any, max_rows: int, row_capacity: int | None = None) -> BatchedRunner:
    """The batched runner (:class:`~specdecode.models.contract.BatchedRunner`: many sequences, one
    pass; the server's) of a loaded model: for a llama.cpp model a
    :class:`~specdecode.models.llamacpp.batch.LlamaCppBatchedRunner` (its context reserves
    ``row_capacity`` tokens per row, default the model's ``n_ctx``), else a
    :class:`~specdecode.models.torch.batch.TorchBatchedRunner` over a ``transformers`` model (its cache starts
    at ``min(row_capacity, 256)`` positions per row and grows as needed).

    Raises:
        ValueError: ``max_rows`` < 1, or a model the batched runner cannot run.
    """
    if _is_llamacpp(model):
        from specdecode.models.llamacpp.batch import LlamaCppBatchedRunner

        return LlamaCppBatchedRunner(model, max_rows, (row_capacity or model.options.n_ctx) * max_rows)
    from specdecode.models.torch.batch import TorchBatchedRunner

    return TorchBatchedRunner(model, max_rows, capacity=min(row_capacity or 256, 256))


def backend_of(model: Any) -> str:
    """``"llamacpp"`` or ``"torch"``: the backend a loaded model runs on, for records and messages
    (what a model can do is :func:`runner_capabilities`, not this name)."""
    return runner_capabilities(model).backend


def runner_class(model: Any) -> type:
    """The class of the runner :func:`make_runner` makes of ``model`` (for messages and checks)."""
    if _is_llamacpp(model):
        from specdecode.models.llamacpp.model import LlamaCppRunner

        return LlamaCppRunner
    from specdecode.models.torch.runner import ModelRunner

    return ModelRunner


def runner_capabilities(model: Any) -> RunnerCapabilities:
    """What the runner :func:`make_runner` makes of ``model`` can do, before making one (a
    proposer deciding how to build itself: a reduced head, an int8 copy, a drafter's LM-head rows):
    :attr:`LlamaCppModel.capabilities <specdecode.models.llamacpp.LlamaCppModel.capabilities>`
    for a llama.cpp model, else :attr:`ModelRunner.capabilities
    <specdecode.models.torch.runner.ModelRunner.capabilities>` (batch-invariant for a model marked for
    exact passes: :func:`~specdecode.models.torch.exact.use_exact_passes` on the CPU; fixed-width
    passes on a GPU, which run no trees)."""
    if _is_llamacpp(model):
        return model.capabilities  # its options decide batch_invariant and greedy_hints
    from specdecode.models.torch.exact import exact_passes
    from specdecode.models.torch.static_runner import static_cache_settings

    capabilities = runner_class(model).capabilities  # type: ignore[attr-defined]
    static = static_cache_settings(model)
    if static is not None and static.exact_width is not None:  # fixed-width passes: exact chains, no trees
        return replace(capabilities, batch_invariant=True, trees=False)
    return replace(capabilities, batch_invariant=True) if exact_passes(model) else capabilities


def describe_passes(model: Any, runner: Runner | None = None) -> str:
    """How passes of a loaded model run, in words, for records (a cost table's ``device``): the
    processor or GPU, the backend, the weights, and the runner's mode (llama.cpp: where its layers
    run, threads, exact or fast mode; torch: device, dtype, eager or static KV cache with CUDA
    graphs, exact passes). ``runner``: one :func:`make_runner` made of ``model`` already (else one is made)."""
    import os
    import platform

    runner = runner if runner is not None else make_runner(model)
    device = runner.device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        from specdecode.models.llamacpp.build import cpu_info

        where = f"{cpu_info().get('model') or platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if _is_llamacpp(model):
        options = model.options
        on = "its GPU" if model.on_gpu else f"the CPU, {options.n_threads} threads"
        mode = "exact mode (batch-invariant chunks)" if options.exact else "fast mode"
        return f"{where}, llama.cpp on {on}, {runner.dtype}, {mode}"
    from specdecode.models.torch.static_runner import StaticCacheRunner

    mode = "static KV cache and CUDA graphs" if isinstance(runner, StaticCacheRunner) else "eager"
    exact = ", exact passes" if runner.capabilities.batch_invariant else ""
    return f"{where}, torch {torch.__version__} on {device}, {runner.dtype}, {mode}{exact}"
