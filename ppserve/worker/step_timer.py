"""How long each of a stage's steps computed, read without making the host wait for the device.

A stage times its layers' compute once per microbatch: the scheduler's cost model learns from it, and
the trace shows it as the stage's `compute` span (ARCHITECTURE.md#measuring-bubbles). On a CPU the host
clock knows the time when the step ends (`HostStepTimer`). On a GPU a launch returns before its work is
done, so `EventStepTimer` records a CUDA event pair around the layers and reads a step's pair only once
`query()` says its end event is done, at a later step: never `synchronize()` on the hot path, which
would stall the host, and with it the next step's launches, every step. A timed step therefore comes
back with the id of the step it measures (`TimedStep.step_id`), which may be an earlier one.
A stage's wait for its input (the previous stage's hidden states, stage 0's ring tokens) is timed the
same way: `with timer.waiting(step_id):` around the receive is a `recv_wait` span on the host clock on
CPU; on a GPU the host does not wait (the stream does), so the span runs from an event recorded as the
wait is ordered to the step's start event: the time the device sat waiting for the data.

A step is: `begin(step_id)`, the layers, `end_compute()`, whatever follows (sampling: not timed), then
`finish(host_s, **span_tags)`, which adds the step's host seconds (its prepare span). `take()` hands back
every step read since the last call, oldest first; `poll()` reads what is done without handing it back,
for the span drain (another thread on a Ray actor), and never waits either: a drain must not stall serving.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppserve.metrics.spans import SpanRecorder

MAX_PENDING = 64  # steps on the device not yet read; far above any pipeline's lag (a few steps)
REANCHOR_NS = 1_000_000_000  # how often the event clock is laid onto the host clock again (drift)


@dataclass(frozen=True)
class TimedStep:
    """One step's measured seconds on this stage: its layers' compute plus its host (prepare) seconds."""

    step_id: int
    seconds: float


class StepTimer(Protocol):
    def waiting(self, step_id: int) -> AbstractContextManager[None]: ...

    def begin(self, step_id: int) -> None: ...

    def end_compute(self) -> None: ...

    def finish(self, host_s: float, **span_tags: Any) -> None: ...

    def take(self) -> list[TimedStep]: ...

    def poll(self) -> None: ...


def _host_ns() -> int:
    return time.perf_counter_ns()  # looked up per call: tests put a fake clock in `time`


class HostStepTimer:
    """The host clock: a step's time is known when it ends. Its compute span covers everything up to
    `finish` (the stage is busy with its sampling too); its figure only up to `end_compute`."""

    def __init__(self, recorder: SpanRecorder, clock_ns: Callable[[], int] = _host_ns) -> None:
        self.recorder = recorder
        self.clock_ns = clock_ns
        self._step = -1
        self._start_ns = 0
        self._end_ns: int | None = None
        self._done: list[TimedStep] = []

    @contextmanager
    def waiting(self, step_id: int) -> Iterator[None]:
        start = self.clock_ns()
        try:
            yield
        finally:
            self.recorder.record("recv_wait", start, self.clock_ns(), step_id)

    def begin(self, step_id: int) -> None:
        self._step, self._start_ns, self._end_ns = step_id, self.clock_ns(), None

    def end_compute(self) -> None:
        self._end_ns = self.clock_ns()

    def finish(self, host_s: float, **span_tags: Any) -> None:
        # Recorded even if the step raised (no end_compute): a failed step still occupied the stage.
        self.recorder.record("compute", self._start_ns, self.clock_ns(), self._step, **span_tags)
        if self._end_ns is not None:
            self._done.append(TimedStep(self._step, (self._end_ns - self._start_ns) * 1e-9 + host_s))
            self._end_ns = None

    def take(self) -> list[TimedStep]:
        done, self._done = self._done, []
        return done

    def poll(self) -> None:
        return None  # every step is read when it ends


class TimingEvent(Protocol):
    """What the timer needs of a CUDA event (torch.cuda.Event(enable_timing=True)); tests pass fakes."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any, /) -> float: ...  # milliseconds

    def synchronize(self) -> None: ...


@dataclass
class _Anchor:
    """An event the device ran when the host clock read `host_ns`: event times become host times."""

    event: TimingEvent
    host_ns: int


@dataclass
class _OnDevice:
    step_id: int
    start: TimingEvent
    end: TimingEvent
    anchor: _Anchor
    host_s: float
    span_tags: dict[str, Any] = field(default_factory=dict)
    waits: list[tuple[int, TimingEvent]] = field(default_factory=list)  # (step, event) of its input waits


class EventStepTimer:
    """CUDA events, read late. Each step's start/end pair waits in order until its end event is done;
    `take` reads the done ones from the front and stops at the first that is not (the device runs a
    stream in order, so none behind it is done either)."""

    def __init__(self, recorder: SpanRecorder, new_event: Callable[[], TimingEvent],
                 clock_ns: Callable[[], int] = _host_ns, reanchor_ns: int = REANCHOR_NS) -> None:
        self.recorder = recorder
        self.new_event = new_event
        self.clock_ns = clock_ns
        self.reanchor_ns = reanchor_ns
        self.dropped = 0  # steps never read because MAX_PENDING were waiting (a bug if it is not 0)
        self._pool: list[TimingEvent] = []
        self._on_device: deque[_OnDevice] = deque()
        self._done: list[TimedStep] = []
        self._lock = threading.Lock()  # poll runs on the span drain's thread, beside the step loop
        self._step = -1
        self._start: TimingEvent | None = None
        self._end: TimingEvent | None = None
        self._host_start_ns = 0
        self._waits: list[tuple[int, TimingEvent]] = []  # input waits ordered since the last begin
        # Built with the worker, not on the hot path: one wait, so the first anchor runs on an idle device.
        idle = self._event()
        idle.record()
        idle.synchronize()
        self._anchor = self._anchor_now()

    def _event(self) -> TimingEvent:
        return self._pool.pop() if self._pool else self.new_event()

    def _anchor_now(self) -> _Anchor:
        """Only when the device is idle: an event recorded now runs now (within a launch's latency)."""
        host_ns = self.clock_ns()
        event = self._event()
        event.record()
        return _Anchor(event, host_ns)

    @contextmanager
    def waiting(self, step_id: int) -> Iterator[None]:
        event = self._event()
        event.record()  # runs once the stream is done with what came before: from there it waits
        self._waits.append((step_id, event))
        yield

    def begin(self, step_id: int) -> None:
        with self._lock:
            last = self._on_device[-1].end if self._on_device else None
            if self.clock_ns() - self._anchor.host_ns > self.reanchor_ns and (last is None or last.query()):
                self._anchor = self._anchor_now()  # the old one stays with the steps that use it
        self._step, self._host_start_ns, self._end = step_id, self.clock_ns(), None
        self._start = self._event()
        self._start.record()

    def end_compute(self) -> None:
        self._end = self._event()
        self._end.record()

    def finish(self, host_s: float, **span_tags: Any) -> None:
        start, end = self._start, self._end
        self._start = self._end = None
        waits, self._waits = self._waits, []
        if start is None or end is None:
            self._pool += [event for _, event in waits]  # an unfinished step's waits: nothing to end them at
        if start is None:
            return
        # the step raised before its layers were done: no figure; the host span shows the stage busy
        if end is None:
            self.recorder.record("compute", self._host_start_ns, self.clock_ns(), self._step, **span_tags)
            return
        with self._lock:
            self._on_device.append(_OnDevice(self._step, start, end, self._anchor, host_s, span_tags, waits))
            if len(self._on_device) > MAX_PENDING:
                self._on_device.popleft()
                self.dropped += 1

    def take(self) -> list[TimedStep]:
        with self._lock:
            self._read_done()
            done, self._done = self._done, []
        return done

    def poll(self) -> None:
        """Read the steps the device has finished (spans recorded, times kept for the next `take`). After
        a run nothing is left on the device (the last result's sampling waited for it), so the span
        drain that calls this then gets a whole trace, without a wait."""
        with self._lock:
            self._read_done()

    def _read_done(self) -> None:
        while self._on_device and self._on_device[0].end.query():
            self._read(self._on_device.popleft())

    def _read(self, step: _OnDevice) -> None:
        compute_ms = step.start.elapsed_time(step.end)
        start_ns = step.anchor.host_ns + round(step.anchor.event.elapsed_time(step.start) * 1e6)
        for wait_step, waited in step.waits:  # each ends where the step's compute starts
            wait_ns = step.anchor.host_ns + round(step.anchor.event.elapsed_time(waited) * 1e6)
            self.recorder.record("recv_wait", min(wait_ns, start_ns), start_ns, wait_step)
            self._pool.append(waited)
        self.recorder.record("compute", start_ns, start_ns + round(compute_ms * 1e6), step.step_id,
                             **step.span_tags)
        self._done.append(TimedStep(step.step_id, compute_ms * 1e-3 + step.host_s))
        self._pool += (step.start, step.end)


def cuda_event() -> TimingEvent:
    import torch

    event: TimingEvent = torch.cuda.Event(enable_timing=True)
    return event


def step_timer_for(device_type: str, recorder: SpanRecorder) -> StepTimer:
    """CUDA events on a GPU, the host clock elsewhere."""
    if device_type == "cuda":
        return EventStepTimer(recorder, cuda_event)
    return HostStepTimer(recorder)
