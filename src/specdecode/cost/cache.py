"""A disk cache of the server's start-up cost model: a restarted server reuses its measurement.

``specdecode serve --speculation adaptive`` measures a
:class:`~specdecode.cost.serve_model.CostModel` before it serves
(:mod:`specdecode.cost.serve_measure`, through :meth:`Scheduler.calibrate
<specdecode.serve.scheduler.Scheduler.calibrate>`: every batch size of the grid up to
``--max-batch-size`` times every tokens-per-row width, and the default proposer's draft cost), a
few minutes of the machine with the default pair on 2 cores. The measurement depends only on what
this module puts in its key, so a restart with the same key loads it instead, from
``<cache>/serve-cost/<key>.json`` (``<cache>``: :func:`specdecode.models.default.cache_dir`,
``$SPECDECODE_CACHE`` or ``~/.cache/specdecode``), or from ``$SPECDECODE_SERVE_COST_CACHE`` where
that is set (a folder of its own, e.g. for tests, which keep the default models in the shared
cache).

The key (:func:`cost_key`) is the SHA-256 of every ingredient of the measurement, kept in the
file in clear too (a file under the key with other ingredients is ignored as corrupt):

- the target and the draft: for a GGUF file (llama.cpp) its resolved path, size and mtime, the
  :class:`~specdecode.models.llamacpp.LlamaCppOptions` it runs with (threads, exact, repack, ...),
  llama-cpp-python's version and the installed build's key
  (:func:`specdecode.models.llamacpp.build.installed_record`);
  for a ``transformers`` model its class, config, the kinds of its modules (an int8 or oneDNN
  copy differs), parameter count, dtype and device, and the path, size and mtime of the weight and
  config files of the folder it was loaded from (none for a model built in memory: two such
  models of one config, dtype and device share a key, as their passes cost the same);
- the backend's name, specdecode's, torch's and transformers' versions, torch's thread count;
- the grid (batch sizes, tokens per row), the proposer measured, its options (an option naming a
  file or folder also by that file's size and mtime) and k;
- the machine: CPU model, a hash of its flags, architecture, cores (all and usable), the CUDA
  GPUs torch sees;
- :data:`FORMAT`, raised whenever the file's layout changes, and
  :data:`~specdecode.cost.serve_measure.MEASUREMENT_VERSION`, declared beside the measuring code
  and raised when the measurement changes what it returns (its context, repeats, which pass it
  keeps). An explicit number, not a hash of the code's source: editing a comment or a docstring
  keeps every user's stored measurement.

**What is stored is the start-up measurement only.** While serving, the scheduler refines the
model in place (:meth:`CostModel.observe_target`'s per-batch-size speed factors,
:meth:`CostModel.observe_draft`'s moving averages, proposers measured on first use); those follow
the load and the hour, not the machine, and a drifted value stored would become the next start's
truth and drift further. So the model is stored right after it is measured, before a request runs;
a loaded model starts from that measurement with speed factors of 1 and refines itself as a fresh
one does.

Never fatal: a missing file is a miss; an unreadable or corrupt one (not JSON, another format,
fields :meth:`CostModel.from_dict` refuses) is logged as a warning and measured again (the new
measurement replaces it); a folder that cannot be written is a warning, and the server serves with
the model it measured. Files are written atomically (a temporary file in the folder, then
``os.replace``): a reader never sees half a file, and two servers starting together each store a
whole one. The folder keeps the :data:`KEEP` most recently used files (a changed key, after an
upgrade or a rebuild, leaves its old file behind).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.cost.serve_model import CostModel

log = logging.getLogger("specdecode.serve")

FORMAT = 1
"""Version of the file's layout; part of the key (the measurement's own version is
:data:`~specdecode.cost.serve_measure.MEASUREMENT_VERSION`)."""

FOLDER = "serve-cost"
"""The cache's sub-folder of specdecode's cache folder."""

KEEP = 32
"""Most files the folder keeps; storing one removes the least recently used beyond it."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
"""Files of a model folder whose size and mtime enter the key (with ``config.json``)."""


FOLDER_ENV = "SPECDECODE_SERVE_COST_CACHE"
"""Environment variable naming the cost cache's folder instead of ``<cache>/serve-cost``."""


def default_folder() -> Path:
    """``$SPECDECODE_SERVE_COST_CACHE`` where set, else ``<cache>/serve-cost`` under
    :func:`specdecode.models.default.cache_dir` (not created)."""
    if os.environ.get(FOLDER_ENV):
        return Path(os.environ[FOLDER_ENV]).expanduser()
    from specdecode.models.default import cache_dir

    return cache_dir() / FOLDER


@dataclass(frozen=True)
class CostKey:
    """What a measurement depends on (:func:`cost_key`).

    Attributes:
        ingredients: JSON-ready data (str keys; str, int, float, bool, None, lists, dicts).
        digest: 16 hex digits of the SHA-256 of ``ingredients`` (sorted keys): the file's name.
    """

    ingredients: dict[str, Any]
    digest: str


@dataclass(frozen=True)
class CachedCost:
    """A cost model read from the cache.

    Attributes:
        cost: the model as measured at start-up (speed factors 1).
        path: the file it came from.
        measured_at: when it was measured, ISO 8601 in UTC (``"2025-01-31T12:00:00+00:00"``).
        measure_s: seconds the measurement took then.
    """

    cost: CostModel
    path: Path
    measured_at: str
    measure_s: float


def file_identity(path: str | Path) -> dict[str, Any]:
    """``{"path": resolved str, "size": bytes, "mtime_ns": int}`` of a file or folder (size and
    mtime None where it cannot be read)."""
    resolved = Path(path).expanduser().resolve()
    try:
        st = resolved.stat()
    except OSError:
        return {"path": str(resolved), "size": None, "mtime_ns": None}
    return {"path": str(resolved), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def folder_identity(folder: Path) -> list[dict[str, Any]]:
    """:func:`file_identity` of ``config.json`` and the weight files (:data:`WEIGHT_SUFFIXES`)
    directly in ``folder``, sorted by name; [] if it cannot be listed."""
    try:
        names = sorted(p.name for p in folder.iterdir() if p.name == "config.json" or p.suffix in WEIGHT_SUFFIXES)
    except OSError:
        return []
    return [file_identity(folder / name) for name in names]


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_identity(model: Any) -> dict[str, Any] | None:
    """What a loaded model contributes to the key (module docstring); None for None.

    A model whose runners have no ``model_insides``
    (:func:`~specdecode.models.backends.runner_capabilities`) runs from its file (a
    :class:`~specdecode.models.llamacpp.LlamaCppModel`: the file, its options and llama.cpp's
    build); else it is a ``transformers`` module (its class, config, modules, dtype, device and
    the files of its folder).

    Args:
        model: a :class:`~specdecode.models.llamacpp.LlamaCppModel` or a ``transformers`` model
            (``torch.nn.Module`` with a ``config``), or None.
    """
    if model is None:
        return None
    from specdecode.models.backends import runner_capabilities

    if not runner_capabilities(model).model_insides:
        options = dataclasses.asdict(model.options)
        return {"gguf": file_identity(model.path), "options": options, "on_gpu": bool(model.on_gpu), **_llama_cpp()}
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    name = str(model.name_or_path or "")
    folder = Path(name).expanduser()
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": _digest(config),
        "modules": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype),
        "device": str(model.device),
        "name_or_path": str(folder.resolve()) if name and folder.is_dir() else name,
        "files": folder_identity(folder) if name and folder.is_dir() else [],
    }


def _llama_cpp() -> dict[str, Any]:
    """llama-cpp-python's version and the installed build's key (None where unknown)."""
    from importlib.metadata import PackageNotFoundError, version

    from specdecode.models.llamacpp.build import installed_record

    try:
        package = version("llama_cpp_python")
    except PackageNotFoundError:
        package = None
    record = installed_record()
    return {"llama_cpp_python": package, "llama_cpp_build": record.get("key") if record else None}


def _option_identity(value: Any) -> Any:
    """An option's value; a str or path naming an existing file or folder also by its identity."""
    if isinstance(value, (str, os.PathLike)) and str(value) and Path(value).expanduser().exists():
        path = Path(value).expanduser()
        return {
            "value": str(value),
            "file": file_identity(path),
            "files": folder_identity(path) if path.is_dir() else [],
        }
    return value


def machine_identity() -> dict[str, Any]:
    """The machine: CPU model, a hash of its flags, architecture, cores (``os.cpu_count()`` and
    the ones this process may use), the names of the CUDA GPUs torch sees ([] without CUDA)."""
    import torch

    from specdecode.models.llamacpp.build import cpu_info

    cpu = cpu_info()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return {
        "cpu": cpu["model"],
        "cpu_flags": _digest(cpu["flags"]),
        "arch": cpu["machine"] or platform.machine(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "gpus": gpus,
    }


def _versions() -> dict[str, Any]:
    import torch
    import transformers

    import specdecode

    return {
        "specdecode": specdecode.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def cost_key(
    target: Any,
    draft: Any | None,
    *,
    batch_sizes: Sequence[int],
    tokens: Sequence[int],
    proposer: str | None,
    proposer_options: Mapping[str, Any],
    k: int,
) -> CostKey:
    """The key of a start-up measurement (module docstring): reads file sizes and mtimes, no weights.

    Args:
        target: the loaded target (llama.cpp or ``transformers``).
        draft: the loaded draft model, or None.
        batch_sizes, tokens: the grid of the target's table (as measured: sorted, no duplicates).
        proposer: the proposer whose draft cost is measured, or None.
        proposer_options: its options (JSON-ready values; others are written with ``str``).
        k: the tokens it drafts per call in the measurement.
    """
    from specdecode.cost import serve_measure  # the measuring code (torch, the engine): only when keying
    from specdecode.models.backends import backend_of

    ingredients = {
        "format": FORMAT,
        "measurement": serve_measure.MEASUREMENT_VERSION,
        "backend": backend_of(target),
        "versions": _versions(),
        "machine": machine_identity(),
        "target": model_identity(target),
        "draft": model_identity(draft),
        "batch_sizes": [int(b) for b in batch_sizes],
        "tokens": [int(t) for t in tokens],
        "proposer": proposer,
        "proposer_options": {name: _option_identity(v) for name, v in sorted(proposer_options.items())},
        "k": int(k),
    }
    ingredients = json.loads(json.dumps(ingredients, sort_keys=True, default=str))  # as a file gives it back
    return CostKey(ingredients, _digest(ingredients))


def cache_path(key: CostKey, folder: str | Path) -> Path:
    """``<folder>/<key.digest>.json``."""
    return Path(folder) / f"{key.digest}.json"


def load_cost_model(key: CostKey, folder: str | Path) -> CachedCost | None:
    """The cost model stored under ``key`` in ``folder``, or None: no file (a miss, nothing
    logged), or a file that cannot be read, is not this format's JSON, was stored under other
    ingredients or holds a model :meth:`CostModel.from_dict` refuses (a warning logged). A file
    read is marked used (its mtime: :data:`KEEP`). Never raises for the file's sake."""
    path = cache_path(key, folder)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as error:
        log.warning("cost model: ignoring the unreadable cache file %s (%s); measuring again", path, error)
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a cost-model file of format {FORMAT}")
        if data.get("key") != key.digest or data.get("ingredients") != key.ingredients:
            raise ValueError("it was stored under other ingredients")
        cost = CostModel.from_dict(data.get("cost_model"))
        measured_at, measure_s = str(data.get("measured_at", "?")), float(data.get("measure_s", 0.0))
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        log.warning("cost model: ignoring the corrupt cache file %s (%s); measuring again", path, error)
        return None
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache still serves
    return CachedCost(cost, path, measured_at, measure_s)


def store_cost_model(key: CostKey, cost: CostModel, folder: str | Path, measure_s: float) -> Path | None:
    """Write ``cost`` (as measured, before serving refines it) under ``key`` in ``folder`` (created
    if needed), atomically; then remove the least recently used files beyond :data:`KEEP`.

    Args:
        key: :func:`cost_key` of the measurement.
        cost: the measured model.
        folder: the cache folder (:func:`default_folder`).
        measure_s: seconds the measurement took (recorded, shown when it is loaded).

    Returns:
        the file written, or None when it could not be written (a warning logged; never raises
        for the folder's sake).
    """
    path = cache_path(key, folder)
    record = {
        "format": FORMAT,
        "key": key.digest,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "measure_s": round(float(measure_s), 3),
        "cost_model": cost.to_dict(),
        "ingredients": key.ingredients,
    }
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{key.digest}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as error:
        log.warning("cost model: could not store it in %s (%s); serving with the measured model", path, error)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return None
    _prune(path.parent, KEEP)
    return path


def _prune(folder: Path, keep: int) -> None:
    """Remove the least recently used ``*.json`` files of ``folder`` beyond ``keep`` (errors ignored)."""
    try:
        files = [(p.stat().st_mtime_ns, p) for p in folder.glob("*.json")]
    except OSError:
        return
    for _, old in sorted(files, reverse=True)[keep:]:
        try:
            old.unlink()
        except OSError:
            pass
