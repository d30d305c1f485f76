"""Structured output through the server (issue 33): ``response_format`` (json_object, json_schema)
and function calling (``tools`` / ``tool_choice``) with the official ``openai`` client, streaming
included; bad input is a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from specdecode import SamplingParams, SpeculativeGenerator
from specdecode.constraints import JsonSchema
from specdecode.serve.structured import chat_template_messages, parse_tool_calls, tool_mode
from test_serve import Server

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
def server(chat_models, tiny_tokenizer):
    target, draft = chat_models
    with Server(target, tiny_tokenizer, draft, speculation="on", max_batch_size=4) as s:
        yield s


def test_json_schema_response_equals_constrained_generate(server, chat_models, tiny_tokenizer) -> None:
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
    reference = SpeculativeGenerator(chat_models[0], tokenizer=tiny_tokenizer).generate(
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


# --- multi-turn function calling: assistant tool_calls and tool messages in the history ---

# Qwen2.5's way of rendering tool calls and results, on the tiny tokenizer's turn markers
TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|end|>"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>{{ m['name'] }}: {{ m['content'] }}</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tool_server(chat_models, tiny_tokenizer):
    """The tiny pair behind a tokenizer whose chat template renders tool calls and results."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TOOL_TEMPLATE
    target, draft = chat_models
    with Server(target, tokenizer, draft, speculation="on", max_batch_size=4) as s:
        yield s, tokenizer


def test_two_turn_tool_exchange_round_trips(tool_server) -> None:
    """The agent loop of a client: a required call, its result sent back as a ``tool`` message
    with the assistant's ``tool_calls`` (``content: null``) before it, then the final answer; the
    second prompt is the template's rendering of the call (arguments as an object) and the result."""
    server, tokenizer = tool_server
    client = server.client()
    ask = [{"role": "user", "content": "add 2 and 3"}]
    first = client.chat.completions.create(
        model="tiny", messages=ask, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    _check_calls([call], {"get_weather", "add"})
    history = [
        *ask,
        first.choices[0].message.model_dump(exclude_none=True),  # the openai client's own shape
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    assert history[1]["tool_calls"][0]["id"] == call.id and "content" not in history[1]
    second = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=12, extra_body={"return_token_ids": True}
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    arguments = json.dumps(json.loads(call.function.arguments))  # as the template's tojson writes them
    expected = (
        "<|user|>add 2 and 3<|end|>"
        f'<|assistant|><tool_call>{{"name": "{call.function.name}", "arguments": {arguments}}}</tool_call><|end|>'
        f"<|user|><tool_response>{call.function.name}: 5</tool_response><|end|><|assistant|>"
    )
    assert tokenizer.decode(answer.model_extra["prompt_token_ids"]) == expected
    # the same exchange as a stream ends with the same answer
    stream = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=12, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer.message.content


def test_parallel_tool_calls(tool_server) -> None:
    """``parallel_tool_calls`` false: a required call is still one call; an ``auto`` reply with
    several ``<tool_call>`` blocks keeps the first (true: all of them)."""
    server, _ = tool_server
    out = server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    assert len(out.choices[0].message.tool_calls) == 1
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' * 2
    assert len(parse_tool_calls(text, tool_mode(TOOLS, "auto"))) == 2
    assert len(parse_tool_calls(text, tool_mode(TOOLS, "auto", parallel_tool_calls=True))) == 2
    assert len(parse_tool_calls(text, tool_mode(TOOLS, "auto", parallel_tool_calls=False))) == 1


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "{oops"}}],
                }
            ],
            "messages",
            "messages.0.tool_calls.0.function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "add", "arguments": "[1]"}}]}],
            "messages",
            "arguments",
        ),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}], "messages", "id"),
        ([{"role": "tool", "content": "5"}], "messages", "tool_call_id"),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_1"}],
            "messages",
            "content",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "messages", "tool_calls"),
        ([{"role": "tool", "tool_call_id": "call_9", "content": "5"}], "messages[0].tool_call_id", "call_9"),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "call_2", "content": "5"}],
            "messages[1].tool_call_id",
            "call_2",
        ),
        ([{"role": "robot", "content": "x"}], "messages", "role"),
    ],
)
def test_bad_tool_messages_are_400_naming_the_field(tool_server, messages: list, param: str, words: str) -> None:
    server, _ = tool_server
    body = {"model": "tiny", "messages": messages, "max_tokens": 4}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_template_without_tool_calls_refuses_them(server) -> None:
    """The tiny template renders only roles and text: tool calls would vanish from the prompt, so 400."""
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    response = httpx.post(
        server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[1].tool_calls"


QWEN = Path.home() / ".cache/specdecode/models/Qwen2.5-Coder-1.5B-Instruct-bf16"


@pytest.mark.skipif(not (QWEN / "tokenizer.json").exists(), reason="the Qwen2.5 tokenizer is not cached")
def test_qwen_template_renders_a_tool_exchange() -> None:
    """Through Qwen2.5's own chat template (the one the GGUF tokenizer carries too): the call with
    its arguments as JSON (not a quoted string) and the result in ``<tool_response>``."""
    from transformers import AutoTokenizer

    from specdecode.serve.schemas import ChatMessage

    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    messages = [
        ChatMessage(role="user", content="2+3?"),
        ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [CALL]}),
        ChatMessage(role="tool", tool_call_id="call_1", content="3"),
    ]
    rendered = chat_template_messages(messages, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ), text
    assert '"name": "get_weather"' in text  # the tools are in the system turn
