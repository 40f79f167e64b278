"""Control-plane latency from spans (metrics/control_plane.py): dispatch, stage-to-stage hop, turnaround."""

from __future__ import annotations

import pytest

from ppserve.metrics import control_plane_latency
from ppserve.metrics.control_plane import FIGURES
from ppserve.metrics.spans import ENGINE_STAGE, Span

MS = 1_000_000


def test_gaps_on_a_hand_built_two_stage_timeline():
    spans = [
        # step 0: scheduled 0-1, stage 0 at 2-12, stage 1 at 13-23; step 1 scheduled 1-2,
        # stage 0 busy until 12
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
    assert got == {k: {"count": 0, "p50_s": None, "p90_s": None} for k in FIGURES}


def test_a_microbatch_on_the_token_ring_waits_for_its_tokens_not_for_the_dispatch():
    """Two stages, two decode groups (a, b) and the ring's third microbatch: step 2 carries group a's next
    token, formed (3-4) while step 0 was still on stage 1. Stage 0 is free at 20 and starts step 2 at
    25.5, 0.5 ms after step 0 left stage 1 at 25: a ring gap of 0.5 ms, not a 5.5 ms dispatch; and the
    engine's schedule at 26 forms step 3 ahead, on the ring (group b's tokens from step 1), so it is no
    turnaround of step 0. A prompt's next chunk that follows its previous one (step 5 after step 4, both
    carrying p) starts on stage 0 before step 4 leaves stage 1: formed ahead, no ring time, dispatch."""
    a, b, p = ("a1", "a2"), ("b1",), ("p",)
    spans = [
        Span("schedule", 0, 1 * MS, ENGINE_STAGE, 0, 0),
        Span("schedule", 1 * MS, 2 * MS, ENGINE_STAGE, 0, 1),
        Span("schedule", 3 * MS, 4 * MS, ENGINE_STAGE, 0, 2),
        Span("compute", 1 * MS, 11 * MS, 0, 0, 0, request_ids=a),
        Span("compute", 11 * MS, 20 * MS, 0, 0, 1, request_ids=b),
        Span("compute", 12 * MS, 25 * MS, 1, 0, 0, request_ids=a),
        Span("compute", 25 * MS + MS // 2, 35 * MS, 0, 0, 2, request_ids=a),
        Span("compute", 25 * MS + MS // 5, 38 * MS, 1, 0, 1, request_ids=b),
        Span("schedule", 26 * MS, 27 * MS, ENGINE_STAGE, 0, 3),
        Span("compute", 38 * MS + MS // 2, 48 * MS, 0, 0, 3, request_ids=b),
        Span("compute", 38 * MS, 50 * MS, 1, 0, 2, request_ids=a),
        Span("compute", 50 * MS, 60 * MS, 1, 0, 3, request_ids=b),
        Span("schedule", 47 * MS, 48 * MS, ENGINE_STAGE, 0, 4),
        Span("compute", 48 * MS, 58 * MS, 0, 0, 4, request_ids=p),
        Span("schedule", 49 * MS, 50 * MS, ENGINE_STAGE, 0, 5),
        Span("compute", 60 * MS, 70 * MS, 1, 0, 4, request_ids=p),
        Span("compute", 58 * MS, 68 * MS, 0, 0, 5, request_ids=p),
        Span("compute", 70 * MS, 80 * MS, 1, 0, 5, request_ids=p),
    ]
    got = control_plane_latency(spans)
    assert got["ring"]["count"] == 2  # steps 2 and 3
    assert got["ring"]["p50_s"] == pytest.approx(0.0005)  # 25 -> 25.5 and 38 -> 38.5
    # dispatch: step 0 (0), step 1 (stage 0 free at 11: 0), step 4 (0), step 5 (stage 0 free at 58: 0)
    assert got["dispatch"]["count"] == 4 and got["dispatch"]["p50_s"] == 0
    # turnaround: step 0 leaves stage 1 at 25 -> schedule 26 forms step 3 ahead: not counted; step 1 at 38
    # -> 47 forms step 4, a new prompt, while steps 2 and 3 are on the stages: the ring's extra slot, which
    # the ring's clock formed when stage 0 was about to be free (48), not a turnaround; steps 2-5 end at 50,
    # 60, 70, 80: nothing scheduled after 49
    assert got["turnaround"]["count"] == 0


def test_a_formation_after_a_result_with_a_free_stage_slot_is_a_turnaround_under_the_ring_too():
    """The same two stages with one decode group on the ring: when step 0 leaves stage 1 at 20, only step 1
    (its next step, formed ahead) is on the stages, so the schedule at 21 for a new prompt's step 2 used a
    free slot: its 1 ms is the turnaround."""
    a, p = ("a",), ("p",)
    spans = [
        Span("schedule", 0, 1 * MS, ENGINE_STAGE, 0, 0),
        Span("compute", 1 * MS, 10 * MS, 0, 0, 0, request_ids=a),
        Span("compute", 10 * MS, 20 * MS, 1, 0, 0, request_ids=a),
        Span("schedule", 5 * MS, 6 * MS, ENGINE_STAGE, 0, 1),
        Span("compute", 20 * MS + MS // 2, 30 * MS, 0, 0, 1, request_ids=a),
        Span("compute", 30 * MS, 40 * MS, 1, 0, 1, request_ids=a),
        Span("schedule", 21 * MS, 22 * MS, ENGINE_STAGE, 0, 2),
        Span("compute", 30 * MS, 40 * MS, 0, 0, 2, request_ids=p),
        Span("compute", 40 * MS, 50 * MS, 1, 0, 2, request_ids=p),
    ]
    got = control_plane_latency(spans)
    assert got["ring"]["count"] == 1  # step 1: 20 -> 20.5
    assert got["turnaround"]["count"] == 1 and got["turnaround"]["p50_s"] == pytest.approx(0.001)


def test_a_schedule_that_comes_after_a_later_result_is_not_the_earlier_results_turnaround():
    """Step 0 leaves stage 1 at 20 and step 1 at 30; the engine schedules step 2 at 31. That schedule
    followed step 1's result (1 ms), not step 0's (11 ms): an engine waiting on the ring's clock or on
    step 1 formed it, whatever step 0's result did."""
    spans = [
        Span("schedule", 0, 1 * MS, ENGINE_STAGE, 0, 0),
        Span("schedule", 1 * MS, 2 * MS, ENGINE_STAGE, 0, 1),
        Span("compute", 1 * MS, 10 * MS, 0, 0, 0),
        Span("compute", 10 * MS, 20 * MS, 1, 0, 0),
        Span("compute", 10 * MS, 20 * MS, 0, 0, 1),
        Span("compute", 20 * MS, 30 * MS, 1, 0, 1),
        Span("schedule", 31 * MS, 32 * MS, ENGINE_STAGE, 0, 2),
        Span("compute", 32 * MS, 40 * MS, 0, 0, 2),
        Span("compute", 40 * MS, 50 * MS, 1, 0, 2),
    ]
    got = control_plane_latency(spans)
    assert got["turnaround"]["count"] == 1 and got["turnaround"]["p50_s"] == pytest.approx(0.001)
