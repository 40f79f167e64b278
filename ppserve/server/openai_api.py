"""The OpenAI-compatible HTTP front door (FastAPI): completions, chat completions, models, health, metrics.

Chat with tools renders them into the prompt (LLMEngine.render_chat), constrains calls with a
structural tag (structured/tools.py) and reads them back (structured/tool_parser.py): `message.tool_calls`
and finish_reason "tool_calls", or streamed `delta.tool_calls`, as OpenAI answers them.

It shares the gRPC server's process, event loop and AsyncEngine: one engine, two front doors, one
validation (SamplingParams.validate and the engine's length checks give the same messages here as
over gRPC). Streaming answers are server-sent events (`data: {json}` chunks and a final
`data: [DONE]`); errors are OpenAI's error JSON (`{"error": {"message", "type", "param", "code"}}`)
with 400 (bad input, a malformed or uncompilable structured output or tool list among it), 401
(missing or wrong bearer token), 404 (unknown model), 429 (the waiting queue is full) and 503 (the
pipeline is starting, being rebuilt, failed or shutting down).

A client that disconnects cancels its request at once (its KV blocks are freed): a streaming
response is cancelled by Starlette when the connection drops, a non-streaming one watches the
connection while it waits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.messages import PipelineUnavailable, PromptInput
from ppserve.engine.streams import RequestStream, StreamChunk, merge_choices
from ppserve.request import SamplingParams, TokenLogprob
from ppserve.server.metrics import ServerMetrics
from ppserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from ppserve.structured.tool_parser import ToolCallParser, parse_tool_calls

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: what the context leaves)


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def api_error(exc: BaseException) -> APIError:
    """ppserve's exceptions as HTTP statuses (the same mapping as convert.error_to_status for gRPC)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), "invalid_request_error")
    if isinstance(exc, OverflowError):
        return APIError(429, str(exc), "rate_limit_error", "queue_full")
    if isinstance(exc, (PipelineUnavailable, TimeoutError)):
        return APIError(503, str(exc) or "the engine did not answer in time", "service_unavailable_error")
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request body"


@dataclass
class _Choice:
    """One choice's output as it accumulates (for the non-streaming answer and for usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class OpenAIFrontDoor:
    """The handlers; `build_app` wires them to routes."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}  # token id -> its text, for logprobs

    # ---- checks ------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model_not_found", "model")

    # ---- small endpoints ---------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "ppserve",
            "max_model_len": int(self.engine.engine.max_model_len),
        }]}

    def health(self) -> Response:
        try:
            self.engine._check_available()
        except PipelineUnavailable as e:
            return APIError(503, str(e), "service_unavailable_error").response()
        return Response(status_code=200)

    async def metrics_text(self) -> Response:
        try:
            self.metrics.refresh(await self.engine.stats())
        except (PipelineUnavailable, TimeoutError):
            pass  # a pipeline that is down still exports its counters (and its restarts)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # ---- completions -------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        self.check_model(body.model)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        sampling = body.sampling(self.engine.sampling_defaults, max_tokens, body.logprobs, body.structured())
        salt = body.cache_salt or None
        prompts = [PromptInput(text=p, cache_salt=salt) if isinstance(p, str)
                   else PromptInput(token_ids=tuple(p), cache_salt=salt) for p in body.prompts()]
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams, num_prompt = await self._add(prompts, sampling, rid)
        fmt = _Format(self, rid, "text_completion", chat=False, logprobs=body.logprobs)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(fmt, rid, streams, num_prompt, include_usage)
        return await self._whole(fmt, rid, streams, num_prompt, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        self.check_model(body.model)
        # max_completion_tokens is the newer name; None leaves the limit to the model and the context.
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        plan = body.tool_plan()
        sampling = body.sampling(self.engine.sampling_defaults, max_tokens, body.logprob_count(),
                                 body.constraint(plan))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = PromptInput(messages=body.conversation(), tools=plan.tools,
                             cache_salt=body.cache_salt or None)
        streams, num_prompt = await self._add([prompt], sampling, rid)
        fmt = _Format(self, rid, "chat.completion", chat=True, logprobs=body.logprob_count(),
                      tool_calls=plan.tools is not None and plan.choice.parses)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self._sse(fmt, rid, streams, num_prompt, include_usage)
        return await self._whole(fmt, rid, streams, num_prompt, request)

    async def _add(self, prompts: list[PromptInput], sampling: SamplingParams,
                   rid: str) -> tuple[list[tuple[str, RequestStream]], int]:
        """Queue every prompt's n choices (all or none). Returns ((group id, stream) in choice-index
        order: prompt-major, as OpenAI numbers them) and the prompts' token count."""
        added: list[tuple[str, list[RequestStream]]] = []
        try:
            for i, prompt in enumerate(prompts):
                group = rid if len(prompts) == 1 else f"{rid}-{i}"
                added.append((group, await self.engine.add_choices(prompt, sampling, group)))
        except BaseException:
            for group, _ in added:  # bad input (or a full queue) loses nothing else
                self.engine.cancel_nowait(group)
                self.engine.release(group)
            raise
        streams = [(group, st) for group, sts in added for st in sts]
        return streams, sum(sts[0].num_prompt_tokens for _, sts in added)

    def _finish(self, streams: list[tuple[str, RequestStream]], finished: set[int]) -> None:
        """Release every stream; cancel the choices still running (the client went away or failed)."""
        groups = dict.fromkeys(g for g, _ in streams)
        for i, (group, _) in enumerate(streams):
            if i not in finished:
                self.engine.cancel_nowait(group)
        for group in groups:
            self.engine.release(group)

    async def _whole(self, fmt: _Format, rid: str, streams: list[tuple[str, RequestStream]], num_prompt: int,
                     request: Request) -> Response:
        """Wait for every choice, answering one JSON; a disconnect meanwhile cancels the request."""
        choices = [_Choice() for _ in streams]
        finished: set[int] = set()

        async def collect() -> None:
            async for i, chunk in merge_choices([st for _, st in streams]):
                self._check_failed(chunk)
                c = choices[i]
                c.text += chunk.text
                c.token_ids.extend(chunk.token_ids)
                c.logprobs.extend(chunk.logprobs)
                if chunk.finished:
                    c.finish_reason = chunk.finish_reason
                    c.num_cached_tokens = chunk.num_cached_tokens
                    finished.add(i)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                return Response(status_code=499)  # nobody reads it: the client closed the connection
            work.result()  # raises what collect raised
        finally:
            gone.cancel()
            work.cancel()
            self._finish(streams, finished)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        cached = sum(choices[i].num_cached_tokens for i in _first_choices(streams))
        return JSONResponse({
            "id": rid, "object": fmt.object, "created": int(time.time()), "model": self.model_name,
            "choices": [fmt.whole_choice(i, c) for i, c in enumerate(choices)],
            "usage": _usage(num_prompt, completion_tokens, cached),
        })

    def _sse(self, fmt: _Format, rid: str, streams: list[tuple[str, RequestStream]], num_prompt: int,
             include_usage: bool) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            finished: set[int] = set()
            completion_tokens = 0
            firsts = _first_choices(streams)
            cached = 0
            try:
                if fmt.chat:  # the role comes first, once per choice, as OpenAI sends it
                    for i in range(len(streams)):
                        yield _event(fmt.chunk([fmt.role_delta(i)]))
                async for i, chunk in merge_choices([st for _, st in streams]):
                    try:
                        self._check_failed(chunk)
                    except APIError as e:
                        yield _event({"error": {"message": e.message, "type": e.kind, "param": None,
                                                "code": e.code}})
                        return
                    completion_tokens += len(chunk.token_ids)
                    if chunk.finished:
                        finished.add(i)
                        cached += chunk.num_cached_tokens if i in firsts else 0
                    if chunk.text or chunk.token_ids or chunk.finished:
                        yield _event(fmt.chunk([fmt.stream_choice(i, chunk)]))
                if include_usage:
                    yield _event(fmt.chunk([], usage=_usage(num_prompt, completion_tokens, cached)))
                yield "data: [DONE]\n\n"
            finally:  # the end, or the client went away (Starlette cancels this generator)
                self._finish(streams, finished)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _check_failed(self, chunk: StreamChunk) -> None:
        if chunk.finished and chunk.finish_reason == "error":
            failure = self.engine.failure
            raise APIError(503, (f"the pipeline failed: {failure}" if failure
                                 else "the request failed in the engine"), "service_unavailable_error")

    # ---- token text for logprobs -------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.engine.tokenizer
            text = (str(token_id) if tok is None
                    else tok.decode([token_id], clean_up_tokenization_spaces=False))
            self._token_text[token_id] = text
        return text


class _Format:
    """The JSON shapes of one endpoint (completions or chat), whole and streamed."""

    def __init__(self, door: OpenAIFrontDoor, rid: str, obj: str, *, chat: bool,
                 logprobs: int | None, tool_calls: bool = False) -> None:
        self.door, self.rid, self.object, self.chat, self.logprobs = door, rid, obj, chat, logprobs
        self.tool_calls = tool_calls  # chat with tools: the answer is read for Hermes tool calls
        self.created = int(time.time())
        self._text_offset: dict[int, int] = {}  # streamed completions: where each choice's next token starts
        self._parsers: dict[int, ToolCallParser] = {}  # streamed tool calls: each choice's parser

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.rid, "object": self.object + (".chunk" if self.chat else ""),
                               "created": self.created, "model": self.door.model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def role_delta(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def stream_choice(self, index: int, chunk: StreamChunk) -> dict[str, Any]:
        reason = chunk.finish_reason if chunk.finished else None
        lp = None
        if self.logprobs is not None:
            lp = self.logprob_block(chunk.token_ids, chunk.logprobs, self._text_offset.get(index, 0))
            if not self.chat and lp["tokens"]:
                self._text_offset[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if self.chat and self.tool_calls:
            parser = self._parsers.setdefault(index, ToolCallParser())
            got = parser.feed(chunk.text)
            if chunk.finished:
                got.extend(parser.finish())
                if parser.calls and reason == "stop":
                    reason = "tool_calls"
            delta: dict[str, Any] = {"content": got.content} if got.content else {}
            if got.tool_calls:
                delta["tool_calls"] = got.tool_calls
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if self.chat:
            delta = {"content": chunk.text} if chunk.text else {}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return {"index": index, "text": chunk.text, "logprobs": lp, "finish_reason": reason}

    def whole_choice(self, index: int, c: _Choice) -> dict[str, Any]:
        lp = self.logprob_block(c.token_ids, c.logprobs, 0) if self.logprobs is not None else None
        reason = c.finish_reason
        if self.chat and self.tool_calls:
            content, calls = parse_tool_calls(c.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
                if reason == "stop":
                    reason = "tool_calls"
            return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                    "finish_reason": reason}
        return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": reason}

    def logprob_block(self, token_ids: list[int], logprobs: list[TokenLogprob],
                      offset: int) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's `content` list, or the completions' four parallel lists."""
        text = self.door.token_text
        if self.chat:
            return {"content": [
                {"token": text(t), "logprob": lp, "bytes": list(text(t).encode()),
                 "top_logprobs": [{"token": text(i), "logprob": v, "bytes": list(text(i).encode())}
                                  for i, v in top]}
                for t, (lp, top) in zip(token_ids, logprobs, strict=True)
            ]}
        tokens = [text(t) for t in token_ids]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [{text(i): v for i, v in top} for _, top in logprobs], "text_offset": offsets}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache supplied (each prompt once)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _first_choices(streams: list[tuple[str, RequestStream]]) -> set[int]:
    """The index of each prompt's first choice: its prompt counts once in usage, like its tokens."""
    seen: dict[str, int] = {}
    for i, (group, _) in enumerate(streams):
        seen.setdefault(group, i)
    return set(seen.values())


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class BearerAuth:
    """ASGI middleware: every path but /health must carry `Authorization: Bearer <token>` (the gRPC
    server's token). It runs before the body is read, so a request without the token learns nothing else."""

    OPEN_PATHS = ("/health",)  # load balancers and liveness probes carry no token

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            got = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(got, self._expected):  # constant time
                refusal = APIError(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                                   "authentication_error", "invalid_api_key")
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, *, model_name: str, token: str | None = None,
              metrics: ServerMetrics | None = None) -> FastAPI:
    """The FastAPI application over a started (or soon started) AsyncEngine."""
    metrics = metrics or ServerMetrics(model_name)
    door = OpenAIFrontDoor(engine, model_name, metrics)
    app = FastAPI(title="ppserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.door = door
    if token:
        app.add_middleware(BearerAuth, token=token)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, _validation_message(exc), "invalid_request_error").response()

    async def answer(make: Callable[[], Awaitable[Any]]) -> Any:
        """ppserve's exceptions as OpenAI's error JSON."""
        try:
            return await make()
        except Exception as e:
            return api_error(e).response()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await answer(lambda: door.completions(body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await answer(lambda: door.chat_completions(body, request))

    @app.get("/v1/models")
    async def models() -> Any:
        return door.models()

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return await door.metrics_text()

    @app.get("/health")
    async def health() -> Response:
        return door.health()

    return app
