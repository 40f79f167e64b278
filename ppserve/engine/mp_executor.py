"""The multi-process executor (`parallel.executor: mp`): the pipeline on one machine without Ray.

One process per (stage, tp rank), started with multiprocessing's `spawn` (a forked child would inherit
the engine's CUDA and OpenMP state), each running the same StageActor body a Ray actor runs. Rank r
takes CUDA device r when the stages use GPUs (NCCL between them), else the CPU (gloo, or the socket
links). The stage-to-stage transport and the engine's control plane are the Ray executor's: hidden
states go stage to stage over torch.distributed or a socket, microbatches come over one authenticated
connection per process (ConnectionDispatch), and only start-up, span and shutdown calls use each
process's pipe. This is what a single multi-GPU machine needs where Ray is not installed (the GPU
check's `multi_gpu` phase runs on it); a dead process is seen at once and the pipeline rebuilt like
the Ray one.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ppserve.config import EngineConfig
from ppserve.engine.dispatch import FAILURE_POLL_S, ConnectionDispatch, ControlPlane, StageFailure
from ppserve.engine.executor import agreed_block_size, pool_cap, stage_spec, startup_pipeline_cost
from ppserve.engine.placement import resolve_gpus_per_worker
from ppserve.engine.stage_executor import RemoteStagesExecutor
from ppserve.metrics.spans import estimate_offset

if TYPE_CHECKING:
    from ppserve.model.arch import ModelArch
    from ppserve.worker.stage_worker import StageSpec

logger = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 30.0  # for a process to close its links and exit before it is killed


def local_gpus(setting: float | None, world_size: int) -> list[int | None]:
    """The CUDA device of each rank (None: CPU): one whole GPU per rank when this machine has enough."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    per_worker = resolve_gpus_per_worker(setting, count, world_size)
    if per_worker == 0:
        return [None] * world_size
    if per_worker != 1 or count < world_size:
        raise ValueError(f"parallel.executor=mp gives each of the {world_size} ranks one GPU of this machine "
                         f"(parallel.gpus_per_worker={per_worker:g}, {count} visible): run fewer ranks, or "
                         "parallel.executor=inproc for every stage on one GPU")
    return list(range(world_size))


def serve_calls(conn: Connection, spec: StageSpec, rank: int, world: int, prev_rank: int | None,
                next_rank: int | None, gpu: int | None) -> None:
    """A stage process's main thread: run each (method, args) the executor sends on the StageActor and
    send back ("ok", value) or ("error", message), until `shutdown` or the pipe closes."""
    from ppserve.worker.stage_actor import LocalPlacement, StageActor

    actor = StageActor(spec, rank, world, prev_rank, next_rank, placement=LocalPlacement(gpu))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, Any] = ("ok", getattr(actor, method)(*args))
        except BaseException as e:  # the executor raises it with this stage named
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        if method == "shutdown":
            return


class StageProcess:
    """One (stage, tp rank) process and the pipe of its start-up, span and shutdown calls."""

    def __init__(self, ctx: Any, name: str, spec: StageSpec, rank: int, world: int, prev_rank: int | None,
                 next_rank: int | None, gpu: int | None) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_calls,
                                args=(child, spec, rank, world, prev_rank, next_rank, gpu),
                                name=f"ppserve-{name.replace(' ', '-')}", daemon=True)
        self.proc.start()
        child.close()  # this end belongs to the child: its exit then closes the pipe

    def call(self, method: str, *args: Any) -> None:
        try:
            self.conn.send((method, args))
        except OSError as e:
            raise StageFailure(f"{self.name}: its process is gone ({type(e).__name__}) before "
                               f"{method}") from e

    def result(self, method: str, deadline: float) -> Any:
        """The answer to the last call: StageFailure when the process died, failed or ran past `deadline`."""
        while not self.conn.poll(max(0.0, min(FAILURE_POLL_S, deadline - time.monotonic()))):
            if not self.proc.is_alive():
                raise StageFailure(f"{self.name}: its process exited (code {self.proc.exitcode}) during "
                                   f"{method}")
            if time.monotonic() >= deadline:
                raise StageFailure(f"{self.name}: {method} took longer than its limit")
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as e:
            raise StageFailure(f"{self.name}: its process exited (code {self.proc.exitcode}) during "
                               f"{method}") from e
        if kind == "error":
            raise StageFailure(f"{self.name}: {method}: {value}")
        return value

    def stop(self, wait_s: float) -> None:
        self.proc.join(wait_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.conn.close()


class MultiprocExecutor(RemoteStagesExecutor):
    def __init__(self, config: EngineConfig, model_dir: str, arch: ModelArch,
                 ranges: list[tuple[int, int]]) -> None:
        par = config.parallel
        self.config, self.model_dir, self.arch = config, model_dir, arch
        self.num_stages, self.tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.ranges = list(ranges)
        self.gpus = local_gpus(par.gpus_per_worker, self.num_stages * self.tp)
        self.dispatch: ControlPlane | None = None
        self.procs: list[StageProcess] = []
        self.start_processes()
        self.block_size = agreed_block_size(self.call_all("block_size"))
        fitted = pool_cap(config, arch, self.block_size, min(self.call_all(
            "num_blocks_for_memory", config.cache.kv_cache_memory, config.cache.gpu_memory_utilization)))
        self.num_kv_blocks = config.cache.num_blocks or fitted
        self.init_caches_and_dispatch()

    # ---- calls over the pipes --------------------------------------------------------------------
    def call_all(self, method: str, *args: Any, per_rank: list[tuple[Any, ...]] | None = None,
                 timeout_s: float | None = None) -> list[Any]:
        """Call `method` on every process at once (with `args`, or rank r's `per_rank[r]`); their answers."""
        for i, p in enumerate(self.procs):
            p.call(method, *(per_rank[i] if per_rank is not None else args))
        deadline = time.monotonic() + (timeout_s or self.config.parallel.startup_timeout_s)
        return [p.result(method, deadline) for p in self.procs]

    # ---- construction ----------------------------------------------------------------------------
    def start_processes(self) -> None:
        par = self.config.parallel
        ctx = multiprocessing.get_context("spawn")
        world = self.num_stages * self.tp
        threads = par.num_threads or max(1, int(par.cpus_per_worker))
        self.layout: list[dict[str, Any]] = []
        for s, (start, end) in enumerate(self.ranges):
            for r in range(self.tp):
                rank = s * self.tp + r
                spec = stage_spec(self.config, self.model_dir, self.arch, s, self.ranges, tp_rank=r,
                                  num_threads=threads, gpus=0.0 if self.gpus[rank] is None else 1.0)
                self.procs.append(StageProcess(  # stage links join TP ranks 0 only, as on Ray
                    ctx, f"stage {s} tp {r}", spec, rank, world, rank - self.tp if s > 0 and r == 0 else None,
                    rank + self.tp if s < self.num_stages - 1 and r == 0 else None, self.gpus[rank]))
                self.layout.append({"stage": s, "tp_rank": r, "layers": [start, end]})
        for lay, info in zip(self.layout, self.call_all("node_info"), strict=True):
            lay.update(info)
        self.procs[0].call("listen_for_store", "127.0.0.1")
        port = self.procs[0].result("listen_for_store", time.monotonic() + par.startup_timeout_s)
        tp_groups = [[s * self.tp + r for r in range(self.tp)] for s in range(self.num_stages)]
        self.call_all("init_distributed", "127.0.0.1", port, tp_groups)
        self.offsets = [self.clock_offset(p) for p in self.procs]

    def clock_offset(self, proc: StageProcess, pings: int = 5) -> int:
        """The process's offset to the engine clock: half the round trip of the fastest of a few pings."""
        samples = []
        for _ in range(pings):
            t0 = time.perf_counter_ns()
            proc.call("clock_ns")
            remote = proc.result("clock_ns", time.monotonic() + self.config.parallel.startup_timeout_s)
            samples.append((t0, remote, time.perf_counter_ns()))
        return estimate_offset(samples)

    def init_caches_and_dispatch(self) -> None:
        costs = self.call_all("init_cache", self.num_kv_blocks)
        self.startup_cost = startup_pipeline_cost(costs[:: self.tp])  # TP rank 0's of each stage

        def connect(address: Any, authkey: bytes) -> None:
            self.call_all("serve_connection",
                          per_rank=[(address, authkey, i) for i in range(len(self.procs))])

        self.dispatch = ConnectionDispatch(len(self.procs), self.num_stages, self.tp, "127.0.0.1", connect)

    # ---- the hot path --------------------------------------------------------------------------
    def drain_spans(self) -> list[dict[str, Any]]:
        batches = self.call_all("drain_spans", timeout_s=self.config.parallel.stage_timeout_s)
        return self.on_engine_clock(batches)

    # ---- failure recovery and teardown ------------------------------------------------------------
    def rebuild(self) -> None:
        self._teardown_dispatch()
        self._kill_processes()
        self.start_processes()
        self.init_caches_and_dispatch()

    def shutdown(self) -> None:
        self.stop_stages()

    def stop_stages(self) -> None:
        self._teardown_dispatch()
        try:
            self.call_all("shutdown", timeout_s=SHUTDOWN_WAIT_S)
        except StageFailure as e:  # a dead process must not block the others' teardown
            logger.warning("stage shutdown: %s", e)
        self._kill_processes()

    def _kill_processes(self) -> None:
        for p in self.procs:
            p.stop(0.0 if not p.proc.is_alive() else 1.0)
        self.procs = []
