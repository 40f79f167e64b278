"""The step loop, shared by the real engine and the simulator: one copy, so the two cannot drift apart.

    intake -> fill the pipeline -> collect the oldest microbatch -> hand it to the scheduler (its
    tokens, and its stage times for the cost model) -> intake -> fill the pipeline again

The loop knows nothing of models, Ray or time itself. It is handed a scheduler, an executor (the Ray
or in-process pipeline, or the simulator's cost-model pipeline), two clocks (seconds for request times,
integer nanoseconds for spans) and an optional `intake` that adds the requests that have arrived
before the engine looks (the simulator's arrivals; a server adds requests between steps instead).
Pure Python: no torch, Ray or grpc.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ppserve.metrics.spans import ENGINE_STAGE, Span, WorkTracker
from ppserve.sched.output import RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.scheduler import Scheduler


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
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.clock_ns = clock_ns
        self.intake = intake
        self.work = WorkTracker()  # when the engine had work: the bubble math's "had work" intervals
        self.engine_spans: list[Span] = []  # `schedule` spans on the engine track
        # Told of every microbatch that came back (the metrics exporter); quick, and must not raise.
        self.step_observers: list[Callable[[SchedulerOutput, StepResult], None]] = []

    def step(self) -> tuple[float, list[RequestUpdate]] | None:
        """Fill the pipeline, collect the oldest microbatch, update the scheduler, fill again.
        Returns (the time the result came back, what each request gained), or None when nothing could
        be put in flight."""
        sched = self.scheduler
        self.fill()
        if not sched.in_flight:
            self.work.update(sched.has_unfinished, self.clock_ns())
            return None
        result = self.executor.collect()
        now = self.clock()
        done = sched.in_flight[0]
        updates = sched.update_from_output(done, result)
        sched.observe_step(done, result.stage_seconds)
        for observe in self.step_observers:
            observe(done, result)
        self.fill()  # the stages get their next work before the caller does any text work
        self.work.update(sched.has_unfinished, self.clock_ns())
        return now, updates

    def fill(self) -> None:
        """Take in what has arrived, then schedule and submit until the pipeline is full or nothing can run."""
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
                     out.num_prefill_tokens, out.num_decode_tokens, out.order)
            )
            self.executor.submit(out)

    def drain_engine_spans(self) -> list[Span]:
        spans, self.engine_spans = self.engine_spans, []
        return spans

    def reset_observations(self) -> None:
        self.engine_spans = []
        self.work = WorkTracker()
