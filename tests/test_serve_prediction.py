"""OpenAI's Predicted Outputs on ``specdecode serve``: ``prediction`` on chat and text completions,
``usage.completion_tokens_details``, streaming, log-probabilities, sampling, bad shapes (400
naming the field, the server serving on), and the audit log (tiny float32 models, real HTTP)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from test_serve import Server, extra, greedy_reference

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server(chat_models, tiny_tokenizer, tmp_path_factory):
    audit = tmp_path_factory.mktemp("audit") / "prediction.jsonl"
    target, draft = chat_models
    with Server(target, tiny_tokenizer, draft, speculation="on", max_batch_size=2, audit_log=str(audit),
                proposer="prompt_lookup") as s:  # fmt: skip
        s.audit_path = audit
        yield s


def plain_answer(server, max_tokens: int = 32) -> openai.types.Completion:
    return server.client().completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"speculative": False, "return_token_ids": True},
    )


def test_completion_with_a_prediction_equals_the_target_alone(server, chat_models, tiny_tokenizer) -> None:
    plain = plain_answer(server)
    expected = greedy_reference(chat_models[0], tiny_tokenizer, tiny_tokenizer.encode(PROMPT), 32)
    assert extra(plain.choices[0], "token_ids") == expected
    assert getattr(plain.usage, "completion_tokens_details", None) is None  # no prediction: no details
    answer = tiny_tokenizer.decode(expected, skip_special_tokens=True)
    for prediction in (answer, [{"type": "text", "text": answer[:10]}, {"type": "text", "text": answer[10:]}]):
        out = server.client().completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=32,
            temperature=0,
            extra_body={"prediction": {"type": "content", "content": prediction}, "return_token_ids": True},
        )
        assert extra(out.choices[0], "token_ids") == expected
        details = out.usage.completion_tokens_details
        predicted = len(tiny_tokenizer.encode(answer, add_special_tokens=False))
        # the tiny model's bytes are not valid UTF-8, so the answer's text re-encodes to other ids almost
        # everywhere: the prediction misses and the proposer stops drafting it (accepted tokens counted
        # through the server: test_chat_prediction_streams_its_usage)
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted
        spec = extra(out, "speculative")
        assert spec["num_speculative_tokens"] == 16  # a prediction's default k
        assert spec["prediction"]["accepted_prediction_tokens"] == details.accepted_prediction_tokens


def test_chat_prediction_streams_its_usage(server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Rename nothing:\n" + PROMPT}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    prediction = {"type": "content", "content": whole.choices[0].message.content}
    predicted = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=0, prediction=prediction
    )
    assert predicted.choices[0].message.content == whole.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=24,
            temperature=0,
            prediction=prediction,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = chunks[-1].usage.completion_tokens_details
    assert streamed.accepted_prediction_tokens == details.accepted_prediction_tokens
    assert streamed.rejected_prediction_tokens == details.rejected_prediction_tokens


def test_prediction_with_logprobs_and_sampling(server) -> None:
    """Unlike OpenAI's, a prediction works with log-probabilities (the target's own: equal to those
    without a prediction) and with sampling (it runs and its usage adds up; that the sampled tokens
    follow the target's distribution is tested in test_prediction.py)."""
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    prediction = {"type": "content", "content": plain.choices[0].text}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2, extra_body={"prediction": prediction}
    )
    assert out.choices[0].text == plain.choices[0].text
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    sampled = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.8, seed=3, extra_body={"prediction": prediction}
    )
    details = sampled.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0


BAD = [
    ({"prediction": "some text"}, "prediction"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content"}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": 3}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "image", "text": "x"}]}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": "x", "extra": 1}}, "prediction.extra"),
]


@pytest.mark.parametrize(("body", "field"), BAD)
def test_bad_prediction_gets_400_naming_the_field(server, body, field) -> None:
    for route, base in (
        ("/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ):
        r = httpx.post(server.url + route, json={**base, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(field) and error["param"] == "prediction", error
    ok = server.client().completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_audit_log_records_the_prediction_usage(server) -> None:
    plain = plain_answer(server, 12)
    out = server.client().completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": plain.choices[0].text}},
    )
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines()]
    last = [line for line in lines if line["settings"].get("prediction_tokens")][-1]
    assert last["usage"]["completion_tokens_details"] == out.usage.completion_tokens_details.model_dump(
        include={"accepted_prediction_tokens", "rejected_prediction_tokens"}
    )
    assert last["speculative"]["prediction"]["prediction_tokens"] == last["settings"]["prediction_tokens"]
