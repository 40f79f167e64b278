"""Warm start: every stage runs its largest microbatch, a chunk after cached tokens and a decode step once
at start-up, after its KV cache exists and before the first request, so no first real microbatch of
any shape stalls the pipeline behind a cold stage."""

from __future__ import annotations

from ppserve.config import load_config
from ppserve.engine.executor import InProcExecutor
from ppserve.model.loader import read_hf_config
from ppserve.model.registry import describe_model


def test_every_stage_warms_up_once_before_serving(tiny_llama_dir):
    config = load_config(overrides=[f"model.model={tiny_llama_dir}", "parallel.pipeline_parallel_size=2",
                                    "cache.block_size=4", "scheduler.token_budget=24", "scheduler.max_num_seqs=3"])
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
        forward = memory._scratch_forward
        memory._scratch_forward = lambda q, n, *rest: shapes.append((q, n)) or forward(q, n, *rest)  # type: ignore[method-assign]
        worker.kv_caches[0][:, :3].fill_(1.0)  # as if written: the warm-up leaves its blocks zeroed
        assert memory.warm_up(worker.kv_caches) > 0.0
        assert all(not layer[:, :8].any() for layer in worker.kv_caches)
        cached = 2 * 4 + 1  # two blocks of 4 and one token into the third
        assert shapes == [([16], [cached + 16]), ([1] * 3, [cached + 1] * 3)]  # a chunk after cached tokens, decodes
        assert memory.decode_warm and memory.warm_up() == 0.0
    finally:
        executor.shutdown()
