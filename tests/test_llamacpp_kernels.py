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


def test_a_prompts_first_pass_keeps_the_fast_kernels_past_three_tokens() -> None:
    """With wide invariant passes (the patched build's 64), a verification pass of 40 tokens runs
    on the reference kernels, but a prompt's first pass of 40 (every sequence starting at position
    0: the same pass for plain and speculative decoding) keeps llama.cpp's fast kernels."""
    calls: list[bool] = []
    kernels = ReferenceKernels(lambda backend, on: calls.append(on), 1, invariant_tokens=64)
    kernels.before_pass(40, prompt=True)
    assert not kernels.on and calls == []
    kernels.before_pass(3, prompt=True)  # a prompt of at most 3 tokens: as before the patch
    assert kernels.on
    kernels.before_pass(40)
    assert kernels.on and calls == [True]
    kernels.before_pass(65)
    assert not kernels.on and calls == [True, False]


def test_every_pass_keeps_the_switch_on_prefills_included() -> None:
    """On a patched build (``every_pass``) every pass runs on the reference kernels, a prompt's
    first pass of any width included: each cell is what one-token decoding writes."""
    calls: list[bool] = []
    kernels = ReferenceKernels(lambda backend, on: calls.append(on), 1, invariant_tokens=64, every_pass=True)
    for n, prompt in ((512, True), (40, True), (1, False), (65, False)):
        kernels.before_pass(n, prompt=prompt)
        assert kernels.on
    assert calls == [True]
