"""AsyncEngine: drives the single-threaded LLMEngine from one dedicated thread for asyncio front doors.

The LLMEngine is not thread-safe, so exactly one thread ("ppserve-engine") ever touches it after
start-up. Everything else talks to that thread through a FIFO inbox of commands (add, cancel, call,
stop), applied between steps. Results travel back with `loop.call_soon_threadsafe`, one callback per
step carrying that step's `TokenDelta`s, so the engine thread never blocks on a client. Each request's
deltas are merged into one pending `StreamChunk` on the event loop (a queue of depth one that
coalesces), so a slow client receives bigger chunks instead of stalling anyone.

Every front door (gRPC, HTTP, the demo) uses this bridge; it imports no grpc, protobuf or web
framework, and keeps no copy of the engine's request state: the engine's final delta of a request
carries its times.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppserve.config import EngineConfig, config_to_dict
from ppserve.engine.messages import PipelineUnavailable, PromptInput, RequestTimes, TokenDelta
from ppserve.request import FinishReason, SamplingParams, TokenLogprob
from ppserve.sched.output import SchedulerOutput, StepResult

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.2  # how long the idle engine thread waits for a command before housekeeping
SPAN_DRAIN_INTERVAL_S = 10.0  # drain stage spans at least this often (a drain waits for in-flight work)
STATS_WINDOW_S = 30.0  # the "recent window" of GetStats rates and bubble fractions
CALL_TIMEOUT_S = 60.0  # an engine-thread call that takes longer means the pipeline is stuck


def engine_to_unix_offset(engine_clock: Any = time.perf_counter) -> float:
    """Add this to an engine-clock time (monotonic seconds) to get Unix seconds."""
    return time.time() - float(engine_clock())


@dataclass
class StreamChunk:
    """New output of one request since the last chunk the client took (its deltas merged)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # engine clock
    num_output_tokens: int = 0  # cumulative
    finished: bool = False
    finish_reason: str | None = None
    times: RequestTimes | None = None  # on the last chunk
    logprobs: list[TokenLogprob] = field(default_factory=list)  # aligned with token_ids, when asked for

    def merge(self, d: TokenDelta) -> None:
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.text += d.text
        self.token_times.extend(d.token_times)
        if d.finished:
            self.finished, self.finish_reason, self.times = True, d.finish_reason, d.times


class RequestStream:
    """The event-loop side of one request: merges deltas; iterate it to receive chunks."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = 0
        self._pending: StreamChunk | None = None
        self._event = asyncio.Event()
        self._num_output = 0
        self._done = False

    # Called on the event loop only (via call_soon_threadsafe).
    def _push(self, delta: TokenDelta) -> None:
        if self._done or (self._pending is not None and self._pending.finished):
            return
        if self._pending is None:
            self._pending = StreamChunk(self.request_id)
        self._pending.merge(delta)
        self._event.set()

    async def next_chunk(self) -> StreamChunk | None:
        """The merged output since the last call; None after the final chunk."""
        if self._done:
            return None
        await self._event.wait()
        self._event.clear()
        chunk, self._pending = self._pending, None
        assert chunk is not None
        self._num_output += len(chunk.token_ids)
        chunk.num_output_tokens = self._num_output
        self._done = chunk.finished
        return chunk

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamChunk]:
        while (chunk := await self.next_chunk()) is not None:
            yield chunk


async def merge_choices(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) from several streams as each has output, until every one has finished."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    waiting = {asyncio.ensure_future(st.next_chunk()): i for i, st in enumerate(streams)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(fut)
                chunk = fut.result()
                if chunk is None:
                    continue
                if not chunk.finished:
                    waiting[asyncio.ensure_future(streams[i].next_chunk())] = i
                yield i, chunk
    finally:
        for fut in waiting:
            fut.cancel()


class EngineObserver(Protocol):
    """Told on the engine thread what happens (the metrics exporter is one); must be quick and not raise."""

    def on_added(self, num_prompt_tokens: int) -> None: ...

    def on_deltas(self, deltas: Sequence[TokenDelta]) -> None: ...

    def on_step(self, out: SchedulerOutput, result: StepResult) -> None: ...


class AsyncEngine:
    """Owns an LLMEngine and its step-loop thread; every public method is for the event loop's thread."""

    def __init__(
        self, engine: Any, *, keep_all_spans: bool = False, stats_window_s: float = STATS_WINDOW_S
    ) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.vocab_size: int = engine.arch.vocab_size
        # Unset sampling fields take these (the model's generation_config.json) before ppserve's own.
        self.sampling_defaults: dict[str, Any] = dict(getattr(engine, "sampling_defaults", {}))
        self.keep_all_spans = keep_all_spans or bool(self.config.trace.path)
        self.stats_window_s = stats_window_s
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._groups: dict[str, list[str]] = {}  # a request id -> its choices' stream ids
        self.observers: list[EngineObserver] = []  # see add_observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: BaseException | None = None
        # Engine-thread state below.
        self._spans: collections.deque[Any] = collections.deque()
        self._last_drain = time.monotonic()
        self._token_log: collections.deque[tuple[float, int]] = collections.deque()  # (engine time, tokens)
        self._tokens_total = 0
        self._finished_total = 0
        self._start_time = engine.clock()
        self._start_ns = time.perf_counter_ns()
        # Engine clock (monotonic) -> Unix time, for the per-token timestamps clients see.
        self.engine_to_unix = engine_to_unix_offset(engine.clock)

    @classmethod
    def build(cls, config: EngineConfig, **kwargs: Any) -> AsyncEngine:
        """Build the LLMEngine (slow: loads weights, starts the pipeline). Call before the event loop runs."""
        from ppserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    def add_observer(self, observer: EngineObserver) -> None:
        """Tell `observer` (on the engine thread) of requests added, deltas and microbatches. Before start()."""
        self.observers.append(observer)
        self.engine.core.step_observers.append(observer.on_step)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="ppserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the step loop (unfinished requests are cancelled) and join the thread."""
        self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("engine thread did not stop within %.0f s", timeout)

    def shutdown(self) -> None:
        """Tear the pipeline down. After stop(); runs in the caller's thread (the loop thread is gone)."""
        self.engine.shutdown()

    # ---- requests ------------------------------------------------------------------------------
    async def add_request(
        self, prompt: PromptInput, sampling: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request of one sequence (n = 1); raises ValueError / OverflowError /
        PipelineUnavailable before any streaming."""
        if sampling.n != 1:
            raise ValueError("add_request takes one sequence (n = 1); use add_choices for n > 1")
        return (await self.add_choices(prompt, sampling, request_id))[0]

    async def add_choices(
        self, prompt: PromptInput, sampling: SamplingParams, request_id: str | None = None
    ) -> list[RequestStream]:
        """Queue the request's n choices (all or none; see LLMEngine.add_choices): one stream per choice.
        Cancelling or releasing `request_id` covers every choice."""
        self._check_available()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        rids = [rid] if sampling.n == 1 else [f"{rid}/{i}" for i in range(sampling.n)]
        if rid in self._groups or any(r in self._streams for r in rids):
            raise ValueError(f"request_id {rid!r} is already in use by a request that has not finished")
        streams = [RequestStream(r) for r in rids]
        # Registered before the engine sees the request, so no delta can arrive for an unknown stream.
        self._streams.update(zip(rids, streams, strict=True))
        self._groups[rid] = rids
        fut = self._post_call(("add", prompt, sampling, rid))
        try:
            num_prompt_tokens = await fut
        except asyncio.CancelledError:
            # The caller went away while the add was queued: the add still happens, so undo it after.
            self.cancel_nowait(rid)
            self.release(rid)
            raise
        except BaseException:
            self.release(rid)
            raise
        for st in streams:
            st.num_prompt_tokens = num_prompt_tokens
        return streams

    def cancel_nowait(self, request_id: str) -> None:
        """Fire-and-forget cancel of a request and its choices (safe inside a handler's cleanup: it
        never awaits)."""
        for rid in self._groups.get(request_id, [request_id]):
            self._inbox.put(("cancel", rid, None))

    async def cancel(self, request_id: str) -> bool:
        # Checked first: once the engine thread has stopped, nothing would ever answer the command.
        self._check_available()
        rids = self._groups.get(request_id, [request_id])
        results = [await self._post_call(("cancel", rid)) for rid in rids]
        return any(results)

    def release(self, request_id: str) -> None:
        """The handler is done with this request's streams (finished, cancelled or disconnected)."""
        for rid in self._groups.pop(request_id, [request_id]):
            self._streams.pop(rid, None)

    async def call(self, fn: Callable[[Any], Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run fn(engine) on the engine thread between steps and return its result."""
        self._check_available()
        return await asyncio.wait_for(self._post_call(("call", fn)), timeout)

    async def stats(self) -> dict[str, Any]:
        return dict(await self.call(lambda _eng: self._stats()))

    def _check_available(self) -> None:
        if self.failure is not None:
            raise PipelineUnavailable(f"the pipeline failed ({self.failure}); the server must be restarted")
        if self._stopping or self._thread is None:
            raise PipelineUnavailable("the engine is not running (starting up or shutting down)")
        if getattr(self.engine, "recovering", False):
            raise PipelineUnavailable("the pipeline is being rebuilt after a stage failure; retry shortly")

    def _post_call(self, cmd: tuple[Any, ...]) -> asyncio.Future[Any]:
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._inbox.put((*cmd, fut))
        return fut

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            # Block only when idle; with work, apply whatever arrived and step again at once.
            if not self._drain_inbox(block=not eng.has_unfinished):
                break
            if eng.has_unfinished:
                try:
                    deltas = eng.step()
                except Exception as e:  # a dead stage or a bug: fail every request, refuse new ones
                    logger.exception("engine step failed")
                    self._fail(e)
                    break
                if deltas:
                    self._emit(deltas)
            if time.monotonic() - self._last_drain > SPAN_DRAIN_INTERVAL_S:
                self._drain_spans()
        self._cancel_all(FinishReason.CANCELLED)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            cmd = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        kind, fut = cmd[0], cmd[-1]
        try:
            if kind == "add":
                _, prompt, sampling, rid, _ = cmd
                result: Any = self._add(prompt, sampling, rid)
            elif kind == "cancel":
                # End the stream (if a client still reads it) with a cancelled finish.
                closing = self.engine.abort(cmd[1], FinishReason.CANCELLED)
                result = closing is not None
                if closing is not None:
                    self._observe([closing])
                self._post(self._deliver, [closing or TokenDelta(cmd[1], (), "", (), True, "cancelled")])
            elif kind == "call":
                result = cmd[1](self.engine)
            else:
                raise RuntimeError(f"unknown engine command {kind!r}")
        except BaseException as e:
            if fut is not None:
                self._post(_set_exception, fut, e)
            else:
                logger.warning("engine command %s failed: %s", kind, e)
            return
        if fut is not None:
            self._post(_set_result, fut, result)

    def _add(self, prompt: PromptInput, sampling: SamplingParams, rid: str) -> int:
        eng = self.engine
        rids = eng.add_choices(prompt, sampling, request_id=rid)
        num_prompt_tokens = int(eng.request_state(rids[0]).request.num_prompt_tokens)
        for obs in self.observers:
            obs.on_added(num_prompt_tokens * len(rids))
        return num_prompt_tokens

    def _observe(self, deltas: list[TokenDelta]) -> None:
        for obs in self.observers:
            obs.on_deltas(deltas)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        self._observe(deltas)
        n = sum(len(d.token_ids) for d in deltas)
        self._finished_total += sum(d.finished for d in deltas)
        self._tokens_total += n
        self._token_log.append((self.engine.clock(), n))
        self._post(self._deliver, deltas)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        """On the event loop: route each delta to its stream (a stream already released drops it)."""
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                stream._push(d)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        self._cancel_all(FinishReason.ERROR)

    def _cancel_all(self, reason: FinishReason) -> None:
        closing = []
        for rid in self.engine.unfinished_ids():
            try:
                delta = self.engine.abort(rid, reason)
            except Exception as e:  # a broken engine must not stop the others from being told
                logger.warning("abort %s: %s", rid, e)
                delta = None
            closing.append(delta or TokenDelta(rid, (), "", (), True, reason.value))
        self._observe(closing)
        self._post(self._deliver, closing)
        # Commands that arrived after the last step are answered, not left hanging.
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[-1] is not None and cmd[0] != "stop":
                self._post(_set_exception, cmd[-1], PipelineUnavailable("the engine stopped"))

    # ---- observability (engine thread) -----------------------------------------------------------
    def _drain_spans(self) -> None:
        self._last_drain = time.monotonic()
        try:
            self._spans.extend(self.engine.collect_spans())
        except Exception as e:  # observability must never take serving down
            logger.warning("collecting spans failed: %s", e)
            return
        if not self.keep_all_spans:
            horizon = time.perf_counter_ns() - int(self.stats_window_s * 1e9)
            while self._spans and self._spans[0].end_ns < horizon:
                self._spans.popleft()

    def all_spans(self) -> list[Any]:
        """Engine thread only (through call()): every span kept so far, freshly drained."""
        self._drain_spans()
        return list(self._spans)

    def _stats(self) -> dict[str, Any]:
        from ppserve.metrics.bubbles import bubble_report

        eng = self.engine
        s: dict[str, Any] = dict(eng.stats())
        now_ns = time.perf_counter_ns()
        t0_ns = max(self._start_ns, now_ns - int(self.stats_window_s * 1e9))
        window_s = max(1e-9, (now_ns - t0_ns) / 1e9)
        now = eng.clock()
        while self._token_log and self._token_log[0][0] < now - self.stats_window_s:
            self._token_log.popleft()
        s["tokens_per_s"] = sum(n for _, n in self._token_log) / window_s
        s["window_s"] = window_s
        self._drain_spans()
        spans = [sp for sp in self._spans if sp.end_ns > t0_ns]
        stages: list[dict[str, Any]] = []
        mean_bubble = 0.0
        if spans:
            try:
                rep = bubble_report(spans, eng.work.intervals(now_ns), window=(t0_ns, now_ns))
                stages = [
                    {
                        "stage": st.stage,
                        "busy_fraction": st.busy_fraction,
                        "bubble_fraction": st.bubble_fraction,
                        "starvation_fraction": st.starvation_fraction,
                    }
                    for st in rep.stages
                ]
                mean_bubble = rep.mean_bubble_fraction
            except Exception as e:  # e.g. a window with no stage spans at all
                logger.debug("bubble report: %s", e)
        s["stages"] = stages
        s["mean_bubble_fraction"] = mean_bubble
        s["workers"] = [dict(w, node_ip=w.get("node_ip", w.get("node", ""))) for w in eng.executor.describe()]
        s["requests_finished"] = self._finished_total
        s["tokens_generated"] = self._tokens_total
        s["uptime_s"] = now - self._start_time
        s["config"] = self.serving_config()
        return s

    def serving_config(self) -> dict[str, Any]:
        import json

        c = self.config
        return {
            "model": c.model.model or "SmolLM2-135M-Instruct (default)",
            "pipeline_parallel_size": c.parallel.pipeline_parallel_size,
            "tensor_parallel_size": c.parallel.tensor_parallel_size,
            "policy": c.scheduler.policy,
            "token_budget": c.scheduler.token_budget,
            "max_num_seqs": c.scheduler.max_num_seqs,
            "max_waiting": c.scheduler.max_waiting,
            "block_size": int(self.engine.scheduler.blocks.block_size),
            "max_model_len": int(self.engine.max_model_len),
            "config_json": json.dumps(config_to_dict(c), default=str, sort_keys=True),
        }


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():  # the awaiting caller may have been cancelled meanwhile
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
