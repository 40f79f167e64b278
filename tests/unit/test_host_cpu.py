"""Host CPU accounting (metrics/host_cpu.py) on a fake /proc: parsing, the parts, and no /proc at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ppserve.metrics.host_cpu import CpuSnapshot, cpu_usage, snapshot

HZ = os.sysconf("SC_CLK_TCK")


def _write_proc(root: Path, idle: int, busy: int, procs: dict[str, tuple[int, int]]) -> None:
    """A /proc with two cores: `busy` ticks of user time and `idle` idle ticks in all, and per process
    (pid or "self") its utime and stime ticks, under a command name with a space and a parenthesis."""
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(
        f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\ncpu1 1 0 0 1 0 0 0 0 0 0\nintr 0\n")
    for pid, (utime, stime) in procs.items():
        (root / pid).mkdir(exist_ok=True)
        rest = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
        (root / pid / "stat").write_text(f"{pid} (ray::Stage (x)) " + " ".join(rest) + "\n")


def test_the_parts_of_the_machines_time_come_from_the_kernels_counters(tmp_path):
    proc = tmp_path / "proc"
    _write_proc(proc, idle=100, busy=100, procs={"11": (10, 0), "12": (20, 5), "self": (3, 1)})
    before = snapshot([11, 12, 12], proc)  # a pid named twice counts once
    assert before is not None and before.cores == 2
    assert before.stages_s == pytest.approx(35 / HZ) and before.own_s == pytest.approx(4 / HZ)
    # 200 ticks later: 40 idle, stage 11 used 70, stage 12 60, this process 20, 10 went elsewhere.
    _write_proc(proc, idle=140, busy=260, procs={"11": (60, 20), "12": (70, 15), "self": (20, 4)})
    usage = cpu_usage(before, snapshot([11, 12], proc))
    assert usage is not None
    assert (usage.stages, usage.own, usage.idle, usage.other) == pytest.approx((0.65, 0.10, 0.20, 0.05))
    assert "stage processes 65.0 %" in usage.format_text() and "idle 20.0 %" in usage.format_text()
    assert set(usage.to_dict()) == {"seconds", "cores", "stages", "own", "other", "idle"}


def test_a_process_that_ended_and_counters_that_tick_apart_stay_within_the_whole(tmp_path):
    proc = tmp_path / "proc"
    _write_proc(proc, idle=0, busy=0, procs={"self": (0, 0)})
    before = snapshot([99], proc)  # no such process: it counts nothing
    assert before is not None and before.stages_s == 0.0
    # Process ticks a little ahead of the machine's: the parts are scaled to the whole, none is negative.
    after = CpuSnapshot(before.wall_s + 1, 2, before.total_s + 1.0, before.idle_s + 0.5, 0.45, 0.1)
    usage = cpu_usage(before, after)
    assert usage is not None and usage.other == 0.0
    assert usage.idle + usage.stages + usage.own == pytest.approx(1.0)
    assert cpu_usage(before, before) is None  # no time accounted: no figure


def test_without_proc_there_is_no_figure(tmp_path):
    assert snapshot([1], tmp_path / "nowhere") is None
