"""Structured output through the server (issue 33): ``response_format`` (json_object, json_schema)
and function calling (``tools`` / ``tool_choice``) with the official ``openai`` client, streaming
included; bad input is a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import JsonSchema
from test_serve import Server

from conftest import make_tiny_model, perturbed_copy

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "size": {"type": "integer", "maximum": 999}},
    "required": ["name", "size"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99}, "b": {"type": "integer", "maximum": 99}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    target = make_tiny_model(vocab_size=len(tiny_tokenizer), seed=0)
    return target, perturbed_copy(target, noise=0.01)


@pytest.fixture(scope="module")
def server(models, tiny_tokenizer):
    target, draft = models
    with Server(target, tiny_tokenizer, draft, speculation="on", max_batch_size=4) as s:
        yield s


def test_json_schema_response_equals_constrained_generate(server, models, tiny_tokenizer) -> None:
    """Greedy ``json_schema``: the content validates and equals the library's constrained generate
    (target alone); with speculation, so the server decodes exactly under the constraint."""
    out = server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}},
    )
    content = out.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    reference = SpeculativeGenerator(models[0], tokenizer=tiny_tokenizer).generate(
        MESSAGES[0]["content"], SamplingParams(max_new_tokens=80), speculative=False, constraint=JsonSchema(SCHEMA)
    )
    assert content == reference.text
    assert out.model_extra["speculative"]["enabled"]


def test_json_object_streams_a_json_object(server) -> None:
    stream = server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        temperature=1.0,
        seed=3,
        max_tokens=120,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)


def _check_calls(calls, names) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        arguments = json.loads(call.function.arguments)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(arguments, schema)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_call(server, seed: int) -> None:
    out = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_tokens=80
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather", "add"})


def test_named_tool_call_streams(server) -> None:
    stream = server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)
    assert len(calls) == 1 and calls[0].index == 0
    _check_calls(calls, {"get_weather"})


def test_auto_tools_answer_text_or_calls(server) -> None:
    """``tool_choice`` auto: unconstrained; a reply without a ``<tool_call>`` block is content."""
    out = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=20
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_structured_requests_are_400_naming_the_field(server, extra: dict, param: str) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, **extra}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.content is not None, "the server keeps serving"


def test_openai_client_raises_bad_request(server) -> None:
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=4, response_format={"type": "json_schema"}
        )
