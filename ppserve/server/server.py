"""The gRPC server's lifecycle: build the engine, serve PPServe + health + reflection, shut down gracefully.

Shutdown order matters: health goes NOT_SERVING, the server stops accepting RPCs and gives in-flight
streams `grace_seconds` to finish (grpc.aio then cancels the rest, and their handlers cancel their
requests), the engine thread stops, and only then is the pipeline torn down.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ppserve.config import EngineConfig, ServerConfig
from ppserve.engine.async_engine import AsyncEngine
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.server.servicer import PPServeServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PPServe"].full_name  # "ppserve.v1.PPServe"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    engine: AsyncEngine
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let streams finish for up to grace_s, then stop the engine loop."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        # The engine thread is joined off the event loop: it may be finishing a step.
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call (health and reflection included) must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        got: Any = dict(details.invocation_metadata or ()).get("authorization", b"")
        if isinstance(got, str):
            got = got.encode()
        if handler is None or hmac.compare_digest(got, self._expected):  # constant time
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED and nothing else."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _auth_token(cfg: ServerConfig) -> str | None:
    if cfg.auth_token_file:
        token = Path(cfg.auth_token_file).read_text().strip()
        if not token:
            raise ValueError(f"server.auth_token_file {cfg.auth_token_file!r} is empty")
        return token
    return cfg.auth_token


def _add_ppserve_service(server: grpc.aio.Server, servicer: PPServeServicer, max_message_bytes: int) -> None:
    """Like the generated add_PPServeServicer_to_server, but Generate parses with a deserializer that
    never raises, so malformed bytes (invalid UTF-8, oversized) get INVALID_ARGUMENT, not INTERNAL."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=convert.generate_request_deserializer(max_message_bytes),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            servicer.Cancel,
            request_deserializer=pb.CancelRequest.FromString,
            response_serializer=pb.CancelResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats,
            request_deserializer=pb.StatsRequest.FromString,
            response_serializer=pb.Stats.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


async def start_server(
    engine: AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 4 * 1024 * 1024,
    server_config: ServerConfig | None = None,
) -> RunningServer:
    """Start the engine loop and a grpc.aio server on host:port (0 picks a free port).

    `server_config` adds TLS, the bearer token and the per-connection stream limit.
    """
    cfg = server_config or ServerConfig(max_message_bytes=max_message_bytes)
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        # gRPC itself refuses only beyond twice the limit (RESOURCE_EXHAUSTED, before any handler runs);
        # between the limit and that, the deserializer answers INVALID_ARGUMENT naming the limit.
        ("grpc.max_receive_message_length", 2 * max_message_bytes),
        ("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
        # Ports must not be shared with a stale server: a second `serve` on the same port fails loudly.
        ("grpc.so_reuseport", 0),
    ]
    token = _auth_token(cfg)
    interceptors = [BearerTokenInterceptor(token)] if token else []
    # No maximum_concurrent_rpcs: admission control is the engine's bounded waiting queue, and a
    # grpc-level limit would also count health checks and stats calls.
    server = grpc.aio.server(options=options, interceptors=interceptors)
    _add_ppserve_service(server, PPServeServicer(engine), max_message_bytes)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if cfg.tls_cert and cfg.tls_key:
        creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    engine.start(asyncio.get_running_loop())
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health, engine, host, bound)


async def serve_until_signal(
    engine: AsyncEngine,
    host: str,
    port: int,
    grace_s: float,
    max_message_bytes: int,
    on_ready: Callable[[RunningServer], None] | None = None,
    server_config: ServerConfig | None = None,
) -> None:
    running = await start_server(engine, host, port, max_message_bytes, server_config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        on_ready(running)
    watcher = asyncio.ensure_future(_watch_engine(running))
    await stop.wait()
    watcher.cancel()
    logger.info("shutting down: grace %.1f s", grace_s)
    await running.stop(grace_s)


async def _watch_engine(running: RunningServer) -> None:
    """A failed pipeline cannot serve: say so through health; Generate answers UNAVAILABLE meanwhile."""
    engine = running.engine
    while engine.is_running:
        await asyncio.sleep(1.0)
    if engine.failure is not None:
        logger.error("the pipeline failed: %s; new requests get UNAVAILABLE", engine.failure)
        for name in ("", SERVICE_NAME):
            await running.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def run_server(config: EngineConfig, host: str, port: int) -> int:
    """Blocking: build the pipeline, serve until SIGINT/SIGTERM, tear everything down."""
    engine = AsyncEngine.build(config)
    try:

        def ready(r: RunningServer) -> None:
            # Tests and scripts wait for this exact line; flush so a pipe sees it at once.
            print(f"ppserve serving on {r.address}", flush=True)

        asyncio.run(
            serve_until_signal(
                engine, host, port, config.server.grace_seconds, config.server.max_message_bytes, ready,
                config.server,
            )
        )
    finally:
        engine.stop()
        if config.trace.path:
            _save_trace(engine, config.trace.path)
        engine.shutdown()
        print("ppserve stopped", file=sys.stderr, flush=True)
    return 0


def _save_trace(engine: AsyncEngine, path: str) -> None:
    """After the engine thread stopped: this thread may touch the engine directly."""
    import time

    from ppserve.metrics.trace import save_chrome_trace

    try:
        save_chrome_trace(
            path, engine.all_spans(), work_intervals=engine.engine.work.intervals(time.perf_counter_ns())
        )
        logger.info("trace written to %s", path)
    except Exception as e:  # a trace is a by-product; shutdown must go on
        logger.warning("writing the trace to %s failed: %s", path, e)
