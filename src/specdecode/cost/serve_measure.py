"""The server's start-up measurement of its cost model (:mod:`specdecode.cost.serve_model`).

``specdecode serve --speculation adaptive`` measures, before it serves
(:meth:`Scheduler.calibrate <specdecode.serve.scheduler.Scheduler.calibrate>`), what one batched
target pass costs on a grid of batch sizes and tokens per row (:func:`measure_target_costs`, the
grid from :func:`default_batch_grid`) and what its default proposer takes per drafted token
(:func:`measure_draft_cost`), in a thread that ends with the measurement (:func:`in_own_thread`).
A restarted server may load that measurement from disk instead (:mod:`specdecode.cost.cache`),
under a key that includes :data:`MEASUREMENT_VERSION`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdecode.cost.serve_model import CostModel
from specdecode.engine import needs_features
from specdecode.sampling import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MEASUREMENT_VERSION = 1
"""The version of the start-up measurement, part of the cost cache's key (:func:`specdecode.cost.cache.cost_key`).

Raise it when the measurement changes what it returns: :func:`measure_target_costs`,
:func:`monotone`, :func:`measure_draft_cost`, or what
:meth:`Scheduler.calibrate <specdecode.serve.scheduler.Scheduler.calibrate>` and its
``_calibration_grid`` measure (the context, the repeats, which pass is kept, the grid's rule). A
stored model measured otherwise is then measured again instead of loaded. Editing their comments
or docstrings leaves it alone. (The grid itself, the models, the versions of the libraries and the
machine are in the key already.)
"""


def in_own_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run in a thread of its own that ends with it; its result returned, its exception raised.

    Model passes made at start-up from a thread that lives on (the server's event loop) would leave
    that thread a pool of OpenMP worker threads: llama.cpp's CPU backend (built with OpenMP) runs
    each pass as an ``omp parallel`` region, and libgomp keeps one pool per thread that ever opened
    one. With more pooled threads than cores, libgomp shortens its barrier spinning, and every
    operator's barrier in every later pass then sleeps and wakes: measured on 2 cores, a one-token
    pass of the 1.5B target in the scheduler thread took 37 ms after a calibration in another live
    thread, 27-29 ms without one or after one in a thread that had ended. Passes made here leave
    nothing behind.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            box["error"] = error

    thread = threading.Thread(target=run, name="specdecode-calibration")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def default_batch_grid(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... and ``max_batch_size`` itself."""
    grid, b = [], 1
    while b < max_batch_size:
        grid.append(b)
        b *= 2
    return grid + [max_batch_size]


def measure_target_costs(
    model: PreTrainedModel | Any,
    batch_sizes: Sequence[int],
    tokens: Sequence[int],
    context: int = 64,
    repeats: int = 3,
) -> CostModel:
    """Time one batched target pass for every (B, T) of the grid, after ``context`` cached tokens per row.

    Uses its own batched runner (:func:`~specdecode.models.backends.make_batched_runner`: its own
    cache), so it can run
    before serving starts. One warm-up sweep over the grid, then ``repeats`` timed sweeps; each
    point keeps its fastest pass (the least disturbed by other processes). Sweeping the whole grid
    per repeat, rather than repeating one point before the next, spreads a disturbance of a few
    seconds over one sample of many points instead of every sample of a few: measured point by
    point, one slow second could price T = 2 at B = 1 well above T = 1 and switch drafting off for
    the server's life. The table is then made monotone (:func:`monotone`).

    Returns:
        a :class:`CostModel` without draft costs.
    """
    from specdecode.models.backends import make_batched_runner
    from specdecode.models.torch.placement import synchronize

    batch_sizes, tokens = sorted(set(batch_sizes)), sorted(set(tokens))
    runner = make_batched_runner(model, max(batch_sizes), context + max(tokens))
    g = torch.Generator().manual_seed(0)
    V = runner.vocab_size
    prompt = torch.randint(0, V, (context,), generator=g)
    step = torch.randint(0, V, (max(tokens),), generator=g)
    for _ in range(max(batch_sizes)):
        runner.add_row()
    runner.forward(0, [prompt] * runner.num_rows, [1] * runner.num_rows)
    table = [[math.inf] * len(tokens) for _ in batch_sizes]
    for sweep in range(repeats + 1):
        for i, B in enumerate(batch_sizes):
            for j, T in enumerate(tokens):
                for r in range(B):
                    runner.truncate(r, context)
                synchronize(runner.device)
                tic = time.perf_counter()
                runner.forward(0, [step[:T]] * B, [T] * B)
                synchronize(runner.device)
                if sweep > 0:  # sweep 0 warms every shape up
                    table[i][j] = min(table[i][j], time.perf_counter() - tic)
    return CostModel(list(batch_sizes), list(tokens), monotone(table))


def monotone(table: list[list[float]]) -> list[list[float]]:
    """The table made non-decreasing along both axes by a running *minimum* from the largest pass
    down: a pass over fewer rows or tokens never costs more than one over more. Timing noise on a
    shared machine only ever slows a pass down, so where two points disagree the faster one is
    the better estimate (a running maximum from the smallest pass up would instead let one slow
    B = 1 sample raise the whole table, making every larger batch look as cheap as B = 1)."""
    out = [list(row) for row in table]
    for i in reversed(range(len(out))):
        for j in reversed(range(len(out[i]))):
            if j + 1 < len(out[i]):
                out[i][j] = min(out[i][j], out[i][j + 1])
            if i + 1 < len(out):
                out[i][j] = min(out[i][j], out[i + 1][j])
    return out


def measure_draft_cost(proposer: object, vocab_size: int, k: int, context: int = 64, repeats: int = 3) -> float:
    """Seconds per drafted token of ``proposer`` (greedy, a random ``context``-token prompt).

    A proposer that drafts nothing on random text (prompt lookup) is charged its call time per
    requested token. A proposer that reads the target's features (Medusa, EAGLE) gets random ones
    of its drafter's width and dtype. The fastest of ``repeats`` timed calls (after one warm-up) is kept.
    """
    g = torch.Generator().manual_seed(0)
    sampling = SamplingParams()
    drafter = proposer.drafter if needs_features(proposer) else None  # type: ignore[attr-defined]  # ProposerBase

    def features(m: int) -> None:  # the target's features of the next m positions, as the scheduler passes them
        if drafter is not None:
            weight = next(drafter.parameters())
            rows = torch.randn(m, drafter.config.hidden_size, generator=g).to(weight.device, weight.dtype)
            proposer.observe_features(rows)  # type: ignore[attr-defined]

    times = []
    for _ in range(repeats + 1):
        proposer.reset()  # type: ignore[attr-defined]
        ids = torch.randint(0, vocab_size, (context,), generator=g)
        features(context - 1)
        proposer.propose(ids, 1, sampling, None)  # type: ignore[attr-defined]  # sync the proposer's cache first
        ids = torch.cat([ids, torch.randint(0, vocab_size, (1,), generator=g)])
        features(1)
        tic = time.perf_counter()
        draft = proposer.propose(ids, k, sampling, None)  # type: ignore[attr-defined]
        times.append((time.perf_counter() - tic) / max(1, len(draft)))
    proposer.reset()  # type: ignore[attr-defined]
    return min(times[1:])
