"""Speculative decoding in the simulator (sim/speculation.py) and the regime suite's speculation cells."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from ppserve.bench import regimes as rg
from ppserve.config import SchedulerConfig
from ppserve.sim import ConstantCostModel, SimConfig, WorkloadRequest, simulate, with_poisson_arrivals
from ppserve.sim.speculation import AcceptanceModel
from ppserve.sim.workload import uniform_lengths

K = 4


def cfg(acceptance: float | None, **kw) -> SimConfig:
    return SimConfig(SchedulerConfig(token_budget=64), check_invariants=True, spec_acceptance=acceptance,
                     num_speculative_tokens=K, **kw)


def one_request(output_len: int = 41) -> list[WorkloadRequest]:
    return [WorkloadRequest(0.0, 32, output_len)]


def trips(times: list[float]) -> list[int]:
    """How many tokens each step delivered (tokens of one step share a time)."""
    return [len(list(g)) for _, g in itertools.groupby(times)]


def test_full_acceptance_gains_k_plus_one_tokens_a_trip_and_tbt_drops():
    cost = ConstantCostModel(2, 0.001)
    off = simulate(one_request(), cost, cfg(None))
    on = simulate(one_request(), cost, cfg(1.0))
    spec = on.speculation
    assert off.speculation is None and spec is not None
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
    sizes = trips(on.timings["r0"].token_times_s)
    assert sum(sizes) == 41 and max(sizes) == K + 1
    # After the first token (the prompt's) and while the estimate warms up, every trip brings k + 1.
    assert sizes.count(K + 1) >= len(sizes) - 4
    assert on.num_microbatches < off.num_microbatches
    assert on.latency()["tbt_s"]["p50"] < off.latency()["tbt_s"]["p50"]
    assert on.latency()["tpot_s"]["p50"] < off.latency()["tpot_s"]["p50"]


def test_zero_acceptance_keeps_the_output():
    wl = with_poisson_arrivals(uniform_lengths(12, (16, 64), (5, 40), seed=1), 50.0, seed=1)
    cost = ConstantCostModel(2, 0.001)
    off, on = simulate(wl, cost, cfg(None)), simulate(wl, cost, cfg(0.0))
    assert on.speculation is not None and on.speculation["num_drafts"] > 0
    assert on.speculation["num_accepted_tokens"] == 0
    assert on.num_finished == off.num_finished == len(wl)
    assert on.num_output_tokens == off.num_output_tokens
    assert all(len(t.token_times_s) == len(off.timings[rid].token_times_s) for rid, t in on.timings.items())
    assert all(max(trips(t.token_times_s)) == 1 for t in on.timings.values())


@pytest.mark.parametrize("acceptance", [0.3, 0.7, 1.0])
def test_outputs_end_at_their_lengths(acceptance):
    # Outputs 1..k+2 long: the scheduler cuts accepted drafts at max_tokens.
    wl = [WorkloadRequest(0.001 * i, 24, 1 + i % (K + 2)) for i in range(18)]
    res = simulate(wl, ConstantCostModel(3, 0.001), cfg(acceptance))
    assert res.num_finished == len(wl) and not res.rejected
    for k, w in enumerate(wl):
        assert len(res.timings[f"r{k}"].token_times_s) == w.output_len


def test_a_seed_makes_a_run_deterministic():
    wl = with_poisson_arrivals(uniform_lengths(10, (16, 64), (10, 60), seed=2), 40.0, seed=2)
    cost = ConstantCostModel(2, 0.001)
    a, b = (simulate(wl, cost, cfg(0.6, spec_seed=3)) for _ in range(2))
    c = simulate(wl, cost, cfg(0.6, spec_seed=4))
    def times(res):
        return {r: t.token_times_s for r, t in res.timings.items()}

    assert times(a) == times(b)
    assert a.speculation == b.speculation != c.speculation


def test_acceptance_model_and_config_checks():
    assert AcceptanceModel(1.0).accepted(K) == K and AcceptanceModel(0.0).accepted(K) == 0
    m = AcceptanceModel(0.5, seed=0)
    counts = [m.accepted(1) for _ in range(2000)]
    assert 0.45 < sum(counts) / len(counts) < 0.55
    with pytest.raises(ValueError, match="acceptance"):
        AcceptanceModel(1.5)
    with pytest.raises(ValueError, match="spec_acceptance"):
        SimConfig(spec_acceptance=-0.1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SimConfig(spec_acceptance=0.5, num_speculative_tokens=0)


def test_regime_speculation_cells():
    only = ["sparse", "one-long-prompt"]
    suite = rg.run_suite(reduced=True, only=only)
    rows = {r["regime"]: r for r in suite["speculation"]}
    assert list(rows) == only
    for name, row in rows.items():
        base = next(c for c in suite["regimes"][name]["cells"] if c["formation"] == rg.BALANCED)
        assert row["off"] == base and "speculation" not in base  # the suite's own cell, speculation off
        assert row["on"]["acceptance"] == 0.7 and row["on"]["num_speculative_tokens"] == 4
        assert row["on"]["num_requests"] == base["num_requests"]
    sparse = rows["sparse"]
    assert sparse["on"]["tpot_p50_s"] < 0.6 * sparse["off"]["tpot_p50_s"]
    assert sparse["on"]["speculation"]["num_accepted_tokens"] > 0
    # one output token: nothing to draft, the same cell
    lone = rows["one-long-prompt"]
    assert lone["on"]["speculation"]["num_drafts"] == 0
    assert lone["on"]["mean_bubble"] == lone["off"]["mean_bubble"]
    table = rg.speculation_table(suite)
    assert table.count("| sparse |") == 2 and "a=0.7, k=4" in table


def test_spec_cell_runs_alone_with_its_name():
    reg = next(r for r in rg.regimes(reduced=True) if r.name == "sparse")
    sc = rg.SpecCell("sparse", acceptance=1.0, num_speculative_tokens=2)
    wl = reg.workload()[:2]
    cell = rg.run_cell(reg, rg.FORMATIONS[0], wl, spec=sc)
    assert cell["formation"] == sc.name == "sarathi-spec-a1-k2"
    assert cell["speculation"]["acceptance_rate"] == 1.0
    on, off = rg.sim_setup(reg, rg.FORMATIONS[0], wl, sc)[2], rg.sim_setup(reg, rg.FORMATIONS[0], wl)[2]
    assert off.spec_acceptance is None
    assert dataclasses.replace(on, spec_acceptance=None, num_speculative_tokens=4) == off
