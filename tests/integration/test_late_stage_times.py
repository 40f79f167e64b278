"""Stage times read late through the real pipeline: an in-process pp=2 engine on CPU whose stages
time their steps with the CUDA-event timer over a fake event backend (tests/unit/fake_events.py).
Stage 0's events are done one step after they are recorded, stage 1's two steps after, and no
stage ever waits for them. Each step's fake device time encodes its step and stage, so the test sees
that the scheduler's cost fit gets (the composition of step j, both stages' times of step j), that the
trace's compute spans come from the event times, and that the tokens are unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from ppserve import LLM, SamplingParams
from ppserve.sched.cost import BatchShape
from ppserve.worker import stage_worker
from ppserve.worker.step_timer import EventStepTimer
from tests.oracle import random_prompts, reference_greedy
from tests.unit.fake_events import FakeDevice

LAG_EVENTS = {0: 2, 1: 4}  # events recorded after one before it is done: 1 step on stage 0, 2 on stage 1
MAX_NEW = 6


def device_ms(step_id: int, stage: int) -> float:
    return 10_000.0 * (step_id + 1) + 1_000.0 * stage  # seconds: 10 (step + 1) + stage, + prepare (< 1 s)


def decode(seconds: float) -> tuple[int, int]:
    return int(seconds // 10) - 1, int(seconds % 10)


class SteppedDevice(FakeDevice):
    step_id = -1


def test_cost_fit_gets_each_steps_own_composition_and_times(tiny_llama_dir,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    devices: dict[int, SteppedDevice] = {}

    class TellingTimer(EventStepTimer):
        def __init__(self, recorder: Any, device: SteppedDevice) -> None:
            super().__init__(recorder, device.new_event)
            self.device = device

        def begin(self, step_id: int) -> None:
            self.device.step_id = step_id
            super().begin(step_id)

    def fake_timer(device_type: str, recorder: Any) -> TellingTimer:
        devices[recorder.stage] = device = SteppedDevice(lag=LAG_EVENTS[recorder.stage])
        return TellingTimer(recorder, device)

    forward = stage_worker.StageWorker._forward

    def timed_forward(self: Any, inp: Any, hidden_in: Any) -> Any:
        device = devices[self.spec.stage]
        device.run(device_ms(device.step_id, self.spec.stage))  # the layers "on the device"
        return forward(self, inp, hidden_in)

    monkeypatch.setattr(stage_worker, "step_timer_for", fake_timer)
    monkeypatch.setattr(stage_worker.StageWorker, "_forward", timed_forward)
    prompts = random_prompts(1, (3, 9, 20, 31))
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
             token_budget=16, block_size=4, overrides=["scheduler.budget_mode=time"]) as llm:
        sched, core = llm.engine.scheduler, llm.engine.core
        outs: dict[int, Any] = {}
        results: list[Any] = []
        fitted: list[tuple[BatchShape, tuple[float, ...]]] = []
        core.step_observers.append(lambda out, result: (outs.__setitem__(out.step_id, out),
                                                        results.append(result)))
        fit = sched.cost.observe
        monkeypatch.setattr(sched.cost, "observe", lambda shape, secs: (fitted.append((shape, tuple(secs))),
                                                                       fit(shape, secs)))
        syncs = {s: d.num_syncs for s, d in devices.items()}
        got = [o.token_ids
               for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))]
        assert {s: d.num_syncs for s, d in devices.items()} == syncs  # no stage waited on an event in a step
        spans = [s for s in llm.engine.collect_spans() if s.kind == "compute"]
    assert got == reference_greedy(tiny_llama_dir, prompts, MAX_NEW)
    steps = sorted(outs)
    # Stage 0 reads a step one step late, stage 1 two: the row of both waits on stage 1 for its time.
    assert [r.timed_step_id for r in results] == [None, None] + steps[:-2]
    assert len(fitted) == len(steps) - 2
    shapes_differ = 0
    for (shape, secs), (now, _) in zip(fitted, [(r.step_id, r) for r in results[2:]], strict=True):
        (step0, stage0), (step1, stage1) = decode(secs[0]), decode(secs[1])
        assert (stage0, stage1) == (0, 1) and step0 == step1, "a row mixed two steps' times"
        assert shape == BatchShape.of(outs[step0])  # the timed step's composition, not the current one's
        shapes_differ += shape != BatchShape.of(outs[now])
    assert shapes_differ > 0  # pairing with the step collected at the time would have been wrong
    # The compute spans are the event times, of every step whose events are done (the fake device never
    # finishes the last one or two: a real one has, once the last result came back).
    for stage in (0, 1):
        mine = {s.step_id: s for s in spans if s.stage == stage}
        assert sorted(mine) == steps[:len(steps) - 1 - stage]
        assert all(s.end_ns - s.start_ns == round(device_ms(j, stage) * 1e6) for j, s in mine.items())
