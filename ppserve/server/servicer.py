"""The ppserve.v1.PPServe servicer: validates requests, streams engine output, maps errors to status codes.

Tool calling means what it means on the HTTP chat API: the tool plan's structural tag constrains the
output, and the whole output of each choice is read back for calls on its last message.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.streams import StreamChunk, merge_choices
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.server.gen import ppserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class PPServeServicer(pb_grpc.PPServeServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # Validation happens here, before anything is queued: a bad request costs the engine nothing.
        if isinstance(request, convert.MalformedRequest):  # not parseable: see generate_request_deserializer
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            plan = convert.tool_plan_from_proto(request)
            prompt = convert.prompt_from_proto(request, self.engine.vocab_size, plan.tools)
            sampling = convert.sampling_from_proto(request.sampling, self.engine.sampling_defaults, plan)
            rid = convert.request_id_from_proto(request) or f"req-{uuid.uuid4().hex[:16]}"
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            streams = await self.engine.add_choices(prompt, sampling, rid)
        except (ValueError, OverflowError, convert.PipelineUnavailable) as e:
            code, message = convert.error_to_status(e)
            await context.abort(code, message)
        offset = self.engine.engine_to_unix
        num_prompt_tokens = streams[0].num_prompt_tokens
        unfinished = len(streams)
        texts: dict[int, list[str]] = {}  # each choice's output so far, where it is read for tool calls
        try:
            async for index, chunk in merge_choices(streams):
                unfinished -= chunk.finished
                if chunk.finished and chunk.finish_reason == "error" and self.engine.failure is not None:
                    # The pipeline died and could not be rebuilt: retrying later may succeed.
                    if chunk.token_ids:
                        chunk.finished, chunk.finish_reason, chunk.times = False, None, None
                        yield _response(rid, index, chunk, num_prompt_tokens, offset)
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"the pipeline failed: {self.engine.failure}")
                msg = _response(rid, index, chunk, num_prompt_tokens, offset)
                if plan.parses:
                    texts.setdefault(index, []).append(chunk.text)
                    if chunk.finished:
                        convert.add_tool_calls(msg, "".join(texts.pop(index)))
                yield msg
        finally:
            # Runs on every exit: normal end, client cancel / deadline (grpc.aio raises CancelledError
            # here, which propagates untouched), or server shutdown. Never awaits, so it cannot be
            # interrupted half way.
            if unfinished:
                self.engine.cancel_nowait(rid)
            self.engine.release(rid)

    async def Cancel(self, request: pb.CancelRequest, context: grpc.aio.ServicerContext) -> pb.CancelResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        try:
            ok = await self.engine.cancel(request.request_id)
        except convert.PipelineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return pb.CancelResponse(cancelled=ok)

    async def GetStats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.Stats:
        try:
            stats = await self.engine.stats()
        except convert.PipelineUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except TimeoutError:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine did not answer in time")
        return convert.stats_to_proto(stats)


def _response(request_id: str, index: int, chunk: StreamChunk, num_prompt_tokens: int,
              engine_to_unix: float) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        index=index,
        token_ids=chunk.token_ids,
        text=chunk.text,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=chunk.num_output_tokens,
        token_times=convert.to_unix_times(chunk.token_times, engine_to_unix),
        finish_reason=convert.finish_reason_to_proto(chunk.finish_reason if chunk.finished else None),
        logprobs=convert.logprobs_to_proto(chunk.logprobs, chunk.token_ids) if chunk.logprobs else [],
    )
    if chunk.finished and chunk.times is not None:
        msg.metrics.CopyFrom(convert.request_metrics_to_proto(chunk.times))
        msg.num_cached_tokens = chunk.num_cached_tokens
    return msg
