"""benchmarks/analysis_sim_bubble.py: stage 0's idle time cut by cause adds up to its bubble, and each part
is what the simulated engine's events say on hand-computable runs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ppserve.config import SchedulerConfig
from ppserve.sim import ConstantCostModel, SimConfig, WorkloadRequest, simulate
from ppserve.sim.cost_model import BatchShape
from tests.bench_scripts import load_benchmark

MS = 1_000_000


@dataclass(frozen=True)
class PrefillHeavyCost:
    """A microbatch with a prefill chunk costs `prefill_s`, a decode-only one `step_s`, on every stage."""

    num_stages: int
    step_s: float
    prefill_s: float

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        return self.prefill_s if shape.num_prefill_tokens else self.step_s

    def transfer_time(self, shape: BatchShape) -> float:
        return 0.0


def _run(cost, workload, overhead_s: float, dispatch_s: float, **sched):
    # Without the token ring unless asked: these parts are those of a decode cycle through the engine.
    cfg = SchedulerConfig(**{"policy": "sarathi", "token_budget": 64, "max_num_seqs": 8, "token_ring": False,
                             **sched})
    res = simulate(workload, cost, SimConfig(cfg, 256, 16, 512, overhead_s, dispatch_s))
    mod = load_benchmark("analysis_sim_bubble")
    parts = mod.first_stage_idle(res, dispatch_s)
    bubble = res.bubble_report("active").stages[0].bubble_ns
    return parts, bubble


def test_decode_ring_idles_stage_zero_for_the_turnaround_and_the_dispatch_only():
    # Two decoding requests on two equal stages: each group's next microbatch waits for its return
    # (1 ms turnaround, then 2 ms dispatch) and never for an unequal microbatch.
    wl = [WorkloadRequest(0.0, 4, 12), WorkloadRequest(0.0, 4, 12)]
    parts, bubble = _run(ConstantCostModel(2, 0.010), wl, 0.001, 0.002)
    assert parts["ring_prefill"] == parts["ring_decode"] == 0
    assert parts["turnaround"] > 0
    # Every gap after a return: 1 ms of turnaround then 2 ms of dispatch; the first microbatch only waits
    # for its dispatch (2 ms).
    assert parts["dispatch"] == 2 * parts["turnaround"] + 2 * MS
    assert sum(parts.values()) == pytest.approx(bubble, abs=1)


def test_a_long_microbatch_makes_the_ring_wait_for_it():
    # Prefill microbatches cost 3x a decode step: the decode group behind one finishes early on stage 0
    # and waits for it to come back round.
    wl = [WorkloadRequest(0.0, 40, 16), WorkloadRequest(0.05, 40, 16), WorkloadRequest(0.12, 40, 4)]
    parts, bubble = _run(PrefillHeavyCost(2, 0.010, 0.030), wl, 0.0, 0.0, token_budget=40)
    assert parts["ring_prefill"] > 0
    assert parts["turnaround"] == parts["dispatch"] == 0
    assert sum(parts.values()) == pytest.approx(bubble, abs=1)


@pytest.mark.parametrize("balance", [True, False])
def test_parts_add_up_to_the_bubble_on_a_mixed_run(balance: bool):
    wl = [WorkloadRequest(0.004 * k, 20 + 37 * (k % 5), 6 + 3 * (k % 4)) for k in range(24)]
    parts, bubble = _run(PrefillHeavyCost(3, 0.004, 0.009), wl, 0.0004, 0.0003, balance=balance)
    assert bubble > 0
    assert sum(parts.values()) == pytest.approx(bubble, abs=1)


def _under_p(workload, num_stages: int):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, token_ring=False)
    res = simulate(workload, ConstantCostModel(num_stages, 0.010), SimConfig(cfg, 256, 16, 512, 0.001, 0.002))
    mod = load_benchmark("analysis_sim_bubble")
    return mod.under_p_requests(res), res.bubble_report("active").stages[0].bubble_ns


def test_a_lone_request_leaves_all_of_stage_zeros_bubble_under_p_requests():
    under, bubble = _under_p([WorkloadRequest(0.0, 4, 6)], 2)
    assert bubble > 0
    assert under == bubble


def test_with_more_requests_than_stages_only_the_tail_is_under_p_requests():
    # Four requests on two stages finish two by two: until the last token at least two are in the system.
    # After it none is, and the engine's 1 ms turnaround on the last microbatch is all that is left.
    under, bubble = _under_p([WorkloadRequest(0.0, 4, 12)] * 4, 2)
    assert under == 1 * MS
    assert bubble > 40 * MS  # the turnarounds and dispatches of the decode ring, with four requests in


@dataclass(frozen=True)
class SlowLastStageCost:
    """Every microbatch costs `step_s` on each stage but the last, which takes `extra_s` more (its LM
    head)."""

    num_stages: int
    step_s: float
    extra_s: float

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        return self.step_s + (self.extra_s if stage == self.num_stages - 1 else 0.0)

    def transfer_time(self, shape: BatchShape) -> float:
        return 0.0


def test_the_token_ring_paces_the_faster_stages_at_the_slowest_ones_step():
    # Eight decoding requests on four stages, the last 0.1 ms slower a step, no control plane: with the ring
    # every faster stage waits 0.1 ms for its tokens each step; the last stage never waits in the steady
    # state.
    mod = load_benchmark("analysis_sim_bubble")
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, token_ring=True)
    cuts = {}
    for extra_s in (0.0, 0.0001):
        res = simulate([WorkloadRequest(0.0, 4, 40)] * 8, SlowLastStageCost(4, 0.005, extra_s),
                       SimConfig(cfg, 256, 16, 512, 0.0, 0.0))
        cuts[extra_s] = cut = mod.every_stage_idle(res)
        # the three parts are all of the bubble
        assert sum(cut.values()) == pytest.approx(res.bubble_report("active").mean_bubble_fraction, abs=1e-6)
    assert cuts[0.0]["pace"] == 0  # equal stages: no stage waits on another's pace
    # ~0.1 ms of every ~5.1 ms step on three stages of four: about 1.5 % of the window; nothing else moves
    assert 0.010 < cuts[0.0001]["pace"] < 0.016
    assert cuts[0.0001]["rest"] == pytest.approx(cuts[0.0]["rest"], abs=1e-3)
