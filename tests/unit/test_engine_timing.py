"""EngineCore pairs each reported stage time with the composition of the step it measures
(`StepResult.timed_step_id`), not the step it came back with: GPU stages read their times one step
late or more (worker/step_timer.py). A scripted pipeline reports every step's time `lag` collections
late; each time encodes its step, so every pairing the scheduler's cost fit receives is checkable.
No time may be paired twice, or with another step, at the end of a run, on preemption, or across a
pipeline rebuild."""

from __future__ import annotations

from collections import deque

import pytest

from ppserve.engine.core import EngineCore
from ppserve.sched import SchedulerOutput, StepResult
from ppserve.sched.cost import BatchShape
from ppserve.sched.scheduler import Scheduler
from tests.unit.sched_helpers import make_request, make_scheduler


def seconds_of(step_id: int) -> tuple[float, float]:
    return (0.001 * (step_id + 1), 0.002 * (step_id + 1))


def step_of(seconds: tuple[float, ...]) -> int:
    return round(seconds[0] / 0.001) - 1


class LaggedPipeline:
    """Computes each microbatch when collected and reports its time `lag` collections later."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.pending: deque[SchedulerOutput] = deque()
        self.measured: deque[int] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        self.pending.append(out)

    def collect(self) -> StepResult:
        out = self.pending.popleft()
        self.measured.append(out.step_id)
        tokens = {rid: 7 for rid in out.sample_request_ids}
        if len(self.measured) > self.lag:
            timed = self.measured.popleft()
            return StepResult(out.step_id, tokens, seconds_of(timed), timed_step_id=timed)
        return StepResult(out.step_id, tokens)

    def rebuild(self) -> None:
        """A stage died: its in-flight work and the times it had not reported yet are gone."""
        self.pending.clear()
        self.measured.clear()


class Recorder:
    """What the scheduler's cost fit was given, and every collected step's composition."""

    def __init__(self, core: EngineCore, sched: Scheduler) -> None:
        self.outs: dict[int, SchedulerOutput] = {}
        self.collected: list[int] = []
        self.fitted: list[tuple[BatchShape, tuple[float, ...], int]] = []  # (shape, seconds, step collected)
        self.timed: list[tuple[SchedulerOutput, tuple[float, ...]]] = []
        core.step_observers.append(self.on_step)
        core.timing_observers.append(lambda out, secs: self.timed.append((out, secs)))
        fit = sched.cost.observe

        def observe(shape: BatchShape, stage_seconds: tuple[float, ...]) -> None:
            self.fitted.append((shape, tuple(stage_seconds), self.collected[-1] + 1))
            fit(shape, stage_seconds)

        sched.cost.observe = observe  # type: ignore[method-assign]

    def on_step(self, out: SchedulerOutput, result: StepResult) -> None:
        self.outs[out.step_id] = out
        self.collected.append(out.step_id)

    def check_pairs(self) -> list[int]:
        """Every fitted time is its own step's; each step fitted at most once. Returns the steps fitted."""
        steps = [step_of(secs) for _, secs, _ in self.fitted]
        assert len(steps) == len(set(steps)), "a step's time was fitted twice"
        for (shape, secs, _), step in zip(self.fitted, steps, strict=True):
            assert secs == pytest.approx(seconds_of(step))
            assert shape == BatchShape.of(self.outs[step]), (
                f"step {step}'s time paired with another composition")
        assert [(o.step_id, step_of(s)) for o, s in self.timed] == [(s, s) for s in steps]
        return steps


def engine(lag: int, **cfg: object) -> tuple[EngineCore, Scheduler, LaggedPipeline, Recorder]:
    sched = make_scheduler(token_budget=16, pp=2, budget_mode="time", **cfg)
    pipe = LaggedPipeline(lag)
    core = EngineCore(sched, pipe, clock=lambda: 0.0, clock_ns=lambda: 0)
    return core, sched, pipe, Recorder(core, sched)


def run(core: EngineCore, sched: Scheduler) -> None:
    while sched.has_unfinished:
        core.step()


def test_late_times_fit_the_step_they_measure_even_under_preemption() -> None:
    core, sched, pipe, rec = engine(lag=2, num_blocks=12, block_size=4)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", prompt_len=9 + 5 * i, max_tokens=12))
    run(core, sched)
    assert sched.num_preemptions > 0  # the KV is too small for all four: compositions change under it
    fitted = rec.check_pairs()
    assert fitted == rec.collected[:-2]  # every step, in order, but the last two still on the "device"
    # The test has teeth: pairing with the step collected at the time would have fitted other shapes.
    assert any(shape != BatchShape.of(rec.outs[now]) for shape, _, now in rec.fitted if now in rec.outs)


def test_times_left_at_the_end_of_a_run_come_back_in_the_next() -> None:
    core, sched, pipe, rec = engine(lag=3)
    sched.add_request(make_request("a", prompt_len=20, max_tokens=6))
    run(core, sched)
    first_run = list(rec.collected)
    assert set(core.untimed) == set(first_run[-3:])  # kept, not dropped, while the engine idles
    sched.add_request(make_request("b", prompt_len=10, max_tokens=6))
    run(core, sched)
    fitted = rec.check_pairs()
    assert set(first_run) <= set(fitted)  # the first run's last steps, paired with their own compositions
    assert fitted == rec.collected[:-3]


def test_a_rebuild_loses_only_the_dead_pipelines_times_and_pairs_no_stale_one() -> None:
    core, sched, pipe, rec = engine(lag=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt_len=12, max_tokens=10))
    for _ in range(5):
        core.step()
    lost = list(pipe.measured)  # collected, their times not reported when the stage died
    pipe.rebuild()
    sched.requeue_all_for_recompute()
    run(core, sched)
    fitted = rec.check_pairs()
    assert lost and not set(lost) & set(fitted)
    assert sorted(fitted + lost) == rec.collected[:-2]
    assert not set(lost) & set(core.untimed)  # forgotten once the new pipeline timed a later step


def test_a_step_result_must_say_which_step_its_seconds_measure() -> None:
    with pytest.raises(ValueError, match="need the step they measure"):
        StepResult(3, {}, (0.1,))
    with pytest.raises(ValueError, match="need the step they measure"):
        StepResult(3, {}, timed_step_id=2)
    with pytest.raises(ValueError, match="a later step"):
        StepResult(3, {}, (0.1,), timed_step_id=4)
    assert StepResult(3, {}, (0.1,), timed_step_id=1).timed_step_id == 1


class DiesOnSubmit(LaggedPipeline):
    """A stage that dies between a collect and the next submit."""

    def __init__(self, die_on_submit: int) -> None:
        super().__init__(lag=0)
        self.submits, self.die_on_submit = 0, die_on_submit

    def submit(self, out: SchedulerOutput) -> None:
        self.submits += 1
        if self.submits == self.die_on_submit:
            raise RuntimeError("stage 1 died")
        super().submit(out)


def test_tokens_collected_before_a_failed_submit_reach_the_caller():
    """The result is applied to its requests before the next microbatch is submitted. A submit that fails
    there must not take that result's tokens with it: the step returns them, and the next step raises."""
    sched = make_scheduler(token_budget=64, pp=2)
    pipeline = DiesOnSubmit(die_on_submit=4)
    core = EngineCore(sched, pipeline)
    sched.add_request(make_request("a", 8, max_tokens=20))
    sched.add_request(make_request("b", 8, max_tokens=20))
    got: list[int] = []
    with pytest.raises(RuntimeError, match="stage 1 died"):
        for _ in range(10):
            stepped = core.step()
            assert stepped is not None
            got.extend(t for u in stepped[1] for t in u.new_token_ids)
    applied = sum(len(sched.requests[rid].output_token_ids) for rid in ("a", "b"))
    assert pipeline.submits == 4 and applied == len(got) > 0  # every applied token was handed out
    assert core.deferred_failure is None
