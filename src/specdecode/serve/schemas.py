"""Request bodies of the OpenAI API, with specdecode's extensions (pydantic models).

Extensions (ignored by OpenAI's own servers, sent by the ``openai`` client through ``extra_body``):

- ``speculative`` (bool, default true): false decodes with the target alone;
- ``speculation`` (``"on"``, ``"off"`` or ``"adaptive"``): this request's own speculation mode in
  place of the server's ``--speculation``: ``"on"`` drafts k tokens every step whatever the load,
  ``"adaptive"`` lets the cost model decide (needs a server started with ``--speculation
  adaptive``), ``"off"`` is ``speculative: false``. A server started with ``--speculation off``
  refuses ``"on"`` and ``"adaptive"``;
- ``proposer`` (str): a proposer name (``GET /v1/models`` lists those the server can run);
- ``num_speculative_tokens`` (int, in :data:`~specdecode.limits.K_RANGE`): k, the most tokens drafted per
  step (default: the server's ``--num-speculative-tokens``, else the proposer's own: 4, EAGLE and Medusa 2,
  prompt lookup 8);
- ``top_k`` (int >= 0, 0 = off; -1 is read as off, as in vLLM);
- ``return_token_ids`` (bool): add the prompt's and the completion's token ids to the choice;
- ``ignore_eos`` (bool): do not stop at end-of-sequence tokens (as in vLLM; for benchmarks).

Predicted Outputs (OpenAI's ``prediction: {"type": "content", "content": str | [text parts]}``), on
chat and text completions: the predicted text is drafted from where the answer follows it
(:mod:`specdecode.proposers.prediction`), with the request's proposer drafting elsewhere; ``usage``
then carries ``completion_tokens_details.accepted_prediction_tokens`` and
``rejected_prediction_tokens`` as OpenAI's does. Unlike OpenAI's, it works with ``logprobs``,
structured output, tools and sampling, and the output is still the target's own.

Log-probabilities: chat ``logprobs`` (bool) with ``top_logprobs`` (0 .. 20), completions
``logprobs`` (0 .. 20), from the target's raw distribution (:mod:`specdecode.serve.logprob_fields`).

Structured output and function calling (``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``tool`` messages and assistant ``tool_calls`` in the history):
:mod:`specdecode.serve.structured`.

Standard fields that would change what is decoded but are not implemented (``echo``,
``best_of`` > 1, ``n`` > 1, penalties, ``logit_bias``, ``suffix``) are refused with a message
naming them, never silently ignored. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specdecode.limits import MAX_SPECULATIVE_TOKENS, MIN_SPECULATIVE_TOKENS
from specdecode.serve.logprob_fields import chat_num_logprobs, completion_num_logprobs


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's ``prediction``: ``{"type": "content", "content": "..." | [{"type": "text", "text": ...}]}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        """The predicted text (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    user: str | None = None
    # specdecode extensions
    speculative: bool | None = None
    speculation: Literal["on", "off", "adaptive"] | None = None
    proposer: str | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=MIN_SPECULATIVE_TOKENS, le=MAX_SPECULATIVE_TOKENS)
    return_token_ids: bool | None = False
    ignore_eos: bool | None = False
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs
    # standard fields that are refused unless left at their neutral values
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        items = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return stop

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Common:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ValueError(f"{name} is not supported by this server (it would change the target's distribution)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.speculative is False and self.speculation in ("on", "adaptive"):
            raise ValueError(f"speculation {self.speculation!r} contradicts speculative: false")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    """``POST /v1/completions``. ``prompt`` is a string or a list of token ids (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_completion_extras(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by this server (only 1)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        completion_num_logprobs(self.logprobs)  # ValueError naming the field
        return self

    def num_logprobs(self) -> int | None:
        """Alternatives per token for ``logprobs: N``; None: off."""
        return completion_num_logprobs(self.logprobs)


class FunctionCall(BaseModel):
    """The function of an assistant's tool call: ``name`` and ``arguments`` (a JSON object, as a string)."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as error:
            raise ValueError(f"must be a JSON object as a string ({error})") from None
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object as a string")
        return arguments


class ToolCall(BaseModel):
    """One tool call of an assistant message in the history (OpenAI's shape)."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of ``messages``. ``tool_calls`` only on an ``assistant`` message (its
    ``content`` may then be null); a ``tool`` message needs ``tool_call_id`` and ``content``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has tool calls, not a {self.role!r} one")
        if self.role == "tool":
            if not self.tool_call_id:
                raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
            if self.content is None:
                raise ValueError("content: a tool message needs content (the tool's result)")
        elif self.tool_call_id is not None:
            raise ValueError(f"tool_call_id: only a tool message has one, not a {self.role!r} one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``: the tokenizer's chat template renders ``messages``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Any] | None = None  # function calling: specdecode.serve.structured
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call (specdecode.serve.structured)
    response_format: dict[str, Any] | None = None  # text / json_object / json_schema: specdecode.serve.structured
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        chat_num_logprobs(self.logprobs, self.top_logprobs)  # ValueError naming the field
        return self

    def num_logprobs(self) -> int | None:
        """Alternatives per token for ``logprobs: true`` (``top_logprobs``, default 0); None: off."""
        return chat_num_logprobs(self.logprobs, self.top_logprobs)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
