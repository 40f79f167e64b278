"""Chrome trace export: schema validity, layout, broken-trace detection, exact round trip."""

from __future__ import annotations

import copy
import json

import pytest

from ppserve.metrics.bubbles import bubble_report
from ppserve.metrics.spans import Span
from ppserve.metrics.trace import (
    load_chrome_trace,
    save_chrome_trace,
    to_chrome_trace,
    validate_chrome_trace,
)

US = 1000  # ns per µs


def pipeline_spans(p: int = 3, m: int = 4, d: int = 10 * US, tp: int = 2) -> list[Span]:
    """A GPipe-like run with recv waits, sends, skewed tp ranks, a gap and an engine track."""
    spans: list[Span] = []
    for j in range(m):
        gap = 50 * US if j >= 2 else 0  # no work for a while between the 2nd and 3rd microbatch
        spans.append(Span("schedule", j * d + gap, j * d + gap + 1 * US, -1, 0, j))
        for s in range(p):
            for r in range(tp):
                start = (s + j) * d + gap + 1 * US
                end = start + d - 2 * US - r * 333  # ranks end at slightly different times
                tags = dict(num_prefill_tokens=3 * j, num_decode_tokens=2, request_ids=(f"req{j}", "shared"))
                if s > 0:
                    spans.append(Span("recv_wait", start - 1 * US, start, s, r, j))
                spans.append(Span("compute", start, end, s, r, j, **tags))
                spans.append(Span("send", end, end + 1 * US, s, r, j))
    return spans


def work_for(spans: list[Span]) -> list[tuple[int, int]]:
    return [(0, 40 * US), (55 * US, max(s.end_ns for s in spans))]


def events(trace, ph=None, name=None, cat=None):
    return [
        e
        for e in trace["traceEvents"]
        if (ph is None or e["ph"] == ph)
        and (name is None or e.get("name") == name)
        and (cat is None or e.get("cat") == cat)
    ]


def test_generated_trace_is_valid_and_json():
    spans = pipeline_spans()
    counters = [
        ("queue depth", 0, {"waiting": 3}),
        ("in flight", 5 * US, {"microbatches": 2, "kv_blocks": 17}),
    ]
    trace = to_chrome_trace(spans, work_for(spans), counters=counters)
    assert validate_chrome_trace(trace) == []
    json.dumps(trace)  # serializable as is


def test_track_layout_and_names():
    spans = pipeline_spans(p=2, m=2, tp=2)
    trace = to_chrome_trace(spans, work_for(spans))
    names = {e["tid"]: e["args"]["name"] for e in events(trace, ph="M", name="thread_name")}
    assert events(trace, ph="M", name="process_name")[0]["args"]["name"] == "pipeline"
    assert set(names.values()) == {
        "scheduler",
        "engine work",
        "stage 0 / tp 0",
        "stage 0 / tp 1",
        "stage 1 / tp 0",
        "stage 1 / tp 0 recv",
        "stage 1 / tp 1",
        "stage 1 / tp 1 recv",
    }
    assert all(isinstance(t, int) for t in names)
    by_name = {v: k for k, v in names.items()}
    # compute/send of stage 1 tp 1 on its track, recv_wait on the sub-track, bubbles on the main one
    for e in events(trace, ph="X"):
        span = e["args"].get("span")
        if span and span["stage"] == 1 and span["tp_rank"] == 1:
            want = "stage 1 / tp 1 recv" if span["kind"] == "recv_wait" else "stage 1 / tp 1"
            assert e["tid"] == by_name[want]
    assert any(e["tid"] == by_name["stage 1 / tp 1"] for e in events(trace, ph="X", name="bubble"))
    assert all(e["cat"] == "bubble" for e in events(trace, name="starvation"))


def test_span_events_carry_args_and_microseconds():
    spans = [Span("compute", 2500, 7500, 0, 0, 9, 4, 1, ("a", "b"))]
    (e,) = events(to_chrome_trace(spans), ph="X", cat="compute")
    assert (e["ts"], e["dur"]) == (2.5, 5.0)
    assert e["args"]["step_id"] == 9
    assert e["args"]["request_ids"] == ["a", "b"]
    assert (e["args"]["num_prefill_tokens"], e["args"]["num_decode_tokens"]) == (4, 1)


def test_speculated_spans_carry_drafts_and_accepted_and_round_trip(tmp_path):
    spans = [Span("schedule", 0, 1000, -1, 0, 3, 0, 2, ("a", "b"), num_draft_tokens=5,
                  num_accepted_tokens=2),
             Span("compute", 2000, 7000, 0, 0, 3, 0, 7, ("a", "b"), num_draft_tokens=5),
             Span("compute", 8000, 9000, 0, 0, 4, 0, 2, ("a", "b"))]
    trace = to_chrome_trace(spans)
    by_span = {json.dumps(e["args"]["span"]): e for e in events(trace, ph="X") if "span" in e["args"]}
    sched, drafted, plain = (by_span[json.dumps(s.to_dict())] for s in spans)
    assert (sched["args"]["num_draft_tokens"], sched["args"]["num_accepted_tokens"]) == (5, 2)
    assert drafted["args"]["num_draft_tokens"] == 5 and "num_accepted_tokens" not in drafted["args"]
    assert "num_draft_tokens" not in plain["args"] and "num_draft_tokens" not in spans[2].to_dict()
    path = tmp_path / "t.json"
    save_chrome_trace(path, spans)
    assert load_chrome_trace(path)[0] == spans


def test_flows_link_consecutive_stages():
    p, m = 3, 4
    trace = to_chrome_trace(pipeline_spans(p=p, m=m))
    starts, finishes = events(trace, ph="s"), events(trace, ph="f")
    assert len(starts) == len(finishes) == m * (p - 1)
    assert {e["id"] for e in starts} == {e["id"] for e in finishes}
    assert all(e["bp"] == "e" for e in finishes)
    for s, f in zip(starts, finishes, strict=True):
        assert s["id"] == f["id"] and s["ts"] <= f["ts"]


def test_counters():
    trace = to_chrome_trace(pipeline_spans(), counters=[("kv blocks", 3 * US, {"used": 5, "free": 11})])
    (c,) = events(trace, ph="C")
    assert c["ts"] == 3.0 and c["args"] == {"used": 5.0, "free": 11.0}


def test_bubbles_can_be_left_out():
    trace = to_chrome_trace(pipeline_spans(), bubbles=False)
    assert events(trace, cat="bubble") == []
    assert validate_chrome_trace(trace) == []


def test_overlapping_spans_of_one_track_go_to_overflow_tracks():
    spans = [Span("compute", 0, 10 * US, 0, 0, 0), Span("compute", 5 * US, 15 * US, 0, 0, 1)]
    trace = to_chrome_trace(spans)
    assert validate_chrome_trace(trace) == []
    names = {e["args"]["name"] for e in events(trace, ph="M", name="thread_name")}
    assert "stage 0 / tp 0 (overlap 1)" in names


@pytest.mark.parametrize("window", ["all", "active", "steady", (5 * US, 80 * US)])
def test_round_trip_reproduces_bubble_report_exactly(tmp_path, window):
    spans = pipeline_spans()
    work = work_for(spans)
    path = tmp_path / "trace.json"
    save_chrome_trace(path, spans, work, counters=[("queue", 0, {"n": 1})])
    loaded_spans, loaded_work = load_chrome_trace(path)
    assert loaded_spans == spans
    assert loaded_work == work
    assert bubble_report(loaded_spans, loaded_work, window) == bubble_report(spans, work, window)


def test_round_trip_keeps_missing_work_intervals_missing(tmp_path):
    spans = pipeline_spans()
    path = tmp_path / "trace.json"
    save_chrome_trace(path, spans, None)
    loaded_spans, loaded_work = load_chrome_trace(path)
    assert loaded_work is None
    assert bubble_report(loaded_spans, loaded_work) == bubble_report(spans)


# --- the validator catches broken traces ------------------------------------------------------


@pytest.fixture
def good_trace():
    return to_chrome_trace(pipeline_spans(p=2, m=2, tp=1))


def test_validator_flow_without_finish(good_trace):
    bad = copy.deepcopy(good_trace)
    f = events(bad, ph="f")[0]
    bad["traceEvents"].remove(f)
    assert any("finish" in p for p in validate_chrome_trace(bad))


def test_validator_negative_dur(good_trace):
    bad = copy.deepcopy(good_trace)
    events(bad, ph="X")[0]["dur"] = -1.0
    assert any("dur" in p for p in validate_chrome_trace(bad))


def test_validator_overlapping_slices():
    trace = {
        "traceEvents": [
            {"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
            {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1},
            # nesting and a different track are fine
            {"name": "c", "ph": "X", "ts": 1, "dur": 2, "pid": 1, "tid": 1},
            {"name": "d", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 2},
        ]
    }
    problems = validate_chrome_trace(trace)
    assert len(problems) == 1 and "without nesting" in problems[0]


def test_validator_missing_fields():
    trace = {
        "traceEvents": [
            {"name": "a", "ph": "X", "dur": 1, "pid": 1, "tid": 1},
            {"name": "b", "ph": "X", "ts": 0, "dur": 1, "pid": 1},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "x"}},
            {"name": "c", "ph": "?", "ts": 0, "pid": 1, "tid": 1},
        ]
    }
    problems = validate_chrome_trace(trace)
    assert len(problems) == 3
    assert validate_chrome_trace({}) == ["trace has no traceEvents list"]
