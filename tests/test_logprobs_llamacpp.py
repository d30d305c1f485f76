"""Log-probabilities under speculation on the real llama.cpp target (the default GGUF pair), issue 33.

Re-scoring: a fresh runner of the same target scores prompt + emitted tokens as plain decoding
passes them (the prompt in one prefill pass, then the emitted tokens in one pass); the exact mode's
passes are batch-invariant (rows of a pass of up to ``invariant_tokens`` tokens are bit-identical to
one-token passes: tests/test_llamacpp.py), so every reported value must equal the re-scored one
exactly. Tolerance: ``ATOL = 0.0`` nats (bit-identical), chosen tokens and alternatives, greedy
(prompt lookup and the draft model, whose verification passes stop early at a wrong draft; token
trees, whose greedy walk decodes only the nodes it reads) and sampled. (Re-scoring prompt and
completion in ONE pass instead differs by up to ~0.06 nats here, with or without speculation
alike: the prompt's cache is then computed in other batch shapes.)

Skipped, with the reason, when llama-cpp-python or the model packages are not installed.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SamplingParams, SpeculativeGenerator

from conftest import load_default_gguf

pytestmark = pytest.mark.slow

ATOL = 0.0  # nats: bit-identical (see the module docstring)
PROMPT = "Write a Python function that checks whether a string is a palindrome."


@pytest.fixture(scope="module")
def pair():
    from specdecode.models.backends import load_llamacpp_tokenizer

    target = load_default_gguf("target")
    return target, load_default_gguf("draft"), load_llamacpp_tokenizer(target)


_RESCORED: dict[tuple, torch.Tensor] = {}


@pytest.fixture(scope="module", autouse=True)
def forget_rescorings():
    """The rescorings ([n, V] each) live as long as this module's tests."""
    yield
    _RESCORED.clear()


def rescored(target, prompt: list[int], emitted: list[int]) -> torch.Tensor:
    """float32 ``[len(emitted), V]`` log_softmax from a fresh runner: prefill, then the emitted tokens
    (once per prompt and tokens: the greedy cases below all emit plain decoding's tokens)."""
    key = (id(target), tuple(prompt), tuple(emitted))
    if key not in _RESCORED:
        _RESCORED[key] = _rescored(target, prompt, emitted)
    return _RESCORED[key]


def _rescored(target, prompt: list[int], emitted: list[int]) -> torch.Tensor:
    runner = target.make_runner()
    first = runner.forward(torch.tensor(prompt), num_logits=1)  # (1, V)
    rest = runner.forward(torch.tensor(emitted[:-1]), num_logits=len(emitted) - 1) if len(emitted) > 1 else first[:0]
    return torch.log_softmax(torch.cat([first, rest]).float(), dim=-1)  # (m, V)


GREEDY = SamplingParams(max_new_tokens=40)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=1, max_new_tokens=40)


@pytest.mark.parametrize(
    ("proposer", "sampling", "tree"),
    [
        (None, GREEDY, None),
        ("prompt_lookup", GREEDY, None),
        ("draft_model", GREEDY, None),
        ("draft_model", SAMPLED, None),
        ("draft_model", GREEDY, "tree8"),  # the depth-first walk decodes the greedy path's nodes
        ("draft_model", SAMPLED, "tree8"),
    ],
    ids=["off", "prompt_lookup", "draft_model", "draft_model-sampled", "tree", "tree-sampled"],
)
def test_logprobs_equal_rescoring_on_the_llamacpp_target(pair, proposer, sampling, tree) -> None:
    from specdecode.proposers import make_proposer

    target, draft, tokenizer = pair
    built = make_proposer(proposer, draft=draft, target=target) if proposer else None
    spec = SpeculativeGenerator(target, tokenizer=tokenizer, proposer=built)
    result = spec.generate(PROMPT, sampling, logprobs=5, tree=tree, schedule="ungated")  # every draft sent
    ids = result.token_ids
    assert len(result.logprobs) == len(ids) > 1
    if proposer is not None:  # accepted drafts (the greedy draft model: all of them, bonus tokens)
        assert result.stats.accepted_tokens > 0
    if proposer == "prompt_lookup":  # rejections: recovered tokens, passes stopped early
        assert result.stats.accepted_tokens < result.stats.draft_tokens
    ref = rescored(target, spec.encode_prompt(PROMPT).tolist(), ids)
    for i, (entry, token) in enumerate(zip(result.logprobs, ids, strict=True)):
        assert entry.token_id == token and abs(entry.logprob - float(ref[i, token])) <= ATOL, i
        best = torch.topk(ref[i], 5)
        assert [t for t, _ in entry.top] == best.indices.tolist(), i
        assert all(abs(v - e) <= ATOL for (_, v), e in zip(entry.top, best.values.tolist(), strict=True)), i


def test_server_logprobs_on_llamacpp_equal_decoding_alone(pair) -> None:
    """The llama.cpp server (one context for every row, prompt lookup, passes stopped early at a
    wrong greedy draft): concurrent completions' log-probabilities equal, bit for bit (``ATOL``),
    those of the same prompt decoded alone without speculation on this backend."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from test_serve import Server

    target, _, tokenizer = pair
    prompts = [PROMPT, "Translate to French: the cat sleeps on the warm stone.", "def running_sum(xs):"]
    plain = SpeculativeGenerator(target, tokenizer=tokenizer)
    options = dict(proposer="prompt_lookup", proposer_options={"min_ngram": 2}, kv_budget_tokens=4 * 1024)
    with Server(target, tokenizer, speculation="on", max_batch_size=4, **options) as server:

        def ask(prompt: str) -> dict:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 3}
            return httpx.post(server.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=600)

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = [r.json() for r in pool.map(ask, prompts)]
    drafted = 0
    for prompt, out in zip(prompts, answers, strict=True):
        choice = out["choices"][0]
        ids = tokenizer.encode(prompt)  # as the server encodes a completion's prompt
        alone = plain.generate(ids, SamplingParams(max_new_tokens=32), speculative=False, logprobs=3)
        assert choice["token_ids"] == alone.token_ids
        logprobs = choice["logprobs"]
        assert all(abs(a - e.logprob) <= ATOL for a, e in zip(logprobs["token_logprobs"], alone.logprobs, strict=True))
        for top, e in zip(logprobs["top_logprobs"], alone.logprobs, strict=True):
            expected: dict[str, float] = {}  # the 3 alternatives and the chosen token, by text (the likelier first)
            for t, lp in [*e.top, (e.token_id, e.logprob)]:
                expected.setdefault(tokenizer.decode([t]), lp)
            assert top == expected  # JSON carries floats exactly
        drafted += out["speculative"]["draft_tokens"]
    assert drafted > 0
