"""Structured output in the OpenAI API: ``response_format`` and function calling (``tools`` /
``tool_choice``) as constraints (:mod:`specdecode.constraints`), and tool calls back in OpenAI's shape.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`` (JSON
  valid against the schema; enforced whether ``strict`` is true or false).
- ``tools``: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, rendered
  into the prompt by the model's chat template. ``tool_choice``:
  ``"required"`` (the output is one call of one of the tools: JSON ``{"name": ..., "arguments":
  {...}}`` constrained by the tools' parameter schemas), ``{"type": "function", "function": {"name":
  N}}`` (a call of N), ``"auto"`` (default: the model chooses; unconstrained, and a
  ``<tool_call>{...}</tool_call>`` block in the output, the Hermes / Qwen2.5 convention, becomes a
  tool call), ``"none"`` (the tools are not shown, plain text).

A response with tool calls has ``message.content`` null, ``message.tool_calls`` and
``finish_reason: "tool_calls"``; a stream sends them in one delta at the end. ``parallel_tool_calls:
false`` keeps the first call of an ``"auto"`` reply. The history of a multi-turn exchange (assistant
``tool_calls``, ``tool`` results) is rendered by the chat template (:func:`chat_template_messages`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specdecode.constraints.spec import Constraint, JsonSchema
from specdecode.serve.request import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.serve.schemas import ChatMessage

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolSpec:
    """One function a request offers: its name and JSON schema of arguments."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolMode:
    """How a request's tools are used: ``choice`` is ``"auto"``, ``"required"`` or ``"named"``;
    ``parallel`` false (``parallel_tool_calls: false``) keeps at most one call."""

    tools: tuple[ToolSpec, ...]
    choice: str
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint | None:
    """The constraint of OpenAI's ``response_format`` (None for text or absent).

    Raises:
        InvalidRequestError: an unknown type or a ``json_schema`` without a schema object (the
            parameter named, e.g. ``response_format.json_schema.schema``).
    """
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return JsonSchema({"type": "object"}, param="response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError("response_format.json_schema must be an object", "response_format.json_schema")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"
            )
        return JsonSchema(schema, param="response_format.json_schema.schema")
    raise InvalidRequestError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format.type"
    )


def tool_mode(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None = None) -> ToolMode | None:
    """Parse ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (None: no tools, or
    ``tool_choice: "none"``). ``parallel_tool_calls`` (default true): false keeps at most one call of
    an ``"auto"`` reply (the first); ``"required"`` and a named choice always give exactly one.

    Raises:
        InvalidRequestError: a malformed tool or choice, or a named tool that is not offered.
    """
    if tool_choice is not None and not tools:
        raise InvalidRequestError("tool_choice needs tools", "tool_choice")
    if not tools or tool_choice == "none":
        return None
    parallel = parallel_tool_calls is not False
    specs = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise InvalidRequestError(f"tools[{i}].function.name must be 1-64 of a-z A-Z 0-9 _ . -", f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be an object", f"tools[{i}]")
        specs.append(ToolSpec(name, parameters))
    if len({s.name for s in specs}) != len(specs):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    if tool_choice in (None, "auto"):
        return ToolMode(tuple(specs), "auto", parallel)
    if tool_choice == "required":
        return ToolMode(tuple(specs), "required", parallel)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [s for s in specs if s.name == name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among tools", "tool_choice")
        return ToolMode(tuple(chosen), "named", parallel)
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def tool_call_constraint(mode: ToolMode) -> Constraint:
    """JSON ``{"name": <a tool's name>, "arguments": <valid against its parameters>}`` (one of the
    tools: ``anyOf``)."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in mode.tools
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return JsonSchema(schema, param="tools")


def chat_template_tools(mode: ToolMode) -> list[dict[str, Any]]:
    """The tools as the chat template takes them (OpenAI's ``tools`` list)."""
    return [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in mode.tools]


def chat_template_messages(messages: Sequence[ChatMessage], chat_template: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as ``transformers``' ``apply_chat_template`` takes them.

    Text messages become ``{"role", "content"}``; an assistant message with ``tool_calls`` becomes
    ``{"role": "assistant", "content": text or "", "tool_calls": [{"id", "type": "function",
    "function": {"name", "arguments": dict}}]}`` (arguments parsed from OpenAI's JSON string: Qwen2.5's
    and Llama 3's templates serialise them with ``tojson``); a ``tool`` message becomes ``{"role":
    "tool", "content", "tool_call_id", "name"}`` with the name of the call it answers.

    Args:
        messages: the validated messages (:class:`~specdecode.serve.schemas.ChatMessage`).
        chat_template: the tokenizer's ``chat_template`` (a string, or a dict of named templates).

    Raises:
        InvalidRequestError: ``messages[i].tool_call_id`` answers no earlier assistant tool call, or
            ``messages[i].tool_calls`` with a chat template that does not render tool calls (it
            would drop them silently).
    """
    template = chat_template if isinstance(chat_template, str) else " ".join(map(str, (chat_template or {}).values()))
    calls: dict[str, str] = {}  # id -> function name, of the tool calls so far
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            if "tool_calls" not in template:
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls: this model's chat template does not render tool calls",
                    f"messages[{i}].tool_calls",
                )
            rendered["tool_calls"] = []
            for call in message.tool_calls:
                calls[call.id] = call.function.name
                function = {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
                rendered["tool_calls"].append({"id": call.id, "type": "function", "function": function})
        if message.role == "tool":
            name = calls.get(message.tool_call_id or "")
            if name is None:
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id {message.tool_call_id!r} answers no tool call of an earlier "
                    "assistant message",
                    f"messages[{i}].tool_call_id",
                )
            rendered["tool_call_id"] = message.tool_call_id
            rendered["name"] = name
        out.append(rendered)
    return out


def parse_tool_calls(text: str, mode: ToolMode) -> list[dict[str, Any]] | None:
    """The tool calls in a completion, in OpenAI's shape (``id``, ``type``, ``function.name``,
    ``function.arguments`` as a JSON string), or None when it holds none.

    Constrained (required / named): the whole text is one call. Auto: each
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` block naming an offered tool (only the
    first when ``mode.parallel`` is false).
    """
    names = {t.name for t in mode.tools}
    bodies = [text] if mode.constrained else _TOOL_CALL.findall(text)
    calls = []
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": "call_" + uuid.uuid4().hex[:24],
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
            }
        )
    return (calls if mode.parallel else calls[:1]) or None
