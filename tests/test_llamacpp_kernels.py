"""The reference-kernel switch exact mode sets before every llama.cpp pass
(:mod:`specdecode.models.llamacpp.kernels`): on for passes of at most ``invariant_tokens`` tokens,
off for longer ones, one call per change. The real-model checks (invariance with flash attention on,
and what happens without the switch) are in ``tests/test_llamacpp.py``."""

from __future__ import annotations

from specdecode.models.llamacpp.kernels import ReferenceKernels


def test_the_switch_is_on_for_invariant_passes_and_set_only_when_it_changes() -> None:
    calls: list[tuple[int, bool]] = []
    kernels = ReferenceKernels(lambda backend, on: calls.append((backend, on)), 1234, invariant_tokens=3)
    assert not kernels.on  # llama.cpp's default
    kernels.before_pass(512)  # a prefill: the fast kernels, already on
    assert calls == [] and not kernels.on
    for n in (1, 3, 2, 1):  # decoding and verification chunks
        kernels.before_pass(n)
    assert calls == [(1234, True)] and kernels.on
    kernels.before_pass(4)
    kernels.before_pass(40)
    assert calls == [(1234, True), (1234, False)] and not kernels.on
