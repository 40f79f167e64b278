"""The Ray pipeline: one actor per (stage, tp rank), torch.distributed between them.

Hidden states travel stage to stage over torch.distributed p2p (gloo on CPU, NCCL on GPU), never
through the Ray object store. The small SchedulerOutput goes to every actor through Ray; Ray runs
an actor's calls from one caller in order, so every stage sees microbatches in the same order.
The last stage's TP rank 0 returns the StepResult.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from ppserve.config import EngineConfig
from ppserve.metrics.spans import estimate_offset
from ppserve.model.partition import StageCostModel, partition_layers
from ppserve.sched.output import SchedulerOutput, StepResult

logger = logging.getLogger(__name__)

# Start-up and rebuild calls (placement, weight loading) may take minutes on big models; a microbatch
# must not: the hot path waits parallel.stage_timeout_s, so a hung stage is rebuilt like a dead one.
RAY_GET_TIMEOUT_S = 600.0  # no ray.get waits forever: a dead stage must surface as an error
FAILURE_POLL_S = 0.5  # while waiting for a microbatch, look this often for a stage that already failed


@contextlib.contextmanager
def ray_single_machine_mode() -> Iterator[None]:
    """Make an embedded Ray's servers listen on 127.0.0.1 only.

    Ray (2.60) rewrites `_node_ip_address="127.0.0.1"` to the machine's routable address
    (services.resolve_ip_for_localhost), and its GCS, raylet, worker and agent servers then listen on
    all interfaces (they pick 127.0.0.1 only when the node IP is 127.0.0.1). Its single-machine mode,
    the default on macOS and Windows, keeps the node IP on loopback; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    selects it. Ray reads that variable when it is imported, so the module constant is set as well.
    Both are restored afterwards: the started processes have inherited the environment by then.
    """
    from ray._private import ray_constants

    env_key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    old_env, old_const = os.environ.get(env_key), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[env_key] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if old_env is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = old_env
        ray_constants.ENABLE_RAY_CLUSTER = old_const


class StageFailure(RuntimeError):
    """A stage actor died, failed or stopped answering: the pipeline must be rebuilt."""


class StageActor:
    """Ray actor body: owns a StageWorker and the p2p links to its neighbours."""

    def __init__(self, spec: Any, rank: int, world_size: int, prev_rank: int | None, next_rank: int | None) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.worker: Any = None
        self._store_sock: socket.socket | None = None  # rank 0: the TCPStore's listening socket
        self._pending_send: Any = None
        self._send_buf: Any = None

    def node_info(self) -> dict[str, Any]:
        import ray

        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def listen_for_store(self, host: str) -> int:
        """Rank 0: bind the TCPStore's socket now, on `host` only, and return its port.

        TCPStore itself listens on all interfaces; handed this socket (master_listen_fd) it listens
        where we bound. Holding it open until init_distributed also leaves no window for another
        process to take the port.
        """
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self._store_sock = socket.create_server((host, 0), family=family)
        port: int = self._store_sock.getsockname()[1]
        return port

    def clock_ns(self) -> int:
        return time.perf_counter_ns()

    def init_distributed(self, master: str, port: int, tp_groups: list[list[int]]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.constants import default_pg_timeout

        from ppserve.model.parallel import TPContext
        from ppserve.worker.stage_worker import StageWorker

        if self.spec.num_threads:
            torch.set_num_threads(self.spec.num_threads)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        if ipaddress.ip_address(master).is_loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Every rank is on this machine. Gloo otherwise listens on whatever the host name resolves
            # to, often a routable address.
            lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
            if lo:
                os.environ["GLOO_SOCKET_IFNAME"] = lo
        # Same store as init_method="tcp://..." (multi-tenant, default timeout), on rank 0's bound socket.
        store = dist.TCPStore(master, port, self.world_size, is_master=self.rank == 0, multi_tenant=True,
                              timeout=default_pg_timeout,
                              master_listen_fd=self._store_sock.fileno() if self._store_sock else None)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        my_group = None
        for ranks in tp_groups:  # every rank must create every group, in the same order
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                my_group = g
        tp = TPContext(rank=self.spec.tp_rank, size=self.spec.tp_size, group=my_group)
        self.worker = StageWorker(self.spec, tp)
        self.device = self.worker.device

    def num_blocks_for_memory(self, kv_cache_memory: float) -> int:
        n: int = self.worker.num_blocks_for_memory(kv_cache_memory)
        return n

    def init_cache(self, num_blocks: int) -> None:
        self.worker.init_cache(num_blocks)

    def execute(self, out: SchedulerOutput) -> StepResult | None:
        import torch
        import torch.distributed as dist

        rec = self.worker.recorder
        hidden_in = None
        if self.prev_rank is not None:
            # Stage s > 0: the token count is known from the SchedulerOutput, so the buffer is exact.
            hidden_in = torch.empty(out.total_tokens, self.worker.arch.hidden_size, dtype=self.worker.dtype,
                                    device=self.device)
            with rec.span("recv_wait", out.step_id):
                dist.recv(hidden_in, src=self.prev_rank)
        result = self.worker.execute(out, hidden_in)
        if isinstance(result, StepResult):
            return result if self.spec.tp_rank == 0 else None
        assert self.next_rank is not None
        with rec.span("send", out.step_id):
            if self._pending_send is not None:
                self._pending_send.wait()  # at most one send outstanding; keeps its buffer alive until done
            self._send_buf = result.contiguous()
            self._pending_send = dist.isend(self._send_buf, dst=self.next_rank)
        return None

    def drain_spans(self) -> list[dict[str, Any]]:
        spans: list[dict[str, Any]] = self.worker.drain_spans()
        return spans

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self._pending_send is not None:
            try:
                self._pending_send.wait()
            except Exception:  # the peer may be gone already; shutting down anyway
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


class RayExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, hf_config: dict[str, Any]) -> None:
        import ray

        self.config = config
        par = config.parallel
        self.pp, self.tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.model_dir, self.hf_config = model_dir, hf_config
        self.init_ray()
        self.ranges = self.compute_partition(hf_config)
        self.init_actors(model_dir, hf_config)
        self.init_clock_offsets()
        blocks = [a.num_blocks_for_memory.remote(config.cache.kv_cache_memory) for a in self.actors]
        fitted = min(ray.get(blocks, timeout=RAY_GET_TIMEOUT_S))
        self.num_kv_blocks = config.cache.num_blocks or fitted
        ray.get([a.init_cache.remote(self.num_kv_blocks) for a in self.actors], timeout=RAY_GET_TIMEOUT_S)
        self.in_flight: deque[tuple[int, list[Any]]] = deque()

    # ---- construction ----------------------------------------------------------------------------
    def init_ray(self) -> None:
        import ray

        par = self.config.parallel
        self.owns_ray = False
        if ray.is_initialized():
            return
        if par.ray_address:
            ray.init(address=par.ray_address, log_to_driver=True)
        else:
            # Embedded local instance: loopback only, no dashboard. Logical CPUs may exceed physical
            # ones so a 2-core machine can host a 4-stage pipeline.
            need = int(par.world_size * max(par.cpus_per_worker, 1.0))
            # address="local" never attaches to a `ray start` cluster that happens to run on this machine.
            with ray_single_machine_mode():
                ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), include_dashboard=False,
                         _node_ip_address="127.0.0.1", log_to_driver=True)
            self.owns_ray = True
            ip = ray.util.get_node_ip_address()
            if ip != "127.0.0.1":
                logger.warning("embedded Ray runs on %s, not loopback: its servers listen on all interfaces", ip)

    def compute_partition(self, hf_config: dict[str, Any]) -> list[tuple[int, int]]:
        par = self.config.parallel
        num_layers = int(hf_config["num_hidden_layers"])
        cost = None
        if par.partition_mode == "cost":
            from ppserve.model.llama import LlamaArch

            a = LlamaArch.from_hf_config(hf_config)
            cost = StageCostModel.for_llama(a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                                            a.vocab_size, logits_fraction=1.0)
        return partition_layers(num_layers, self.pp, par.layer_partition, par.partition_mode, cost)

    def init_actors(self, model_dir: str, hf_config: dict[str, Any]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ppserve.worker.stage_worker import StageSpec

        par, cfg = self.config.parallel, self.config
        world = self.pp * self.tp
        bundle = {"CPU": par.cpus_per_worker}
        if par.gpus_per_worker:
            bundle["GPU"] = par.gpus_per_worker
        # One placement group per stage: its TP ranks packed on one node; stages go where resources allow,
        # or onto the nodes labelled with the stage's custom resource (launch/ scripts set those labels).
        self.placement_groups = []
        for s in range(self.pp):
            b = dict(bundle)
            if par.stage_resources:
                b[par.stage_resources[s]] = 0.01
            self.placement_groups.append(placement_group([dict(b) for _ in range(self.tp)], strategy="STRICT_PACK"))
        ray.get([pg.ready() for pg in self.placement_groups], timeout=RAY_GET_TIMEOUT_S)
        actor_cls = ray.remote(StageActor)
        self.actors: list[Any] = []
        self.layout: list[dict[str, Any]] = []
        for s, (start, end) in enumerate(self.ranges):
            for r in range(self.tp):
                rank = s * self.tp + r
                spec = StageSpec(
                    model_dir=model_dir, hf_config=hf_config, stage=s, num_stages=self.pp, layer_start=start,
                    layer_end=end, tp_rank=r, tp_size=self.tp, dtype=cfg.model.dtype, kv_cache_dtype=cfg.cache.dtype,
                    block_size=cfg.cache.block_size, attention_backend=cfg.model.attention_backend,
                    num_threads=par.num_threads or max(1, int(par.cpus_per_worker)), trace=cfg.trace.enabled,
                    cuda_graphs=cfg.model.cuda_graphs, cuda_graph_max_batch=cfg.model.cuda_graph_max_batch,
                    max_model_len=cfg.model.max_model_len,
                )
                actor = actor_cls.options(
                    num_cpus=par.cpus_per_worker, num_gpus=par.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[s], placement_group_bundle_index=r),
                ).remote(spec, rank, world, rank - self.tp if s > 0 else None,
                         rank + self.tp if s < self.pp - 1 else None)
                self.actors.append(actor)
                self.layout.append({"stage": s, "tp_rank": r, "layers": [start, end]})
        infos = ray.get([a.node_info.remote() for a in self.actors], timeout=RAY_GET_TIMEOUT_S)
        for lay, info in zip(self.layout, infos, strict=True):
            lay.update(info)
        master = infos[0]["node_ip"]
        port = ray.get(self.actors[0].listen_for_store.remote(master), timeout=RAY_GET_TIMEOUT_S)
        tp_groups = [[s * self.tp + r for r in range(self.tp)] for s in range(self.pp)]
        ray.get([a.init_distributed.remote(master, port, tp_groups) for a in self.actors], timeout=RAY_GET_TIMEOUT_S)
        for lay in self.layout:
            logger.info("stage %d tp %d: layers %s on node %s (pid %s)", lay["stage"], lay["tp_rank"],
                        lay["layers"], lay["node_ip"], lay["pid"])
        self.last_actor = self.actors[(self.pp - 1) * self.tp]

    def init_clock_offsets(self, pings: int = 5) -> None:
        """Each actor's offset to the engine clock: half the round trip of the fastest of a few pings."""
        import ray

        self.offsets: list[int] = []
        for a in self.actors:
            samples = []
            for _ in range(pings):
                t0 = time.perf_counter_ns()
                remote = ray.get(a.clock_ns.remote(), timeout=RAY_GET_TIMEOUT_S)
                samples.append((t0, remote, time.perf_counter_ns()))
            self.offsets.append(estimate_offset(samples))

    # ---- the hot path --------------------------------------------------------------------------
    def submit(self, out: SchedulerOutput) -> None:
        refs = [a.execute.remote(out) for a in self.actors]
        self.in_flight.append((out.step_id, refs))

    def collect(self, timeout_s: float | None = None) -> StepResult:
        import ray

        step_id, refs = self.in_flight.popleft()
        limit = timeout_s or self.config.parallel.stage_timeout_s
        deadline = time.monotonic() + limit
        pending = list(refs)
        try:
            # Wait for every stage, but look at those already done as we go: when one stage died, the
            # others may block in a p2p call forever, so its error must not wait behind them.
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageFailure(f"step {step_id}: no answer from {len(pending)} stage actor(s) in {limit:g} s "
                                       "(parallel.stage_timeout_s): hung")
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(FAILURE_POLL_S, left))
                if ready:
                    ray.get(ready, timeout=RAY_GET_TIMEOUT_S)  # raises at once for a dead or failed stage
            results = ray.get(refs, timeout=RAY_GET_TIMEOUT_S)
        except ray.exceptions.RayError as e:  # RayActorError / ActorDiedError, RayTaskError, GetTimeoutError
            raise StageFailure(f"step {step_id}: {type(e).__name__}: {e}") from e
        result = results[(self.pp - 1) * self.tp]
        if not isinstance(result, StepResult) or result.step_id != step_id:
            raise RuntimeError(f"stage pipeline returned {result!r} for step {step_id}")
        return result

    def drain_spans(self) -> list[dict[str, Any]]:
        import ray

        # Queued behind the in-flight microbatches, so it is bounded like them.
        batches = ray.get([a.drain_spans.remote() for a in self.actors], timeout=self.config.parallel.stage_timeout_s)
        out = []
        for offset, spans in zip(self.offsets, batches, strict=True):
            for d in spans:
                d = dict(d)
                d["start_ns"] += offset
                d["end_ns"] += offset
                out.append(d)
        return out

    def describe(self) -> list[dict[str, Any]]:
        return [dict(lay) for lay in self.layout]

    # ---- failure recovery ------------------------------------------------------------------------
    def rebuild(self) -> None:
        """Replace the whole pipeline: new placement groups, new actors, new process groups, empty caches.

        Survivors are killed too: their process group includes the dead rank and cannot be repaired.
        The KV block count stays the same, because the scheduler's allocator keeps its size.
        """
        import ray

        self.in_flight.clear()  # their results are lost with the old actors
        self._kill_actors()
        self.init_actors(self.model_dir, self.hf_config)
        self.init_clock_offsets()
        ray.get([a.init_cache.remote(self.num_kv_blocks) for a in self.actors], timeout=RAY_GET_TIMEOUT_S)

    def _kill_actors(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a, no_restart=True)
            except Exception as e:  # already dead: nothing to do
                logger.debug("kill stage actor: %s", e)
        for pg in getattr(self, "placement_groups", []):
            try:
                remove_placement_group(pg)
            except Exception as e:
                logger.debug("remove placement group: %s", e)
        self.actors, self.placement_groups = [], []

    def shutdown(self) -> None:
        import ray

        if not getattr(self, "actors", None):
            return
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        except Exception as e:  # a dead actor must not block the rest of the teardown
            logger.warning("stage shutdown: %s", e)
        self._kill_actors()
        if self.owns_ray:
            ray.shutdown()
