"""Control-plane latency from spans (metrics/control_plane.py): dispatch, stage-to-stage hop, turnaround."""

from __future__ import annotations

import pytest

from ppserve.metrics import control_plane_latency
from ppserve.metrics.spans import ENGINE_STAGE, Span

MS = 1_000_000


def test_gaps_on_a_hand_built_two_stage_timeline():
    spans = [
        # step 0: scheduled 0-1, stage 0 at 2-12, stage 1 at 13-23; step 1 scheduled 1-2, stage 0 busy until 12
        Span("schedule", 0, 1 * MS, ENGINE_STAGE, 0, 0),
        Span("schedule", 1 * MS, 2 * MS, ENGINE_STAGE, 0, 1),
        Span("compute", 2 * MS, 12 * MS, 0, 0, 0),
        Span("compute", 13 * MS, 23 * MS, 1, 0, 0),
        Span("compute", 12 * MS + MS // 2, 22 * MS, 0, 0, 1),  # waits for stage 0: only 0.5 ms is dispatch
        Span("compute", 25 * MS, 35 * MS, 1, 0, 1),  # stage 1 free at 23, data at 22: a 2 ms hop
        Span("schedule", 24 * MS, 25 * MS, ENGINE_STAGE, 0, 2),  # 1 ms after step 0 left stage 1
        Span("compute", 25 * MS, 30 * MS, 0, 0, 2),
        Span("compute", 12 * MS, 22 * MS, 1, 1, 1),  # another TP rank: ignored
    ]
    got = control_plane_latency(spans)
    assert got["dispatch"]["count"] == 3
    assert got["dispatch"]["p50_s"] == pytest.approx(0.0005)  # gaps 1 ms, 0.5 ms (after stage 0 was free), 0
    assert got["hop"]["count"] == 2
    assert got["hop"]["p50_s"] == pytest.approx(0.0015)  # 1 ms and 2 ms
    assert got["turnaround"]["count"] == 1  # step 1 leaves stage 1 at 35 ms and nothing is scheduled after
    assert got["turnaround"]["p50_s"] == pytest.approx(0.001)


def test_no_spans_gives_empty_figures():
    got = control_plane_latency([])
    assert got == {k: {"count": 0, "p50_s": None, "p90_s": None} for k in ("dispatch", "hop", "turnaround")}
