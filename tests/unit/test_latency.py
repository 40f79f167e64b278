"""Serving latency metrics: exact values on hand-made request timelines, percentile definition."""

from __future__ import annotations

import pytest

from ppserve.metrics.latency import RequestTiming, percentile, stats, summarize


def test_percentile_linear_interpolation():
    v = [10.0, 20.0, 30.0, 40.0]
    assert percentile(v, 0) == 10
    assert percentile(v, 100) == 40
    assert percentile(v, 50) == 25  # rank 1.5
    assert percentile(v, 90) == pytest.approx(37)  # rank 2.7
    assert percentile([3, 1, 2], 50) == 2  # unsorted input
    assert percentile([7], 99) == 7


def test_percentile_matches_numpy_linear_on_examples():
    # Values computed by hand with numpy's default method (rank = q/100 * (n-1)).
    v = [1, 2, 3, 4, 5, 6, 7, 8, 9, 100]
    assert percentile(v, 99) == pytest.approx(9 + 0.91 * 91)
    assert percentile(v, 10) == pytest.approx(1.9)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_request_timing_metrics():
    t = RequestTiming(arrival_s=1.0, first_scheduled_s=1.5, token_times_s=[2.0, 2.25, 2.75, 3.0])
    assert t.ttft_s == 1.0
    assert t.scheduling_delay_s == 0.5
    assert t.tbt_gaps_s == [0.25, 0.5, 0.25]
    assert t.tpot_s == pytest.approx(1.0 / 3)
    assert t.e2e_s == 2.0


def test_request_timing_edge_cases():
    none = RequestTiming(arrival_s=0.0, first_scheduled_s=None)
    assert (none.ttft_s, none.tpot_s, none.scheduling_delay_s, none.tbt_gaps_s) == (None, None, None, [])
    one = RequestTiming(arrival_s=0.0, first_scheduled_s=0.0, token_times_s=[0.5])
    assert (one.ttft_s, one.tpot_s, one.tbt_gaps_s) == (0.5, None, [])


def test_summarize_pools_tbt_gaps_over_requests():
    timings = [
        RequestTiming(0.0, 0.0, [1.0, 2.0, 3.0]),  # gaps 1, 1
        RequestTiming(0.0, 1.0, [4.0, 8.0]),  # gap 4
        RequestTiming(2.0, None, []),  # not scheduled yet
    ]
    s = summarize(timings)
    assert s["num_requests"] == 3 and s["num_output_tokens"] == 5
    assert s["ttft_s"]["count"] == 2 and s["ttft_s"]["mean"] == 2.5
    assert s["tbt_s"]["count"] == 3
    assert s["tbt_s"]["p50"] == 1.0
    assert s["tbt_s"]["mean"] == 2.0
    assert s["tbt_s"]["p99"] == pytest.approx(1 + 0.98 * 3)
    assert s["tpot_s"]["mean"] == 2.5
    assert s["scheduling_delay_s"]["p50"] == 0.5
    assert s["e2e_s"]["max"] == 8.0


def test_stats_of_nothing():
    assert stats([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    assert summarize([])["ttft_s"]["count"] == 0
