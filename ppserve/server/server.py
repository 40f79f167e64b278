"""The gRPC server's lifecycle: build the engine, serve PPServe + health + reflection, shut down gracefully.

Shutdown order matters: health goes NOT_SERVING, the server stops accepting RPCs and gives in-flight
streams `grace_seconds` to finish (grpc.aio then cancels the rest, and their handlers cancel their
requests), the engine thread stops, and only then is the pipeline torn down.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ppserve.config import EngineConfig
from ppserve.server.async_engine import AsyncEngine
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.server.gen import ppserve_pb2_grpc as pb_grpc
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


async def start_server(
    engine: AsyncEngine, host: str = "127.0.0.1", port: int = 0, max_message_bytes: int = 4 * 1024 * 1024
) -> RunningServer:
    """Start the engine loop and a grpc.aio server on host:port (0 picks a free port)."""
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Ports must not be shared with a stale server: a second `serve` on the same port fails loudly.
        ("grpc.so_reuseport", 0),
    ]
    # No maximum_concurrent_rpcs: admission control is the engine's bounded waiting queue, and a
    # grpc-level limit would also count health checks and stats calls.
    server = grpc.aio.server(options=options)
    pb_grpc.add_PPServeServicer_to_server(PPServeServicer(engine), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
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
) -> None:
    running = await start_server(engine, host, port, max_message_bytes)
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
                engine, host, port, config.server.grace_seconds, config.server.max_message_bytes, ready
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
