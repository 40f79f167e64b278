"""Warm start: every stage runs its largest microbatch, a chunk after cached tokens and a decode step once
at start-up, after its KV cache exists and before the first request, so no first real microbatch of
any shape stalls the pipeline behind a cold stage."""

from __future__ import annotations

from ppserve.config import load_config
from ppserve.engine.executor import InProcExecutor
from ppserve.model.loader import read_hf_config
from ppserve.model.registry import describe_model
from ppserve.sched.cost import features


def test_every_stage_warms_up_once_before_serving(tiny_llama_dir):
    config = load_config(overrides=[f"model.model={tiny_llama_dir}", "parallel.pipeline_parallel_size=2",
                                    "cache.block_size=4", "scheduler.token_budget=24",
                                    "scheduler.max_num_seqs=3"])
    arch = describe_model(read_hf_config(tiny_llama_dir))
    executor = InProcExecutor(config, str(tiny_llama_dir), arch, [(0, 2), (2, 4)])
    try:
        for worker in executor.workers:
            phases = [e["phase"] for e in worker.memory.log]
            assert phases.count("warmed up") == 1, phases
            assert phases.index("warmed up") > phases.index("KV cache allocated")
            assert worker.memory.warm and worker.memory.decode_warm
            assert worker.memory.warm_up() == 0.0  # once only: a second call runs nothing
        # After a GPU memory profile (the largest microbatch, done) the other paths still run, once.
        worker = executor.workers[-1]
        memory = worker.memory
        memory.decode_warm = False
        shapes = []
        forward = memory.scratch_forward
        memory.scratch_forward = lambda q, n, *rest: shapes.append((q, n)) or forward(q, n, *rest)  # type: ignore[method-assign]
        worker.kv_caches[0][:, :3].fill_(1.0)  # as if written: the warm-up leaves its blocks zeroed
        assert memory.warm_up(worker.kv_caches) > 0.0
        assert all(not layer[:, :8].any() for layer in worker.kv_caches)
        cached = 2 * 4 + 1  # two blocks of 4 and one token into the third
        # a chunk after cached tokens, decodes
        assert shapes == [([16], [cached + 16]), ([1] * 3, [cached + 1] * 3)]
        assert memory.decode_warm and memory.warm_up() == 0.0
    finally:
        executor.shutdown()


def test_the_scheduler_starts_from_the_stages_timed_step_costs(tiny_llama_dir):
    """Each stage times its step cost at start-up (worker/startup_cost.py); the engine's scheduler starts
    calibrated from them, so its first microbatches are shared by predicted time, as the simulator's are."""
    from ppserve import LLM

    with LLM(str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=2, token_budget=24, block_size=4,
             overrides=["parallel.executor=inproc"]) as llm:
        prior = llm.engine.executor.startup_cost
        assert prior is not None and prior.num_stages == 2
        # Each stage's prior prices a one-decode step above zero (how its few timings split between floor,
        # tokens and samples follows the host's noise: see the next test).
        assert all(s.of_features(features(((1, 8),), 1)) > 0 for s in prior.stages), prior
        cost = llm.engine.scheduler.cost
        assert cost.calibrated and cost.current == prior  # before any microbatch: the prior itself
        for worker in llm.engine.executor.workers:
            assert [e["phase"] for e in worker.memory.log].count("step cost timed") == 1


def test_a_stage_under_the_triton_interpreter_times_its_short_shapes_once(tiny_llama_dir, monkeypatch):
    """A stage whose kernels run under Triton's interpreter (the CPU check of a GPU kernel: seconds a
    step) skips the long-context shapes and times each short one once; a compiled stage times all,
    best of REPEATS."""
    from ppserve.model.attention import SdpaBackend
    from ppserve.model.triton_attention import TritonPagedBackend
    from ppserve.worker import startup_cost

    config = load_config(overrides=[f"model.model={tiny_llama_dir}", "cache.block_size=16",
                                    "scheduler.token_budget=24", "scheduler.max_num_seqs=3"])
    arch = describe_model(read_hf_config(tiny_llama_dir))
    executor = InProcExecutor(config, str(tiny_llama_dir), arch, [(0, 4)])
    try:
        worker = executor.workers[0]
        assert not worker.model.interpreted
        assert (TritonPagedBackend().interpreted(worker.device)
                and not SdpaBackend().interpreted(worker.device))
        memory = worker.memory
        cached, chunk, _ = memory.warm_shapes(worker.kv_caches)
        shapes: list[tuple[list[int], list[int]]] = []
        forward = memory.scratch_forward
        monkeypatch.setattr(memory, "scratch_forward",
                            lambda q, n, *rest: shapes.append((q, n)) or forward(q, n, *rest))
        for interpreted in (False, True):
            shapes.clear()
            monkeypatch.setattr(worker.model.attn_backend, "interpreted", lambda device, i=interpreted: i)
            assert worker.model.interpreted == interpreted
            cost = startup_cost.measure_startup_cost(memory, worker.kv_caches)
            # A prior in seconds: a one-decode step priced above zero. Not the floor alone: how a tiny model's
            # few timings split between floor, tokens and samples follows the host's noise (a CI run fitted
            # floor 0 and put the step on sample_s), and timings are for benchmarks, not tests.
            assert cost.of_features(features(((1, cached),), 1)) > 0
            longest = max(max(n) for _, n in shapes)
            distinct = {(tuple(q), tuple(n)) for q, n in shapes}
            if interpreted:
                assert longest <= cached + chunk and len(shapes) == len(distinct)
            else:  # this model's positions cap the long context below LONG_CONTEXT, still past the short one
                assert longest > cached + chunk and len(shapes) == startup_cost.REPEATS * len(distinct)
    finally:
        executor.shutdown()
