"""The start-up step-cost prior (worker/startup_cost.py): the shapes a stage times and the fit over them."""

from __future__ import annotations

import pytest

from ppserve.sched.cost import StepCost, features
from ppserve.worker.startup_cost import fit_startup_cost, startup_shapes


def test_startup_shapes_are_decodes_two_chunks_and_a_mix():
    shapes = startup_shapes(cached=9, chunk=16, seqs=3)
    assert shapes == [
        ([1], [10]),  # one decode
        ([1, 1, 1], [10, 10, 10]),  # the scheduler's decodes
        ([8], [17]),  # half a chunk
        ([16], [25]),  # a chunk
        ([8, 1, 1, 1], [17, 10, 10, 10]),  # the half chunk beside the decodes
    ]
    assert len(startup_shapes(cached=9, chunk=2, seqs=1)) == 4  # a chunk of two has no smaller half


def _timed(cost: StepCost, cached: int, chunk: int, seqs: int):
    out = []
    for q, n in startup_shapes(cached, chunk, seqs):
        chunks = [(a, b - a) for a, b in zip(q, n, strict=True)]
        out.append((chunks, len(q), cost.of_features(features(chunks, len(q)))))
    return out


@pytest.mark.parametrize("cost", [StepCost(2e-3, 1e-4, 1e-8, 0.0, 5e-4),  # a CPU-like last stage
                                  StepCost(4e-3, 4e-5, 1e-9, 0.0, 0.0)])  # a GPU-like middle stage
def test_the_fit_predicts_serving_shapes_it_did_not_time(cost):
    """Timed exactly, the fit prices the shapes it saw and, what matters to the scheduler, a mixed step
    it did not see (a longer chunk after a longer context beside more decodes) within a few percent."""
    fit = fit_startup_cost(_timed(cost, cached=33, chunk=64, seqs=16))
    for chunks, sampled, seconds in _timed(cost, cached=33, chunk=64, seqs=16):
        assert fit.of_features(features(chunks, sampled)) == pytest.approx(seconds, rel=0.02)
    unseen = [(96, 200)] + [(1, 300)] * 24
    want, got = cost.of_features(features(unseen, 25)), fit.of_features(features(unseen, 25))
    assert got == pytest.approx(want, rel=0.05)
    assert fit.floor_s == pytest.approx(cost.floor_s, rel=0.05)
