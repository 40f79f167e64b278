"""The replicas' one front door: Serve's HTTP proxy reaches this deployment (the OpenAI-compatible API,
/health and /metrics), and it serves ppserve's gRPC API on its own port.

A generating request is relayed whole to one replica (replica.py) through the deployment handle, with
the prompt's prefix keys for the router (router.py): the prompt is tokenized here exactly as the replica
will (engine/prompter.py), so the keys are the replica's cache keys. A request that cannot be relayed,
or whose replica dies before answering, gets 503 (gRPC: UNAVAILABLE) naming why; a streamed answer whose
replica dies mid-way ends with an error event (gRPC: UNAVAILABLE), never silence. Cancel, GetStats,
/health and /metrics address the replicas one by one (the router pins those calls).

FastAPI reads the handlers' annotations at run time, so this module does not postpone them.
"""

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from ppserve.config import load_config
from ppserve.deploy.merge import merge_expositions, merge_stats
from ppserve.deploy.replica import RelayedAbort
from ppserve.deploy.router import PipelineRouter, routers
from ppserve.engine.messages import PromptInput
from ppserve.route import prefix_keys

logger = logging.getLogger(__name__)

PINNED_CALL_S = 10.0  # a call to one named replica (cancel, stats, health, metrics) gives up after this
_DROP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}

api = FastAPI(title="ppserve", docs_url=None, redoc_url=None, openapi_url=None)


class ReplicaLost(Exception):
    """The replica serving a request could not be reached or died."""


def _unavailable(message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": None}}
    return JSONResponse(body, status_code=503)


def http_prompt(path: str, body: bytes) -> PromptInput | None:
    """The first prompt of a completions or chat body, as the replica's front door will read it;
    None when it does not parse (the replica answers that request's error)."""
    from ppserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest

    try:
        data = json.loads(body)
        if path.endswith("/chat/completions"):
            chat = ChatCompletionRequest.model_validate(data)
            return PromptInput(messages=chat.conversation(), tools=chat.tool_plan().tools,
                               cache_salt=chat.cache_salt or None)
        if path.endswith("/completions"):
            cmpl = CompletionRequest.model_validate(data)
            first = cmpl.prompts()[0]
            salt = cmpl.cache_salt or None
            return (PromptInput(text=first, cache_salt=salt) if isinstance(first, str)
                    else PromptInput(token_ids=tuple(first), cache_salt=salt))
    except Exception:
        return None
    return None


async def _disconnected(request: Request) -> None:
    from ppserve.server.openai_api import _disconnected as wait_disconnect

    await wait_disconnect(request)


async def _collect(gen: Any) -> bytes:
    parts: list[bytes] = []
    try:
        async for chunk in gen:
            parts.append(chunk)
    except Exception as e:
        raise ReplicaLost(f"the replica failed while answering: {type(e).__name__}: {e}") from None
    return b"".join(parts)


async def _events(gen: Any) -> AsyncIterator[bytes]:
    """The replica's event stream; an error event if the replica dies mid-way; the replica's request
    is cancelled when the client goes away (Starlette cancels this generator)."""
    try:
        async for chunk in gen:
            yield chunk
    except Exception as e:
        error = {"error": {"message": f"the replica failed while streaming: {type(e).__name__}: {e}",
                           "type": "service_unavailable_error", "param": None, "code": None}}
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        gen.cancel()


def _token(cfg: Any) -> str | None:
    from ppserve.server.server import _auth_token

    return _auth_token(cfg)


class RelayServicer:
    """PPServe over gRPC, each Generate relayed to one replica (the router chooses, by prefix)."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        from ppserve.server import convert
        from ppserve.server.gen import ppserve_pb2 as pb

        if isinstance(request, convert.MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        ing = self.ingress
        try:
            plan = convert.tool_plan_from_proto(request)
            prompt: PromptInput | None = convert.prompt_from_proto(request, ing.prompter.vocab_size,
                                                                   plan.tools)
        except ValueError:
            prompt = None  # the replica answers INVALID_ARGUMENT with the same message
        keys = await ing.keys(prompt)
        gen: Any = ing.replicas.options(stream=True).generate.remote(request.SerializeToString(),
                                                                routing={"keys": keys})
        rid = None
        try:
            try:
                replica = (await gen.__anext__())["replica"]
            except Exception as e:
                raise ReplicaLost(f"no replica could answer: {type(e).__name__}: {e}") from None
            async for msg in _relayed(gen):
                if isinstance(msg, RelayedAbort):
                    await context.abort(msg.code, msg.details)
                msg = pb.GenerateResponse.FromString(msg)
                if rid is None:
                    rid = msg.request_id
                    ing.where[rid] = replica
                yield msg
        except ReplicaLost as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        finally:
            gen.cancel()
            if rid is not None:
                ing.where.pop(rid, None)

    async def Cancel(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from ppserve.server.gen import ppserve_pb2 as pb

        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        replica = self.ingress.where.get(request.request_id)
        if replica is None:
            return pb.CancelResponse(cancelled=False)
        try:
            ok = await self.ingress.pinned("cancel", replica, request.request_id)
        except Exception as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {replica}: {type(e).__name__}: {e}")
        return pb.CancelResponse(cancelled=bool(ok))

    async def GetStats(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        answers = await self.ingress.each("stats")
        from ppserve.server.gen import ppserve_pb2 as pb

        good = [pb.Stats.FromString(a) for a in answers.values() if isinstance(a, bytes)]
        if not good:
            why = "; ".join(f"{r}: {a}" for r, a in answers.items()) or "no replica is running"
            await context.abort(grpc.StatusCode.UNAVAILABLE, why)
        return merge_stats(good)


async def _relayed(gen: Any) -> AsyncIterator[Any]:
    try:
        async for msg in gen:
            yield msg
    except Exception as e:
        raise ReplicaLost(f"the replica failed while streaming: {type(e).__name__}: {e}") from None


class _RouterCollector:
    """The router's view as metrics: requests routed and ongoing per replica, affinity decisions."""

    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        router = self.ingress.router
        routed = CounterMetricFamily("ppserve:router_requests", "Requests the router sent to each replica.",
                                     labels=["replica", "policy"])
        ongoing = GaugeMetricFamily("ppserve:router_ongoing_requests",
                                    "Requests the router sent to each replica that have not completed.",
                                    labels=["replica"])
        affine = CounterMetricFamily("ppserve:router_affinity_decisions",
                                     "Prefix-aware choices: followed the prefix, or passed it over for load.",
                                     labels=["decision"])
        if router is not None:
            for replica, n in sorted(router.routed.items()):
                routed.add_metric([replica, router.policy.name], n)
            for replica, n in sorted(router.ongoing.items()):
                ongoing.add_metric([replica], n)
            affine.add_metric(["followed"], getattr(router.policy, "num_affine", 0))
            affine.add_metric(["overloaded"], getattr(router.policy, "num_overloaded", 0))
        yield routed
        yield ongoing
        yield affine


class Ingress:
    # Serve awaits an async constructor (mypy knows only synchronous ones).
    async def __init__(self, replicas: DeploymentHandle[Any], settings: dict[str, Any]) -> None:  # type: ignore[misc]
        from ppserve.engine.prompter import Prompter

        self.replicas = replicas
        self.config = load_config(extra=settings["config"], overrides=list(settings.get("set") or ()))
        self.token = _token(self.config.server)
        self.prompter = await asyncio.to_thread(Prompter.for_model, self.config.model)
        info = await replicas.describe.remote(routing={"keys": []})  # waits for a first replica
        self.block_size, self.model_name = int(info["block_size"]), str(info["model_name"])
        self.where: dict[str, str] = {}  # gRPC request id -> the replica streaming it
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_RouterCollector(self))
        self.grpc: grpc.aio.Server | None = None
        port = int(settings.get("grpc_port", self.config.server.port))
        if port >= 0:
            from ppserve.server.server import build_grpc_server, set_serving

            host = settings.get("grpc_host") or self.config.server.host
            self.grpc, health, self.grpc_port = build_grpc_server(RelayServicer(self), host, port,
                                                                  self.config.server)
            await self.grpc.start()
            await set_serving(health, True)
            logger.info("ppserve gRPC relay on %s:%d", host, self.grpc_port)

    async def __del__(self) -> None:
        server = getattr(self, "grpc", None)
        if server is not None:
            await server.stop(self.config.server.grace_seconds)

    # ---- routing -------------------------------------------------------------------------------
    @property
    def router(self) -> PipelineRouter | None:
        live = routers()
        return live[0] if live else None

    def replica_ids(self) -> list[str]:
        router = self.router
        return router.replica_ids() if router is not None else []

    async def keys(self, prompt: "PromptInput | None") -> list[bytes]:
        """The prompt's prefix keys; none when it cannot be tokenized (the replica answers the error)."""
        if prompt is None:
            return []
        try:
            ids = await asyncio.to_thread(self.prompter.tokenize, prompt)
        except Exception:
            return []
        return prefix_keys(ids, self.block_size, prompt.cache_salt)

    async def pinned(self, method: str, replica: str, *args: Any) -> Any:
        call = getattr(self.replicas, method).remote(*args, routing={"replica": replica})
        return await asyncio.wait_for(call, PINNED_CALL_S)

    async def each(self, method: str) -> dict[str, Any]:
        """`method` on every live replica: its answer, or the exception it raised."""
        ids = self.replica_ids()
        answers = await asyncio.gather(*(self.pinned(method, r) for r in ids), return_exceptions=True)
        return dict(zip(ids, answers, strict=True))

    # ---- HTTP ----------------------------------------------------------------------------------
    def _denied(self, request: Request) -> Response | None:
        if not self.token:
            return None
        got = request.headers.get("authorization", "").encode()
        if hmac.compare_digest(got, f"Bearer {self.token}".encode()):
            return None
        body = {"error": {"message": "missing or wrong bearer token (Authorization header)",
                          "type": "authentication_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=401)

    @api.get("/health")
    async def health(self, request: Request) -> Response:
        """200 while at least one replica serves; each replica's state in the body."""
        answers = await self.each("health")
        states = {r: (a if isinstance(a, dict) else {"serving": False, "error": f"{type(a).__name__}: {a}"})
                  for r, a in answers.items()}
        serving = any(s.get("serving") for s in states.values())
        return JSONResponse({"serving": serving, "replicas": states}, status_code=200 if serving else 503)

    @api.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        answers = await self.each("metrics_text")
        texts = [a for a in answers.values() if isinstance(a, str)]
        texts.append(generate_latest(self.registry).decode())
        return Response(merge_expositions(texts), media_type=CONTENT_TYPE_LATEST)

    @api.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def relay(self, request: Request, path: str) -> Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        body = await request.body()
        keys = await self.keys(http_prompt(request.url.path, body)) if request.method == "POST" else []
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"authorization"]
        routing: dict[str, Any] = {"keys": keys}
        for attempt in range(2):
            gen: Any = self.replicas.options(stream=True).http.remote(
                request.method, request.url.path, request.url.query.encode(), headers, body, routing=routing)
            try:
                replica = (await gen.__anext__())["replica"]
                start = await gen.__anext__()
            except Exception as e:
                gen.cancel()
                return _unavailable(f"no replica could answer: {type(e).__name__}: {e}")
            if start["status"] != 503 or attempt == 1 or len(self.replica_ids()) < 2:
                break
            # Its pipeline is being rebuilt (or failed) and it has not started answering: once elsewhere.
            gen.cancel()
            routing = {"keys": keys, "avoid": replica}
        out_headers = {k.decode(): v.decode() for k, v in start["headers"] if k.lower() not in _DROP_HEADERS}
        if out_headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_events(gen), status_code=start["status"], headers=out_headers)
        collect = asyncio.ensure_future(_collect(gen))
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client went away: cancel its request on the replica
            collect.cancel()
            gen.cancel()
            return Response(status_code=499)
        gone.cancel()
        try:
            whole = collect.result()
        except ReplicaLost as e:
            return _unavailable(str(e))
        return Response(whole, status_code=start["status"], headers=out_headers)


# The class itself stays importable by its name (Serve pickles it by reference, not by value).
PPServeIngress = serve.ingress(api)(Ingress)
