"""Capacity search (ppserve.metrics.capacity) on fake monotone latency functions: pure Python, no model."""

from __future__ import annotations

import pytest

from ppserve.metrics.capacity import SLO, Probe, find_capacity, probe_from_summary


def threshold_eval(capacity: float, calls: list[float] | None = None):
    """A system that meets the SLO exactly up to `capacity` req/s."""

    def evaluate(rate: float) -> Probe:
        if calls is not None:
            calls.append(rate)
        return Probe(rate, rate <= capacity)

    return evaluate


@pytest.mark.parametrize("true_cap", [0.37, 1.0, 2.9, 13.0, 100.0])
def test_finds_capacity_within_tolerance(true_cap):
    res = find_capacity(threshold_eval(true_cap), start_rate=1.0, max_evals=40, rel_tol=0.01)
    assert res.capacity is not None
    assert res.capacity <= true_cap  # never reports a failing rate
    assert res.capacity >= true_cap / 1.011
    lo, hi = res.bracket
    assert lo == res.capacity and hi is not None and hi > true_cap


def test_every_probe_agrees_with_the_oracle_and_is_not_repeated():
    calls: list[float] = []
    res = find_capacity(threshold_eval(5.0, calls), start_rate=1.0, max_evals=20, rel_tol=0.02)
    assert len(calls) == len(set(calls)) == len(res.probes)
    assert all(p.ok == (p.rate <= 5.0) for p in res.probes)
    # Bracketing doubles up from the start rate: 1, 2, 4 pass, 8 fails.
    assert calls[:4] == [1.0, 2.0, 4.0, 8.0]


def test_halves_down_when_the_start_rate_fails():
    calls: list[float] = []
    res = find_capacity(threshold_eval(0.3, calls), start_rate=4.0, max_evals=20, rel_tol=0.05)
    assert calls[:5] == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert res.capacity is not None and 0.3 / 1.06 <= res.capacity <= 0.3


def test_budget_of_evaluations_is_respected():
    calls: list[float] = []
    res = find_capacity(threshold_eval(3.3, calls), start_rate=1.0, max_evals=4)
    assert len(calls) == 4
    # 1 and 2 pass, 4 fails, then one bisection step: 3 passes. The best passing rate so far is reported.
    assert calls == [1.0, 2.0, 4.0, 3.0]
    assert res.capacity == 3.0 and res.bracket == (3.0, 4.0)


def test_nothing_passes():
    res = find_capacity(threshold_eval(0.0), start_rate=1.0, max_evals=30, min_rate=0.1)
    assert res.capacity is None
    assert res.bracket[1] is not None and res.bracket[1] <= 0.125


def test_saturates_at_max_rate():
    res = find_capacity(threshold_eval(1e9), start_rate=1.0, max_evals=30, max_rate=64.0)
    assert res.capacity == 64.0 and res.saturated


def test_noisy_latency_curve():
    # p99 TBT grows with load; the SLO is met while latency <= 0.1 s, i.e. rate <= 6.
    slo = SLO(tbt_p99_s=0.1)

    def evaluate(rate: float) -> Probe:
        summary = {"latency": {"tbt_s": {"p99": 0.05 + rate * (1 / 120)}, "scheduling_delay_s": {"p50": 0.2}}}
        return probe_from_summary(rate, summary, slo)

    res = find_capacity(evaluate, start_rate=1.0, max_evals=30, rel_tol=0.001)
    assert res.capacity == pytest.approx(6.0, rel=0.002)


def test_probe_from_summary_reasons():
    slo = SLO(tbt_p99_s=0.1, sched_delay_p50_s=2.0)
    ok = probe_from_summary(1.0, {"latency": {"tbt_s": {"p99": 0.09}, "scheduling_delay_s": {"p50": 1.0}}},
                            slo)
    assert ok.ok and ok.reason == "meets SLO"
    slow = probe_from_summary(1.0, {"latency": {"tbt_s": {"p99": 0.2}, "scheduling_delay_s": {"p50": 3.0}}},
                              slo)
    assert not slow.ok and "TBT" in slow.reason and "scheduling delay" in slow.reason
    cut = probe_from_summary(1.0, {"aborted": True,
                                   "latency": {"tbt_s": {"p99": 0.01}, "scheduling_delay_s": {"p50": 0.1}}},
                                   slo)
    assert not cut.ok and "time limit" in cut.reason
    empty = probe_from_summary(1.0,
                               {"latency": {"tbt_s": {"p99": None}, "scheduling_delay_s": {"p50": None}}},
                               slo)
    assert not empty.ok
    fast = {"tbt_s": {"p99": 0.05}, "scheduling_delay_s": {"p50": 0.1}, "ttft_s": {"p90": 0.8}}
    assert probe_from_summary(1.0, {"latency": fast}, slo).ok  # TTFT unchecked unless the SLO names it
    late = probe_from_summary(1.0, {"latency": fast}, SLO(0.1, 2.0, ttft_p90_s=0.5))
    assert not late.ok and late.reason == "p90 TTFT 0.8 s > 0.5 s" and late.extra["ttft_p90_s"] == 0.8


@pytest.mark.parametrize("kwargs", [dict(start_rate=0.0), dict(start_rate=2.0, max_rate=1.0),
                                    dict(start_rate=1.0, max_evals=0), dict(start_rate=1.0, rel_tol=0.0)])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        find_capacity(threshold_eval(1.0), **kwargs)


def test_slo_validation():
    with pytest.raises(ValueError):
        SLO(tbt_p99_s=0.0)


def test_prior_probes_seed_the_bracket_and_are_not_repeated():
    coarse = find_capacity(threshold_eval(5.0), start_rate=1.0, max_evals=20, rel_tol=0.5)
    assert coarse.bracket == (4.0, 6.0)  # 1, 2, 4 pass, 8 fails, 6 fails: within 50 %
    calls: list[float] = []
    fine = find_capacity(threshold_eval(5.0, calls), start_rate=1.0, max_evals=20, rel_tol=0.05,
                         prior=coarse.probes)
    assert calls == [5.0, 5.5, 5.25]  # bisection goes on from (4, 6); nothing is probed twice
    assert fine.capacity == 5.0 and fine.probes[:len(coarse.probes)] == coarse.probes
    # A prior with only passes (or only fails) brackets on from its edge by `growth`.
    calls.clear()
    find_capacity(threshold_eval(5.0, calls), start_rate=1.0, max_evals=2, growth=1.5,
                  prior=[Probe(4.0, True)])
    assert calls == [6.0, 5.0]
    calls.clear()
    find_capacity(threshold_eval(5.0, calls), start_rate=1.0, max_evals=1, prior=[Probe(8.0, False)])
    assert calls == [4.0]
