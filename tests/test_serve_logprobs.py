"""Log-probabilities through the server (issue 33): chat ``logprobs`` / ``top_logprobs`` and
completions ``logprobs``, whole and streamed, in OpenAI's shapes, each value equal to a plain
re-scoring of prompt + completion by the same target (one fresh forward, no cache), with speculation
on and off, greedy and sampled, several requests in one batch; bad input answered 400 naming the
field while the server keeps serving.

Tolerance: ``ATOL = 1e-4`` nats, absolute, on every log-probability: both sides are float32
``log_softmax`` of the same tiny target's logits, scored in the server's batched verification pass
(padded rows) against one plain forward (differences ~1e-6 here).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from specdecode.serve.config import ServeSettings
from specdecode.serve.logprob_fields import token_bytes
from specdecode.serve.server import BackgroundServer, build_app

ATOL = 1e-4  # nats; see the module docstring
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def server(chat_models, tiny_tokenizer):
    target, draft = chat_models
    settings = ServeSettings(model_name="tiny", speculation="on", max_batch_size=4)
    app, _ = build_app(target, tiny_tokenizer, settings, draft=draft)
    with BackgroundServer(app) as background:
        yield background.url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def rescored(target, prompt: list[int], emitted: list[int]) -> torch.Tensor:
    """float32 ``[len(emitted), V]``: log_softmax of one plain forward over prompt + emitted."""
    P = len(prompt)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + emitted])).logits[0].float()  # (P + m, V)
    return torch.log_softmax(logits[P - 1 : P - 1 + len(emitted)], dim=-1)  # (m, V)


def chat_prompt(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)  # as the server encodes it


def check_chat(content: list[dict], ids: list[int], ref: torch.Tensor, n: int, tokenizer) -> None:
    assert len(content) == len(ids) > 0
    for i, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert entry["token"] == tokenizer.decode([token])
        assert entry["bytes"] == list(token_bytes(tokenizer, token))
        assert abs(entry["logprob"] - float(ref[i, token])) <= ATOL
        assert len(entry["top_logprobs"]) == n
        best = torch.topk(ref[i], n).values.tolist()
        for alt, expected in zip(entry["top_logprobs"], best, strict=True):
            assert abs(alt["logprob"] - expected) <= ATOL


def check_completion(logprobs: dict, ids: list[int], ref: torch.Tensor, n: int, tokenizer) -> None:
    texts = [tokenizer.decode([t]) for t in ids]
    assert logprobs["tokens"] == texts
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs["text_offset"] == offsets
    for i, (token, value, top) in enumerate(
        zip(ids, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    ):
        assert abs(value - float(ref[i, token])) <= ATOL
        # the N likeliest and the chosen token, keyed by text (tokens of one text share a key: the likelier)
        best = torch.topk(ref[i], n)
        candidates = [*zip(best.indices.tolist(), best.values.tolist(), strict=True), (token, float(ref[i, token]))]
        assert set(top) == {tokenizer.decode([t]) for t, _ in candidates}
        for key, got in top.items():
            assert abs(got - max(v for t, v in candidates if tokenizer.decode([t]) == key)) <= ATOL


@pytest.mark.parametrize("options", [{}, {"speculative": False}], ids=["speculative", "target-only"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_logprobs_equal_rescoring(server, chat_models, tiny_tokenizer, options, temperature) -> None:
    extra = {"return_token_ids": True, "top_k": 5, **options}
    out = client(server).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=16,
        temperature=temperature,
        seed=3,
        logprobs=True,
        top_logprobs=4,
        extra_body=extra,
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    content = [c.model_dump() for c in choice.logprobs.content]  # parsed by the official client
    check_chat(content, ids, rescored(chat_models[0], chat_prompt(tiny_tokenizer), ids), 4, tiny_tokenizer)
    if not options:
        assert out.model_extra["speculative"]["draft_tokens"] > 0
    plain = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=temperature, seed=3, extra_body=extra
    )
    assert plain.choices[0].model_extra["token_ids"] == ids and plain.choices[0].logprobs is None


def test_chat_logprobs_without_top_logprobs_and_streamed(server, chat_models, tiny_tokenizer) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 14, "temperature": 0, "logprobs": True}
    whole = httpx.post(server + "/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=120).json()
    ids = whole["choices"][0]["token_ids"]
    content = whole["choices"][0]["logprobs"]["content"]
    check_chat(content, ids, rescored(chat_models[0], chat_prompt(tiny_tokenizer), ids), 0, tiny_tokenizer)
    streamed: list[dict] = []
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("role"):
                    assert choice["logprobs"] is None  # the role chunk carries no token
                else:
                    streamed += choice["logprobs"]["content"]
    assert streamed == content


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_rescoring(server, chat_models, tiny_tokenizer, stream) -> None:
    prompt = "for i in range(10):"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 15, "temperature": 0, "logprobs": 3}
    whole = httpx.post(server + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120).json()
    ids = whole["choices"][0]["token_ids"]
    logprobs = whole["choices"][0]["logprobs"]
    if stream:  # the chunks' logprobs put together, offsets continuing, are the whole response's
        pieces = list(client(server).completions.create(**body, stream=True))
        parts = [c.choices[0].logprobs for c in pieces if c.choices and c.choices[0].logprobs]
        logprobs = {key: sum((getattr(p, key) for p in parts), []) for key in logprobs}
    ref = rescored(chat_models[0], tiny_tokenizer.encode(prompt, add_special_tokens=True), ids)
    check_completion(logprobs, ids, ref, 3, tiny_tokenizer)


def test_concurrent_requests_in_one_batch_each_equal_rescoring(server, chat_models, tiny_tokenizer) -> None:
    prompts = ["def is_prime(n):", "class Stack:", "The quick brown fox", "def add(a, b):"]

    def ask(i: int) -> dict:
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 12 + 3 * i, "logprobs": 2}
        body |= {"temperature": 0.8 if i % 2 else 0, "seed": i, "return_token_ids": True}
        return httpx.post(server + "/v1/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(ask, range(4)))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = out["choices"][0]["token_ids"]
        ref = rescored(chat_models[0], tiny_tokenizer.encode(prompt, add_special_tokens=True), ids)
        check_completion(out["choices"][0]["logprobs"], ids, ref, 2, tiny_tokenizer)


BAD = [
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),  # chat's logprobs is a boolean
]


def test_top_logprobs_0_without_logprobs_is_off(server) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "top_logprobs": 0}
    r = httpx.post(server + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(("route", "fields", "name"), BAD)
def test_bad_logprobs_get_400_naming_the_field_and_the_server_keeps_serving(server, route, fields, name) -> None:
    base = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    base |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": MESSAGES}
    r = httpx.post(server + route, json={**base, **fields}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert name in error["message"] and error["type"] == "invalid_request_error", error
    ok = httpx.post(server + route, json={**base, "logprobs": True if "chat" in route else 0}, timeout=120)
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is not None
