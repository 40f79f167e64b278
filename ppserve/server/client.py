"""Python clients for the ppserve.v1 API: `PPServeClient` (blocking) and `AsyncPPServeClient` (asyncio).

Both hand back plain Python objects (`Chunk`, `Completion`, dicts), so callers never touch protobuf.
Errors surface as `grpc.RpcError` (sync) / `grpc.aio.AioRpcError` (async) with the server's status code
and a message naming the offending field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
    finish_reason: str | None  # set on the last chunk: stop | length | cancelled | error
    metrics: dict[str, float] | None  # queue_time_s, ttft_s, mean_tbt_s, e2e_s on the last chunk
    index: int = 0  # which choice (sampling n > 1)
    # One per new token when sampling.logprobs was set: {"token_id", "logprob", "top": [(id, logprob), ...]}
    logprobs: list[dict[str, Any]] = field(default_factory=list)

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

    def add(self, c: Chunk) -> None:
        self.request_id, self.index = c.request_id, c.index
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs)
        self.token_times.extend(c.token_times)
        self.num_prompt_tokens = c.num_prompt_tokens
        if c.finish_reason is not None:
            self.finish_reason, self.metrics = c.finish_reason, c.metrics


def _single(choices: list[Completion]) -> Completion:
    if len(choices) != 1:
        raise ValueError(f"the request produced {len(choices)} choices (sampling n > 1): use generate_choices")
    return choices[0]


def _request(
    prompt: str | Sequence[int] | None,
    messages: Sequence[dict[str, str]] | None,
    sampling: SamplingParams | None,
    request_id: str,
    **sampling_kwargs: Any,
) -> pb.GenerateRequest:
    if sampling is None and sampling_kwargs:
        sampling = SamplingParams(**sampling_kwargs)
    return convert.generate_request_to_proto(prompt, sampling, messages=messages, request_id=request_id)


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
    """A live Generate stream (sync): iterate for chunks; cancel() ends it and the server frees the request."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        for msg in self._call:
            yield Chunk.from_proto(msg)

    def cancel(self) -> None:
        self._call.cancel()


class PPServeClient:
    """Blocking client. Use as a context manager, or call close()."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        max_message_bytes: int = 4 * 1024 * 1024,
        tls: bool = False,
        root_certificates: bytes | str | None = None,
        token: str | None = None,
    ) -> None:
        """tls / root_certificates (PEM bytes or path; implies tls): TLS; token: bearer token sent on every call."""
        self.target = target
        opts = _channel_options(max_message_bytes)
        creds = _credentials(tls, root_certificates)
        self.channel = grpc.secure_channel(target, creds, opts) if creds else grpc.insecure_channel(target, opts)
        self.metadata = _metadata(token)
        self.stub = pb_grpc.PPServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def wait_ready(self, timeout: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout)

    def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> ChunkStream:
        """Start a Generate stream; sampling fields may be passed as keywords (max_tokens=8, ...)."""
        req = _request(prompt, messages, sampling, request_id, **sampling_kwargs)
        return ChunkStream(self.stub.Generate(req, timeout=timeout, metadata=self.metadata))

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """One whole completion (n = 1; see generate_choices)."""
        return _single(self.generate_choices(prompt, **kwargs))

    def generate_choices(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> list[Completion]:
        """Every choice of a request (sampling n), assembled, in index order."""
        out: dict[int, Completion] = {}
        for c in self.stream(prompt, **kwargs):
            out.setdefault(c.index, Completion()).add(c)
        return [out[i] for i in sorted(out)]

    def cancel(self, request_id: str, timeout: float | None = 10.0) -> bool:
        resp = self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)
        return bool(resp.cancelled)

    def stats(self, timeout: float | None = 30.0) -> dict[str, Any]:
        return convert.stats_from_proto(self.stub.GetStats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata))

    def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """SERVING | NOT_SERVING | SERVICE_UNKNOWN | UNKNOWN."""
        resp = self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self.metadata
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PPServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPPServeClient:
    """asyncio client; create it inside a running event loop. `async with` closes the channel."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        max_message_bytes: int = 4 * 1024 * 1024,
        tls: bool = False,
        root_certificates: bytes | str | None = None,
        token: str | None = None,
    ) -> None:
        self.target = target
        opts = _channel_options(max_message_bytes)
        creds = _credentials(tls, root_certificates)
        self.channel = (
            grpc.aio.secure_channel(target, creds, opts) if creds else grpc.aio.insecure_channel(target, opts)
        )
        self.metadata = _metadata(token)
        self.stub = pb_grpc.PPServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        import asyncio

        await asyncio.wait_for(self.channel.channel_ready(), timeout)

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        sampling: SamplingParams | None = None,
        request_id: str = "",
        timeout: float | None = None,
        **sampling_kwargs: Any,
    ) -> AsyncIterator[Chunk]:
        """Yield chunks as they arrive. Leaving the loop early (break, task cancel) cancels the request."""
        req = _request(prompt, messages, sampling, request_id, **sampling_kwargs)
        call = self.stub.Generate(req, timeout=timeout, metadata=self.metadata)
        try:
            async for msg in call:
                yield Chunk.from_proto(msg)
        finally:
            call.cancel()  # a no-op when the stream already ended

    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Completion:
        """One whole completion (n = 1; see generate_choices)."""
        return _single(await self.generate_choices(prompt, **kwargs))

    async def generate_choices(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> list[Completion]:
        """Every choice of a request (sampling n), assembled, in index order."""
        out: dict[int, Completion] = {}
        async for c in self.stream(prompt, **kwargs):
            out.setdefault(c.index, Completion()).add(c)
        return [out[i] for i in sorted(out)]

    async def cancel(self, request_id: str, timeout: float | None = 10.0) -> bool:
        resp = await self.stub.Cancel(pb.CancelRequest(request_id=request_id), timeout=timeout, metadata=self.metadata)
        return bool(resp.cancelled)

    async def stats(self, timeout: float | None = 30.0) -> dict[str, Any]:
        msg = await self.stub.GetStats(pb.StatsRequest(), timeout=timeout, metadata=self.metadata)
        return convert.stats_from_proto(msg)

    async def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        resp = await self.health_stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, metadata=self.metadata
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncPPServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
