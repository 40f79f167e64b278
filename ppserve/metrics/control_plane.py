"""Control-plane latency from spans: how long a microbatch waits on the engine and the links, not on compute.

Gaps per microbatch, on the engine's clock (spans of TP rank 0):
- dispatch: the engine's `schedule` span ends -> stage 0 starts working on it (its `prepare` span, where
  it has one, else its compute);
- hop: stage s ends computing it -> stage s+1 starts computing it, counted from max(stage s end, stage
  s+1 free) (the transfer and the wake-up, not a wait a busy stage would have anyway);
- turnaround: the last stage ends computing it -> the engine's next `schedule` span starts (the result
  travelling back, the scheduler's update, and whatever the engine did before scheduling again);
- ring: a microbatch whose decodes take their tokens from the previous carrier's last stage (the token
  ring), where stage 0 started it after those tokens came and later than the dispatch allowed: last
  stage's compute end -> stage 0 starts. It is left out of `dispatch`.
Under the ring the engine forms microbatches just in time for stage 0, whenever the last result came, so
a `turnaround` is counted only where the next schedule forms a microbatch that needed a result: not one
formed ahead (on the ring, or a prompt's next chunk), not the ring's extra microbatch (p others still on
the stages), and not one formed only after another microbatch left the last stage (that result, or the
ring's clock, set it off; docs/decisions.md#turnaround-under-the-ring). A microbatch's requests are in
its compute spans. Pure Python over `Span` records; medians and p90s in seconds.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ppserve.metrics.latency import percentile
from ppserve.metrics.spans import ENGINE_STAGE, Span

__all__ = ["FIGURES", "control_plane_latency"]

FIGURES = ("dispatch", "hop", "turnaround", "ring")


def control_plane_latency(spans: Iterable[Span]) -> dict[str, Any]:
    """{"dispatch", "hop", "turnaround", "ring"}: each {"count", "p50_s", "p90_s"} (None when nothing was
    seen)."""
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
        return {k: _stats([]) for k in FIGURES}
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
    ahead, ring_ready = _formed_ahead(compute, schedule, first_prepare, last)
    by_start = sorted((s.start_ns, step) for step, s in schedule.items())
    starts = [start for start, _ in by_start]
    # Microbatches on the stages when a schedule starts: scheduled before it, not yet out of the last stage.
    whole = [step for step, stages in compute.items() if step in schedule and last in stages]
    scheduled_at = sorted(schedule[step].start_ns for step in whole)
    left_at = sorted(compute[step][last].end_ns for step in whole)

    def on_stages(t: int) -> int:
        return bisect.bisect_left(scheduled_at, t) - bisect.bisect_right(left_at, t)

    dispatch, hop, turnaround, ring = [], [], [], []
    for step, stages in compute.items():
        sched = schedule.get(step)
        if sched is not None and 0 in stages:
            ready = max(sched.end_ns, free_before.get((0, step), sched.end_ns))
            start = first_prepare.get(step, stages[0].start_ns)
            tokens = ring_ready.get(step)
            if tokens is not None and tokens >= ready:
                ring.append(start - tokens)
            else:
                dispatch.append(max(0, start - ready))
        for st in range(last):
            if st in stages and st + 1 in stages:
                ready = max(stages[st].end_ns, free_before.get((st + 1, step), stages[st].end_ns))
                hop.append(max(0, stages[st + 1].start_ns - ready))
        if last in stages:
            end = stages[last].end_ns
            i = bisect.bisect_left(starts, end)
            j = bisect.bisect_right(left_at, end)  # the next microbatch out of the last stage, if any
            if (i < len(starts) and by_start[i][1] not in ahead and on_stages(starts[i]) <= last
                    and (j == len(left_at) or starts[i] <= left_at[j])):
                turnaround.append(starts[i] - end)
    return {"dispatch": _stats(dispatch), "hop": _stats(hop), "turnaround": _stats(turnaround),
            "ring": _stats(ring)}


def _formed_ahead(compute: dict[int, dict[int, Span]], schedule: dict[int, Span],
                  first_prepare: dict[int, int], last: int) -> tuple[set[int], dict[int, int]]:
    """(the steps formed while the step that last carried one of their requests was still in flight: on
    the token ring, or a prompt's next chunk; for those that stage 0 started no earlier than that step's
    last stage ended, when the last of it ended: their ring tokens' time). A next chunk that follows its
    previous one down the pipeline starts on stage 0 before that one reaches the last stage, so it has
    no ring time."""
    ahead: set[int] = set()
    ring_ready: dict[int, int] = {}
    latest: dict[str, int] = {}  # request -> the latest step that carried it (steps in formation order)
    for step in sorted(schedule):
        stages = compute.get(step, {})
        first = stages.get(0)
        if first is None:
            continue
        formed, start = schedule[step].end_ns, first_prepare.get(step, first.start_ns)
        for rid in first.request_ids:
            source = compute.get(latest.get(rid, -1), {}).get(last)
            latest[rid] = step
            if source is None or source.end_ns <= formed:
                continue  # its token (or its chunk) was back before this step was formed
            ahead.add(step)
            if source.end_ns <= start:
                ring_ready[step] = max(ring_ready.get(step, 0), source.end_ns)
    return ahead, ring_ready


def _stats(values_ns: list[int]) -> dict[str, Any]:
    if not values_ns:
        return {"count": 0, "p50_s": None, "p90_s": None}
    return {"count": len(values_ns), "p50_s": percentile(values_ns, 50) * 1e-9,
            "p90_s": percentile(values_ns, 90) * 1e-9}
