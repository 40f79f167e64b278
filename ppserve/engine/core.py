"""The step loop, shared by the real engine and the simulator: one copy, so the two cannot drift apart.

    intake -> fill the pipeline -> collect the oldest microbatch -> hand it to the scheduler in one call
    (its tokens, and the stage times it carries for the cost model) -> intake -> fill the pipeline again

A result's stage times measure the step `timed_step_id`, which GPU stages report one step late or
more (ARCHITECTURE.md#measuring-bubbles): the loop keeps each collected microbatch until its times come
back and hands the scheduler that microbatch's composition with them, never the current one's.

The loop knows nothing of models, Ray or time itself. It is handed a scheduler, an executor (the Ray
or in-process pipeline, or the simulator's cost-model pipeline), two clocks (seconds for request times,
integer nanoseconds for spans), an optional `intake` that adds the requests that have arrived
before the engine looks (the simulator's arrivals; a server adds requests between steps instead), and an
optional `wait_until` (a real engine sleeps, the simulator moves its clock) with which the token ring's
extra microbatch is formed just before stage 0 needs it, not as soon as its slot frees.
Pure Python: no torch, Ray or grpc.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

from ppserve.metrics.spans import ENGINE_STAGE, Span, WorkTracker
from ppserve.sched.output import RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.scheduler import Scheduler

MAX_UNTIMED = 256  # collected microbatches kept for their times: stages lag a few steps, never this many
# the longest a real engine sleeps before forming a microbatch (a guard, not a tuning)
MAX_FORMATION_WAIT_S = 1.0


def sleep_until(clock: Callable[[], float]) -> Callable[[float], None]:
    """EngineCore's `wait_until` for a real engine: sleep until `clock` reads the due time. The result of
    the oldest microbatch, if it comes back meanwhile, waits in its channel: the due time is a prediction of
    when stage 0 frees, which is before that result is back unless the prediction ran late."""

    def wait(due_s: float) -> None:
        delay = due_s - clock()
        if delay > 0:
            time.sleep(min(delay, MAX_FORMATION_WAIT_S))

    return wait


class StepExecutor(Protocol):
    def submit(self, out: SchedulerOutput) -> None: ...

    def collect(self) -> StepResult: ...


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: StepExecutor,
        clock: Callable[[], float] = time.perf_counter,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        intake: Callable[[], None] | None = None,
        wait_until: Callable[[float], None] | None = None,
        dispatch_s: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.clock_ns = clock_ns
        self.intake = intake
        # Waits until a clock time (seconds), or until the oldest microbatch is back if that comes first
        # (the simulator): lets the token ring's extra microbatch be formed just before stage 0 needs it
        # (`Scheduler.formation_due`). None: an executor whose stages compute only when the engine collects
        # (the in-process one), where waiting gains nothing; the next microbatch is then formed at once.
        self.wait_until = wait_until
        self.dispatch_s = dispatch_s  # the control plane's latency from submit to the stages (an estimate)
        self.fill_due: float | None = None  # when the deferred fill is due (the clock's seconds)
        self.work = WorkTracker()  # when the engine had work: the bubble math's "had work" intervals
        self.engine_spans: list[Span] = []  # `schedule` spans on the engine track
        # Told of every microbatch that came back (the metrics exporter); quick, and must not raise.
        self.step_observers: list[Callable[[SchedulerOutput, StepResult], None]] = []
        # Told of every microbatch whose stage times came back, with them (calibration, the GPU check).
        self.timing_observers: list[Callable[[SchedulerOutput, tuple[float, ...]], None]] = []
        self.untimed: dict[int, SchedulerOutput] = {}  # collected, stage times not back yet, by step id
        # A submit that failed after a result was applied: raised by the next step, once that result's
        # tokens have reached the caller.
        self.deferred_failure: Exception | None = None

    def step(self) -> tuple[float, list[RequestUpdate]] | None:
        """Fill the pipeline, collect the oldest microbatch, update the scheduler, fill again (with the
        token ring, where the engine can wait: the fill of the ring's extra slot is deferred to the next
        step, which first waits until it is due). Returns (the time the result came back, what each
        request gained), or None when nothing could be put in flight."""
        sched = self.scheduler
        if self.deferred_failure is not None:
            failure, self.deferred_failure = self.deferred_failure, None
            raise failure
        if self.fill_due is not None:
            deferred, self.fill_due = self.fill_due, None
            if self.wait_until is not None:
                self.wait_until(deferred)
        self.fill()
        if not sched.in_flight:
            self.work.update(sched.has_unfinished, self.clock_ns())
            return None
        result = self.executor.collect()
        now = self.clock()
        done = sched.in_flight[0]
        timed = self.timed_output(done, result)
        outcome = sched.step_done(done, result, timed,
                                  self.dispatch_s if self.wait_until is not None else None)
        if done.draft_token_ids:
            self.mark_accepted(done.step_id, sum(result.num_accepted.values()))
        for observe in self.step_observers:
            observe(done, result)
        if timed is not None:
            for observe_time in self.timing_observers:
                observe_time(timed, result.stage_seconds)
        due = outcome.formation_due
        if due is not None and due > self.clock():
            # The token ring's extra microbatch is not needed yet: the caller does its text work, the next
            # step waits until it is due and forms it then, with whatever arrived meanwhile.
            self.fill_due = due
        else:
            try:
                self.fill()  # the stages get their next work before the caller does any text work
            except Exception as e:
                # The result's tokens are in their requests already (a recovery recomputes from them), so
                # they must reach the caller: return them, and fail on the next step. Raised here, a stage
                # that died between this collect and the next submit lost them from the streams.
                self.deferred_failure = e
        self.work.update(sched.has_unfinished, self.clock_ns())
        return now, outcome.updates

    def timed_output(self, done: SchedulerOutput, result: StepResult) -> SchedulerOutput | None:
        """The microbatch `result`'s stage times measure (`done` itself, or one collected earlier), or
        None when it carries none or they are for a step this loop no longer holds (one from before a
        pipeline rebuild). Each microbatch is handed out once; those older than the timed one will
        never be timed (their stage failed) and are forgotten."""
        self.untimed[done.step_id] = done
        if result.timed_step_id is None:
            if len(self.untimed) > MAX_UNTIMED:
                del self.untimed[min(self.untimed)]
            return None
        timed = self.untimed.pop(result.timed_step_id, None)
        for step_id in [s for s in self.untimed if s < result.timed_step_id]:
            del self.untimed[step_id]
        return timed

    def fill(self) -> None:
        """Take in what has arrived, then schedule and submit until the pipeline is full or nothing can
        run."""
        if self.intake is not None:
            self.intake()
        sched = self.scheduler
        while True:
            t0 = self.clock_ns()
            out = sched.schedule()
            if out is None:
                return
            self.engine_spans.append(
                Span("schedule", t0, self.clock_ns(), ENGINE_STAGE, 0, out.step_id,
                     out.num_prefill_tokens, out.num_decode_tokens, out.order,
                     num_draft_tokens=out.num_draft_tokens)
            )
            self.executor.submit(out)

    def mark_accepted(self, step_id: int, accepted: int) -> None:
        """Put a speculated microbatch's accepted drafts on its schedule span, if not drained yet (a drain
        between its schedule and its result leaves that span with draft tokens only). Step ids rise in
        schedule order, so the scan from the newest stops within the microbatches in flight."""
        spans = self.engine_spans
        for k in range(len(spans) - 1, -1, -1):
            if spans[k].step_id <= step_id:
                if spans[k].step_id == step_id:
                    spans[k] = dataclasses.replace(spans[k], num_accepted_tokens=accepted)
                return

    def drain_engine_spans(self) -> list[Span]:
        spans, self.engine_spans = self.engine_spans, []
        return spans

    def reset_observations(self) -> None:
        self.engine_spans = []
        self.work = WorkTracker()
