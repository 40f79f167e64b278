"""Chrome trace event JSON export of spans, bubbles and counters (opens in Perfetto UI and chrome://tracing).

Layout: one process "pipeline" (pid 1). Tracks (threads), in this order:
- "scheduler": engine-track spans (stage -1), then "engine work" with one "work" slice per work interval;
- per (stage, tp rank): "stage S / tp R" holding prepare, compute and send slices plus "bubble" and
  "starvation" slices (category "bubble"; both are idle time, so they never overlap a busy slice),
  and "stage S / tp R recv" holding recv_wait slices. recv_wait gets its own track because waiting
  for input overlaps idle time (and, with async receives, compute) and slices on one track must nest.
  `NESTED_KINDS` slices (grammar_mask) sit one level inside the span containing them (its prepare);
  one that nothing contains goes to an overflow track, off the idle slices it would overlap.
  If spans of one track still overlap without nesting, the later ones go to overflow tracks
  "... (overlap k)" rather than being clipped, so nothing is hidden.
Flow arrows ("s"/"f", one id per hop) follow each microbatch's compute from stage s to s+1.
Counters ("C") come from the caller. Speculated microbatches' slices carry `num_draft_tokens` in args.

Round trip: each span slice carries its raw span dict in `args["span"]` and the work intervals sit
in `otherData["ppserve"]`, so `load_chrome_trace` recovers the exact inputs of the bubble math.
Timestamps are microseconds (floats) on the engine clock.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from ppserve.metrics.bubbles import Window, idle_intervals
from ppserve.metrics.spans import ENGINE_STAGE, Span, WorkInterval

__all__ = ["to_chrome_trace", "save_chrome_trace", "load_chrome_trace", "validate_chrome_trace",
           "NESTED_KINDS"]

PID = 1
FORMAT_VERSION = 1
# Slices whose ends differ by less than this (µs) are treated as touching, not overlapping:
# ns -> µs float conversion can move an end by an ulp.
_EPS_US = 1e-3

Counter = tuple[str, int, dict[str, float]]
# Kinds drawn one level inside the span of their track that contains them (not busy kinds of their own).
NESTED_KINDS: frozenset[str] = frozenset({"grammar_mask"})


def _us(ns: int) -> float:
    return ns / 1000.0


def _lanes(items: list[tuple[int, int, Any]],
           nested: Container[Any] = ()) -> list[list[tuple[int, int, Any]]]:
    """Split (start, end, payload) items into lanes whose items never overlap (first fit, by start), except
    that an item whose payload is in `nested` may sit inside its lane's last top-level item (one level
    down, not overlapping the lane's other nested items). A nested item that nothing contains opens or
    joins a lane after the first: the first lane's track also holds the idle slices, which it would
    overlap."""
    lanes: list[list[tuple[int, int, Any]]] = []
    ends: list[int] = []  # each lane's top-level end
    parents: list[tuple[int, int]] = []  # each lane's last top-level item
    inner_ends: list[int] = []  # each lane's last nested end
    # Containers before what starts with them inside: at one start, top-level items first.
    for item in sorted(items, key=lambda x: (x[0], x[2] in nested, x[1])):
        start, end, payload = item
        inner = payload in nested
        for k in range(len(lanes)):
            if inner and parents[k][0] <= start and end <= parents[k][1] and start >= inner_ends[k]:
                inner_ends[k] = end
            elif start >= ends[k] and (not inner or k > 0):
                ends[k], parents[k], inner_ends[k] = end, (start, end), start
            else:
                continue
            lanes[k].append(item)
            break
        else:
            if inner and not lanes:  # keep the first lane for the top-level items
                lanes.append([])
                ends.append(start)
                parents.append((start, start))
                inner_ends.append(start)
            lanes.append([item])
            ends.append(end)
            parents.append((start, end))
            inner_ends.append(start)
    return lanes


def _slice(name: str, cat: str, start_ns: int, end_ns: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    start = _us(start_ns)
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": start,
        # Computed from the rounded ends so that ts + dur lands on the next slice's ts.
        "dur": max(0.0, _us(end_ns) - start),
        "pid": PID,
        "tid": tid,
        "args": args,
    }


def to_chrome_trace(
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None = None,
    counters: Iterable[Counter] = (),
    bubbles: bool = True,
    bubble_window: Window = "all",
) -> dict[str, Any]:
    """Build a Chrome trace (JSON object format) from spans, work intervals and counters.

    `bubble_window` chooses where bubble / starvation slices are drawn (default: the whole run).
    """
    spans = list(spans)
    work = None if work_intervals is None else [(int(a), int(b)) for a, b in work_intervals]
    groups = _group_by_track(spans)
    idle = _idle_slices(spans, work, bubble_window) if bubbles else {}
    for stage, rank in idle:  # a stage track that only idled still gets drawn
        groups.setdefault((stage, rank, "main"), [])
    tracks = _Tracks()
    nested = {idx for idx, s in enumerate(spans) if s.kind in NESTED_KINDS}
    slices = _lay_out_tracks(tracks, groups, work, idle, nested)
    slices += _span_slices(spans, tracks.span_tid)
    slices += _flow_arrows(spans, tracks.span_tid)
    slices += _counter_events(counters)
    return {"traceEvents": tracks.events + slices, "displayTimeUnit": "ns", "otherData": _other_data(work)}


TrackKey = tuple[int, int, str]  # (stage, tp rank, "main" | "recv"); the engine track is stage -1
Item = tuple[int, int, int]  # (start ns, end ns, index of the span)
IdleSlice = tuple[str, int, int]  # ("bubble" | "starvation", start ns, end ns)


def _group_by_track(spans: Sequence[Span]) -> dict[TrackKey, list[Item]]:
    """The spans of each logical track; recv_wait has its own, as it overlaps idle time and compute."""
    groups: dict[TrackKey, list[Item]] = defaultdict(list)
    for idx, s in enumerate(spans):
        sub = "recv" if s.kind == "recv_wait" else "main"
        stage = s.stage if s.stage >= 0 else ENGINE_STAGE
        groups[(stage, s.tp_rank if stage >= 0 else 0, sub)].append((s.start_ns, s.end_ns, idx))
    return groups


def _idle_slices(
    spans: Sequence[Span], work: list[WorkInterval] | None, window: Window
) -> dict[tuple[int, int], list[IdleSlice]]:
    """Per (stage, tp rank): its bubble then its starvation intervals, from the bubble math itself."""
    if not any(s.stage >= 0 for s in spans):
        return {}  # an engine-only trace has no stage to be idle
    return {
        key: [("bubble", a, b) for a, b in bub] + [("starvation", a, b) for a, b in starve]
        for key, (bub, starve) in idle_intervals(spans, work, window).items()
    }


class _Tracks:
    """Hands out track ids in display order, with their metadata events, and records each span's track."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": 0, "args": {"name": "pipeline"}},
        ]
        self.span_tid: dict[int, int] = {}
        self._last_tid = 0

    def new(self, name: str) -> int:
        """A new track named `name`, sorted after every track made before it."""
        self._last_tid += 1
        tid = self._last_tid
        self.events.append(
            {"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": tid, "args": {"name": name}}
        )
        self.events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "ts": 0,
                "pid": PID,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
        return tid

    def place(self, name: str, items: list[Item], nested: Container[int] = ()) -> int:
        """Give each lane of `items` a track (overflow lanes "... (overlap k)"); returns the first lane's
        tid. The spans whose indices are in `nested` nest inside their lane's spans (`_lanes`)."""
        lanes = _lanes(items, nested) or [[]]
        first = self.new(name)
        for k, lane in enumerate(lanes):
            tid = first if k == 0 else self.new(f"{name} (overlap {k})")
            for _, _, idx in lane:
                self.span_tid[idx] = tid
        return first


def _lay_out_tracks(
    tracks: _Tracks,
    groups: dict[TrackKey, list[Item]],
    work: list[WorkInterval] | None,
    idle: dict[tuple[int, int], list[IdleSlice]],
    nested: Container[int] = (),
) -> list[dict[str, Any]]:
    """Make the tracks in display order (scheduler, engine work, stages); returns the work and idle slices."""
    slices: list[dict[str, Any]] = []
    tracks.place("scheduler", groups.pop((ENGINE_STAGE, 0, "main"), []))
    if (ENGINE_STAGE, 0, "recv") in groups:
        tracks.place("scheduler recv", groups.pop((ENGINE_STAGE, 0, "recv")))
    if work:
        work_tid = tracks.new("engine work")
        for a, b in work:
            slices.append(_slice("work", "work", a, b, work_tid, {}))
    for stage, rank in sorted({(k[0], k[1]) for k in groups}):
        name = f"stage {stage} / tp {rank}"
        main_tid = tracks.place(name, groups.get((stage, rank, "main"), []), nested)
        for bname, a, b in idle.get((stage, rank), []):
            slices.append(_slice(bname, "bubble", a, b, main_tid, {"stage": stage, "tp_rank": rank}))
        if groups.get((stage, rank, "recv")):
            tracks.place(f"{name} recv", groups[(stage, rank, "recv")])
    return slices


# A span slice's args: these fields of its span (drafts only where it speculated), then the raw span.
_ARG_KEYS = ("step_id", "num_prefill_tokens", "num_decode_tokens", "request_ids", "num_draft_tokens",
             "num_accepted_tokens")


def _span_args(s: Span) -> dict[str, Any]:
    raw = s.to_dict()
    args: dict[str, Any] = {k: raw[k] for k in _ARG_KEYS if k in raw}
    args["span"] = raw
    return args


def _span_slices(spans: Sequence[Span], span_tid: dict[int, int]) -> list[dict[str, Any]]:
    """One slice per span, in span order, carrying the raw span so `load_chrome_trace` gets it back."""
    return [_slice(s.kind, s.kind, s.start_ns, s.end_ns, span_tid[idx], _span_args(s))
            for idx, s in enumerate(spans)]


def _first_rank_compute(spans: Sequence[Span]) -> dict[int, dict[int, int]]:
    """step_id -> stage -> index of that stage's compute span on its lowest tp rank."""
    compute: dict[int, dict[int, int]] = defaultdict(dict)
    for idx, s in enumerate(spans):
        if s.kind == "compute" and s.stage >= 0:
            prev = compute[s.step_id].get(s.stage)
            if prev is None or s.tp_rank < spans[prev].tp_rank:
                compute[s.step_id][s.stage] = idx
    return compute


def _flow_arrows(spans: Sequence[Span], span_tid: dict[int, int]) -> list[dict[str, Any]]:
    """One arrow per hop of a microbatch, from its compute on stage s to its compute on stage s+1.

    The start sits just inside the source slice's end so that it binds to that slice.
    """
    compute = _first_rank_compute(spans)
    events: list[dict[str, Any]] = []
    flow_id = 0
    for step in sorted(compute):
        by_stage = compute[step]
        for stage in sorted(by_stage):
            if stage + 1 not in by_stage:
                continue
            src, dst = spans[by_stage[stage]], spans[by_stage[stage + 1]]
            flow_id += 1
            name = f"microbatch {step}"
            src_ts = _us(max(src.start_ns, src.end_ns - 1))
            events.append(
                {
                    "name": name,
                    "cat": "flow",
                    "ph": "s",
                    "id": flow_id,
                    "ts": src_ts,
                    "pid": PID,
                    "tid": span_tid[by_stage[stage]],
                }
            )
            events.append(
                {
                    "name": name,
                    "cat": "flow",
                    "ph": "f",
                    "bp": "e",
                    "id": flow_id,
                    "ts": _us(dst.start_ns),
                    "pid": PID,
                    "tid": span_tid[by_stage[stage + 1]],
                }
            )
    return events


def _counter_events(counters: Iterable[Counter]) -> list[dict[str, Any]]:
    """The caller's counters (queue depth, KV blocks, ...) as "C" events on the process."""
    return [
        {
            "name": name,
            "ph": "C",
            "ts": _us(int(t_ns)),
            "pid": PID,
            "tid": 0,
            "args": {k: float(v) for k, v in values.items()},
        }
        for name, t_ns, values in counters
    ]


def _other_data(work: list[WorkInterval] | None) -> dict[str, Any]:
    """What the trace carries besides its events: the format and the work intervals, for the round trip."""
    return {
        "ppserve": {
            "format": FORMAT_VERSION,
            "clock": "engine ns; ts/dur in µs",
            # None (not []) when the engine reported none: the bubble math treats them differently.
            "work_intervals": None if work is None else [list(w) for w in work],
        }
    }


def save_chrome_trace(
    path: str | os.PathLike[str],
    spans: Sequence[Span],
    work_intervals: Iterable[WorkInterval] | None = None,
    counters: Iterable[Counter] = (),
    bubbles: bool = True,
    bubble_window: Window = "all",
) -> dict[str, Any]:
    """Write `to_chrome_trace(...)` as JSON to `path` and return it."""
    trace = to_chrome_trace(spans, work_intervals, counters, bubbles, bubble_window)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    return trace


def load_chrome_trace(path: str | os.PathLike[str]) -> tuple[list[Span], list[WorkInterval] | None]:
    """Recover the raw spans (in their original order) and work intervals from a saved trace."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    spans = [
        Span.from_dict(e["args"]["span"])
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and isinstance(e.get("args"), dict) and "span" in e["args"]
    ]
    raw = trace.get("otherData", {}).get("ppserve", {}).get("work_intervals")
    work = None if raw is None else [(int(a), int(b)) for a, b in raw]
    return spans, work


_KNOWN_PHASES = frozenset("BEXiIbneCsftPNODMRcV(),T")


def validate_chrome_trace(trace: dict[str, Any] | list[Any]) -> list[str]:
    """Schema problems of a Chrome trace; an empty list means it is well formed.

    Checks: every event has ph, ts, pid, tid (M events may have ts 0); X events have dur >= 0;
    every flow start "s" has a finish "f" with the same id and vice versa; X slices on one
    (pid, tid) track nest (each either contains or follows the others).
    """
    problems: list[str] = []
    events = trace if isinstance(trace, list) else trace.get("traceEvents")
    if not isinstance(events, list):
        return ["trace has no traceEvents list"]
    flow_starts: dict[Any, int] = defaultdict(int)
    flow_ends: dict[Any, int] = defaultdict(int)
    tracks: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object")
            continue
        ph = e.get("ph")
        if ph not in _KNOWN_PHASES:
            problems.append(f"event {i} has unknown ph {ph!r}")
            continue
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int):
                problems.append(f"event {i} ({ph} {e.get('name')!r}) has no integer {key}")
        ts = e.get("ts", 0 if ph == "M" else None)
        if not isinstance(ts, (int, float)):
            problems.append(f"event {i} ({ph} {e.get('name')!r}) has no numeric ts")
            continue
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"event {i} (X {e.get('name')!r}) has bad dur {dur!r}")
                continue
            tracks[(e.get("pid"), e.get("tid"))].append(
                (float(ts), float(ts) + float(dur), str(e.get("name")))
            )
        elif ph in ("s", "f"):
            if "id" not in e:
                problems.append(f"event {i} (flow {ph}) has no id")
                continue
            (flow_starts if ph == "s" else flow_ends)[e["id"]] += 1
    for fid, n in flow_starts.items():
        if flow_ends.get(fid, 0) != n:
            problems.append(f"flow id {fid!r}: {n} start(s) but {flow_ends.get(fid, 0)} finish(es)")
    for fid in flow_ends:
        if fid not in flow_starts:
            problems.append(f"flow id {fid!r} finishes but never starts")
    for (pid, tid), slices in tracks.items():
        # Longest first at equal start, so a parent comes before the children it contains.
        slices.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float, str]] = []
        for start, end, name in slices:
            while stack and start >= stack[-1][1] - _EPS_US:
                stack.pop()
            if stack and end > stack[-1][1] + _EPS_US:
                top = stack[-1]
                problems.append(
                    f"track pid={pid} tid={tid}: slice {name!r} [{start}, {end}] overlaps "
                    f"{top[2]!r} [{top[0]}, {top[1]}] without nesting"
                )
                continue
            stack.append((start, end, name))
    return problems
