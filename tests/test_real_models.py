"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), installed by scripts/test.sh.

Skipped, with the reason, when the model packages are not installed."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.errors import ModelNotFoundError
from specdecode.models.default import DEFAULT_DRAFT, DEFAULT_TARGET, part_paths

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def all_cores():
    """Real models do use intra-op threads (conftest sets one thread for the tiny models)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def real_pair() -> SpeculativeGenerator:
    try:
        part_paths(DEFAULT_TARGET), part_paths(DEFAULT_DRAFT)
    except ModelNotFoundError as error:
        pytest.skip(f"default models not installed: {error}")
    return SpeculativeGenerator.from_pretrained(dtype="float32")


def test_real_pair_greedy_float32_equals_target_only(real_pair: SpeculativeGenerator) -> None:
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    sampling = SamplingParams(max_new_tokens=24)
    baseline = real_pair.generate(prompt, sampling, speculative=False)
    result = real_pair.generate(prompt, sampling, num_speculative_tokens=4)
    assert result.token_ids == baseline.token_ids
    assert len(result.token_ids) == 24
    assert result.stats.acceptance_rate > 0.3  # the 0.5B draft does agree with the 1.5B target
    assert "def" in result.text


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_shipped_drafters_load_on_the_real_target_and_stay_lossless(real_pair: SpeculativeGenerator, kind: str) -> None:
    """The drafters trained for the default target ship in specdecode/data/drafters (lab/notebook/
    2026-11-25-shipped-drafters.md): they load on it (identity checked), reproduce target-only
    greedy decoding in float32, and draft tokens it keeps on a coding request."""
    from specdecode.drafters import shipped_drafter_dir
    from specdecode.proposers import make_proposer

    target = real_pair.target.model
    folder = shipped_drafter_dir(kind, target)
    assert (folder / "drafter.json").is_file(), f"no shipped {kind} drafter in {folder}"
    generator = SpeculativeGenerator(
        target, tokenizer=real_pair.tokenizer, proposer=make_proposer(kind, target=target, drafter=str(folder))
    )
    prompt = (
        "Complete the following Python function:\n```python\ndef count_vowels(text: str) -> int:\n"
        '    """Return how many characters of text are vowels (a, e, i, o, u; either case)."""\n```'
    )
    sampling = SamplingParams(max_new_tokens=32)
    baseline = real_pair.generate(prompt, sampling, speculative=False)
    result = generator.generate(prompt, sampling, num_speculative_tokens=4)
    assert result.token_ids == baseline.token_ids
    assert result.stats.proposer == kind
    assert result.stats.mean_acceptance_length > 1.2  # trained: more than the one token a target step gives
