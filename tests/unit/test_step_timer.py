"""The stage step timer (worker/step_timer.py) and the relay of step times down the pipeline
(worker/stage_times.py), on a fake event backend the test completes late (tests/unit/fake_events.py)."""

from __future__ import annotations

import pytest

from ppserve.metrics.spans import SpanRecorder
from ppserve.worker.stage_times import NO_ROW, StageTimes, TimeRow, unwire, wire, wire_length
from ppserve.worker.step_timer import EventStepTimer, HostStepTimer, TimedStep
from tests.unit.fake_events import FakeDevice


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000

    def __call__(self) -> int:
        return self.ns


def event_timer(device: FakeDevice, clock: Clock | None = None) -> tuple[EventStepTimer, SpanRecorder]:
    recorder = SpanRecorder(stage=0, tp_rank=0)
    return EventStepTimer(recorder, device.new_event, clock_ns=clock or Clock()), recorder


def run_step(timer: EventStepTimer | HostStepTimer, device: FakeDevice | None, step: int, compute_ms: float,
             host_s: float = 0.0, clock: Clock | None = None) -> None:
    timer.begin(step)
    if device is not None:
        device.run(compute_ms)  # the layers, on the device
    if clock is not None:
        clock.ns += int(compute_ms * 1e6)  # the host's view of them (HostStepTimer)
    timer.end_compute()
    if device is not None:
        device.run(1.0)  # sampling: after the end event, outside the figure
    timer.finish(host_s, num_decode_tokens=step + 1)


def test_event_times_come_back_one_step_late_without_a_wait() -> None:
    device = FakeDevice()
    timer, recorder = event_timer(device)
    syncs_at_start = device.num_syncs  # the first anchor waits once, when the worker is built
    seen: list[list[TimedStep]] = []
    for step in range(4):
        run_step(timer, device, step, compute_ms=10.0 * (step + 1), host_s=0.5)
        seen.append(timer.take())
        device.complete_through(device.num_records)  # the device catches up only after the host looked
    assert device.num_syncs == syncs_at_start  # never a synchronize in the steps
    assert seen[0] == []  # step 0 was still on the device when its step ended
    for step in range(1, 4):  # step k reads step k-1, with its own figure
        assert seen[step] == [TimedStep(step - 1, pytest.approx(0.5 + 0.01 * step))]


def test_event_spans_are_laid_on_the_host_clock() -> None:
    clock = Clock()
    device = FakeDevice(lag=0)
    timer, recorder = event_timer(device, clock)
    anchor_host_ns = clock.ns  # the device is idle at the anchor, so it ran then
    device.run(3.0)  # the device reaches the step 3 ms after the anchor
    run_step(timer, device, 0, compute_ms=7.0)
    assert timer.take() == [TimedStep(0, pytest.approx(0.007))]
    (span,) = recorder.drain()
    assert (span.kind, span.step_id, span.num_decode_tokens) == ("compute", 0, 1)
    assert span.start_ns == anchor_host_ns + 3_000_000 and span.end_ns - span.start_ns == 7_000_000


def test_a_stall_delays_times_but_loses_none_and_a_span_drain_keeps_them() -> None:
    device = FakeDevice()
    timer, recorder = event_timer(device)
    for step in range(3):
        run_step(timer, device, step, compute_ms=1.0 + step)
        assert timer.take() == []  # the device is behind: nothing is read, nothing waits
    device.complete_through(2 + 4)  # the two anchor events, steps 0 and 1 (two each); step 2 still running
    assert [t.step_id for t in timer.take()] == [0, 1]
    device.complete_through(device.num_records)  # step 2 done, between two steps
    syncs = device.num_syncs
    timer.poll()  # the span drain: reads what is done, without a wait
    assert device.num_syncs == syncs
    assert [s.step_id for s in recorder.drain()] == [0, 1, 2]
    assert timer.take() == [TimedStep(2, pytest.approx(0.003))]  # kept for the next step's report
    assert timer.take() == []  # and reported once


def test_a_failed_step_has_a_host_span_and_no_figure() -> None:
    device = FakeDevice(lag=0)
    clock = Clock()
    timer, recorder = event_timer(device, clock)
    timer.begin(0)
    clock.ns += 5_000
    timer.finish(0.0)  # raised in the layers: no end_compute
    run_step(timer, device, 1, compute_ms=2.0)
    assert [t.step_id for t in timer.take()] == [1]
    spans = recorder.drain()
    assert [(s.step_id, s.end_ns - s.start_ns) for s in spans] == [(0, 5_000), (1, 2_000_000)]


def test_host_timer_reports_the_step_at_once_its_span_includes_sampling() -> None:
    clock = Clock()
    recorder = SpanRecorder(stage=0, tp_rank=0)
    timer = HostStepTimer(recorder, clock_ns=clock)
    timer.begin(4)
    clock.ns += 2_000_000
    timer.end_compute()
    clock.ns += 1_000_000  # sampling
    timer.finish(0.25)
    assert timer.take() == [TimedStep(4, pytest.approx(0.252))]
    (span,) = recorder.drain()
    assert span.end_ns - span.start_ns == 3_000_000


def test_wire_round_trip() -> None:
    row = TimeRow(12, (0.5, 0.25))
    assert unwire(wire(row, 2)) == row
    assert wire(None, 2) == (NO_ROW, 0.0, 0.0) and unwire(wire(None, 2)) is None
    assert len(wire(None, 3)) == wire_length(3)
    with pytest.raises(ValueError, match="2 stage times for a link after 3"):
        wire(row, 3)


def test_rows_wait_on_a_stage_until_its_own_time_is_read() -> None:
    """Stage 1's device is one step further behind than stage 0's: each row waits there a step, and
    every row leaves complete with both stages' times for its own step, in order."""
    dev0, dev1 = FakeDevice(lag=2), FakeDevice(lag=4)  # events recorded after one before it is done
    t0, _ = event_timer(dev0)
    t1, _ = event_timer(dev1)
    first, second = StageTimes(t0, first=True), StageTimes(t1, first=False)
    reported: list[tuple[int, TimeRow | None]] = []
    for step in range(6):
        run_step(t0, dev0, step, compute_ms=10.0 * (step + 1))
        row = first.relay()
        run_step(t1, dev1, step, compute_ms=100.0 * (step + 1))
        reported.append((step, second.relay([row] if row else [])))
    rows = [(step, r) for step, r in reported if r is not None]
    assert [r.step_id for _, r in rows] == [0, 1, 2, 3]
    for step, r in rows:
        assert step - r.step_id == 2  # one step late on stage 0, one more on stage 1
        assert r.seconds == pytest.approx((0.01 * (r.step_id + 1), 0.1 * (r.step_id + 1)))
    assert dev0.num_syncs == dev1.num_syncs == 1  # the anchors only


def test_a_row_whose_step_failed_on_this_stage_is_dropped_not_stuck() -> None:
    device = FakeDevice(lag=0)
    timer, _ = event_timer(device)
    second = StageTimes(timer, first=False)
    timer.begin(0)
    timer.finish(0.0)  # step 0 failed here
    assert second.relay([TimeRow(0, (0.1,))]) is None  # nothing read yet for step 0: it waits
    run_step(timer, device, 1, compute_ms=2.0)
    assert second.relay([TimeRow(1, (0.2,))]) == TimeRow(1, (0.2, pytest.approx(0.002)))
    assert second.dropped == 1


def test_other_tp_ranks_read_their_timer_and_relay_nothing() -> None:
    device = FakeDevice(lag=0)
    timer, recorder = event_timer(device)
    rank1 = StageTimes(timer, first=True, relays=False)
    run_step(timer, device, 0, compute_ms=1.0)
    assert rank1.relay() is None
    assert [s.step_id for s in recorder.drain()] == [0]  # its compute span still recorded
    with pytest.raises(ValueError, match="no upstream"):
        StageTimes(timer, first=True).relay([TimeRow(0, ())])
