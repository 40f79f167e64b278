"""Executors run microbatches through the stages. The engine sees one small interface.

`InProcExecutor` runs every stage (pp >= 1, tp = 1) in the engine's own process, through the same
StageActor body the Ray actors run, with hidden states handed over in memory: for unit tests, and for
a single GPU with no Ray. `RayExecutor` (ray_executor.py) runs one actor per (stage, tp rank).

Both return each microbatch's `StepResult` with every stage's compute seconds for the step they
measure (`timed_step_id`: this one, or an earlier one when GPU stages read their events late), which
the engine hands to the scheduler's cost model with that step's composition (engine/core.py).
"""

from __future__ import annotations

import gc
import os
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ppserve.config import EngineConfig
from ppserve.sched.cost import PipelineCost, StepCost
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.worker.info import WorkerInfo

if TYPE_CHECKING:  # the worker layer imports torch: this module imports it only where it builds stages
    from ppserve.model.arch import ModelArch
    from ppserve.worker.stage_actor import StageActor
    from ppserve.worker.stage_worker import StageSpec, StageWorker


class Executor(Protocol):
    """What the engine (LLMEngine) needs of an executor: InProcExecutor and RayExecutor both are one. An
    executor that can replace a dead pipeline also has `rebuild()`, which the engine looks for."""

    num_kv_blocks: int
    block_size: int  # the KV block size every stage agreed on (agreed_block_size)
    ranges: list[tuple[int, int]]  # decoder layers [start, end) per stage
    # Each stage's step cost timed at start-up (worker/startup_cost.py), the prior of the scheduler's
    # cost model; None when a stage did not time one.
    startup_cost: PipelineCost | None
    # Whether the stages compute while the engine does other things (submit returns at once): only then
    # can the engine wait to form a microbatch until stage 0 needs it (EngineCore.wait_until), forming it
    # `dispatch_latency_s` (the control plane's, from submit to stage 0) ahead.
    asynchronous: bool
    dispatch_latency_s: float

    def submit(self, out: SchedulerOutput) -> None:
        """Start a microbatch; returns without waiting when the executor is asynchronous."""

    def collect(self, timeout_s: float | None = None) -> StepResult:
        """The result of the oldest submitted microbatch (blocks until it is ready)."""

    def drain_spans(self) -> list[dict[str, Any]]:
        """Spans recorded by every stage since the last drain, on the engine's clock."""

    def describe(self) -> list[WorkerInfo]:
        """One per (stage, tp rank): its layers and where it runs."""

    def repartition(self, ranges: list[tuple[int, int]]) -> None:
        """Rebuild the stages with other layer ranges (empty KV caches, same block count)."""

    def shutdown(self) -> None: ...


def stage_spec(config: EngineConfig, model_dir: str, arch: ModelArch, stage: int,
               ranges: list[tuple[int, int]], tp_rank: int = 0, num_threads: int | None = None,
               gpus: float = 0.0) -> StageSpec:
    """What one (stage, tp rank) needs to build its shard, from the engine config."""
    from ppserve.model.ops.settings import KernelSettings
    from ppserve.worker.stage_worker import StageSpec

    par, cfg = config.parallel, config
    start, end = ranges[stage]
    m = cfg.model
    kernels = KernelSettings(native=m.native_kernels, amx=m.amx_kernels, linear_path=m.linear_path,
                             cache_dir=m.kernel_cache_dir, moe_kernel=m.moe_kernel,
                             quantization=m.quantization)
    return StageSpec(
        model_dir=model_dir, arch=arch, stage=stage, num_stages=len(ranges), layer_start=start,
        layer_end=end, tp_rank=tp_rank, tp_size=par.tensor_parallel_size, dtype=cfg.model.dtype,
        kv_cache_dtype=cfg.cache.dtype, block_size=cfg.cache.block_size,
        profile_tokens=cfg.scheduler.token_budget, profile_seqs=cfg.scheduler.max_num_seqs,
        attention_backend=cfg.model.attention_backend, num_threads=num_threads or par.num_threads,
        trace=cfg.trace.enabled,
        cuda_graphs=cfg.model.cuda_graphs, cuda_graph_max_batch=cfg.model.cuda_graph_max_batch,
        max_model_len=cfg.model.max_model_len, kernels=kernels, gpus=gpus, stage_link=par.stage_link,
        token_ring=cfg.scheduler.token_ring_on and len(ranges) > 1,
    )


def pool_cap(config: EngineConfig, arch: ModelArch, block_size: int, fitted: int) -> int:
    """The block count memory allows (`fitted`), capped at what max_num_seqs sequences of max_model_len
    tokens can hold (worker/memory.py usable_blocks)."""
    from ppserve.worker.memory import capped_blocks

    max_len = config.model.max_model_len or arch.max_position_embeddings
    return capped_blocks(fitted, config.scheduler.max_num_seqs, max_len, block_size)


def agreed_block_size(sizes: list[int]) -> int:
    """The one KV block size of a pipeline (the scheduler's allocator is shared by every stage)."""
    if len(set(sizes)) != 1:
        raise ValueError(f"the stages chose different KV block sizes {sizes} (their attention backends "
                         "differ: flash-attn on some nodes only?); set cache.block_size")
    return sizes[0]


class InProcExecutor:
    """Every stage in this process, one after another per microbatch (tp = 1)."""

    asynchronous = False  # the stages compute in `collect`, on the engine's thread
    dispatch_latency_s = 0.0

    def __init__(self, config: EngineConfig, model_dir: str, arch: ModelArch,
                 ranges: list[tuple[int, int]]) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("parallel.executor=inproc runs tp = 1; use ray for tensor parallelism")
        self.config, self.model_dir, self.arch = config, model_dir, arch
        self.num_kv_blocks = 0
        self._build(ranges)
        self.block_size = agreed_block_size([w.block_size for w in self.workers])
        self.num_kv_blocks = self._fit_kv_blocks()
        self.startup_cost = startup_pipeline_cost([a.init_cache(self.num_kv_blocks) for a in self.actors])
        self._pending: deque[SchedulerOutput] = deque()  # submitted, computed when collected

    def _fit_kv_blocks(self) -> int:
        """One block count for every stage, capped at what the scheduler can use (pool_cap). The stages
        share this process (and its one device): a fraction of free memory, or the GPU budget, is split
        among them by what a block costs each; the profiled peak is the largest stage's (stages run one
        after another, never at once)."""
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        workers = self.workers
        if cache.kv_cache_memory is None and workers[0].device.type == "cuda":
            from ppserve.worker.memory import split_blocks

            peak = max(w.memory.profile_peak_bytes() for w in workers)
            budget = workers[0].memory.kv_budget_bytes(None, cache.gpu_memory_utilization, peak=peak)
            return pool_cap(self.config, self.arch, self.block_size,
                            split_blocks(budget, [w.memory.kv_bytes_per_block() for w in workers]))
        mem = cache.kv_cache_memory
        if mem is not None and mem <= 1:
            mem = mem / len(workers)  # a fraction of this process's free memory, shared
        return pool_cap(self.config, self.arch, self.block_size,
                        min(w.memory.num_blocks(mem, cache.gpu_memory_utilization) for w in workers))

    def _build(self, ranges: list[tuple[int, int]]) -> None:
        from ppserve.comm.channel import InProcChannel
        from ppserve.worker.stage_actor import StageActor
        from ppserve.worker.stage_worker import StageWorker

        self.ranges = list(ranges)
        links = [InProcChannel() for _ in range(len(ranges) - 1)]
        last = len(ranges) - 1
        # The token ring (scheduler.token_ring): the last stage's tokens back to stage 0.
        ring = InProcChannel() if self.config.scheduler.token_ring_on and last > 0 else None
        self.actors: list[StageActor] = []
        for s in range(len(ranges)):
            worker = StageWorker(stage_spec(self.config, self.model_dir, self.arch, s, self.ranges))
            inbound = links[s - 1] if s > 0 else None
            outbound = links[s] if s < last else None
            self.actors.append(StageActor.local(worker, inbound, outbound, ring_in=ring if s == 0 else None,
                                                ring_out=ring if s == last else None))

    @property
    def workers(self) -> list[StageWorker]:
        """The stages' StageWorkers, in stage order."""
        return [a.worker for a in self.actors]

    def submit(self, out: SchedulerOutput) -> None:
        # Queued, not run: here submitting would compute, and the engine refills the pipeline right after
        # a collect, so the tokens just sampled would reach the caller only after the next microbatch's
        # compute (a whole step late at pp = 1). The work runs in collect instead
        # (ARCHITECTURE.md#the-life-of-a-microbatch).
        self._pending.append(out)

    def collect(self, timeout_s: float | None = None) -> StepResult:
        out = self._pending.popleft()
        result = None
        for a in self.actors:  # stage order; the last returns the result with every stage's seconds
            result = a.execute(out)
        assert result is not None
        return result

    def drain_spans(self) -> list[dict[str, Any]]:
        return [d for a in self.actors for d in a.drain_spans()]

    def describe(self) -> list[WorkerInfo]:
        return [WorkerInfo(stage=s, tp_rank=0, layer_start=start, layer_end=end, node_ip="local",
                           pid=os.getpid())
                for s, (start, end) in enumerate(self.ranges)]

    def repartition(self, ranges: list[tuple[int, int]]) -> None:
        self._release_stages()  # before the new stages load: the old ones' memory would count against them
        self._build(ranges)
        self.startup_cost = startup_pipeline_cost([a.init_cache(self.num_kv_blocks) for a in self.actors])

    def shutdown(self) -> None:
        self._release_stages()

    def _release_stages(self) -> None:
        """Give back every stage's memory now: the KV caches and decode graphs (the bulk of a GPU: the
        cache takes what the weights leave of 0.9 of it), then the stages themselves, so a next engine in
        this process (the GPU check's next phase, a test) starts from what was free before this one."""
        self._pending.clear()
        actors, self.actors = self.actors, []
        on_cuda = any(a.worker.device.type == "cuda" for a in actors)
        for a in actors:
            a.shutdown()
            a.worker.release()
        del actors
        gc.collect()  # stage objects refer to each other (recorder, memory, graphs): free them now, not later
        if on_cuda:
            import torch

            torch.cuda.empty_cache()  # the caching allocator's blocks back to the driver


def startup_pipeline_cost(per_stage: Sequence[Sequence[float] | None]) -> PipelineCost | None:
    """The pipeline's start-up step costs from each stage's coefficients (TP rank 0's, in stage order),
    or None when a stage has none."""
    if not per_stage or any(c is None for c in per_stage):
        return None
    return PipelineCost(tuple(StepCost.of(c) for c in per_stage if c is not None))
