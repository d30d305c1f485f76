"""Structured output on the real default GGUF target (llama.cpp backend, exact mode), issue 33:
a JSON-schema-constrained greedy generation with prompt lookup is token for token constrained
decoding by the target alone (written here with llguidance and one-token llama.cpp passes), and
so is the server's ``response_format`` ``json_schema`` answer; both validate against the schema.

Skipped, with the reason, when llama-cpp-python or the model packages are not installed.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import JsonSchema
from test_serve import Server

from conftest import load_default_gguf

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
        "job": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city", "job"],
    "additionalProperties": False,
}
PROMPT = "Extract the person as JSON (name, age, city, job): Maria Lopez, 34, lives in Lisbon and works as a biologist."
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def target():
    from specdecode.models.backends import load_llamacpp_tokenizer

    model = load_default_gguf("target", threads=2)  # exact mode: the default
    return model, load_llamacpp_tokenizer(model)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


_REFERENCE: dict[tuple, list[int]] = {}


def reference_constrained(model, tokenizer, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Constrained greedy decoding by the target alone: the prompt in one pass, then one token per
    pass, each token the argmax of the logits with every token llguidance forbids masked out
    (decoded once per model, prompt, length and EOS ids: the three tests below share it)."""
    key = (id(model), tuple(prompt), n, frozenset(eos))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_constrained(model, tokenizer, prompt, n, eos)
    return list(_REFERENCE[key])


def _reference_constrained(model, tokenizer, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    import llguidance
    import llguidance.hf

    from specdecode.constraints.spec import compile_constraint

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model.vocab_size, eos_token=sorted(eos))
    matcher = llguidance.LLMatcher(lltok, compile_constraint(JsonSchema(SCHEMA), lltok), log_level=0)
    runner = model.make_runner()
    logits = runner.forward(torch.tensor(prompt))[-1]
    out: list[int] = []
    for _ in range(n):
        allowed = torch.frombuffer(bytearray(llguidance.LLMatcher.compute_logit_bias(matcher)), dtype=torch.uint8)
        mask = allowed[: logits.shape[-1]] > 0
        token = int(logits.masked_fill(~mask, float("-inf")).argmax())
        out.append(token)
        if token in eos:
            break
        assert matcher.consume_tokens([token])
        logits = runner.forward(torch.tensor([token]))[-1]
    return out


def _valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def test_constrained_prompt_lookup_equals_constrained_target_only(target) -> None:
    from specdecode.proposers import make_proposer

    model, tokenizer = target
    spec = SpeculativeGenerator(model, tokenizer=tokenizer, proposer=make_proposer("prompt_lookup", target=model))
    prompt = chat_ids(tokenizer, PROMPT)
    expected = reference_constrained(model, tokenizer, prompt, MAX_TOKENS, set(spec.eos_token_ids))
    result = spec.generate(prompt, SamplingParams(max_new_tokens=MAX_TOKENS), constraint=JsonSchema(SCHEMA))
    assert result.token_ids == expected
    assert result.finish_reason == "stop", "the answer completes the schema within the budget"
    _valid(result.text)
    assert "Lisbon" in result.text
    stats = result.stats
    assert stats.accepted_tokens > 5, "prompt lookup and forced tokens were drafted and accepted"
    assert stats.target_forward_passes < len(expected), "speculation saved target passes"


def test_server_json_schema_on_llamacpp_equals_constrained_target_only(target) -> None:
    model, tokenizer = target
    options = dict(model_name="qwen", proposer="prompt_lookup", proposer_options={"min_ngram": 2})
    with Server(model, tokenizer, speculation="on", max_batch_size=2, kv_budget_tokens=2048, **options) as server:
        out = server.client().chat.completions.create(
            model="qwen",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            max_tokens=MAX_TOKENS,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
            extra_body={"return_token_ids": True},
        )
    choice = out.choices[0]
    eos = set(SpeculativeGenerator(model, tokenizer=tokenizer).eos_token_ids)
    prompt = choice.model_extra["prompt_token_ids"]
    assert prompt == chat_ids(tokenizer, PROMPT)
    expected = reference_constrained(model, tokenizer, prompt, MAX_TOKENS, eos)
    assert choice.model_extra["token_ids"] == expected
    assert choice.finish_reason == "stop"
    _valid(choice.message.content)
    assert out.model_extra["speculative"]["enabled"]


def test_constrained_tree_with_forced_chains_equals_constrained_target_only(target) -> None:
    """Token trees of the draft model under the schema on llama.cpp (the depth-first walk over every
    node): branches cut by the grammar, forced tokens added as chains, and the output still token for
    token constrained target-only decoding."""
    from specdecode.proposers import make_proposer

    model, tokenizer = target
    draft = load_default_gguf("draft", threads=2)
    spec = SpeculativeGenerator(
        model, tokenizer=tokenizer, proposer=make_proposer("draft_model", draft=draft, target=model)
    )
    prompt = chat_ids(tokenizer, PROMPT)
    expected = reference_constrained(model, tokenizer, prompt, MAX_TOKENS, set(spec.eos_token_ids))
    result = spec.generate(
        prompt, SamplingParams(max_new_tokens=MAX_TOKENS), tree="tree8", constraint=JsonSchema(SCHEMA)
    )
    assert result.token_ids == expected
    _valid(result.text)
    assert result.stats.accepted_tokens > 5
