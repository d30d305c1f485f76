"""Proposers that read more than token ids, on the llamacpp backend (issue 31), real GGUF files.

- ``eagle`` / ``medusa``: the shipped drafters run in torch on llama.cpp's final hidden states,
  scoring with the LM-head rows and embeddings dequantized from the target's GGUF file;
- ``cross_tokenizer``: SmolLM2-135M's GGUF drafts text for the Qwen target, in its own llama.cpp
  context;
- ``early_exit`` reads the torch model's layers: refused, naming the proposer and the backend.

Greedy output equals plain decoding on this backend in each case (chains and a tree).
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.errors import ModelNotFoundError

from conftest import plain_greedy, require_default_gguf

pytestmark = pytest.mark.slow

PROMPT = (
    "Complete the following Python function:\n```python\ndef running_sum(xs: list[int]) -> list[int]:\n"
    '    """Return the running sums of xs: running_sum([1, 2, 3]) == [1, 3, 6]."""\n```'
)


def _generator(**options) -> SpeculativeGenerator:
    """``from_pretrained`` on llama.cpp: the target is the session's (conftest shares GGUF loads)."""
    require_default_gguf("target")
    try:
        return SpeculativeGenerator.from_pretrained(backend="llamacpp", threads=2, **options)
    except ModelNotFoundError as error:
        pytest.skip(f"models not installed: {error}")


@pytest.fixture(scope="module")
def eagle() -> SpeculativeGenerator:
    return _generator(proposer="eagle")


@pytest.fixture(scope="module")
def medusa() -> SpeculativeGenerator:
    return _generator(proposer="medusa")


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_trained_drafters_on_llamacpp_features_equal_plain_decoding(kind: str, request) -> None:
    generator = request.getfixturevalue(kind)
    drafter = generator.proposer.drafter
    assert drafter.head_quantized  # head_quantization auto: int8 rows on the CPU
    sampling = SamplingParams(max_new_tokens=40)
    ids = generator.encode_prompt(PROMPT).tolist()
    plain = plain_greedy(generator.target.model, ids, 40, generator.tokenizer)  # once for every test here
    chain = generator.generate(ids, sampling)
    tree = generator.generate(ids, sampling, tree="default")
    assert chain.token_ids == plain and tree.token_ids == plain
    assert chain.stats.proposer == kind and chain.stats.accepted_tokens > 0 and tree.stats.accepted_tokens > 0


def test_gguf_embeddings_are_the_rows_llama_cpp_reads(eagle) -> None:
    from specdecode.models.llamacpp.gguf_tensors import GGUFTargetParts

    generator = eagle
    target = generator.target.model
    parts = GGUFTargetParts(target.path)
    ids = torch.tensor([[0, 151643], [320, 7]])
    rows = generator.proposer.drafter.embed(ids)  # (2, 2, H) float32, dequantized per call
    assert rows.shape == (2, 2, target.hidden_size) and rows.dtype == torch.float32
    assert torch.equal(rows[1, 0], parts.embeddings.take([320])[0])
    # the head rows: llama.cpp's logits are output.weight @ hidden, so re-scoring its hidden states
    # with the dequantized rows gives its logits up to float rounding
    runner = target.make_runner(n_ctx=64)
    logits, hidden = runner.forward(torch.tensor([9707, 11, 1879]), num_logits=1, return_hidden=True)
    head = parts.head.take([int(logits[0].argmax()), 0, 1000])  # (3, H)
    mine = head @ hidden[-1]  # (3,)
    expected = logits[0, [int(logits[0].argmax()), 0, 1000]]
    assert torch.allclose(mine, expected, rtol=1e-3, atol=1e-2 * (1 + float(expected.abs().max())))
    with pytest.raises(ValueError, match="row ids"):
        parts.head.take([target.vocab_size])


def test_cross_tokenizer_smollm2_gguf_equals_plain_decoding(capsys) -> None:
    generator = _generator(draft="smollm2")  # draft_model asked, another vocabulary: cross_tokenizer
    assert generator.proposer.name == "cross_tokenizer"
    assert type(generator.proposer.runner).__name__ == "LlamaCppRunner"
    assert "cross_tokenizer" in capsys.readouterr().err
    ids = generator.encode_prompt(PROMPT).tolist()
    speculative = generator.generate(ids, SamplingParams(max_new_tokens=40))
    assert speculative.token_ids == plain_greedy(generator.target.model, ids, 40, generator.tokenizer)
    assert speculative.stats.drafts > 0


def test_early_exit_is_refused_naming_proposer_and_backend() -> None:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/setup.sh builds it)")
    with pytest.raises(ValueError, match=r"'early_exit' is not available on the llamacpp backend \(it runs on torch\)"):
        SpeculativeGenerator.from_pretrained(backend="llamacpp", proposer="early_exit")
