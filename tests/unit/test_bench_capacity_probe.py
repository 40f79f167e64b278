"""`ppserve bench capacity` sizes its probes by a fixed duration of arrivals (metrics.capacity.ProbeSize),
as `ppserve plan` does: checked on the simulator over a stub profile of known capacity (no model, no torch).

The stub: one stage, every microbatch 10 ms, 4 seats (max_num_seqs), requests of 4 prompt tokens and 4
output tokens. A request holds a seat for 4 steps, so the system serves 4 / 40 ms = 100 req/s; above
that the queue grows without bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppserve.bench.harness import EngineSpec
from ppserve.bench.suites import BenchContext, probe_workload, simulated_probe
from ppserve.bench.workloads import WorkloadSpec
from ppserve.metrics.capacity import SLO, ProbeSize, find_capacity
from ppserve.sched.cost import PipelineCost, StepCost
from ppserve.sim.cost_model import Profile

STEP_S, SEATS = 0.010, 4
SLO_ = SLO(tbt_p99_s=5 * STEP_S)  # TBT is one step here at any load: only the scheduling delay can fail


@pytest.fixture
def ctx(tmp_path: Path) -> BenchContext:
    engine = EngineSpec(model="stub", pp=1, token_budget=64, max_num_seqs=SEATS, block_size=16,
                        max_model_len=64)
    workload = WorkloadSpec(source="uniform", num_requests=SEATS, prompt_min=4, prompt_max=4, output_min=4,
                            output_max=4, arrival="poisson", rate=1.0, max_model_len=64)
    return BenchContext(engine, workload, tmp_path, progress=False, save_traces=False)


PROFILE = Profile(PipelineCost((StepCost(floor_s=STEP_S),)))


def probe(ctx: BenchContext, rate: float, size: ProbeSize):
    return simulated_probe(ctx, "sarathi", rate, PROFILE, 0.0, 1000, size, SLO_)


def test_a_probe_replays_a_fixed_duration_of_arrivals(ctx):
    size = ProbeSize(duration_s=2.0, min_requests=SEATS, max_requests=500)
    assert [len(probe_workload(ctx.workload, r, size)) for r in (1.0, 50.0, 1000.0)] == [4, 100, 500]
    assert size.wanted(1000.0) == 2000  # what the cap cut short
    with pytest.raises(ValueError, match="duration_s > 0"):
        ProbeSize(duration_s=0.0)


def test_the_fixed_count_blind_spot_is_gone(ctx):
    # The old rule, a fixed count (the workload's 4 requests): at 1000 req/s, 10x the capacity, they arrive
    # in a 4 ms burst, sit down in the 4 free seats and never queue: the probe "passes".
    fixed_count = ProbeSize(duration_s=1e-9, min_requests=SEATS)
    assert probe(ctx, 1000.0, fixed_count).ok
    # A fixed duration (5 s of arrivals) at the same rate queues thousands and fails on scheduling delay.
    duration = ProbeSize(duration_s=5.0, min_requests=SEATS)
    overloaded = probe(ctx, 1000.0, duration)
    assert not overloaded.ok and "scheduling delay" in overloaded.reason
    # And the search lands where the duration rule puts it, where the fixed count reports whatever it may
    # probe. The stub serves 100 req/s (4 seats x 100 steps/s, 4 tokens a request); at an overload x the
    # median request, arriving at D / 2, waits x D / 2: the 2 s limit holds up to x = 4 / D = 0.8 (D = 5 s).
    res = find_capacity(lambda r: probe(ctx, r, duration), start_rate=10.0, max_evals=14, rel_tol=0.02)
    assert res.capacity == pytest.approx(100.0 * (1 + 4 / 5.0), rel=0.05)
    blind = find_capacity(lambda r: probe(ctx, r, fixed_count), start_rate=10.0, max_evals=14, max_rate=1e4)
    assert blind.saturated
