"""Executors run microbatches through the stages. The engine sees one small interface.

`InProcExecutor` runs a single stage (pp=1, tp=1) in the engine's own process through the same
StageWorker code that the Ray actors use; `RayExecutor` (ray_executor.py) runs one actor per
(stage, tp rank).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from ppserve.config import EngineConfig
from ppserve.sched.output import SchedulerOutput, StepResult


class Executor(Protocol):
    num_kv_blocks: int

    def submit(self, out: SchedulerOutput) -> None:
        """Start a microbatch; returns without waiting when the executor is asynchronous."""

    def collect(self, timeout_s: float | None = None) -> StepResult:
        """The result of the oldest submitted microbatch (blocks until it is ready)."""

    def drain_spans(self) -> list[dict[str, Any]]:
        """Spans recorded by every stage since the last drain, on the engine's clock."""

    def describe(self) -> list[dict[str, Any]]:
        """One dict per (stage, tp rank): layers, node, pid."""

    def shutdown(self) -> None: ...


class InProcExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, hf_config: dict[str, Any]) -> None:
        from ppserve.worker.stage_worker import StageSpec, StageWorker

        arch_layers = int(hf_config["num_hidden_layers"])
        spec = StageSpec(
            model_dir=model_dir, hf_config=hf_config, stage=0, num_stages=1, layer_start=0,
            layer_end=arch_layers, dtype=config.model.dtype, kv_cache_dtype=config.cache.dtype, block_size=config.cache.block_size,
            attention_backend=config.model.attention_backend, num_threads=config.parallel.num_threads,
            trace=config.trace.enabled, cuda_graphs=config.model.cuda_graphs,
            cuda_graph_max_batch=config.model.cuda_graph_max_batch, max_model_len=config.model.max_model_len,
        )
        self.worker = StageWorker(spec)
        self.num_kv_blocks = config.cache.num_blocks or self.worker.num_blocks_for_memory(config.cache.kv_cache_memory)
        self.worker.init_cache(self.num_kv_blocks)
        self._done: deque[StepResult] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        result = self.worker.execute(out)
        assert isinstance(result, StepResult)
        self._done.append(result)

    def collect(self, timeout_s: float | None = None) -> StepResult:
        return self._done.popleft()

    def drain_spans(self) -> list[dict[str, Any]]:
        return self.worker.drain_spans()

    def describe(self) -> list[dict[str, Any]]:
        import os

        s = self.worker.spec
        return [{"stage": 0, "tp_rank": 0, "layers": [s.layer_start, s.layer_end], "node": "local", "pid": os.getpid()}]

    def shutdown(self) -> None:
        self._done.clear()
