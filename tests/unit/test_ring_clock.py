"""The token ring's just-in-time formation (sched/ring_clock.py, Scheduler.formation_due, EngineCore's
deferred fill): when stage 0 is predicted to free, and that the engine waits for it only where it may."""

from __future__ import annotations

import pytest

from ppserve.config import SchedulerConfig
from ppserve.engine.core import EngineCore
from ppserve.sched import Scheduler, SchedulerOutput, StepResult
from ppserve.sched.cost import PipelineCost, StepCost
from ppserve.sched.ring_clock import RingClock
from ppserve.sim import ConstantCostModel, SimConfig, WorkloadRequest, simulate
from tests.unit.sched_helpers import fake_result, make_request


def mb(step_id: int, ring_step_id: int | None = None) -> SchedulerOutput:
    rid = f"r{step_id}"
    return SchedulerOutput(step_id, (rid,), (1,), (4,), (), (), (rid,),
                           ring_request_ids=(rid,) if ring_step_id is not None else (),
                           ring_step_id=ring_step_id)


def test_stage0_frees_after_the_in_flight_work_in_order_each_once_its_ring_tokens_are_back():
    clock = RingClock(margin_s=0.5, window=8)
    a, b, c = mb(0), mb(1), mb(2, ring_step_id=0)
    clock.formed(0, 0.0, 5.0)
    clock.formed(1, 1.0, 3.0)
    clock.formed(2, 2.0, 4.0)
    assert clock.stage0_free_s([a, b, c]) is None  # c's tokens come with a, still in flight
    clock.returned(0, 10.0)
    # b: formed at 1, 3 s -> 4; c: its tokens back at 10, 4 s -> 14.
    assert clock.stage0_free_s([b, c]) == pytest.approx(14.0)
    assert clock.due_s([b, c]) == pytest.approx(13.5)
    clock.formed(3, 11.0, 20.0)  # no ring decodes: starts once c is done
    assert clock.stage0_free_s([b, c, mb(3)]) == pytest.approx(34.0)


def test_stage0_free_time_is_unknown_without_a_prediction_or_a_record():
    clock = RingClock(margin_s=0.0, window=8)
    assert clock.stage0_free_s([]) is None
    clock.formed(0, 0.0, None)  # formed before the cost model could price it
    assert clock.due_s([mb(0)]) is None
    assert clock.due_s([mb(1)]) is None  # never recorded
    clock.formed(1, 0.0, 2.0)
    assert clock.due_s([mb(1)]) == pytest.approx(2.0)
    clock.forget()
    assert clock.due_s([mb(1)]) is None


def test_returned_steps_are_kept_only_as_far_back_as_a_ring_source_can_be():
    clock = RingClock(margin_s=0.0, window=3)
    for step in range(10):
        clock.formed(step, float(step), 1.0)
        clock.returned(step, float(step) + 0.5)
    assert sorted(clock._returned) == [7, 8, 9]
    assert not clock._formed


def test_a_negative_margin_is_refused():
    with pytest.raises(ValueError, match="margin"):
        RingClock(margin_s=-1e-3, window=4)
    with pytest.raises(ValueError, match="ring_margin_ms"):
        SchedulerConfig(token_ring=True, ring_margin_ms=-1.0)
    with pytest.raises(ValueError, match="ring_margin_ms"):
        SchedulerConfig(token_ring=True, ring_margin_ms=float("inf"))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ring_scheduler(clock: Clock, margin_ms: float | None = 1.0, ring: bool = True, pp: int = 2) -> Scheduler:
    cfg = SchedulerConfig(token_budget=8, token_ring=ring, ring_margin_ms=margin_ms)
    prior = PipelineCost((StepCost(floor_s=0.010),) * pp)  # every microbatch 10 ms a stage
    return Scheduler(cfg, 1000, 4, 4096, num_stages=pp, clock=clock, cost_prior=prior)


def decoding(s: Scheduler, n: int) -> None:
    for i in range(n):
        s.add_request(make_request(f"r{i}", 3, max_tokens=50))
    while s.schedule() is not None:
        pass
    while s.in_flight:
        s.update_from_output(s.in_flight[0], fake_result(s.in_flight[0]))


def test_the_scheduler_says_when_the_rings_extra_microbatch_is_due():
    clock = Clock()
    s = ring_scheduler(clock)
    decoding(s, 4)
    clock.now = 1.000
    a, b = s.schedule(), s.schedule()  # both stage slots: formed now, each 10 ms on stage 0
    assert a is not None and b is not None
    # Only the ring's slot is free: due 1 ms (the margin) before stage 0 has done a and b, at 1.020.
    assert s.formation_due(0.0) == pytest.approx(1.019)
    clock.now = 1.002
    c = s.schedule()  # the ring's extra microbatch: a's decodes, once a's tokens are back
    assert c is not None and c.ring_step_id == a.step_id
    clock.now = 1.021
    s.update_from_output(a, fake_result(a))  # back at 1.021: c starts then, done at 1.031
    # Stage 0: b 1.000 -> 1.020, c 1.021 -> 1.031; the next is due the dispatch and 1 ms before.
    assert s.formation_due(0.0005) == pytest.approx(1.031 - 0.0005 - 0.001)
    assert s.formation_due() == pytest.approx(1.030)


@pytest.mark.parametrize("kw", [{"ring": False}, {"margin_ms": None}])
def test_without_the_ring_or_its_margin_nothing_waits(kw):
    clock = Clock()
    s = ring_scheduler(clock, **kw)
    decoding(s, 4)
    while s.schedule() is not None:
        pass
    s.update_from_output(s.in_flight[0], fake_result(s.in_flight[0]))
    assert s.formation_due(0.0) is None


class QueuePipeline:
    """An executor that returns each microbatch's tokens when collected."""

    def __init__(self) -> None:
        self.queue: list[SchedulerOutput] = []

    def submit(self, out: SchedulerOutput) -> None:
        self.queue.append(out)

    def collect(self) -> StepResult:
        return fake_result(self.queue.pop(0))


def test_the_engine_defers_the_fill_only_where_it_is_given_a_way_to_wait():
    waits: list[float] = []
    for wait in (None, waits.append):
        clock = Clock()
        s = ring_scheduler(clock)
        for i in range(4):
            s.add_request(make_request(f"r{i}", 3, max_tokens=50))
        core = EngineCore(s, QueuePipeline(), clock=clock, clock_ns=lambda: 0, wait_until=wait,
                          dispatch_s=0.0005)
        for _ in range(6):
            core.step()
            if wait is None:  # an executor that computes in collect: refilled at once
                assert len(s.in_flight) == s.max_in_flight and core.fill_due is None
        if wait is not None:
            # The clock never moves here, so stage 0 always has work ahead: every refill waits for its time.
            assert core.fill_due is not None and len(s.in_flight) == s.num_stages
            assert waits and all(w > clock.now for w in waits)


@pytest.mark.parametrize("arrival", [0.1033, 0.105, 0.1077])
def test_a_prompt_arriving_among_decodes_joins_the_rings_next_microbatch(arrival):
    """Two decoding requests on two 10 ms stages (1 ms turnaround, 2 ms dispatch) and a prompt arriving
    mid-cycle. Formed as soon as its slot frees, the ring's extra microbatch then waits a stage time at
    stage 0 and the prompt joins the one after: a step of TTFT over no ring at all. Formed just before
    stage 0 needs it, the microbatch takes the prompt: one stage time sooner, ahead of no ring (whose
    control plane is on the path), and the decode cycle and bubble are the ring's."""
    wl = [WorkloadRequest(0.0, 4, 40), WorkloadRequest(0.0, 4, 40), WorkloadRequest(arrival, 4, 2)]

    def run(ring: bool, margin_ms: float | None) -> tuple[float, float, float]:
        cfg = SchedulerConfig(policy="sarathi", token_budget=64, token_ring=ring, ring_margin_ms=margin_ms)
        res = simulate(wl, ConstantCostModel(2, 0.010), SimConfig(cfg, 64, 16, 512, 0.001, 0.002,
                                                                  check_invariants=True))
        ttft = res.timings["r2"].ttft_s
        assert ttft is not None
        return ttft, res.latency()["tbt_s"]["p50"], res.bubble_report("active").mean_bubble_fraction

    no_ring, ahead, just_in_time = run(False, 1.0), run(True, None), run(True, 1.0)
    assert just_in_time[0] == pytest.approx(ahead[0] - 0.010)
    assert just_in_time[0] < no_ring[0] - 0.004
    assert just_in_time[1:] == pytest.approx(ahead[1:])
    assert ahead[1] < no_ring[1]
