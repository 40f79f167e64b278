"""What a stage reports as its seconds for a microbatch (StepResult.stage_seconds): its prepare span plus
its layers' compute, the last stage's LM head included, without the sampling that follows them; on a
fake clock, so the figures are exact."""

from __future__ import annotations

import pytest

from ppserve import LLM, SamplingParams
from ppserve.engine import executor
from ppserve.sched.cost import PipelineCost, StepCost
from ppserve.worker import stage_worker, step_timer
from ppserve.worker.input_batch import InputBatch

PREPARE_NS, FORWARD_NS, LOGITS_NS, SAMPLE_NS = 30_000_000, 10_000_000, 7_000_000, 50_000_000


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def perf_counter_ns(self) -> int:
        return self.ns


@pytest.mark.parametrize("token_heavy", [False, True])
def test_stage_seconds_are_prepare_plus_compute_not_sampling(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch,
                                                             token_heavy: bool) -> None:
    if token_heavy:  # a token costs ten floors: the 3-token prompt goes down the pipeline as 1 + 1 + 1
        monkeypatch.setattr(executor, "startup_pipeline_cost",
                            lambda per_stage: PipelineCost(tuple(StepCost(1e-4, 1e-3) for _ in per_stage)))
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
             token_budget=16, block_size=4, num_kv_blocks=64) as llm:
        clock = FakeClock()
        monkeypatch.setattr(stage_worker, "time", clock)
        monkeypatch.setattr(step_timer, "time", clock)  # the stage's step timer reads the host clock on CPU

        def advancing(fn, ns):
            def wrapped(*args, **kwargs):
                clock.ns += ns
                return fn(*args, **kwargs)
            return wrapped

        monkeypatch.setattr(InputBatch, "prepare", advancing(InputBatch.prepare, PREPARE_NS))
        monkeypatch.setattr(stage_worker.StageWorker, "_forward",
                            advancing(stage_worker.StageWorker._forward, FORWARD_NS))
        monkeypatch.setattr(stage_worker.StageWorker, "_logits",
                            advancing(stage_worker.StageWorker._logits, LOGITS_NS))
        monkeypatch.setattr(stage_worker, "sample", advancing(stage_worker.sample, SAMPLE_NS))
        seen, steps, sampled = [], set(), set()

        def observe(out, result) -> None:
            seen.append(result.stage_seconds)
            steps.add(out.step_id)
            if result.sampled_token_ids:
                sampled.add(result.step_id)

        llm.engine.core.step_observers.append(observe)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        # The compute spans of this generate's microbatches (none from before the clock was faked)
        spans = [s for s in llm.engine.collect_spans() if s.kind == "compute" and s.stage == 1
                 and s.step_id in steps]
    expected = ((PREPARE_NS + FORWARD_NS) * 1e-9, (PREPARE_NS + FORWARD_NS + LOGITS_NS) * 1e-9)
    assert seen and all(secs == pytest.approx(expected) for secs in seen)
    # The compute span still covers the sampling (the stage is busy with it): only the figure leaves it out.
    # A prompt's chunk before its last samples nothing: a start-up profile that prices a token high beside
    # the step's floor cuts this 3-token prompt into 1 + 1 + 1 (seen in a fresh-clone CI run).
    assert sampled and all(s.end_ns - s.start_ns
                           == FORWARD_NS + LOGITS_NS + (SAMPLE_NS if s.step_id in sampled else 0)
                           for s in spans), [(s.step_id, s.start_ns, s.end_ns, sorted(sampled))
                                             for s in spans]
    assert spans and {s.step_id for s in spans} == steps
    assert not token_heavy or len(steps) > len(sampled)  # the chunks that sample nothing were there
