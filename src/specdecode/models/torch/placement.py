"""Where the torch backend's models run: ``--device``, and what a GPU placement turns on.

``auto`` is the CUDA GPU where torch sees one (``cuda``, device 0), else the CPU. On a CUDA device the
loaded models are moved there and, unless ``cuda_graphs=False``, marked for the static KV cache and
CUDA graphs (:func:`~specdecode.models.torch.static_runner.use_static_cache`): every runner made of
them keeps a preallocated cache and replays one captured graph per pass width (docs/design.md §2c).
Apple's ``mps`` may be named; it is not tested here and gets eager runners.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N", "mps")
"""What ``--device`` accepts (``cuda:N``: the N-th CUDA device)."""


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """The torch device ``device`` names (None or ``"auto"``: ``cuda`` where available, else ``cpu``).

    Raises:
        ValueError: not a device name of :data:`DEVICE_CHOICES`, or a device this torch cannot use
            (CUDA on a CPU-only build or without a GPU, a CUDA index beyond the GPUs present, MPS
            where it is not available); the message names ``device`` and what is present.
    """
    if device is None or device == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be one of {list(DEVICE_CHOICES)}, got {device!r}") from error
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
            raise ValueError(f"device {str(device)!r} was asked for, but {why} (use --device cpu or auto)")
        index = 0 if parsed.index is None else parsed.index
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(
                f"device {str(device)!r}: only {count} CUDA device(s) are present (cuda:0 .. cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    if parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {str(device)!r} was asked for, but MPS is not available here")
        return torch.device("mps")
    raise ValueError(f"device must be one of {list(DEVICE_CHOICES)}, got {device!r}")


def place_model(
    model: torch.nn.Module, device: torch.device, cuda_graphs: bool = True, exact: bool = False
) -> torch.nn.Module:
    """Move a loaded model to ``device`` (nothing for the CPU); on a CUDA device with ``cuda_graphs``,
    mark it for the static KV cache and CUDA graphs; with ``exact`` (a CUDA device), for fixed-width
    passes too (:attr:`~specdecode.models.torch.static_runner.StaticCacheSettings.exact_width`, every
    row of a verification pass bit-identical to a one-token pass; eager with ``cuda_graphs=False``).
    Returns the model."""
    if device.type == "cpu":
        return model
    model = model.to(device)
    if device.type == "cuda" and (cuda_graphs or exact):
        from specdecode.models.torch.static_runner import DEFAULT_EXACT_WIDTH, StaticCacheSettings, use_static_cache

        settings = StaticCacheSettings(cuda_graphs=cuda_graphs, exact_width=DEFAULT_EXACT_WIDTH if exact else None)
        use_static_cache(model, settings)  # type: ignore[arg-type]
    return model


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA, MPS; nothing on the CPU): around a timed pass, so the
    time is the pass's, not its launch's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def device_clock(device: torch.device) -> Callable[[], float]:
    """A clock for timing the two sides of a decoding step on ``device``: ``time.perf_counter`` on
    the CPU (work runs as it is called); elsewhere ``time.perf_counter`` read after
    :func:`synchronize`. CUDA and MPS queue work: read unsynchronized, a pass's time is its launch's,
    and the pass is charged to the next side that waits for it (the draft's host reads after the
    target's replay: issue 49, item 5)."""
    if device.type == "cpu":
        return time.perf_counter

    def clock() -> float:
        synchronize(device)
        return time.perf_counter()

    return clock
