"""The HTTP layer: OpenAI-compatible routes over the :class:`~specdecode.serve.scheduler.Scheduler`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events, ``data: {chunk}`` lines ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text).

Every response carries, next to ``usage``, a ``speculative`` object (in a stream: on the chunk
with the ``finish_reason``, and on the usage chunk)::

    {"enabled": true, "proposer": "draft_model", "num_speculative_tokens": 4, "mode": "adaptive",
     "drafts": 9, "draft_tokens": 36, "accepted_tokens": 30, "acceptance_rate": 0.83,
     "mean_acceptance_length": 4.33, "target_forward_passes": 10, "gated_draft_tokens": 0,
     "lossless": true}

``mode`` is the speculation mode the request decoded with: its own ``speculation`` extension
(``"on"``, ``"off"``, ``"adaptive"``), else the server's ``--speculation``; ``"off"`` when it
did not speculate. ``gated_draft_tokens``: drafted tokens the draft gate kept from the target (a
greedy ``adaptive`` request decoding alone, :mod:`specdecode.draft_gate`). ``lossless`` is always
true: every proposer is verified exactly (greedy output equals the target's own greedy output;
sampled output follows the target's distribution).

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input
(the message and ``param`` name the field; malformed JSON included), 401 for a missing or wrong
API key, 413 for a body over ``--max-body-bytes``, 429 when the queue is full, 504 when a request
times out, 503 when the scheduler is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import time
import traceback
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specdecode.proposers.prediction import MAX_PREDICTION_TOKENS, PREDICTION_DEFAULT_K
from specdecode.sampling import SamplingParams
from specdecode.serve.config import ServeSettings
from specdecode.serve.logprob_fields import LogprobsFormat
from specdecode.serve.request import Event, InvalidRequestError, QueueFullError, ServeRequest
from specdecode.serve.scheduler import Scheduler
from specdecode.serve.schemas import ChatCompletionRequest, CompletionRequest, _Common
from specdecode.serve.structured import (
    ToolMode,
    chat_template_messages,
    chat_template_tools,
    parse_tool_calls,
    response_format_constraint,
    tool_call_constraint,
    tool_mode,
)

log = logging.getLogger("specdecode.serve")
Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param, self.code))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class BodyLimitMiddleware:
    """ASGI middleware: reads the body up to ``max_bytes`` (413 beyond, whatever Content-Length
    says) and counts responses per route and status in ``specdecode_requests_total``."""

    def __init__(self, app: Any, max_bytes: int, count: Callable[[str, int], None]) -> None:
        self.app, self.max_bytes, self.count = app, max_bytes, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_large = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        while not too_large:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            too_large = size > self.max_bytes
            if not message.get("more_body", False):
                break
        if too_large:
            response = APIError(
                413, f"request body exceeds the server's limit of {self.max_bytes} bytes", "invalid_request_error"
            ).response()
            await response(scope, receive, counting_send)
            self.count(path, status["code"])
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, counting_send)
        finally:
            self.count(path, status["code"])


_TYPE_TAGS = re.compile(r"^(str|int|float|bool|list|dict|none|function-.*|.*\[.*\])$")


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming the field, and the top-level field, from pydantic's errors.

    Of several errors (a union's branches), the one deepest in the body is reported; the union
    branch names pydantic puts into the location (``str``, ``list[TextPart]``) are left out.
    """
    errors = error.errors()
    if not errors:
        return "invalid request", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [str(part) for part in first.get("loc", ())[1:] if not _TYPE_TAGS.match(str(part))]  # [0] is "body"
    if not loc:
        if kind == "missing":
            return "the request body is empty; send a JSON object (Content-Type: application/json)", None
        if kind in ("model_attributes_type", "dict_type"):
            return "the request body must be a JSON object (Content-Type: application/json)", None
        return str(first.get("msg", "invalid request")).removeprefix("Value error, "), None  # names its field
    name = ".".join(loc)
    if kind == "missing":
        return f"{name} is required", loc[0]
    return f"{name}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}", loc[0]


def create_app(scheduler: Scheduler, settings: ServeSettings, tokenizer: Any) -> FastAPI:
    """The FastAPI application; starts the scheduler on start-up and stops it on shutdown.

    Args:
        scheduler: the scheduler (started here if it is not running yet).
        settings: server settings (model name, API key, limits).
        tokenizer: the target's tokenizer, used to encode prompts and render chat templates in
            the event loop's thread (the scheduler decodes with its own copy).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started_here = not scheduler.started
        if started_here:
            await asyncio.to_thread(scheduler.start)
        yield
        if started_here:
            await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    # The app owns the scheduler (and through it the models); the routes reach it weakly: FastAPI
    # keeps every endpoint it has seen in module-level caches, so a route that held the scheduler
    # would keep the models of a closed app in memory for the rest of the process.
    app.state.scheduler = scheduler
    live = weakref.ref(scheduler)
    metrics = scheduler.metrics
    admission = scheduler.admission  # the checks of every request, once (the scheduler then trusts them)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        count=lambda path, status: metrics.requests.labels(endpoint=path, status=str(status)).inc(),
    )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        """Anything unexpected: OpenAI's error JSON with an id to find the logged traceback by."""
        error_id = "err-" + uuid.uuid4().hex[:12]
        log.error("%s %s failed (%s): %s", request.method, request.url.path, error_id, traceback.format_exc())
        message = f"internal error {error_id}: {type(error).__name__}: {error}"
        return JSONResponse(status_code=500, content=error_body(message, "server_error", None, error_id))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return bad_request(message, param).response()

    async def check_api_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        expected = f"Bearer {settings.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)", "authentication_error")

    v1 = [Depends(check_api_key)]

    def served() -> Scheduler:
        scheduler = live()
        assert scheduler is not None  # app.state holds it while the app can be called
        return scheduler

    @app.get("/health")
    async def health() -> JSONResponse:
        scheduler = served()
        alive = scheduler.is_alive
        body = {"status": "ok" if alive else "unavailable", "running": len(scheduler.active)}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "specdecode",
            "max_model_len": served().max_length,
            "proposers": list(admission.proposers),
            "default_proposer": settings.proposer,
            "speculation": settings.speculation,
        }
        return {"object": "list", "data": [card]}

    def prepare(body: _Common, prompt_ids: list[int], max_tokens: int, endpoint: str, prompt: Any) -> ServeRequest:
        """The request of ``body``, admitted (:meth:`Admission.admit
        <specdecode.serve.admission.Admission.admit>`: :meth:`Scheduler.submit` does not check it again).

        Raises:
            APIError: 400 naming the field: another model, bad sampling options, speculation asked of
                a server without a proposer, or a check of the admission that fails.
        """
        if body.model != settings.model_name:
            raise APIError(
                400,
                f"model must be {settings.model_name!r} (GET /v1/models), got {body.model!r}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        try:
            sampling = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_k=max(0, body.top_k or 0),
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                max_new_tokens=max_tokens,
                stop=body.stop_strings(),
            )
        except ValueError as error:
            raise bad_request(str(error).replace("max_new_tokens", "max_tokens")) from None
        proposer = body.proposer or settings.proposer
        speculative = body.speculative is not False and body.speculation != "off" and proposer is not None
        if proposer is None and (body.speculative or body.speculation in ("on", "adaptive")):
            field = "speculative" if body.speculative else "speculation"
            raise bad_request(f"{field}: this server has no proposer; give one in 'proposer'", field)
        prefix = "chatcmpl-" if endpoint.endswith("chat/completions") else "cmpl-"
        k = settings.k_for(proposer if speculative else None, body.num_speculative_tokens)
        prediction = None
        if body.prediction is not None:
            prediction = encode(body.prediction.text(), add_special_tokens=False, param="prediction")
            if len(prediction) > MAX_PREDICTION_TOKENS:
                raise bad_request(
                    f"prediction: {len(prediction)} tokens; at most {MAX_PREDICTION_TOKENS} are taken", "prediction"
                )
            if speculative and body.num_speculative_tokens is None and settings.num_speculative_tokens is None:
                k = max(k, PREDICTION_DEFAULT_K)  # an edit's answer copies its prediction for long runs
        req = ServeRequest(
            request_id=prefix + uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            sampling=sampling,
            speculative=speculative,
            proposer=proposer if speculative else None,
            num_speculative_tokens=k,
            speculation=body.speculation if speculative else None,
            on_event=lambda event: None,
            endpoint=endpoint,
            audit_settings={
                "model": body.model,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "max_tokens": max_tokens,
                "seed": body.seed,
                "num_stop_strings": len(sampling.stop),
                "stream": bool(body.stream),
                "speculative_requested": body.speculative,
                "proposer": proposer if speculative else None,
                "num_speculative_tokens": k,
                "speculation_requested": body.speculation,
                "ignore_eos": bool(body.ignore_eos),
                "prediction_tokens": None if prediction is None else len(prediction),
            },
            audit_prompt=prompt,
            ignore_eos=bool(body.ignore_eos),
            logprobs=body.num_logprobs(),  # type: ignore[attr-defined]
            prediction=prediction,
            user=body.user,
        )
        try:
            admission.admit(req)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        req.audit_settings["logprobs"] = req.logprobs
        req.audit_settings["speculation_mode"] = admission.mode(req)  # the mode it decodes with
        return req

    def encode(text: str, add_special_tokens: bool, param: str) -> list[int]:
        """``text``'s token ids; 400 naming ``param`` where it is not valid Unicode text (a lone
        surrogate such as ``"\\ud800"`` is valid JSON but no UTF-8)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise bad_request(
                f"{param}: not valid Unicode text (a lone surrogate at character {error.start})", param
            ) from None
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request("prompt: only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", "prompt")
            ids = encode(prompt, add_special_tokens=True, param="prompt")
        else:
            ids = [int(i) for i in prompt]
        req = prepare(body, ids, body.max_tokens or 16, "/v1/completions", body.prompt)
        return await run(req, body, request, chat=False)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template; use /v1/completions", "messages")
        try:
            messages = chat_template_messages(body.messages, tokenizer.chat_template)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        constraint, tools = structured_output(body)
        extra = {"tools": chat_template_tools(tools)} if tools is not None else {}
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as error:
            raise bad_request(f"messages: the chat template failed: {error}", "messages") from None
        ids = encode(text, add_special_tokens=False, param="messages")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, min(settings.default_max_tokens, served().max_length - len(ids)))
        prompt = [m.model_dump(exclude_none=True) for m in body.messages]
        req = prepare(body, ids, max_tokens, "/v1/chat/completions", prompt)
        req.constraint = constraint
        req.audit_settings["constraint"] = None if constraint is None else constraint.param
        req.audit_settings["tool_choice"] = None if tools is None else tools.choice
        return await run(req, body, request, chat=True, tools=tools)

    def structured_output(body: ChatCompletionRequest) -> tuple[Any, ToolMode | None]:
        """The request's constraint (``response_format``, or a required / named tool call) checked by
        llguidance against the target's tokenizer, and its tools (:mod:`.structured`); 400 naming
        the field on bad input."""
        from specdecode.constraints.spec import ConstraintError, compile_constraint
        from specdecode.constraints.tokenizer import ll_tokenizer

        try:
            constraint = response_format_constraint(body.response_format)
            tools = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        if tools is not None and tools.constrained:
            if constraint is not None:
                raise bad_request("give response_format or a required tool_choice, not both", "response_format")
            constraint = tool_call_constraint(tools)
        if constraint is not None:
            scheduler = served()
            try:
                compile_constraint(constraint, ll_tokenizer(tokenizer, scheduler.vocab_size, scheduler.eos))
            except (ConstraintError, ValueError) as error:
                raise bad_request(str(error), getattr(error, "param", constraint.param)) from None
        return constraint, tools

    async def run(
        req: ServeRequest, body: _Common, request: Request, chat: bool, tools: ToolMode | None = None
    ) -> Response:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        req.on_event = lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)
        req.deadline = time.monotonic() + settings.request_timeout_s
        scheduler = served()
        try:
            scheduler.submit(req)
        except InvalidRequestError as error:
            raise bad_request(str(error), error.param) from None
        except QueueFullError as error:
            raise APIError(429, str(error), "rate_limit_error", None, "queue_full") from None
        except RuntimeError as error:
            raise APIError(503, str(error), "server_error") from None
        created = int(req.created)
        fmt = _ChatFormat(req, settings.model_name, created) if chat else _TextFormat(req, settings.model_name, created)
        if req.logprobs is not None:
            fmt.logprobs = LogprobsFormat(tokenizer, chat)
        fmt.tools = tools
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(scheduler, req, queue, fmt, include_usage, bool(body.return_token_ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": req.request_id},
            )
        return await _collect(scheduler, req, queue, fmt, request, bool(body.return_token_ids))

    return app


class _TextFormat:
    """``/v1/completions`` response and chunk shapes."""

    object = "text_completion"

    def __init__(self, req: ServeRequest, model: str, created: int) -> None:
        self.req, self.model, self.created = req, model, created
        self.logprobs: LogprobsFormat | None = None  # set for a request with logprobs
        self.tools: ToolMode | None = None  # set for a chat request with tools: the text may hold tool calls

    def choice(self, text: str, finish_reason: str | None, final: bool, logprobs: Any = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.req.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def first_chunk(self) -> dict[str, Any] | None:
        return None


class _ChatFormat(_TextFormat):
    """``/v1/chat/completions`` response and chunk shapes."""

    object = "chat.completion"

    def choice(self, text: str, finish_reason: str | None, final: bool, logprobs: Any = None) -> dict[str, Any]:
        calls = parse_tool_calls(text, self.tools) if self.tools is not None and finish_reason else None
        if calls is not None:  # OpenAI's shape: no content, the calls, finish_reason "tool_calls"
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            if final:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
                return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if final:
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            "index": 0,
            "delta": {"content": text} if text else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        out = super().envelope(choices, chunk)
        out["object"] = "chat.completion.chunk" if chunk else "chat.completion"
        return out

    def first_chunk(self) -> dict[str, Any] | None:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self.envelope([choice], chunk=True)


_FAILURES = {
    "timeout": (504, "timeout_error"),
    "error": (500, "server_error"),
    "abort": (503, "server_error"),
}


async def _collect(
    scheduler: Scheduler,
    req: ServeRequest,
    queue: asyncio.Queue[Event],
    fmt: _TextFormat,
    request: Request,
    token_ids: bool,
) -> Response:
    """Wait for the whole generation; abort it if the client disconnects first (or the handler is
    cancelled)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    ids: list[int] = []
    text: list[str] = []
    logprobs: list[Any] = []
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                scheduler.abort(req.request_id)
                return Response(status_code=499)  # nobody reads it
            event = getter.result()
            ids += event.token_ids
            text.append(event.text)
            logprobs += event.logprobs or []
            if event.finish_reason is not None:
                break
    except asyncio.CancelledError:  # a server that cancels the handler when the client leaves (Ray Serve)
        scheduler.abort(req.request_id)
        raise
    finally:
        watcher.cancel()
    if event.finish_reason in _FAILURES:
        status, kind = _FAILURES[event.finish_reason]
        return APIError(status, event.error or event.finish_reason, kind).response()
    formatted = fmt.logprobs.format(logprobs) if fmt.logprobs is not None else None
    choice = fmt.choice("".join(text), event.finish_reason, final=True, logprobs=formatted)
    if token_ids:
        choice["prompt_token_ids"], choice["token_ids"] = req.prompt_ids, ids
    out = fmt.envelope([choice], chunk=False)
    assert event.summary is not None
    out["usage"] = event.summary["usage"]
    out["speculative"] = event.summary["speculative"]
    return JSONResponse(out)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _stream(
    scheduler: Scheduler,
    req: ServeRequest,
    queue: asyncio.Queue[Event],
    fmt: _TextFormat,
    include_usage: bool,
    token_ids: bool,
) -> AsyncIterator[bytes]:
    """Server-sent events; a client that goes away cancels this generator, which aborts the request."""
    finished = False
    held: list[str] = []  # a request with tools: its text is held back until the end (it may be a tool call)
    held_logprobs: list[Any] = []
    try:
        first = fmt.first_chunk()
        if first is not None:
            yield _sse(first)
        while True:
            event = await queue.get()
            if event.finish_reason in _FAILURES:
                finished = True
                status, kind = _FAILURES[event.finish_reason]
                yield _sse(error_body(event.error or event.finish_reason, kind, code=str(status)))
                break
            if fmt.tools is not None:
                held.append(event.text)
                held_logprobs += event.logprobs or []
                if event.finish_reason is None:
                    continue
                event = dataclasses.replace(event, text="".join(held), logprobs=held_logprobs)
            if event.text or event.token_ids or event.finish_reason:
                formatted = fmt.logprobs.format(event.logprobs or []) if fmt.logprobs is not None else None
                choice = fmt.choice(event.text, event.finish_reason, final=False, logprobs=formatted)
                if token_ids:
                    choice["token_ids"] = event.token_ids
                chunk = fmt.envelope([choice], chunk=True)
                if event.finish_reason is not None and event.summary is not None:
                    chunk["speculative"] = event.summary["speculative"]
                yield _sse(chunk)
            if event.finish_reason is not None:
                finished = True
                if include_usage and event.summary is not None:
                    chunk = fmt.envelope([], chunk=True)
                    chunk["usage"] = event.summary["usage"]
                    chunk["speculative"] = event.summary["speculative"]
                    yield _sse(chunk)
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            scheduler.abort(req.request_id)
