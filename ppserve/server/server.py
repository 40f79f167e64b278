"""The gRPC server's lifecycle: build the engine, serve PPServe + health + reflection, shut down gracefully.

Shutdown order matters: health goes NOT_SERVING, the server stops accepting RPCs and gives in-flight
streams `grace_seconds` to finish (grpc.aio then cancels the rest, and their handlers cancel their
requests), the engine thread stops, and only then is the pipeline torn down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ppserve.config import EngineConfig, ServerConfig
from ppserve.engine.async_engine import AsyncEngine
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.server.metrics import ServerMetrics
from ppserve.server.servicer import PPServeServicer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the embedded default model
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PPServe"].full_name  # "ppserve.v1.PPServe"


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    engine: AsyncEngine
    host: str
    port: int
    http: HTTPServer | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def set_health(self, serving: bool) -> None:
        await set_serving(self.health, serving)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting, let streams finish for up to grace_s (both front doors at once), then stop
        the engine loop."""
        await self.health.enter_graceful_shutdown()
        stopping = [self.server.stop(grace_s)]
        if self.http is not None:
            stopping.append(self.http.stop())
        await asyncio.gather(*stopping)
        # The engine thread is joined off the event loop: it may be finishing a step.
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our event loop: signals stay with serve_until_signal, which stops both front doors."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HTTPServer:
    """The OpenAI-compatible API under uvicorn, in the gRPC server's event loop."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int
    scheme: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def start_http(engine: AsyncEngine, cfg: ServerConfig, host: str, token: str | None,
                     metrics: ServerMetrics, model_name: str, grace_s: float) -> HTTPServer:
    """Bind first (a taken port fails here, loudly), then serve in a task of the running loop."""
    from ppserve.server.openai_api import build_app

    app = build_app(engine, model_name=model_name, token=token, metrics=metrics)
    tls = bool(cfg.tls_cert and cfg.tls_key)
    config = uvicorn.Config(app, host=host, port=cfg.http_port, log_level="warning", access_log=False,
                            ssl_certfile=cfg.tls_cert if tls else None,
                            ssl_keyfile=cfg.tls_key if tls else None,
                            timeout_graceful_shutdown=max(1, int(grace_s)), lifespan="off")
    sock = config.bind_socket()
    server = _EmbeddedUvicorn(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():  # it could not start: say why
            task.result()
            raise OSError(f"the HTTP server on {host}:{cfg.http_port} stopped while starting")
        await asyncio.sleep(0.01)
    return HTTPServer(server, task, host, sock.getsockname()[1], "https" if tls else "http")


def served_model_name(config: EngineConfig) -> str:
    """The model's name in the HTTP API: server.served_model_name, else the model directory's name."""
    if config.server.served_model_name:
        return config.server.served_model_name
    if config.model.model:
        return Path(config.model.model.rstrip("/")).name or config.model.model
    return DEFAULT_MODEL_NAME


# grpc is untyped, so its base class is Any to mypy.
class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
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
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong bearer token (authorization metadata)")

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


def _add_ppserve_service(server: grpc.aio.Server, servicer: Any, max_message_bytes: int) -> None:
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


def build_grpc_server(servicer: Any, host: str, port: int, cfg: ServerConfig
                      ) -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
    """A grpc.aio server of the PPServe service (`servicer`: PPServeServicer or the replicas' relay),
    health and reflection, bound to host:port (0 picks a free port) with cfg's TLS and bearer token;
    not started. Returns the server, its health servicer and the bound port."""
    max_message_bytes = cfg.max_message_bytes
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
    _add_ppserve_service(server, servicer, max_message_bytes)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    if cfg.tls_cert and cfg.tls_key:
        creds = grpc.ssl_server_credentials([(Path(cfg.tls_key).read_bytes(),
                                              Path(cfg.tls_cert).read_bytes())])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, health, bound


async def set_serving(health: health_aio.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", SERVICE_NAME):
        await health.set(name, status)


async def start_server(
    engine: AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = 4 * 1024 * 1024,
    server_config: ServerConfig | None = None,
) -> RunningServer:
    """Start the engine loop and a grpc.aio server on host:port (0 picks a free port).

    `server_config` adds TLS, the bearer token, the per-connection stream limit and the OpenAI-compatible
    HTTP API (server.http_port; without a server_config there is none).
    """
    cfg = server_config or ServerConfig(max_message_bytes=max_message_bytes, http_port=-1)
    server, health, bound = build_grpc_server(PPServeServicer(engine), host, port,
                                              dataclasses.replace(cfg, max_message_bytes=max_message_bytes))
    http = None
    if cfg.http_port >= 0:
        metrics = ServerMetrics(served_model_name(engine.config))
        engine.add_observer(metrics)
        http = await start_http(engine, cfg, cfg.http_host or host, _auth_token(cfg), metrics,
                                served_model_name(engine.config), cfg.grace_seconds)
    engine.start(asyncio.get_running_loop())
    await server.start()
    running = RunningServer(server, health, engine, host, bound, http)
    await running.set_health(True)
    return running


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


HEALTH_POLL_S = 0.1  # how often health follows the pipeline (a rebuild takes seconds)


async def _watch_engine(running: RunningServer) -> None:
    """Health follows the pipeline: NOT_SERVING while it is rebuilt after a stage failure (new requests
    get UNAVAILABLE / 503 meanwhile) and SERVING again after; NOT_SERVING for good once it failed."""
    engine = running.engine
    serving = True
    while engine.is_running:
        rebuilding = bool(getattr(engine.engine, "recovering", False))
        if rebuilding == serving:
            serving = not rebuilding
            logger.warning("pipeline %s",
                           "rebuilt: serving again" if serving else "being rebuilt: not serving")
            await running.set_health(serving)
        await asyncio.sleep(HEALTH_POLL_S)
    if engine.failure is not None:
        logger.error("the pipeline failed: %s; new requests get UNAVAILABLE", engine.failure)
        await running.set_health(False)


def run_server(config: EngineConfig, host: str, port: int) -> int:
    """Blocking: build the pipeline, serve until SIGINT/SIGTERM, tear everything down."""
    engine = AsyncEngine.build(config)
    try:

        def ready(r: RunningServer) -> None:
            # Tests and scripts wait for these exact lines; flush so a pipe sees them at once.
            if r.http is not None:
                print(f"ppserve OpenAI API on {r.http.url}/v1", flush=True)
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
            path, engine.all_spans(), work_intervals=engine.engine.work.intervals(time.perf_counter_ns()),
            counters=getattr(engine.engine, "cache_counters", ()),  # the prefix cache's hit rate and blocks
        )
        logger.info("trace written to %s", path)
    except Exception as e:  # a trace is a by-product; shutdown must go on
        logger.warning("writing the trace to %s failed: %s", path, e)
