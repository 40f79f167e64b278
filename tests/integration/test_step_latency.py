"""The serving path's critical path: a token reaches the caller in the step that samples it."""

from __future__ import annotations

import pytest

from ppserve import LLM, SamplingParams


@pytest.mark.parametrize("pp,token_heavy", [(1, False), (2, False), (2, True)])
def test_a_sampled_token_returns_before_the_next_microbatch_computes(tiny_llama_dir, monkeypatch, pp,
                                                                     token_heavy):
    """In-process stages compute when the engine collects, not when it submits: the step that samples
    a token returns it having run that microbatch's forward and no other (the engine refills the pipeline
    right after collecting, before it returns). At pp > 1 the scheduler may cut even this short prompt
    into chunks that follow each other down the pipeline (when the start-up profile prices a token high
    next to a step's floor; `token_heavy` sets such a profile): those forwards sample nothing, so only the
    sampling forwards are counted."""
    from ppserve.engine import executor
    from ppserve.sched.cost import PipelineCost, StepCost
    from ppserve.worker.stage_actor import StageActor

    if token_heavy:  # a token costs ten floors: the 3-token prompt goes down the pipeline as 1 + 1 + 1
        monkeypatch.setattr(executor, "startup_pipeline_cost",
                            lambda per_stage: PipelineCost(tuple(StepCost(1e-4, 1e-3) for _ in per_stage)))

    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp,
             token_budget=16, block_size=4, num_kv_blocks=64) as llm:
        engine = llm.engine
        forwards: list[tuple[int, tuple[int, ...], bool]] = []  # (step id, tokens, samples) per microbatch
        original = StageActor.execute

        def counting(self, out):
            if self.worker.spec.stage == pp - 1:  # one forward of the whole pipeline per microbatch
                forwards.append((out.step_id, out.num_scheduled_tokens, bool(out.sample_request_ids)))
            return original(self, out)

        monkeypatch.setattr(StageActor, "execute", counting)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
        seen: list[int] = []
        while engine.has_unfinished:
            before = len(forwards)
            deltas = engine.step()
            got = [t for d in deltas for t in d.token_ids]
            seen += got
            assert len(forwards) - before <= 1, forwards
            sampling = [f for f in forwards if f[2]]
            # this step's forward sampled exactly these tokens: none is held back for a later step
            assert len(sampling) == len(seen), forwards
            if got:
                assert forwards[-1][2], forwards
        assert len(seen) == 3 and len([f for f in forwards if f[2]]) == 3
        if token_heavy:
            assert [f[1] for f in forwards[:3]] == [(1,), (1,), (1,)], forwards


def test_a_prompt_that_arrives_during_a_forward_is_in_the_next_microbatch(tiny_llama_dir, monkeypatch):
    """The AsyncEngine takes in requests mid-step, before the core schedules the next microbatch
    (EngineCore.fill's intake): a prompt queued while a microbatch computes is in the very next one, not
    the one after it (at pp = 1 the core schedules microbatch k + 1 before step k returns)."""
    import asyncio
    import threading

    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.engine.llm_engine import LLMEngine
    from ppserve.engine.messages import PromptInput
    from ppserve.worker.stage_actor import StageActor

    llm = LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=1,
              token_budget=16, block_size=4, num_kv_blocks=64)
    engine: LLMEngine = llm.engine
    executed: list[tuple[int, tuple[str, ...]]] = []  # (step id, requests) per forward, in order
    arrive = threading.Event()  # set: the next forward lets "late" arrive while it computes
    queued = threading.Event()
    original = StageActor.execute

    def execute(self, out):
        executed.append((out.step_id, out.order))
        if arrive.is_set():
            arrive.clear()
            assert queued.wait(30), "the late request was not queued"
        return original(self, out)

    monkeypatch.setattr(StageActor, "execute", execute)

    async def main() -> None:
        eng = AsyncEngine(engine)
        eng.start()
        loop = asyncio.get_running_loop()
        try:
            first = await eng.add_choices(PromptInput(token_ids=(5, 6, 7)),
                                          SamplingParams(max_tokens=12, ignore_eos=True), "early")
            while len(executed) < 3:  # "early" is decoding
                await asyncio.sleep(0.001)
            arrive.set()
            while arrive.is_set():  # until a forward has taken it: that forward now waits for `queued`
                await asyncio.sleep(0.001)
            late_add = loop.create_task(eng.add_choices(PromptInput(token_ids=(8, 9)),
                                                        SamplingParams(max_tokens=2, ignore_eos=True),
                                                        "late"))
            while eng._inbox.qsize() == 0:
                await asyncio.sleep(0)
            arrived_during = len(executed)  # the forward computing now is executed[arrived_during - 1]
            queued.set()
            late = await late_add
            async for _ in late[0]:
                pass
            async for _ in first[0]:
                pass
            with_late = [i for i, (_, order) in enumerate(executed) if "late" in order]
            assert with_late and with_late[0] == arrived_during, (arrived_during, executed)
        finally:
            await loop.run_in_executor(None, eng.stop)

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
