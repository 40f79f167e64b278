"""The start-up step-cost prior (worker/startup_cost.py): the shapes a stage times and the fit over them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ppserve.sched.cost import StepCost, features
from ppserve.worker.startup_cost import (
    LONG_REPEATS,
    REPEATS,
    fit_startup_cost,
    measure_startup_cost,
    startup_shapes,
)


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
    assert startup_shapes(cached=9, chunk=16, seqs=3, long_context=40, long_seqs=2)[5:] == [
        ([8], [48]),  # half a chunk after the long context
        ([16], [56]),  # a chunk after it
        ([1, 1], [41, 41]),  # decodes after it
    ]
    assert len(startup_shapes(cached=9, chunk=16, seqs=3, long_context=9, long_seqs=2)) == 5  # not longer


def _timed(cost: StepCost, cached: int, chunk: int, seqs: int, long_context: int = 0, long_seqs: int = 0,
           noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    out = []
    for q, n in startup_shapes(cached, chunk, seqs, long_context, long_seqs):
        chunks = [(a, b - a) for a, b in zip(q, n, strict=True)]
        seconds = cost.of_features(features(chunks, len(q)))
        out.append((chunks, len(q), seconds * (1 + rng.uniform(0, noise))))  # noise only adds time
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


@pytest.mark.parametrize("cost", [StepCost(2e-3, 1e-4, 1e-8, 3e-8, 5e-4),  # a CPU-like last stage
                                  StepCost(17e-3, 3e-4, 2e-8, 5e-8, 0.0)])  # a CPU-like first stage
def test_the_long_context_shapes_tell_every_coefficient_apart(cost):
    """With a chunk and decodes after a long context, exact times give back every coefficient, a key's
    cost apart from a token's and a decode's sample apart from its token."""
    fit = fit_startup_cost(_timed(cost, cached=33, chunk=64, seqs=16, long_context=512, long_seqs=16))
    for got, want in zip(fit.coefficients, cost.coefficients, strict=True):
        assert got == pytest.approx(want, rel=0.02, abs=1e-7)  # the ridge leaves a zero at ~1e-8


def test_timing_noise_leaves_a_fit_that_prices_a_serving_chunk_within_a_quarter():
    """Each shape up to 10 % slow (a shared host): no coefficient goes negative, and a budget-sized
    chunk after a longer context beside decodes, far from every timed shape, is priced within 25 %."""
    cost = StepCost(17e-3, 3e-4, 2e-8, 5e-8, 1e-4)
    unseen = [(512, 1500)] + [(1, 800)] * 32
    want = cost.of_features(features(unseen, 33))
    for seed in range(20):
        fit = fit_startup_cost(_timed(cost, 33, 64, 256, 1024, 96, noise=0.1, seed=seed))
        assert min(fit.coefficients) >= 0
        assert fit.of_features(features(unseen, 33)) == pytest.approx(want, rel=0.25), seed


class _SlowestPeer:
    """A TP group whose slowest rank took `peer_s` on every first run (TPContext.max_over_group)."""

    def __init__(self, peer_s: float) -> None:
        self.peer_s, self.calls = peer_s, 0

    def max_over_group(self, value: float, device: object) -> float:
        self.calls += 1
        return max(value, self.peer_s)


class _Memory:
    """What measure_startup_cost reads of a StageMemory, with a forward that only counts its runs."""

    block_size = 16
    device = torch.device("cpu")

    def __init__(self, tp: _SlowestPeer) -> None:
        self.model = SimpleNamespace(interpreted=False, tp=tp)
        self.arch = SimpleNamespace(max_position_embeddings=4096)
        self.runs: dict[tuple[int, ...], int] = {}

    def warm_shapes(self, kv_cache):
        return 9, 16, 3

    def scratch_forward(self, query_lens, seq_lens, params, kv_cache):
        key = tuple(query_lens + seq_lens)
        self.runs[key] = self.runs.get(key, 0) + 1


@pytest.mark.parametrize("peer_s, runs", [(0.0, REPEATS), (1.0, LONG_REPEATS)])
def test_every_tp_rank_times_each_shape_as_often_as_its_peers(peer_s, runs):
    """Each run is a forward with collectives, so the number of runs must not follow one rank's own clock:
    a fast rank whose peer's first run was long runs the long count too (it used to run one more and wait
    in an all-reduce for ever: test_qwen3_moe_on_a_ray_pipeline_with_tp hung in CI)."""
    group = _SlowestPeer(peer_s)
    memory = _Memory(group)
    measure_startup_cost(memory, [torch.zeros(2, 256)])
    assert memory.runs and set(memory.runs.values()) == {runs}
    assert group.calls == len(memory.runs)  # one agreement per shape, after its first run
