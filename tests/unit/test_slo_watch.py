"""A simulated run stops only when its SLO verdict is certain to be a fail (ppserve/sim/slo_watch.py)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from ppserve.config import SchedulerConfig
from ppserve.metrics.capacity import SLO
from ppserve.metrics.latency import percentile
from ppserve.sim import (
    ConstantCostModel,
    SimConfig,
    WorkloadRequest,
    load_hardware,
    load_model_spec,
    simulate,
)
from ppserve.sim.slo_watch import SloStop, over_count_for_certain_fail
from ppserve.sim.workload import with_poisson_arrivals


@pytest.mark.parametrize("q", [50, 90, 99])
def test_the_count_settles_the_percentile_whatever_the_other_values(q):
    rng = random.Random(q)
    for _ in range(2000):
        n = rng.randint(1, 300)
        need = over_count_for_certain_fail(n, q)
        assert 1 <= need <= n
        # `need` values just over X, the rest anywhere below it: the percentile is over X.
        values = ([1.0 + rng.random() * 1e-9 + 1e-12 for _ in range(need)]
                  + [rng.uniform(-5, 1.0) for _ in range(n - need)])
        rng.shuffle(values)
        assert percentile(values, q) > 1.0
    # It never falls as the number of values grows: the largest possible count is a safe one.
    for n in range(1, 2000):
        assert over_count_for_certain_fail(n + 1, q) >= over_count_for_certain_fail(n, q)


def overloaded(n: int, rate: float) -> list[WorkloadRequest]:
    return with_poisson_arrivals([WorkloadRequest(0.0, 48, 16) for _ in range(n)], rate, seed=3)


def run(reqs, stop: SloStop | None, stages: int = 2):
    # 1,024 blocks hold 8 seats of 64 tokens many times over; the invariant check walks every block each
    # step, so the simulator's default 100,000 cost these tests ~25 s.
    cfg = SimConfig(SchedulerConfig(token_budget=64, max_num_seqs=8), num_blocks=1024, check_invariants=True,
                    stop_on_slo_fail=stop)
    return simulate(reqs, ConstantCostModel(stages, 0.010), cfg)


def test_an_overloaded_run_stops_on_the_scheduling_delay_and_would_have_failed():
    # Each microbatch takes 10 ms a stage and seats 8 requests of 16 tokens: ~40 req/s at most; 400 offered.
    reqs = overloaded(400, 400.0)
    full = run(reqs, None)
    stopped = run(reqs, SloStop(sched_delay_p50_s=0.5))
    assert full.stopped_early is None and full.num_finished == 400
    assert stopped.stopped_early and "median scheduling delay over 0.5 s for certain" in stopped.stopped_early
    assert full.latency()["scheduling_delay_s"]["p50"] > 0.5
    assert stopped.end_s < full.end_s / 2


def test_a_run_stops_on_tbt_gaps_only_once_the_p99_is_settled():
    reqs = overloaded(60, 400.0)
    full = run(reqs, None)
    tbt = full.latency()["tbt_s"]
    stopped = run(reqs, SloStop(tbt_p99_s=0.99 * tbt["p50"]))  # half the gaps or more are over it: stops
    assert stopped.stopped_early and "p99 TBT over" in stopped.stopped_early
    assert run(reqs, SloStop(tbt_p99_s=tbt["p99"])).stopped_early is None  # the p99 itself is no fail


def test_a_run_that_meets_the_slo_is_not_stopped_nor_changed():
    reqs = overloaded(40, 5.0)
    full = run(reqs, None)
    watched = run(reqs, SloStop(tbt_p99_s=1.0, sched_delay_p50_s=1.0))
    assert watched.stopped_early is None
    assert watched.timings == full.timings and watched.end_s == full.end_s


def test_stop_settings_are_checked():
    with pytest.raises(ValueError, match="tbt_p99_s"):
        SloStop(tbt_p99_s=-1.0)
    with pytest.raises(ValueError, match="check_every"):
        SloStop(check_every=0)


def test_plan_probes_keep_their_verdicts_and_stopped_ones_say_why():
    from ppserve.plan.search import PlanContext, probe
    from ppserve.plan.space import Cluster, Deployment

    model = replace(load_model_spec("smollm2-135m"), num_layers=8)
    cluster = Cluster(load_hardware("cpu"), gpus_per_node=2)
    reqs = tuple(WorkloadRequest(0.0, 64, 24) for _ in range(40))
    ctx = PlanContext(model, cluster, reqs, SLO(0.5, 2.0), 4.0, min_requests=20)
    d = Deployment(2, 1, 1, "sarathi", 128, 16, (4, 4), 1000, 16)
    full_ctx = replace(ctx, stop_early=False)
    verdicts = []
    for rate in (0.5, 2.0, 8.0, 32.0):
        fast, full = probe(ctx, d, rate), probe(full_ctx, d, rate)
        assert fast.ok == full.ok, (rate, fast.reason, full.reason)
        if fast.extra.get("stopped_early"):
            assert not fast.ok and "for certain" in fast.reason
        else:
            assert fast.reason == full.reason and fast.tbt_p99_s == full.tbt_p99_s
        verdicts.append(fast.ok)
    assert verdicts[0] and not verdicts[-1]  # the rates span the capacity


def test_the_plan_is_the_same_with_full_probes(tmp_path):
    import json

    from ppserve.cli import main

    args = ["plan", "--model", "smollm2-135m", "--hardware", "cpu", "--gpus", "2", "--tbt-p99-ms", "300",
            "--num-requests", "20", "--duration-s", "3", "--prefill-scale", "0.05", "--decode-scale", "0.05",
            "--policies", "sarathi", "--token-budgets", "256", "--refine", "1", "--jobs", "1",
            "--no-progress"]
    plans = {}
    for name, extra in (("fast", []), ("full", ["--full-probes"])):
        assert main([*args, *extra, "--out", str(tmp_path / name)]) == 0
        plans[name] = json.loads((tmp_path / name / "plan.json").read_text())
    assert plans["full"]["settings"]["full_probes"] and not plans["fast"]["settings"]["full_probes"]

    def verdicts(plan):
        return {k: [(p["rate"], p["ok"]) for p in v["probes"]] for k, v in plan["probes"].items()}

    stopped = [p for v in plans["fast"]["probes"].values()
               for p in v["probes"] if p["extra"].get("stopped_early")]
    assert stopped and not any(p["extra"].get("stopped_early") for v in plans["full"]["probes"].values()
                               for p in v["probes"])
    assert verdicts(plans["fast"]) == verdicts(plans["full"])
    assert ([r["capacity_req_s"] for r in plans["fast"]["ranked"]]
            == [r["capacity_req_s"] for r in plans["full"]["ranked"]])
