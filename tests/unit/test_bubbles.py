"""Bubble math on synthetic timelines with exactly known answers (GPipe oracle, hand-built cases)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppserve.metrics.bubbles import (
    bubble_fraction_within,
    bubble_report,
    gpipe_bubble_fraction,
    idle_intervals,
    intersect,
    per_request_bubble_ns,
    short_handed,
    subtract,
    total,
    union,
)
from ppserve.metrics.spans import (
    NULL_RECORDER,
    Span,
    SpanRecorder,
    WorkTracker,
    estimate_offset,
    read_jsonl,
    read_work_intervals,
    shift,
    write_jsonl,
)
from tests.unit.imports import assert_imports_without


def compute(stage: int, start: int, end: int, step: int = 0, rank: int = 0, **tags) -> Span:
    return Span("compute", start, end, stage, rank, step, **tags)


def gpipe_spans(p: int, m: int, d: int, tp: int = 1) -> list[Span]:
    """Stage s computes microbatch j during [(s+j)d, (s+j+1)d)."""
    return [
        compute(s, (s + j) * d, (s + j + 1) * d, step=j, rank=r, num_decode_tokens=4, request_ids=(f"r{j}",))
        for s in range(p)
        for j in range(m)
        for r in range(tp)
    ]


# --- interval algebra ------------------------------------------------------------------------


def test_interval_algebra():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7)]
    assert intersect([(0, 4), (5, 10)], [(2, 6), (8, 20)]) == [(2, 4), (5, 6), (8, 10)]
    assert subtract([(0, 10)], [(2, 3), (5, 7), (9, 12)]) == [(0, 2), (3, 5), (7, 9)]
    assert subtract([(0, 3), (4, 8)], [(1, 5)]) == [(0, 1), (5, 8)]
    assert total([(0, 2), (5, 9)]) == 6


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=8),
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=8),
)
def test_interval_algebra_matches_point_sets(a_raw, b_raw):
    def points(ivs):
        return {t for s, e in ivs for t in range(s, e)}

    a, b = union(a_raw), union(b_raw)
    assert points(a) == points(a_raw)
    assert all(x[1] < y[0] for x, y in pairwise(a))  # disjoint, not touching
    assert points(intersect(a, b)) == points(a) & points(b)
    assert points(subtract(a, b)) == points(a) - points(b)


# --- GPipe oracle ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_gpipe_oracle_all_window(p, m):
    d = 1000
    spans = gpipe_spans(p, m, d)
    report = bubble_report(spans, work_intervals=[(0, (m + p - 1) * d)], window="all")
    assert report.window == "all"
    assert report.mean_bubble_fraction == (p - 1) / (m + p - 1) == gpipe_bubble_fraction(p, m)
    assert report.mean_starvation_fraction == 0
    for s in report.stages:
        assert s.busy_ns == m * d
        assert s.bubble_ns == (p - 1) * d
        assert s.window_ns == (m + p - 1) * d


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 3)])
def test_gpipe_oracle_without_work_intervals_and_with_tp(p, m):
    # Without work intervals, "had work" = some stage busy, which covers the whole GPipe run.
    report = bubble_report(gpipe_spans(p, m, 10, tp=2), window="all")
    assert report.mean_bubble_fraction == gpipe_bubble_fraction(p, m)
    assert all(s.num_tp_ranks == 2 for s in report.stages)


def test_gpipe_steady_window_has_no_bubble():
    p, m, d = 4, 10, 7
    report = bubble_report(gpipe_spans(p, m, d), window="steady")
    assert (report.t0_ns, report.t1_ns) == ((p - 1) * d, m * d)
    assert report.mean_bubble_fraction == 0
    assert report.mean_busy_fraction == 1


def test_steady_window_empty_raises():
    with pytest.raises(ValueError, match="steady"):
        bubble_report(gpipe_spans(4, 2, 10), window="steady")


def test_gpipe_formula():
    assert gpipe_bubble_fraction(1, 5) == 0
    assert gpipe_bubble_fraction(4, 4) == 3 / 7
    with pytest.raises(ValueError):
        gpipe_bubble_fraction(0, 3)


# --- hand-built timelines --------------------------------------------------------------------


def one_stage_timeline() -> tuple[list[Span], list[tuple[int, int]]]:
    # compute [0,10) and [30,40), an overlapping send [5,15); the engine had work during [0,20).
    spans = [compute(0, 0, 10), Span("send", 5, 15, 0, 0, 0), compute(0, 30, 40, step=1)]
    return spans, [(0, 20)]


def test_hand_built_all_window_union_not_sum():
    spans, work = one_stage_timeline()
    s = bubble_report(spans, work, window="all").stages[0]
    # busy = |[0,15) ∪ [30,40)| = 25 (the overlap of send and compute counts once)
    assert (s.window_ns, s.busy_ns, s.bubble_ns, s.starvation_ns) == (40, 25, 5, 10)
    assert (s.busy_fraction, s.bubble_fraction, s.starvation_fraction) == (25 / 40, 5 / 40, 10 / 40)


def test_hand_built_explicit_window_clips_spans():
    spans, work = one_stage_timeline()
    r = bubble_report(spans, work, window=(12, 35))
    s = r.stages[0]
    assert r.window == "(12, 35)"
    # busy [12,15)+[30,35) = 8; bubble [15,20) = 5; starvation [20,30) = 10
    assert (s.window_ns, s.busy_ns, s.bubble_ns, s.starvation_ns) == (23, 8, 5, 10)


def test_hand_built_active_window_is_union_of_work():
    spans, _ = one_stage_timeline()
    r = bubble_report(spans, [(0, 20), (25, 32), (30, 35)], window="active")
    s = r.stages[0]
    assert (r.t0_ns, r.t1_ns, r.window_ns) == (0, 35, 30)
    # window [0,20) ∪ [25,35): busy [0,15)+[30,35) = 20, bubble [15,20)+[25,30) = 10
    assert (s.busy_ns, s.bubble_ns, s.starvation_ns) == (20, 10, 0)


def test_active_window_without_work_is_union_of_compute_across_stages():
    spans = [compute(0, 0, 10), compute(1, 10, 20), compute(0, 50, 60, step=1)]
    r = bubble_report(spans, window="active")
    assert r.window_ns == 30
    by_stage = {s.stage: s for s in r.stages}
    assert (by_stage[0].busy_ns, by_stage[0].bubble_ns) == (20, 10)
    assert (by_stage[1].busy_ns, by_stage[1].bubble_ns) == (10, 20)
    # With window "all" the gap [20,50) has no compute anywhere: starvation for both stages.
    r_all = bubble_report(spans, window="all")
    assert [s.starvation_ns for s in r_all.stages] == [30, 30]


def test_recv_wait_is_idle_and_engine_track_is_ignored():
    spans = [
        Span("schedule", 0, 3, -1, 0, 0),
        Span("recv_wait", 0, 5, 0, 0, 0),
        compute(0, 5, 10),
    ]
    r = bubble_report(spans, [(0, 10)], window="all")
    assert [s.stage for s in r.stages] == [0]
    assert (r.stages[0].busy_ns, r.stages[0].bubble_ns) == (5, 5)


def test_tp_ranks_are_averaged():
    spans = [compute(0, 0, 10, rank=0), compute(0, 0, 6, rank=1), compute(1, 0, 10, rank=0)]
    r = bubble_report(spans, [(0, 10)], window=(0, 10))
    s0, s1 = r.stages
    assert (s0.num_tp_ranks, s0.busy_ns, s0.bubble_ns, s0.bubble_fraction) == (2, 8, 2, 0.2)
    assert s1.bubble_fraction == 0
    assert r.mean_bubble_fraction == 0.1


def test_worst_stalls_largest_first():
    spans = [compute(0, 0, 10), compute(0, 13, 20), compute(0, 27, 30), compute(1, 0, 30)]
    r = bubble_report(spans, [(0, 30)], window="all")
    assert [(x.stage, x.start_ns, x.end_ns) for x in r.worst_stalls] == [(0, 20, 27), (0, 10, 13)]
    assert "stall: stage 0 tp 0" in r.format_text()


def test_idle_intervals_split_bubble_and_starvation():
    spans = [compute(0, 0, 10), compute(0, 30, 40)]
    assert idle_intervals(spans, [(0, 20)], "all") == {(0, 0): ([(10, 20)], [(20, 30)])}


# --- per-request bubble and microbatch stats ------------------------------------------------


def per_request_timeline() -> list[Span]:
    return [
        # step 0 carries a and b: waits 5 between stage 0 and 1, 0 between 1 and 2.
        compute(0, 0, 10, step=0, request_ids=("a", "b"), num_prefill_tokens=6, num_decode_tokens=2),
        compute(1, 15, 25, step=0, request_ids=("a", "b")),
        compute(2, 25, 30, step=0, request_ids=("a", "b")),
        # step 1 carries b: waits 7 then 10.
        compute(0, 10, 20, step=1, request_ids=("b",), num_decode_tokens=4),
        compute(1, 27, 30, step=1, request_ids=("b",)),
        compute(2, 40, 45, step=1, request_ids=("b",)),
    ]


def test_per_request_bubble_exact():
    spans = per_request_timeline()
    assert per_request_bubble_ns(spans) == {"a": 5, "b": 22}
    r = bubble_report(spans, window="all")
    assert r.per_request_bubble_ns == {"a": 5, "b": 22}
    assert r.per_request_bubble_p50_ns == 13.5
    assert r.per_request_bubble_p90_ns == 5 + 0.9 * 17
    assert r.per_request_bubble_p99_ns == 5 + 0.99 * 17


def test_per_request_bubble_uses_slowest_tp_rank_to_leave():
    spans = [
        compute(0, 0, 10, rank=0, request_ids=("a",)),
        compute(0, 0, 12, rank=1, request_ids=("a",)),
        compute(1, 15, 20, rank=0, request_ids=("a",)),
        compute(1, 14, 20, rank=1, request_ids=("a",)),
    ]
    assert per_request_bubble_ns(spans) == {"a": 2}


def test_microbatch_token_and_compute_cv():
    r = bubble_report(per_request_timeline(), window="all")
    assert r.num_microbatches == 2
    assert r.microbatch_token_mean == 6
    assert r.microbatch_token_cv == pytest.approx(2 / 6)
    # stage 0: 10 and 10 -> cv 0; stage 1: 10 and 3 -> std 3.5, mean 6.5
    assert r.compute_time_cv[0] == 0
    assert r.compute_time_cv[1] == pytest.approx(3.5 / 6.5)


def test_report_text_and_dict():
    r = bubble_report(gpipe_spans(3, 4, 1_000_000), window="all")
    text = r.format_text()
    assert "window: all" in text
    assert "mean" in text and "33.33%" in text
    d = r.to_dict()
    assert d["window"] == "all" and len(d["stages"]) == 3
    import json

    json.dumps(d)


def test_bad_window():
    with pytest.raises(ValueError, match="window"):
        bubble_report(gpipe_spans(2, 2, 1), window="busy")
    with pytest.raises(ValueError, match="empty"):
        bubble_report(gpipe_spans(2, 2, 1), window=(5, 5))


# --- spans, recorder, clocks, storage ---------------------------------------------------------


def test_span_validation_and_dict_round_trip():
    s = Span("compute", 1, 2, 0, 1, 3, 4, 5, ["x", "y"])
    assert s.request_ids == ("x", "y")
    assert Span.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="kind"):
        Span("comptue", 1, 2, 0, 0, 0)
    with pytest.raises(ValueError, match="before"):
        Span("compute", 2, 1, 0, 0, 0)


def test_recorder_records_with_clock():
    ticks = iter([100, 150, 200, 260])
    rec = SpanRecorder(stage=2, tp_rank=1, clock=lambda: next(ticks))
    with rec.span("compute", step_id=7, num_decode_tokens=3, request_ids=("r",)):
        pass
    with pytest.raises(RuntimeError), rec.span("send", step_id=7):
        raise RuntimeError("boom")
    rec.record("recv_wait", 10, 20, step_id=8)
    spans = rec.drain()
    assert spans == [
        Span("compute", 100, 150, 2, 1, 7, 0, 3, ("r",)),
        Span("send", 200, 260, 2, 1, 7),
        Span("recv_wait", 10, 20, 2, 1, 8),
    ]
    assert rec.drain() == []
    with pytest.raises(ValueError, match="tags"):
        rec.record("compute", 0, 1, 0, color="red")


def test_disabled_recorder_records_nothing():
    def clock() -> int:
        raise AssertionError("a disabled recorder must not read the clock")

    rec = SpanRecorder(0, 0, enabled=False, clock=clock)
    with rec.span("compute", 1):
        pass
    rec.record("compute", 0, 1, 1)
    assert rec.drain() == [] and len(rec) == 0
    with NULL_RECORDER.span("compute", 1):
        pass
    NULL_RECORDER.record("compute", 0, 1, 1)
    assert NULL_RECORDER.drain() == []


def test_shift_and_estimate_offset():
    spans = [compute(0, 10, 20)]
    assert shift(spans, 5) == [compute(0, 15, 25)]
    # Remote clock is 1000 behind; the fastest ping (round trip 4) decides.
    samples = [(0, 1000 - 1000 + 30, 100), (200, 202 - 1000, 204), (300, 330 - 1000, 400)]
    assert estimate_offset(samples) == 1000
    with pytest.raises(ValueError):
        estimate_offset([])


def test_work_tracker():
    w = WorkTracker()
    w.update(False, 0)
    w.update(True, 10)
    w.update(True, 15)
    w.update(False, 20)
    w.update(True, 30)
    assert w.intervals() == [(10, 20)]
    assert w.intervals(now_ns=35) == [(10, 20), (30, 35)]
    assert w.intervals(now_ns=35, since_ns=19) == [(10, 20), (30, 35)]
    assert w.intervals(now_ns=35, since_ns=20) == [(30, 35)]  # only intervals that end after since_ns
    assert w.intervals(since_ns=100) == []


def test_jsonl_round_trip(tmp_path):
    spans = per_request_timeline()
    path = tmp_path / "spans.jsonl"
    write_jsonl(path, spans, [(0, 45)])
    assert read_jsonl(path) == spans
    assert read_work_intervals(path) == [(0, 45)]


def test_import_pulls_in_no_heavy_dependencies():
    assert_imports_without("ppserve.metrics, ppserve.metrics.trace, ppserve.metrics.latency",
                           ("torch", "ray", "grpc", "matplotlib"))


def test_short_handed_is_where_fewer_than_p_requests_were_in_the_system():
    # Three requests over [0, 100): two overlap in [20, 50) and [60, 70) only.
    lifetimes = [(0, 50), (20, 70), (60, 90)]
    assert short_handed(lifetimes, 2, [(0, 100)]) == [(0, 20), (50, 60), (70, 100)]
    assert short_handed(lifetimes, 1, [(0, 100)]) == [(90, 100)]
    assert short_handed(lifetimes, 2, [(30, 40), (55, 80)]) == [(55, 60), (70, 80)]
    assert short_handed([], 2, [(0, 10)]) == [(0, 10)]
    # A request ending where the next one starts leaves no gap of "fewer" between them at p = 1.
    assert short_handed([(0, 10), (10, 20)], 1, [(0, 20)]) == []


def test_bubble_within_splits_the_bubble_report_exactly():
    # Two stages, one lone request decoding in [0, 40), two requests in [40, 100): the lone request's
    # microbatch leaves each stage idle half of its time; the crowded part has one gap on stage 1.
    spans = [compute(0, 0, 10), compute(1, 10, 20), compute(0, 20, 30), compute(1, 30, 40),
             compute(0, 40, 100), compute(1, 50, 80), compute(1, 90, 100)]
    work = [(0, 100)]
    few = short_handed([(0, 100), (40, 100)], 2, [(0, 100)])
    assert few == [(0, 40)]
    rep = bubble_report(spans, work)
    within = bubble_fraction_within(spans, work, "active", few)
    rest = bubble_fraction_within(spans, work, "active", subtract([(0, 100)], few))
    assert within == pytest.approx((20 + 20) / 2 / 100)  # stage 0: 10-20, 30-40; stage 1: 0-10, 20-30
    assert rest == pytest.approx((0 + 20) / 2 / 100)  # stage 1: 40-50, 80-90
    assert within + rest == pytest.approx(rep.mean_bubble_fraction)
