"""One pipeline as a Ray Serve replica: today's engine and both front doors' logic, minus the sockets.

The ingress (ingress.py) owns the sockets and relays each request here through a deployment handle:
HTTP as ASGI messages into the same FastAPI application `ppserve serve` runs (so validation, errors,
streaming and cancellation on disconnect behave exactly as on one server), gRPC as the same servicer
with a context that hands an abort back to the ingress. The pipeline's actors are this replica's own
(its executor places them in placement groups, as for one server); Serve health-checks the replica
(`check_health` fails once the pipeline failed for good, and Serve replaces the replica) and reads
`record_routing_stats` for the router (`serving` is false while the pipeline is rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import grpc

from ppserve.config import load_config
from ppserve.deploy.merge import label_exposition

logger = logging.getLogger(__name__)


class RelayedAbort(Exception):
    """A gRPC abort raised by the servicer in the replica, to be raised again by the ingress."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)
        self.code, self.details = code, details


class _RelayContext:
    """The part of grpc.aio.ServicerContext that PPServeServicer uses."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise RelayedAbort(code, details)


class PipelineReplica:
    # Serve awaits an async constructor (mypy knows only synchronous ones).
    async def __init__(self, config: dict[str, Any], overrides: list[str] | None = None) -> None:  # type: ignore[misc]
        from ray import serve

        from ppserve.engine.async_engine import AsyncEngine
        from ppserve.server.metrics import ServerMetrics
        from ppserve.server.openai_api import build_app
        from ppserve.server.server import served_model_name
        from ppserve.server.servicer import PPServeServicer

        self.config = load_config(extra=config, overrides=list(overrides or ()))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # Building loads weights and starts the pipeline: off the event loop, which Serve keeps serving.
        self.engine = await asyncio.to_thread(AsyncEngine.build, self.config)
        self.model_name = served_model_name(self.config)
        self.metrics = ServerMetrics(self.model_name)
        self.engine.add_observer(self.metrics)
        self.app = build_app(self.engine, model_name=self.model_name, metrics=self.metrics)
        self.servicer = PPServeServicer(self.engine)
        self.engine.start(asyncio.get_running_loop())
        logger.info("replica %s serving %s", self.replica_id, self.model_name)

    # ---- what Serve calls --------------------------------------------------------------------
    def check_health(self) -> None:
        if self.engine.failure is not None:
            raise RuntimeError(f"the pipeline failed: {self.engine.failure}")
        if not self.engine.is_running:
            raise RuntimeError("the engine loop stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        rebuilding = bool(getattr(self.engine.engine, "recovering", False))
        return {"serving": self.engine.is_running and not rebuilding}

    def __del__(self) -> None:
        """Serve calls this after draining (graceful_shutdown_timeout_s): stop the loop, free the pipeline."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
            engine.shutdown()

    # ---- what the ingress calls ----------------------------------------------------------------
    def describe(self, routing: dict[str, Any] | None = None) -> dict[str, Any]:
        serving = self.engine.serving_config()
        return {"replica": self.replica_id, "model_name": self.model_name, "block_size": serving.block_size,
                "max_model_len": serving.max_model_len}

    def health(self, routing: dict[str, Any] | None = None) -> dict[str, Any]:
        """What /health reports for this replica."""
        stats = self.record_routing_stats()
        failure = self.engine.failure
        return {**stats, "restarts": int(getattr(self.engine.engine, "num_restarts", 0)), "pid": os.getpid(),
                **({"error": str(failure)} if failure is not None else {})}

    async def http(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes, routing: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """Yield the replica id, then the response's {"status", "headers"}, then its body chunks.
        Cancelling this generator (the ingress' client went away) disconnects the request."""
        yield {"replica": self.replica_id}
        messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(dict(message))

        app = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            while True:
                get = asyncio.ensure_future(messages.get())
                await asyncio.wait({get, app}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    app.result()  # the application ended without finishing its response: say why
                    raise RuntimeError(f"{method} {path}: the application ended without a response")
                msg = get.result()
                if msg["type"] == "http.response.start":
                    yield {"status": msg["status"], "headers": list(msg.get("headers", ()))}
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        return
        finally:
            gone.set()
            if not app.done():
                app.cancel()
            with contextlib.suppress(BaseException):
                await app

    async def generate(self, request: bytes, routing: dict[str, Any] | None = None) -> AsyncIterator[Any]:
        """The gRPC Generate stream: the replica id, then serialized GenerateResponse messages, or a
        RelayedAbort as the last item (raised again by the ingress). Messages cross as bytes: Ray
        cannot pickle protobuf classes."""
        from ppserve.server import convert

        yield {"replica": self.replica_id}
        parsed: Any = convert.generate_request_deserializer(self.config.server.max_message_bytes)(request)
        try:
            async for msg in self.servicer.Generate(parsed, _RelayContext()):
                yield msg.SerializeToString()
        except RelayedAbort as e:
            yield e

    async def cancel(self, request_id: str, routing: dict[str, Any] | None = None) -> bool:
        cancelled: bool = await self.engine.cancel(request_id)
        return cancelled

    async def stats(self, routing: dict[str, Any] | None = None) -> Any:
        """This replica's GetStats answer, serialized (a RelayedAbort when the engine cannot answer)."""
        try:
            from ppserve.server.gen import ppserve_pb2 as pb

            return (await self.servicer.GetStats(pb.StatsRequest(), _RelayContext())).SerializeToString()
        except RelayedAbort as e:
            return e

    async def metrics_text(self, routing: dict[str, Any] | None = None) -> str:
        """This replica's /metrics, every series labelled with the replica."""
        from ppserve.engine.messages import PipelineUnavailable

        with contextlib.suppress(PipelineUnavailable, TimeoutError):  # a pipeline that is down keeps its
            self.metrics.refresh(await self.engine.stats())           # counters (and its restarts)
        return label_exposition(self.metrics.exposition().decode(), "replica", self.replica_id)
