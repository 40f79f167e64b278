"""The GPU check's `step_times` rule (ppserve/gpu_check/step_times.py lag_report), on hand-made results:
what a device run must show, and what it fails on."""

from __future__ import annotations

from ppserve.gpu_check.step_times import MAX_LAG, lag_report
from ppserve.sched import StepResult


def results(timed: list[int | None]) -> list[StepResult]:
    return [StepResult(step, {}, (0.001,) if t is not None else (), timed_step_id=t)
            for step, t in enumerate(timed)]


def test_one_step_late_on_cuda_passes() -> None:
    r = lag_report(results([None, 0, 1, 2, 3]), cuda=True)
    assert r["problems"] == [] and r["lag_counts"] == {1: 4} and r["untimed_at_end"] == 1


def test_cuda_times_read_at_once_fail_a_waiting_timer_is_caught() -> None:
    r = lag_report(results([0, 1, 2, 3]), cuda=True)
    assert any("not read late" in p for p in r["problems"])


def test_host_clock_must_time_each_step_at_once() -> None:
    assert lag_report(results([0, 1, 2]), cuda=False)["problems"] == []
    assert any("host clock" in p for p in lag_report(results([None, 0, 1]), cuda=False)["problems"])


def test_a_time_twice_unknown_or_far_behind_fails() -> None:
    assert any("timed twice" in p for p in lag_report(results([None, 0, 0]), cuda=True)["problems"])
    far = [None] * (MAX_LAG + 1) + [0]
    assert any(f"more than {MAX_LAG}" in p for p in lag_report(results(far), cuda=True)["problems"])
    assert any("no result carried" in p for p in lag_report(results([None, None]), cuda=True)["problems"])
