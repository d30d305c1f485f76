"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft) on torch in bfloat16 on the CPU,
exact passes (the default there), installed by scripts/test.sh: loaded once per session
(``real_bf16_pair`` / ``real_pair`` in conftest.py, whose tests run last; tests/test_exact_bf16.py
decodes more turns with the same pair).

Skipped, with the reason, when the model packages are not installed (decided without loading them)."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.errors import ModelNotFoundError

from conftest import plain_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def all_cores():
    """Real models do use intra-op threads (conftest sets one thread for the tiny models)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


def test_real_pair_greedy_equals_target_only(real_pair: SpeculativeGenerator) -> None:
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
    greedy decoding in bf16 (exact passes), and draft tokens it keeps on a coding request."""
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
    ids = real_pair.encode_prompt(prompt).tolist()
    baseline = plain_greedy(target, ids, 32, real_pair.tokenizer)  # once for both drafters (conftest)
    result = generator.generate(ids, sampling)  # the drafter's own k (2: what users get)
    assert result.token_ids == baseline
    assert result.stats.proposer == kind
    assert result.stats.mean_acceptance_length > 1.2  # trained: more than the one token a target step gives


def test_real_target_with_smollm2_draft_greedy(real_pair: SpeculativeGenerator) -> None:
    """Qwen2.5-Coder-1.5B-Instruct drafted for by SmolLM2-135M-Instruct (another tokenizer): the load
    path picks ``cross_tokenizer`` for this draft (``plan_models``, as ``from_pretrained(draft="smollm2")``
    plans it), and the proposer it builds on the shared bf16 target gives identical greedy output."""
    from specdecode.load import plan_models
    from specdecode.models.default import SMOLLM2, part_paths
    from specdecode.models.torch.hf_loading import load_model
    from specdecode.proposers import PROPOSERS

    try:
        part_paths(SMOLLM2)
    except ModelNotFoundError as error:
        pytest.skip(f"models not installed: {error}")
    plan = plan_models(None, "smollm2", backend="torch", dtype="bfloat16", device="cpu")
    assert plan.backend == "torch" and plan.proposer == "cross_tokenizer"
    target = real_pair.target.model
    proposer = PROPOSERS[plan.proposer].build(plan.config, target, load_model(plan.draft, "draft", plan.dtype))
    spec = SpeculativeGenerator(target, tokenizer=real_pair.tokenizer, proposer=proposer)
    prompt = "Write a Python function that checks whether a number is prime."
    sampling = SamplingParams(max_new_tokens=16)
    result = spec.generate(prompt, sampling, num_speculative_tokens=4)
    assert result.stats.proposer == "cross_tokenizer"
    assert result.token_ids == real_pair.generate(prompt, sampling, speculative=False).token_ids
    assert result.stats.acceptance_rate > 0.3
