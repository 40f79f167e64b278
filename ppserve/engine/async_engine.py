"""AsyncEngine: drives the single-threaded LLMEngine from one dedicated thread for asyncio front doors.

The LLMEngine is not thread-safe, so exactly one thread ("ppserve-engine") ever touches it after
start-up. Everything else talks to that thread through a FIFO inbox of commands (engine/inbox.py),
applied between steps; new requests also mid-step, just before the engine core schedules (`_intake`),
so a prompt that arrives while a microbatch computes is in the very next one. Results travel back with
`loop.call_soon_threadsafe`, one callback per step carrying that step's `TokenDelta`s, so the engine
thread never blocks on a client; on the event loop each request's deltas merge into its `RequestStream`
(engine/streams.py). The statistics window (engine/stats.py) is fed on the engine thread and read
anywhere (see below).

Every front door (gRPC, HTTP, the demo) uses this bridge; it imports no grpc, protobuf or web
framework, and keeps no copy of the engine's request state: the engine's final delta of a request
carries its times.

Statistics are published, not asked for: the engine thread puts an immutable snapshot in the stats
window after every step (and drains stage spans at a bounded rate), and `stats()` reads the latest one
on the caller's thread, so `/metrics` scrapes and GetStats calls never queue behind or delay a step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ppserve.config import EngineConfig
from ppserve.engine.inbox import AddRequest, Call, Cancel, Command, Stop
from ppserve.engine.messages import PipelineUnavailable, PromptInput, TokenDelta
from ppserve.engine.stats import STATS_WINDOW_S, EngineStats, ServingConfig, StatsWindow
from ppserve.engine.streams import RequestStream
from ppserve.metrics.spans import Span
from ppserve.request import FinishReason, SamplingParams
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.worker.openmp_pool import release_thread_pool

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.2  # how long the idle engine thread waits for a command before housekeeping
CALL_TIMEOUT_S = 60.0  # an engine-thread call that takes longer means the pipeline is stuck

T = TypeVar("T")


def engine_to_unix_offset(engine_clock: Callable[[], float] = time.perf_counter) -> float:
    """Add this to an engine-clock time (monotonic seconds) to get Unix seconds."""
    return time.time() - float(engine_clock())


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
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._groups: dict[str, list[str]] = {}  # a request id -> its choices' stream ids
        self.observers: list[EngineObserver] = []  # see add_observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: BaseException | None = None
        # Engine-thread state: the statistics window, and whether a step ran since its last span drain.
        self.window = StatsWindow(engine.collect_spans, engine.clock, window_s=stats_window_s,
                                  keep_all_spans=keep_all_spans or bool(self.config.trace.path))
        engine.core.step_observers.append(self.window.on_step)  # the grammar mask seconds of each step
        self._stepped_since_drain = False
        self._publish_failed = False
        # Engine clock (monotonic) -> Unix time, for the per-token timestamps clients see.
        self.engine_to_unix = engine_to_unix_offset(engine.clock)
        # Prompts that arrive while a microbatch computes join the one scheduled right after it (the
        # engine core's intake, mid-step), not the one after that: the core schedules its next
        # microbatch before the step returns: without the intake a new prompt at pp = 1 would wait a whole
        # extra step.
        self._held: Command | None = None  # the first non-add command the intake met, for the loop
        engine.core.intake = self._intake

    @classmethod
    def build(cls, config: EngineConfig, **kwargs: Any) -> AsyncEngine:
        """Build the LLMEngine (slow: loads weights, starts the pipeline). Call before the event loop runs."""
        from ppserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), **kwargs)

    def add_observer(self, observer: EngineObserver) -> None:
        """Tell `observer` (on the engine thread) of requests added, deltas and microbatches.
        Before start()."""
        self.observers.append(observer)
        self.engine.core.step_observers.append(observer.on_step)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._publish_stats(drain=True)  # here, before the thread exists: stats() has a snapshot at once
        # This thread built the engine (an in-process stage's warm-up ran OpenMP regions here); its idle
        # OpenMP pool would stop the engine thread's from spinning at barriers (worker/openmp_pool.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="ppserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the step loop (unfinished requests are cancelled) and join the thread."""
        self._stopping = True
        self._inbox.put(Stop())
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
        if sampling.structured_outputs is not None:
            # The grammar compiles on its own thread, never the engine loop's; the request waits for it
            # here, and one that fails or takes too long is refused with the compiler's message.
            cache = self.engine.grammars
            try:
                await asyncio.wait_for(asyncio.wrap_future(cache.submit(sampling.structured_outputs)),
                                       cache.timeout_s)
            except TimeoutError:
                cache.get(sampling.structured_outputs, timeout_s=0.0)  # raises the timeout's GrammarError
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        rids = [rid] if sampling.n == 1 else [f"{rid}/{i}" for i in range(sampling.n)]
        if rid in self._groups or any(r in self._streams for r in rids):
            raise ValueError(f"request_id {rid!r} is already in use by a request that has not finished")
        streams = [RequestStream(r) for r in rids]
        # Registered before the engine sees the request, so no delta can arrive for an unknown stream.
        self._streams.update(zip(rids, streams, strict=True))
        self._groups[rid] = rids
        fut: asyncio.Future[int] = self._future()
        self._inbox.put(AddRequest(prompt, sampling, rid, fut))
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
            self._inbox.put(Cancel(rid))

    async def cancel(self, request_id: str) -> bool:
        # Checked first: once the engine thread has stopped, nothing would ever answer the command.
        self._check_available()
        results = []
        for rid in self._groups.get(request_id, [request_id]):
            fut: asyncio.Future[bool] = self._future()
            self._inbox.put(Cancel(rid, fut))
            results.append(await fut)
        return any(results)

    def release(self, request_id: str) -> None:
        """The handler is done with this request's streams (finished, cancelled or disconnected)."""
        for rid in self._groups.pop(request_id, [request_id]):
            self._streams.pop(rid, None)

    async def call(self, fn: Callable[[Any], T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run fn(engine) on the engine thread between steps and return its result."""
        self._check_available()
        fut: asyncio.Future[T] = self._future()
        self._inbox.put(Call(fn, fut))
        return await asyncio.wait_for(fut, timeout)

    async def stats(self) -> EngineStats:
        """The engine thread's latest published statistics; it is not asked, so this never waits for a
        step. The counts are as of the last step, the bubble figures as of the last span drain (at most
        SPAN_DRAIN_INTERVAL_S old under load, current once the engine is idle)."""
        self._check_available()
        snap = self.window.latest
        if snap is None:  # start() publishes one; only a failure to publish leaves none
            raise PipelineUnavailable("the engine has published no statistics yet")
        if not snap.ready:  # the bubble report, once per drain: in a worker thread, not on the event loop
            return await asyncio.to_thread(snap.stats)
        return snap.stats()

    def all_spans(self) -> list[Span]:
        """Engine thread only (through call()): every span kept so far, freshly drained."""
        return self.window.all_spans()

    def _check_available(self) -> None:
        if self.failure is not None:
            raise PipelineUnavailable(f"the pipeline failed ({self.failure}); the server must be restarted")
        if self._stopping or self._thread is None:
            raise PipelineUnavailable("the engine is not running (starting up or shutting down)")
        if getattr(self.engine, "recovering", False):
            raise PipelineUnavailable("the pipeline is being rebuilt after a stage failure; retry shortly")

    def _future(self) -> asyncio.Future[Any]:
        assert self._loop is not None
        return self._loop.create_future()

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
                self._stepped_since_drain = True
                if deltas:
                    self._emit(deltas)
                    continue  # _emit published
            self._publish_stats()
        self._cancel_all(FinishReason.CANCELLED)

    def _intake(self) -> None:
        """Mid-step, before the core schedules: apply the AddRequests queued so far, in order, up to the
        first other command. Cancels, calls and stops wait for the loop, between steps, where no
        microbatch's results are half processed."""
        while self._held is None:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                self._apply(cmd)
            else:
                self._held = cmd

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands (the one the intake held first); False when asked to stop."""
        try:
            cmd = self._next_command(timeout=IDLE_POLL_S if block else None)
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, Stop):
                return False
            self._apply(cmd)
            try:
                cmd = self._next_command()
            except queue.Empty:
                return True

    def _next_command(self, timeout: float | None = None) -> Command:
        """The command the intake held, else the inbox's next (waiting up to `timeout` s; queue.Empty)."""
        if self._held is not None:
            cmd, self._held = self._held, None
            return cmd
        return self._inbox.get(timeout=timeout) if timeout is not None else self._inbox.get_nowait()

    def _apply(self, cmd: AddRequest | Cancel | Call) -> None:
        try:
            result: Any
            match cmd:
                case AddRequest(prompt, sampling, rid, _):
                    result = self._add(prompt, sampling, rid)
                case Cancel(rid, _):
                    result = self._cancel(rid)
                case Call(fn, _):
                    result = fn(self.engine)
        except BaseException as e:
            if cmd.reply is not None:
                self._post(_set_exception, cmd.reply, e)
            else:
                logger.warning("engine command %s failed: %s", type(cmd).__name__, e)
            return
        if cmd.reply is not None:
            self._post(_set_result, cmd.reply, result)

    def _add(self, prompt: PromptInput, sampling: SamplingParams, rid: str) -> int:
        eng = self.engine
        rids = eng.add_choices(prompt, sampling, request_id=rid)
        num_prompt_tokens = int(eng.request_state(rids[0]).request.num_prompt_tokens)
        for obs in self.observers:
            obs.on_added(num_prompt_tokens * len(rids))
        return num_prompt_tokens

    def _cancel(self, rid: str) -> bool:
        closing: TokenDelta | None = self.engine.abort(rid, FinishReason.CANCELLED)
        if closing is not None:
            self._observe([closing])
        # End the stream (if a client still reads it) with a cancelled finish.
        self._post(self._deliver, [closing or TokenDelta(rid, (), "", (), True, "cancelled")])
        return closing is not None

    def _observe(self, deltas: list[TokenDelta]) -> None:
        for obs in self.observers:
            obs.on_deltas(deltas)

    def _emit(self, deltas: list[TokenDelta]) -> None:
        self._observe(deltas)
        self.window.record(deltas)
        self._publish_stats()  # before delivery: a client that has its last token sees it counted
        self._post(self._deliver, deltas)

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        """On the event loop: route each delta to its stream (a stream already released drops it)."""
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is not None:
                stream.push(d)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
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
        # Commands that arrived after the last step (and one the intake held) are answered, not left hanging.
        while True:
            try:
                cmd = self._next_command()
            except queue.Empty:
                break
            if not isinstance(cmd, Stop) and cmd.reply is not None:
                self._post(_set_exception, cmd.reply, PipelineUnavailable("the engine stopped"))

    # ---- statistics (engine thread) --------------------------------------------------------------
    def _publish_stats(self, drain: bool = False) -> None:
        """After each step and each idle wake-up: the counts (a few attribute reads) into a new snapshot;
        the stage spans too when a drain is due, or once the engine has just gone idle (nothing in
        flight then, so the drain waits for nothing)."""
        eng = self.engine
        try:
            if drain or self.window.drain_due or (self._stepped_since_drain and not eng.has_unfinished):
                self.window.drain(eng.work.intervals, eng.executor.describe(), self.serving_config())
                self._stepped_since_drain = False
            self.window.publish(eng.stats())
        except Exception:  # observability must never take serving down; said once, not every step
            if not self._publish_failed:
                logger.exception("publishing engine statistics failed")
            self._publish_failed = True

    def serving_config(self) -> ServingConfig:
        return ServingConfig.of(self.config, block_size=int(self.engine.scheduler.blocks.block_size),
                                max_model_len=int(self.engine.max_model_len))


def _set_result(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():  # the awaiting caller may have been cancelled meanwhile
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
