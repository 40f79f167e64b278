"""Pipeline bubble figures: pure functions from spans and work intervals to a labelled report.

Definitions (ARCHITECTURE.md#measuring-bubbles), for one (stage, tp rank) and one window W (a set of time
intervals):
- busy       = |union of its prepare, compute and send spans ∩ W|   (overlaps count once)
- bubble     = |(work ∩ W) − busy spans|   idle while the engine had work (a request waiting or in flight)
- starvation = |W − work − busy spans|     idle with no work at all: the load's fault, not the pipeline's
so busy + bubble + starvation = |W|, and each fraction is that time over |W|. A stage's figures are the
mean over its tp ranks (which run in lock step); the pipeline's, the mean over stages. Without work
intervals from the engine, "had work" is "some stage was computing or sending", all the spans prove.

Windows, always labelled in the report: "all" (first span start .. last span end), "active" (the union of
the work intervals, gaps with no work left out, so starvation is 0 by construction; without them, of all
compute/send spans), "steady" (the last stage's first compute start .. the first stage's last compute
end), or an explicit half-open (t0, t1) in engine-clock ns.

All arithmetic is on integer nanoseconds and exact fractions, so a report recomputed from a saved
trace equals the original exactly, and the GPipe oracle (p-1)/(m+p-1) holds to the last bit.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ppserve.metrics.latency import percentile, stats
from ppserve.metrics.spans import BUSY_KINDS, Span, WorkInterval

__all__ = [
    "Interval",
    "Window",
    "StageStats",
    "Stall",
    "BubbleReport",
    "union",
    "intersect",
    "subtract",
    "total",
    "resolve_window",
    "idle_intervals",
    "short_handed",
    "bubble_fraction_within",
    "short_handed_fractions",
    "per_request_bubble_ns",
    "bubble_report",
    "gpipe_bubble_fraction",
]

Interval = tuple[int, int]
Window = str | tuple[int, int]

# How many of the largest bubble gaps a report lists.
NUM_WORST_STALLS = 5


# ---------------------------------------------------------------------------------------------
# Interval algebra on half-open integer intervals. "Normalized" = sorted, disjoint, non-empty.


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Normalize: merge overlapping or touching intervals, drop empty ones."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two normalized interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        # Advance whichever ends first; the other may still overlap the next one.
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Parts of normalized `a` not covered by normalized `b`."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            out.append((cur, end))
    return out


def total(intervals: Iterable[Interval]) -> int:
    return sum(end - start for start, end in intervals)


# ---------------------------------------------------------------------------------------------
# Windows and idle time


def _busy(spans: Iterable[Span]) -> list[Interval]:
    return union((s.start_ns, s.end_ns) for s in spans if s.kind in BUSY_KINDS)


def _work(spans: Sequence[Span], work_intervals: Iterable[WorkInterval] | None) -> list[Interval]:
    if work_intervals is None:
        return _busy(s for s in spans if s.stage >= 0)
    return union((int(a), int(b)) for a, b in work_intervals)


def _stage_spans(spans: Iterable[Span]) -> dict[tuple[int, int], list[Span]]:
    by_track: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.stage >= 0:
            by_track[(s.stage, s.tp_rank)].append(s)
    return by_track


def resolve_window(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None,
    window: Window,
) -> tuple[str, list[Interval]]:
    """The window's label and its normalized intervals (see the module docstring)."""
    if isinstance(window, tuple):
        t0, t1 = int(window[0]), int(window[1])
        if t1 <= t0:
            raise ValueError(f"window ({t0}, {t1}) is empty")
        return f"({t0}, {t1})", [(t0, t1)]
    if not spans:
        raise ValueError("no spans to measure")
    if window == "all":
        return "all", [(min(s.start_ns for s in spans), max(s.end_ns for s in spans))]
    if window == "active":
        intervals = _work(spans, work_intervals)
        if not intervals:
            raise ValueError("window 'active' is empty: no work intervals and no compute spans")
        return "active", intervals
    if window == "steady":
        compute = [s for s in spans if s.kind == "compute" and s.stage >= 0]
        if not compute:
            raise ValueError("window 'steady' needs compute spans")
        first_stage = min(s.stage for s in compute)
        last_stage = max(s.stage for s in compute)
        t0 = min(s.start_ns for s in compute if s.stage == last_stage)
        t1 = max(s.end_ns for s in compute if s.stage == first_stage)
        if t1 <= t0:
            raise ValueError(
                f"window 'steady' is empty: stage {last_stage} first starts at {t0} ns, after "
                f"stage {first_stage} last ends at {t1} ns (too few microbatches to fill the pipe)"
            )
        return "steady", [(t0, t1)]
    raise ValueError(f"window {window!r} is not 'all', 'active', 'steady' or a (t0, t1) tuple")


def idle_intervals(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None = None,
    window: Window = "all",
) -> dict[tuple[int, int], tuple[list[Interval], list[Interval]]]:
    """Per (stage, tp rank): (bubble intervals, starvation intervals) inside the window."""
    _, win = resolve_window(spans, work_intervals, window)
    work = _work(spans, work_intervals)
    out = {}
    for key, track in sorted(_stage_spans(spans).items()):
        idle = subtract(win, _busy(track))
        out[key] = (intersect(idle, work), subtract(idle, work))
    return out


def short_handed(lifetimes: Iterable[Interval], num_stages: int,
                 within: Sequence[Interval]) -> list[Interval]:
    """The parts of normalized `within` where fewer than `num_stages` requests were in the system, given
    each request's lifetime (arrival, last token; ns on the spans' clock).

    Each request's decodes ride in one microbatch at a time (the next token needs the last one), so
    with fewer than p requests and only decodes left, p stages cannot all be busy whatever the
    formation: the bubble there is the load's shape more than the scheduler's (a prompt's chunks can
    still follow each other down the pipeline, so some of it is formation's to fill)."""
    events = sorted([(start, 1) for start, _ in lifetimes] + [(end, -1) for _, end in lifetimes])
    full: list[Interval] = []
    count, since = 0, 0
    for at, step in events:
        if count >= num_stages and at > since:
            full.append((since, at))
        count += step
        since = at
    return subtract(within, union(full))


def bubble_fraction_within(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None,
    window: Window,
    where: Sequence[Interval],
) -> float:
    """The pipeline's mean bubble fraction as `bubble_report` computes it (over the window; a stage's
    ranks averaged, then the stages), counting only the bubble that fell inside normalized `where`."""
    _, win = resolve_window(spans, None if work_intervals is None else list(work_intervals), window)
    win_ns = total(win)
    per_stage: dict[int, list[int]] = defaultdict(list)
    for (stage, _rank), (bubbles, _starved) in idle_intervals(spans, work_intervals, window).items():
        per_stage[stage].append(total(intersect(bubbles, where)))
    if not per_stage or not win_ns:
        return 0.0
    mean = sum(Fraction(sum(ranks), len(ranks)) for ranks in per_stage.values()) / len(per_stage)
    return float(mean / win_ns)


def short_handed_fractions(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None,
    window: Window,
    lifetimes: Iterable[Interval],
    num_stages: int,
) -> tuple[float, float]:
    """(the mean bubble fraction that fell while fewer than `num_stages` requests were in the system, the
    part of the window that was so), from each request's lifetime (arrival, last token) on the spans'
    clock."""
    work = None if work_intervals is None else list(work_intervals)
    _, win = resolve_window(spans, work, window)
    few = short_handed(lifetimes, num_stages, win)
    win_ns = total(win)
    return bubble_fraction_within(spans, work, window, few), (total(few) / win_ns if win_ns else 0.0)


def bubble_summary(rep: BubbleReport, short_handed: tuple[float, float] | None = None) -> dict[str, Any]:
    """One run's bubble figures as every report writes them (the simulator's `summary`, the benchmark
    harness, `ppserve simulate --json`): the same keys everywhere, seconds and fractions in [0, 1].
    `short_handed`: `short_handed_fractions`' pair, or None where the request times are not on the spans'
    clock (those two keys are then None)."""
    per_req = stats([v * 1e-9 for v in rep.per_request_bubble_ns.values()])
    # The percentiles as the report computed them, in ns, so that every writer gives the same figure.
    for key, ns in (("p50", rep.per_request_bubble_p50_ns), ("p90", rep.per_request_bubble_p90_ns),
                    ("p99", rep.per_request_bubble_p99_ns)):
        per_req[key] = None if ns is None else ns * 1e-9
    return {
        "window": rep.window,
        "window_s": rep.window_ns * 1e-9,
        "mean_bubble_fraction": rep.mean_bubble_fraction,
        "mean_busy_fraction": rep.mean_busy_fraction,
        "mean_starvation_fraction": rep.mean_starvation_fraction,
        # The part of the mean bubble that fell while fewer than p requests were in the system, and the
        # part of the window that was so: a formation cannot fill all of that.
        "short_handed_bubble_fraction": None if short_handed is None else short_handed[0],
        "short_handed_time_fraction": None if short_handed is None else short_handed[1],
        "stages": [
            {"stage": s.stage, "busy_s": s.busy_ns * 1e-9, "bubble_s": s.bubble_ns * 1e-9,
             "bubble_fraction": s.bubble_fraction, "busy_fraction": s.busy_fraction}
            for s in rep.stages
        ],
        "per_request_bubble_s": per_req,
        "num_microbatches": rep.num_microbatches,
        "microbatch_token_mean": rep.microbatch_token_mean,
        "microbatch_token_cv": rep.microbatch_token_cv,
    }


# ---------------------------------------------------------------------------------------------
# Per-request bubble time


def _microbatch_stage_times(spans: Iterable[Span]) -> dict[int, dict[int, tuple[int, int]]]:
    """step_id -> stage -> (earliest compute start, latest compute end) over the stage's tp ranks."""
    times: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for s in spans:
        if s.kind != "compute" or s.stage < 0:
            continue
        prev = times[s.step_id].get(s.stage)
        times[s.step_id][s.stage] = (
            (s.start_ns, s.end_ns) if prev is None else (min(prev[0], s.start_ns), max(prev[1], s.end_ns))
        )
    return times


def per_request_bubble_ns(spans: Sequence[Span]) -> dict[str, int]:
    """For each request: over every microbatch it rode in, the time between leaving stage s and
    starting on stage s+1, summed over consecutive stage pairs.

    A microbatch leaves a stage when its last tp rank ends compute and starts the next when its
    first tp rank starts compute. A negative gap can only be clock skew and is counted as 0. Only
    pairs where both stages recorded the microbatch count. Not windowed: whole microbatches only.
    """
    times = _microbatch_stage_times(spans)
    riders: dict[int, set[str]] = defaultdict(set)
    for s in spans:
        riders[s.step_id].update(s.request_ids)
    out: dict[str, int] = {}
    for step, by_stage in sorted(times.items()):
        wait = sum(max(0, by_stage[st + 1][0] - by_stage[st][1]) for st in by_stage if st + 1 in by_stage)
        for rid in sorted(riders[step]):
            out[rid] = out.get(rid, 0) + wait
    return out


# ---------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class StageStats:
    """One stage's figures in one window; ns figures are means over the stage's tp ranks."""

    stage: int
    num_tp_ranks: int
    busy_ns: float
    bubble_ns: float
    starvation_ns: float
    window_ns: int
    bubble_fraction: float
    busy_fraction: float
    starvation_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Stall:
    """One contiguous bubble on one (stage, tp rank)."""

    stage: int
    tp_rank: int
    start_ns: int
    end_ns: int

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "duration_ns": self.duration_ns}


@dataclass(frozen=True)
class BubbleReport:
    """Bubble figures of one run in one labelled window."""

    window: str
    t0_ns: int
    t1_ns: int
    window_ns: int  # measured length: smaller than t1 - t0 when the window has gaps ("active")
    stages: tuple[StageStats, ...]
    mean_bubble_fraction: float
    mean_busy_fraction: float
    mean_starvation_fraction: float
    per_request_bubble_ns: dict[str, int]
    per_request_bubble_p50_ns: float | None
    per_request_bubble_p90_ns: float | None
    per_request_bubble_p99_ns: float | None
    num_microbatches: int
    microbatch_token_mean: float | None
    microbatch_token_cv: float | None  # population std / mean of tokens per microbatch
    compute_time_cv: dict[int, float | None]  # stage -> cv of per-microbatch compute time
    worst_stalls: tuple[Stall, ...]

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["stages"] = [s.to_dict() for s in self.stages]
        d["worst_stalls"] = [s.to_dict() for s in self.worst_stalls]
        d["per_request_bubble_ns"] = dict(self.per_request_bubble_ns)
        # JSON object keys must be strings.
        d["compute_time_cv"] = {str(k): v for k, v in self.compute_time_cv.items()}
        return d

    def format_text(self) -> str:
        """A readable table, the window named in the heading."""
        ms = 1e-6
        lines = [
            f"pipeline bubbles — window: {self.window} "
            f"[{self.t0_ns} .. {self.t1_ns} ns], measured {self.window_ns * ms:.3f} ms",
            f"{'stage':>5} {'tp':>3} {'busy ms':>10} {'bubble ms':>10} {'starve ms':>10}"
            f" {'busy%':>7} {'bubble%':>8} {'starve%':>8}",
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:>5} {s.num_tp_ranks:>3} {s.busy_ns * ms:>10.3f} {s.bubble_ns * ms:>10.3f}"
                f" {s.starvation_ns * ms:>10.3f} {100 * s.busy_fraction:>6.2f}%"
                f" {100 * s.bubble_fraction:>7.2f}% {100 * s.starvation_fraction:>7.2f}%"
            )
        lines.append(
            f"{'mean':>5} {'':>3} {'':>10} {'':>10} {'':>10} {100 * self.mean_busy_fraction:>6.2f}%"
            f" {100 * self.mean_bubble_fraction:>7.2f}% {100 * self.mean_starvation_fraction:>7.2f}%"
        )
        n = len(self.per_request_bubble_ns)
        if n:
            lines.append(
                f"per-request bubble (all microbatches, {n} requests): "
                f"p50 {_ms(self.per_request_bubble_p50_ns)} p90 {_ms(self.per_request_bubble_p90_ns)}"
                f" p99 {_ms(self.per_request_bubble_p99_ns)}"
            )
        if self.microbatch_token_mean is not None:
            lines.append(
                f"microbatches: {self.num_microbatches}, tokens mean {self.microbatch_token_mean:.1f}"
                f" cv {_num(self.microbatch_token_cv)}; compute-time cv by stage: "
                + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(self.compute_time_cv.items()))
            )
        for st in self.worst_stalls:
            lines.append(
                f"stall: stage {st.stage} tp {st.tp_rank} at +{(st.start_ns - self.t0_ns) * ms:.3f} ms"
                f" for {st.duration_ns * ms:.3f} ms"
            )
        return "\n".join(lines)


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns * 1e-6:.3f} ms"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cv(values: Sequence[float]) -> float | None:
    """Population coefficient of variation; None when undefined (no values or zero mean)."""
    if not values:
        return None
    mean = math.fsum(values) / len(values)
    if mean == 0:
        return None
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


def _microbatch_tokens(spans: Iterable[Span]) -> dict[int, int]:
    """step_id -> tokens, from the first stage that recorded a compute span for it."""
    chosen: dict[int, tuple[int, int]] = {}
    for s in spans:
        if s.kind == "compute" and s.stage >= 0:
            prev = chosen.get(s.step_id)
            if prev is None or s.stage < prev[0]:
                chosen[s.step_id] = (s.stage, s.num_tokens)
    return {step: tokens for step, (_, tokens) in chosen.items()}


def _compute_time_cv(spans: Iterable[Span]) -> dict[int, float | None]:
    """stage -> cv over microbatches of compute time (per microbatch: mean over tp ranks of the
    sum of that rank's compute spans for it)."""
    per: dict[int, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for s in spans:
        if s.kind == "compute" and s.stage >= 0:
            per[s.stage][s.step_id][s.tp_rank] += s.duration_ns
    return {
        stage: _cv([sum(r.values()) / len(r) for r in steps.values()]) for stage, steps in sorted(per.items())
    }


def bubble_report(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None = None,
    window: Window = "active",
) -> BubbleReport:
    """Busy / bubble / starvation per stage in the window, plus per-request and microbatch figures."""
    spans = list(spans)
    work_list = None if work_intervals is None else list(work_intervals)
    label, win = resolve_window(spans, work_list, window)
    win_ns = total(win)
    idle = idle_intervals(spans, work_list, window)

    per_stage: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    stalls: list[Stall] = []
    for (stage, rank), (bubbles, starved) in idle.items():
        bubble_ns, starve_ns = total(bubbles), total(starved)
        per_stage[stage].append((win_ns - bubble_ns - starve_ns, bubble_ns, starve_ns))
        stalls.extend(Stall(stage, rank, a, b) for a, b in bubbles)

    stages: list[StageStats] = []
    # Exact fractions: means of means stay exact until the single final rounding to float.
    sum_busy = sum_bubble = sum_starve = Fraction(0)
    for stage, ranks in sorted(per_stage.items()):
        n = len(ranks)
        busy = Fraction(sum(r[0] for r in ranks), n)
        bubble = Fraction(sum(r[1] for r in ranks), n)
        starve = Fraction(sum(r[2] for r in ranks), n)
        stages.append(
            StageStats(
                stage=stage,
                num_tp_ranks=n,
                busy_ns=float(busy),
                bubble_ns=float(bubble),
                starvation_ns=float(starve),
                window_ns=win_ns,
                bubble_fraction=float(bubble / win_ns),
                busy_fraction=float(busy / win_ns),
                starvation_fraction=float(starve / win_ns),
            )
        )
        sum_busy += busy
        sum_bubble += bubble
        sum_starve += starve
    denom = len(stages) * win_ns
    mean_bubble = float(sum_bubble / denom) if denom else 0.0
    mean_busy = float(sum_busy / denom) if denom else 0.0
    mean_starve = float(sum_starve / denom) if denom else 0.0

    per_req = per_request_bubble_ns(spans)
    waits = list(per_req.values())
    tokens = _microbatch_tokens(spans)
    token_counts = [tokens[k] for k in sorted(tokens)]
    # Largest first; ties broken by time then track so the order is deterministic.
    stalls.sort(key=lambda s: (-s.duration_ns, s.start_ns, s.stage, s.tp_rank))

    return BubbleReport(
        window=label,
        t0_ns=win[0][0],
        t1_ns=win[-1][1],
        window_ns=win_ns,
        stages=tuple(stages),
        mean_bubble_fraction=mean_bubble,
        mean_busy_fraction=mean_busy,
        mean_starvation_fraction=mean_starve,
        per_request_bubble_ns=per_req,
        per_request_bubble_p50_ns=percentile(waits, 50) if waits else None,
        per_request_bubble_p90_ns=percentile(waits, 90) if waits else None,
        per_request_bubble_p99_ns=percentile(waits, 99) if waits else None,
        num_microbatches=len(token_counts),
        microbatch_token_mean=math.fsum(token_counts) / len(token_counts) if token_counts else None,
        microbatch_token_cv=_cv(token_counts),
        compute_time_cv=_compute_time_cv(spans),
        worst_stalls=tuple(stalls[:NUM_WORST_STALLS]),
    )


def gpipe_bubble_fraction(p: int, m: int) -> float:
    """GPipe's bubble fraction for p stages and m equal microbatches: (p-1)/(m+p-1)."""
    if p < 1 or m < 1:
        raise ValueError(f"gpipe_bubble_fraction needs p >= 1 and m >= 1, got p={p} m={m}")
    return (p - 1) / (m + p - 1)
