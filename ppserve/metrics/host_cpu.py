"""Where the host's CPU time went during a run: the stage processes, this process, the rest, and idle.

On a CPU pipeline the stages, the engine (with its server and, in `ppserve demo`, its clients) and Ray's
own daemons share the machine's cores. A stage's bubble then has two very different causes: the core was
idle because the stage waited on a dependency (a token coming round the ring, a hop, an arrival), or the
core was busy with another process. The spans cannot tell them apart; the kernel's counters can. Read
from /proc (Linux): the machine's idle time from /proc/stat, each process's user + system time from
/proc/<pid>/stat. Elsewhere `snapshot` returns None and nothing is reported.

    before = snapshot(stage_pids)
    ... the run ...
    usage = cpu_usage(before, snapshot(stage_pids))   # fractions of all cores over the interval

No torch, Ray or grpc: plain file reads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuSnapshot", "CpuUsage", "cpu_usage", "snapshot"]


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float  # time.monotonic() when read
    cores: int  # CPUs this machine has online (the idle counter counts all of them)
    total_s: float  # all CPU time the machine has accounted since boot (every state, every core)
    idle_s: float  # idle + iowait since boot, every core
    stages_s: float  # user + system time of the stage processes
    own_s: float  # user + system time of this process (every thread)


@dataclass(frozen=True)
class CpuUsage:
    """Parts of the machine's CPU time (all cores) over an interval: they add up to 1."""

    seconds: float
    cores: int
    stages: float
    own: float
    other: float  # Ray's daemons, other processes, the kernel's own work
    idle: float

    def format_text(self, own_name: str = "this process") -> str:
        return (f"host CPU over {self.seconds:.2f} s on {self.cores} cores: stage processes "
                f"{100 * self.stages:.1f} %, {own_name} {100 * self.own:.1f} %, "
                f"other {100 * self.other:.1f} %, idle {100 * self.idle:.1f} %")

    def to_dict(self) -> dict[str, float]:
        return {"seconds": self.seconds, "cores": float(self.cores), "stages": self.stages, "own": self.own,
                "other": self.other, "idle": self.idle}


def _ticks_per_s() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def _process_s(pid: int | str, proc: Path, hz: float) -> float:
    """A process's user + system seconds (0.0 if it is gone: it used nothing more in this interval)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    # The command name (field 2) is in parentheses and may hold spaces: count fields after its last ')'.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / hz


def snapshot(stage_pids: Iterable[int], proc: Path = Path("/proc")) -> CpuSnapshot | None:
    """The counters now, or None where there is no /proc/stat to read (not Linux)."""
    try:
        cpu = (proc / "stat").read_text().splitlines()
    except OSError:
        return None
    hz = _ticks_per_s()
    # The first line sums every core: user nice system idle iowait irq softirq steal ...
    ticks = [int(x) for x in cpu[0].split()[1:9]]
    cores = sum(1 for line in cpu if line.startswith("cpu") and line[3:4].isdigit())
    return CpuSnapshot(
        wall_s=time.monotonic(),
        cores=max(1, cores),
        total_s=sum(ticks) / hz,
        idle_s=(ticks[3] + ticks[4]) / hz,
        stages_s=sum(_process_s(pid, proc, hz) for pid in set(stage_pids)),
        own_s=_process_s("self", proc, hz),
    )


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> CpuUsage | None:
    """The interval's parts of the machine's CPU time; None when no time was accounted between them."""
    total = after.total_s - before.total_s
    if total <= 0:
        return None

    def part(x: float) -> float:
        return min(1.0, max(0.0, x / total))

    idle = part(after.idle_s - before.idle_s)
    stages = part(after.stages_s - before.stages_s)
    own = part(after.own_s - before.own_s)
    # Process times and the machine's counters tick apart (whole ticks each), so the three may overshoot
    # the total by a tick or two: then they are scaled to it and nothing is left for the rest.
    known = idle + stages + own
    if known > 1.0:
        idle, stages, own = idle / known, stages / known, own / known
    return CpuUsage(after.wall_s - before.wall_s, after.cores, stages, own, max(0.0, 1.0 - known), idle)
