"""Exact mode with every layer on a GPU follows the rule measured there, not the CPU's: passes of
up to ``GPU_INVARIANT_TOKENS`` tokens are one pass (bit-identical on CUDA, measured on an H100:
lab/results/issue42-h100/run2), flash attention is llama.cpp's choice, and no CPU reference
kernels are switched. A caller's own ``invariant_tokens`` always wins; a CPU model keeps the CPU
rule (wide passes on a build with specdecode's batch-invariance patch, else 3 tokens)."""

from __future__ import annotations

from specdecode.models.llamacpp.model import (
    GPU_INVARIANT_TOKENS,
    INVARIANT_TOKENS,
    PATCHED_INVARIANT_TOKENS,
    LlamaCppOptions,
    _lib,
    new_context,
    options_for_placement,
)

from conftest import load_default_gguf


def test_exact_mode_on_a_gpu_verifies_up_to_the_measured_width_in_one_pass() -> None:
    options = LlamaCppOptions()
    assert options.invariant_tokens == INVARIANT_TOKENS[True] and not options.invariant_tokens_given
    gpu = options_for_placement(options, all_layers_on_gpu=True)
    assert gpu.invariant_tokens == GPU_INVARIANT_TOKENS == 9 and gpu.exact
    assert not gpu.invariant_tokens_given  # a second placement would change nothing either
    assert options_for_placement(gpu, all_layers_on_gpu=True) == gpu
    assert options_for_placement(options, all_layers_on_gpu=False) is options  # CPU (or part of the layers)


def test_a_callers_invariant_tokens_and_fast_mode_are_left_alone() -> None:
    given = LlamaCppOptions(invariant_tokens=2)
    assert given.invariant_tokens_given
    assert options_for_placement(given, all_layers_on_gpu=True).invariant_tokens == 2
    fast = LlamaCppOptions(exact=False)
    assert options_for_placement(fast, all_layers_on_gpu=True) is fast


def test_a_model_on_the_cpu_keeps_the_cpu_rule_and_a_gpu_context_skips_the_reference_kernels() -> None:
    """On this CPU build the model is not on a GPU (CPU rule; exact mode's context switches the CPU
    reference kernels); a context made as if every layer were on a GPU gets no switch."""
    from specdecode.models.llamacpp.kernels import invariant_rows

    model = load_default_gguf("draft")  # the session's (conftest): left as it was loaded
    assert not model.on_gpu
    assert model.options.invariant_tokens == (PATCHED_INVARIANT_TOKENS if invariant_rows() else INVARIANT_TOKENS[True])
    try:
        for on_gpu, expect_kernels in ((False, True), (True, False)):
            model.on_gpu = on_gpu  # True: as a CUDA build with every layer offloaded sets it
            ctx, kernels = new_context(model, 256)
            try:
                assert (kernels is not None) == expect_kernels
            finally:
                _lib().llama_free(ctx)
    finally:
        model.on_gpu = False
