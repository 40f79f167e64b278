"""Python clients for the ppserve.v1 API: `PPServeClient` (blocking) and `AsyncPPServeClient` (asyncio).

Both hand back plain Python objects (`Chunk`, `Completion`, `EngineStats`), so callers never touch protobuf.
Errors surface as `grpc.RpcError` (sync) / `grpc.aio.AioRpcError` (async) with the server's status code
and a message naming the offending field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ppserve.engine.stats import EngineStats
from ppserve.request import SamplingParams
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.server.gen import ppserve_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the new tokens and text since the previous one."""

    request_id: str
    token_ids: list[int]
    text: str
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative
    token_times: list[float]  # server Unix seconds, one per new token
    finish_reason: str | None  # set on the last chunk: stop | length | cancelled | error | tool_calls
    metrics: dict[str, float] | None  # queue_time_s, ttft_s, mean_tbt_s, e2e_s on the last chunk
    index: int = 0  # which choice (sampling n > 1)
    # One per new token when sampling.logprobs was set: {"token_id", "logprob", "top": [(id, logprob), ...]}
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    num_cached_tokens: int = 0  # on the last chunk: prompt tokens the prefix cache supplied
    # On the last chunk of a request read for tool calls (tools given, tool_choice not "none"): the calls
    # parsed from the whole output, OpenAI-shaped ({"id", "type", "function": {"name", "arguments"}}), and
    # the text beside them (None where that is empty beside calls, or the output was not read for calls).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Chunk:
        return cls(**convert.chunk_from_proto(msg))


@dataclass
class Completion:
    """A whole streamed request, assembled."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: dict[str, float] | None = None
    num_prompt_tokens: int = 0
    index: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # As Chunk's on the last chunk: OpenAI-shaped tool calls (fit for the next turn's assistant message)
    # and the content beside them.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None

    def add(self, c: Chunk) -> None:
        self.request_id, self.index = c.request_id, c.index
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.token_times.extend(c.token_times)
        self.num_prompt_tokens = c.num_prompt_tokens
        if c.finish_reason is not None:
            self.finish_reason, self.metrics = c.finish_reason, c.metrics
            self.num_cached_tokens = c.num_cached_tokens
            self.tool_calls, self.content = c.tool_calls, c.content


def _single(choices: list[Completion]) -> Completion:
    if len(choices) != 1:
        raise ValueError(f"the request produced {len(choices)} choices (sampling n > 1): "
                         "use generate_choices")
    return choices[0]


def _request(
    prompt: str | Sequence[int] | None,
    messages: Sequence[Mapping[str, Any]] | None,
    sampling: SamplingParams | None,
    request_id: str,
    cache_salt: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    **sampling_kwargs: Any,
) -> pb.GenerateRequest:
    # Keywords override the given SamplingParams' fields rather than being dropped: sampling=sp with
    # structured_outputs={...} constrains sp's request.
    if sampling_kwargs:
        sampling = (SamplingParams(**sampling_kwargs) if sampling is None
                    else replace(sampling, **sampling_kwargs))
    return convert.generate_request_to_proto(prompt, sampling, messages=messages, request_id=request_id,
                                             cache_salt=cache_salt, tools=tools, tool_choice=tool_choice,
                                             parallel_tool_calls=parallel_tool_calls)


def _channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def _credentials(tls: bool, root_certificates: bytes | str | None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials (None = plaintext). root_certificates: PEM bytes or a path to a PEM file."""
    if not tls and root_certificates is None:
        return None
    if isinstance(root_certificates, str):
        with open(root_certificates, "rb") as f:
            root_certificates = f.read()
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class ChunkStream:
    """A live Generate stream (sync): iterate for chunks; cancel() ends it and the server frees the
    request."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        for msg in self._call:
            yield Chunk.from_proto(msg)

    def cancel(self) -> None:
        self._call.cancel()


class _Client:
    """What both clients share: the channel, its credentials and bearer token, the stubs, the requests."""

    # The channel constructors (grpc's blocking or grpc.aio's), picked by each client.
    _secure_channel: Callable[..., Any]
    _insecure_channel: Callable[..., Any]

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        max_message_bytes: int = 4 * 1024 * 1024,
        tls: bool = False,
        root_certificates: bytes | str | None = None,
        token: str | None = None,
    ) -> None:
        """tls / root_certificates (PEM bytes or path; implies tls): TLS; token: bearer token sent on every
        call."""
        self.target = target
        opts = _channel_options(max_message_bytes)
        creds = _credentials(tls, root_certificates)
        self.channel = (self._secure_channel(target, creds, opts) if creds
                        else self._insecure_channel(target, opts))
        self.metadata = _metadata(token)
        self.stub = pb_grpc.PPServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def _call(self, timeout: float | None) -> dict[str, Any]:
        """The keyword arguments of every RPC: the deadline and the bearer token."""
        return {"timeout": timeout, "metadata": self.metadata}


def _health_status(resp: Any) -> str:
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def _assemble(chunks: Iterable[Chunk]) -> list[Completion]:
    """Chunks of every choice, assembled per choice, in index order."""
    out: dict[int, Completion] = {}
    for c in chunks:
        out.setdefault(c.index, Completion()).add(c)
    return [out[i] for i in sorted(out)]


class PPServeClient(_Client):
    """Blocking client. Use as a context manager, or call close()."""

    _secure_channel = staticmethod(grpc.secure_channel)
    _insecure_channel = staticmethod(grpc.insecure_channel)

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str = "",
        timeout: float | None = None,
        cache_salt: str = "",
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **sampling_kwargs: Any,
    ) -> ChunkStream:
        """Start a Generate stream; sampling fields may be passed as keywords (max_tokens=8, ...), on
        their own or over `sampling`'s; structured_outputs= takes a StructuredOutputs or vLLM's dict
        ({"json": schema}, {"choice": [...]}, {"regex": ...}, ...). messages are OpenAI-style dicts
        (tool_calls, tool_call_id and name included); tools, tool_choice ("none", "auto", "required" or
        {"type": "function", "function": {"name": ...}}) and parallel_tool_calls (None: true) are OpenAI's,
        and the last chunk carries the calls read back."""
        req = _request(prompt, messages, sampling, request_id, cache_salt, tools, tool_choice,
                       parallel_tool_calls, **sampling_kwargs)
        return ChunkStream(self.stub.Generate(req, **self._call(timeout)))

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """One whole completion (n = 1; see generate_choices)."""
        return _single(self.generate_choices(prompt, **kwargs))

    def generate_choices(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> list[Completion]:
        """Every choice of a request (sampling n), assembled, in index order."""
        return _assemble(self.stream(prompt, **kwargs))

    def cancel(self, request_id: str, timeout: float | None = 10.0) -> bool:
        return bool(self.stub.Cancel(pb.CancelRequest(request_id=request_id),
                                     **self._call(timeout)).cancelled)

    def stats(self, timeout: float | None = 30.0) -> EngineStats:
        return convert.stats_from_proto(self.stub.GetStats(pb.StatsRequest(), **self._call(timeout)))

    def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """SERVING | NOT_SERVING | SERVICE_UNKNOWN | UNKNOWN."""
        return _health_status(self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                     **self._call(timeout)))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PPServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPPServeClient(_Client):
    """asyncio client; create it inside a running event loop. `async with` closes the channel."""

    _secure_channel = staticmethod(grpc.aio.secure_channel)
    _insecure_channel = staticmethod(grpc.aio.insecure_channel)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str = "",
        timeout: float | None = None,
        cache_salt: str = "",
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **sampling_kwargs: Any,
    ) -> AsyncIterator[Chunk]:
        """Yield chunks as they arrive; sampling keywords as in PPServeClient.stream. Leaving the loop
        early (break, task cancel) cancels the request."""
        req = _request(prompt, messages, sampling, request_id, cache_salt, tools, tool_choice,
                       parallel_tool_calls, **sampling_kwargs)
        call = self.stub.Generate(req, **self._call(timeout))
        try:
            async for msg in call:
                yield Chunk.from_proto(msg)
        finally:
            call.cancel()  # a no-op when the stream already ended

    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """One whole completion (n = 1; see generate_choices)."""
        return _single(await self.generate_choices(prompt, **kwargs))

    async def generate_choices(self, prompt: str | Sequence[int] | None = None,
                               **kwargs: Any) -> list[Completion]:
        """Every choice of a request (sampling n), assembled, in index order."""
        return _assemble([c async for c in self.stream(prompt, **kwargs)])

    async def cancel(self, request_id: str, timeout: float | None = 10.0) -> bool:
        return bool((await self.stub.Cancel(pb.CancelRequest(request_id=request_id),
                                            **self._call(timeout))).cancelled)

    async def stats(self, timeout: float | None = 30.0) -> EngineStats:
        return convert.stats_from_proto(await self.stub.GetStats(pb.StatsRequest(), **self._call(timeout)))

    async def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """SERVING | NOT_SERVING | SERVICE_UNKNOWN | UNKNOWN."""
        return _health_status(await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                           **self._call(timeout)))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncPPServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
