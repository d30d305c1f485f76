"""Each side of a step is charged its own time on a device that queues work (issue 49, item 5).

A CUDA pass returns as soon as its kernels are queued; read without a sync, the clock charges the
target's pass to whichever side next waits for the device (``generate --compare`` on an H100 said
target 0.016 s, draft 0.867 s for 64 passes). The engine and the scheduler read their clocks through
:func:`specdecode.models.torch.placement.device_clock`, which synchronizes first off the CPU. Here
the stand-in device (``fake_device.py``) is given a queue: a target pass adds work to it, a sync or
a host read waits for it (sleeps), as on CUDA.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from specdecode.models.torch import placement
from specdecode.models.torch.placement import device_clock

import fake_device
from device_cases import GREEDY, PROMPT, make_generator, make_models, place
from fake_device import STAND_IN, stand_in_device

PASS_S = 0.02  # what one queued target pass takes on the "device"


class Queue:
    """Work a device runs after the call that queued it: a sync or a host read waits for all of it."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.passes = 0

    def add(self, seconds: float) -> None:
        self.pending += seconds
        self.passes += 1

    def wait(self, *args: Any) -> None:
        time.sleep(self.pending)
        self.pending = 0.0


@pytest.fixture
def queue(monkeypatch: pytest.MonkeyPatch) -> Queue:
    """A queue behind the stand-in device: syncs and host reads wait for it."""
    q = Queue()
    monkeypatch.setattr(placement, "synchronize", q.wait)
    read = fake_device.StandInMode._read

    def waiting_read(self: Any, tensor: torch.Tensor) -> None:
        q.wait()
        read(self, tensor)

    monkeypatch.setattr(fake_device.StandInMode, "_read", waiting_read)
    return q


def queued(forward: Any, q: Queue) -> Any:
    """``forward`` that leaves :data:`PASS_S` of work queued when it returns."""

    def call(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        q.add(PASS_S)
        return out

    return call


def test_the_clock_syncs_before_each_read_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(placement, "synchronize", lambda device: events.append(f"sync {device}"))
    assert device_clock(torch.device("cpu")) is time.perf_counter  # the CPU: nothing to wait for
    clock = device_clock(torch.device("cuda", 0))
    before = time.perf_counter()
    assert clock() >= before and events == ["sync cuda:0"]
    clock()
    assert events == ["sync cuda:0"] * 2


def test_generate_charges_the_target_its_queued_passes(tiny_tokenizer, queue: Queue) -> None:
    models = make_models(tiny_tokenizer)
    with stand_in_device():
        generator = make_generator("draft_model", place(models, STAND_IN), tiny_tokenizer)
        generator.target.forward = queued(generator.target.forward, queue)  # type: ignore[method-assign]
        stats = generator.generate(PROMPT, GREEDY, raw=True).stats
    steps = queue.passes - 1  # the prefill's pass is timed apart
    assert steps >= 3 and stats.target_forward_passes == queue.passes
    assert stats.prefill_time_s >= PASS_S
    assert stats.target_time_s >= steps * PASS_S  # unsynchronized: ~0, the passes only queued
    assert stats.prefill_time_s + stats.target_time_s + stats.draft_time_s <= stats.wall_time_s


def test_the_scheduler_charges_the_target_its_queued_passes(chat_models, tiny_tokenizer, queue: Queue) -> None:
    from test_serve_scheduler import Client, make, run

    with stand_in_device():
        placed = place({"target": chat_models[0], "draft": chat_models[1]}, STAND_IN)
        scheduler = make((placed["target"], placed["draft"]), tiny_tokenizer, speculation="on")
        scheduler.runner.forward = queued(scheduler.runner.forward, queue)  # type: ignore[method-assign]
        client = Client(tiny_tokenizer.encode("def add(a, b):"), 16)
        scheduler.submit(client.req)
        run(scheduler)
    assert client.final is not None and client.final.summary["speculative"]["draft_tokens"] > 0
    phase = scheduler.metrics.step_phase
    steps = queue.passes - 1  # one prefill pass, then one batched pass per step
    assert phase.labels(phase="prefill")._sum.get() >= PASS_S
    assert phase.labels(phase="target")._sum.get() >= steps * PASS_S  # unsynchronized: ~0
