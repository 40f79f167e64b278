"""Warm start: every stage runs its largest microbatch once at start-up, after its KV cache exists and
before the first request, so the first real microbatch does not stall the pipeline behind a cold stage."""

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
            assert worker.memory.warm
            assert worker.memory.warm_up() == 0.0  # once only: a second call runs nothing
    finally:
        executor.shutdown()
