"""Control-plane latency from spans: how long a microbatch waits on the engine and the links, not on compute.

Three gaps per microbatch, all on the engine's clock (spans of TP rank 0):
- dispatch: the engine's `schedule` span ends -> stage 0 starts working on it (its `prepare` span, where
  it has one, else its compute);
- hop: stage s ends computing it -> stage s+1 starts computing it (the hidden states' transfer and
  the stage's wake-up; a gap that a busy stage s+1 would have anyway is not the link's: a hop is
  counted from max(stage s end, stage s+1 free));
- turnaround: the last stage ends computing it -> the engine's next `schedule` span starts (the result
  travelling back, the scheduler's update, and whatever the engine did before scheduling again).

Pure Python over `Span` records; medians and p90s in seconds.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ppserve.metrics.latency import percentile
from ppserve.metrics.spans import ENGINE_STAGE, Span

__all__ = ["control_plane_latency"]


def control_plane_latency(spans: Iterable[Span]) -> dict[str, Any]:
    """{"dispatch", "hop", "turnaround"}: each {"count", "p50_s", "p90_s"} (None when nothing was seen)."""
    compute: dict[int, dict[int, Span]] = defaultdict(dict)  # step -> stage -> compute span (tp rank 0)
    schedule: dict[int, Span] = {}
    first_prepare: dict[int, int] = {}  # step -> stage 0's prepare start (the step has arrived)
    for s in spans:
        if s.kind == "compute" and s.tp_rank == 0:
            compute[s.step_id][s.stage] = s
        elif s.kind == "prepare" and s.tp_rank == 0 and s.stage == 0:
            first_prepare[s.step_id] = s.start_ns
        elif s.kind == "schedule" and s.stage == ENGINE_STAGE:
            schedule[s.step_id] = s
    if not compute:
        return {k: _stats([]) for k in ("dispatch", "hop", "turnaround")}
    last = max(st for stages in compute.values() for st in stages)
    # When each stage became free for a step: the end of the previous step it computed.
    by_stage: dict[int, list[Span]] = defaultdict(list)
    for stages in compute.values():
        for st, sp in stages.items():
            by_stage[st].append(sp)
    free_before: dict[tuple[int, int], int] = {}
    for st, lst in by_stage.items():
        lst.sort(key=lambda x: x.start_ns)
        prev_end = None
        for sp in lst:
            if prev_end is not None:
                free_before[(st, sp.step_id)] = prev_end
            prev_end = sp.end_ns
    starts = sorted(s.start_ns for s in schedule.values())
    dispatch, hop, turnaround = [], [], []
    for step, stages in compute.items():
        sched = schedule.get(step)
        if sched is not None and 0 in stages:
            ready = max(sched.end_ns, free_before.get((0, step), sched.end_ns))
            dispatch.append(max(0, first_prepare.get(step, stages[0].start_ns) - ready))
        for st in range(last):
            if st in stages and st + 1 in stages:
                ready = max(stages[st].end_ns, free_before.get((st + 1, step), stages[st].end_ns))
                hop.append(max(0, stages[st + 1].start_ns - ready))
        if last in stages:
            end = stages[last].end_ns
            i = bisect.bisect_left(starts, end)
            if i < len(starts):
                turnaround.append(starts[i] - end)
    return {"dispatch": _stats(dispatch), "hop": _stats(hop), "turnaround": _stats(turnaround)}


def _stats(values_ns: list[int]) -> dict[str, Any]:
    if not values_ns:
        return {"count": 0, "p50_s": None, "p90_s": None}
    return {"count": len(values_ns), "p50_s": percentile(values_ns, 50) * 1e-9,
            "p90_s": percentile(values_ns, 90) * 1e-9}
