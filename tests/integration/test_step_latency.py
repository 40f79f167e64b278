"""The serving path's critical path: a token reaches the caller in the step that samples it."""

from __future__ import annotations

import pytest

from ppserve import LLM, SamplingParams


@pytest.mark.parametrize("pp", [1, 2])
def test_a_sampled_token_returns_before_the_next_microbatch_computes(tiny_llama_dir, monkeypatch, pp):
    """In-process stages compute when the engine collects, not when it submits: the step that samples
    a token returns it having run that microbatch's forward and no other (the engine refills the pipeline
    right after collecting, before it returns)."""
    from ppserve.worker.stage_actor import StageActor

    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp,
             token_budget=16, block_size=4, num_kv_blocks=64) as llm:
        engine = llm.engine
        forwards: list[int] = []
        original = StageActor.execute

        def counting(self, out):
            if self.worker.spec.stage == pp - 1:  # one forward of the whole pipeline per microbatch
                forwards.append(out.step_id)
            return original(self, out)

        monkeypatch.setattr(StageActor, "execute", counting)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
        seen: list[int] = []
        while engine.has_unfinished:
            before = len(forwards)
            deltas = engine.step()
            seen += [t for d in deltas for t in d.token_ids]
            assert len(forwards) - before <= 1
            if deltas and deltas[0].token_ids:
                assert len(forwards) == len(seen)  # this step's forward sampled exactly these tokens
        assert len(seen) == 3 and len(forwards) == 3
