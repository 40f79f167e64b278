"""The Ray pipeline: placement, one actor per (stage, tp rank), torch.distributed between them, rebuild.

The actor body lives in worker/stage_actor.py, the control plane in dispatch.py (a compiled graph or a
call per actor), the stage-to-stage transport in comm/ (torch.distributed p2p: gloo on CPU, NCCL on
GPU). Hidden states never go through the Ray object store. This module places the actors, starts
torch.distributed among them, measures their clock offsets, and replaces the whole pipeline when a
stage dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ppserve.config import EngineConfig
from ppserve.engine.dispatch import (
    CONNECT_TIMEOUT_S,
    ClassicDispatch,
    CompiledGraphDispatch,
    ConnectionDispatch,
    ControlPlane,
    StageActorHandle,
    resolve_dispatch,
)
from ppserve.engine.executor import agreed_block_size, pool_cap, stage_spec, startup_pipeline_cost
from ppserve.engine.placement import order_stages_by_node, resolve_gpus_per_worker
from ppserve.engine.stage_executor import RemoteStagesExecutor
from ppserve.metrics.spans import estimate_offset

if TYPE_CHECKING:
    from ppserve.model.arch import ModelArch


logger = logging.getLogger(__name__)

# Start-up and rebuild calls (placement, weight loading) may take minutes on big models
# (parallel.startup_timeout_s); a microbatch must not: the hot path waits parallel.stage_timeout_s, so a
# hung stage is rebuilt like a dead one.


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


class RayExecutor(RemoteStagesExecutor):
    def __init__(self, config: EngineConfig, model_dir: str, arch: ModelArch,
                 ranges: list[tuple[int, int]]) -> None:
        import ray

        self.config = config
        par = config.parallel
        self.num_stages, self.tp = par.pipeline_parallel_size, par.tensor_parallel_size
        self.model_dir, self.arch = model_dir, arch
        self.ranges = list(ranges)
        self.startup_timeout_s = par.startup_timeout_s
        self.dispatch: ControlPlane | None = None
        self.init_ray()
        self.gpus_per_worker = resolve_gpus_per_worker(par.gpus_per_worker,
                                                       ray.cluster_resources().get("GPU", 0), par.world_size)
        self.dispatch_kind = resolve_dispatch(par.dispatch, self.gpus_per_worker)
        self.init_actors()
        self.init_clock_offsets()
        self.block_size = agreed_block_size(self._startup_get([a.block_size.remote() for a in self.actors],
                                                              "reading the KV block size"))
        blocks = [a.num_blocks_for_memory.remote(config.cache.kv_cache_memory,
                                                 config.cache.gpu_memory_utilization)
                  for a in self.actors]
        fitted = pool_cap(config, arch, self.block_size,
                          min(self._startup_get(blocks, "sizing the KV cache")))
        self.num_kv_blocks = config.cache.num_blocks or fitted
        self.init_caches_and_dispatch()

    def _startup_get(self, refs: Any, what: str) -> Any:
        """ray.get for a start-up step, bounded by parallel.startup_timeout_s (named when it runs out)."""
        import ray

        try:
            return ray.get(refs, timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{what} took longer than "
                               f"parallel.startup_timeout_s={self.startup_timeout_s:g} s") from None

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
                logger.warning("embedded Ray runs on %s, not loopback: its servers listen on all interfaces",
                               ip)

    def init_actors(self) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ppserve.worker.stage_actor import StageActor

        par = self.config.parallel
        world = self.num_stages * self.tp
        bundle = {"CPU": par.cpus_per_worker}
        if self.gpus_per_worker:
            bundle["GPU"] = self.gpus_per_worker
        # One placement group per stage: its TP ranks packed on one node; stages go where resources allow,
        # or onto the nodes labelled with the stage's custom resource (launch/ scripts set those labels).
        self.placement_groups = []
        for s in range(self.num_stages):
            b = dict(bundle)
            if par.stage_resources:
                b[par.stage_resources[s]] = 0.01
            self.placement_groups.append(placement_group([dict(b) for _ in range(self.tp)],
                                                         strategy="STRICT_PACK"))
        self._startup_get([pg.ready() for pg in self.placement_groups], "placing the stages (Ray resources)")
        if not par.stage_resources:
            # The groups are interchangeable: renumber the stages so neighbours share nodes (placement.py).
            nodes = [placement_group_table(pg)["bundles_to_node_id"][0] for pg in self.placement_groups]
            self.placement_groups = [self.placement_groups[i] for i in order_stages_by_node(nodes)]
        actor_cls = ray.remote(StageActor)
        threads = par.num_threads or max(1, int(par.cpus_per_worker))
        self.actors: list[StageActorHandle] = []
        self.layout: list[dict[str, Any]] = []
        for s, (start, end) in enumerate(self.ranges):
            for r in range(self.tp):
                rank = s * self.tp + r
                spec = stage_spec(self.config, self.model_dir, self.arch, s, self.ranges, tp_rank=r,
                                  num_threads=threads, gpus=self.gpus_per_worker)
                actor = actor_cls.options(
                    num_cpus=par.cpus_per_worker, num_gpus=self.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self.placement_groups[s], placement_group_bundle_index=r),
                ).remote(spec, rank, world,  # stage links join TP ranks 0 only: one copy per stage pair
                         rank - self.tp if s > 0 and r == 0 else None,
                         rank + self.tp if s < self.num_stages - 1 and r == 0 else None)
                self.actors.append(actor)
                self.layout.append({"stage": s, "tp_rank": r, "layers": [start, end]})
        infos = self._startup_get([a.node_info.remote() for a in self.actors], "starting the stage actors")
        for lay, info in zip(self.layout, infos, strict=True):
            lay.update(info)
        master = infos[0]["node_ip"]
        port = self._startup_get(self.actors[0].listen_for_store.remote(master), "opening the rendezvous")
        tp_groups = [[s * self.tp + r for r in range(self.tp)] for s in range(self.num_stages)]
        self._startup_get([a.init_distributed.remote(master, port, tp_groups) for a in self.actors],
                          "loading weights and joining torch.distributed")
        for lay in self.layout:
            logger.info("stage %d tp %d: layers %s on node %s (pid %s)", lay["stage"], lay["tp_rank"],
                        lay["layers"], lay["node_ip"], lay["pid"])

    def init_clock_offsets(self, pings: int = 5) -> None:
        """Each actor's offset to the engine clock: half the round trip of the fastest of a few pings."""

        self.offsets: list[int] = []
        for a in self.actors:
            samples = []
            for _ in range(pings):
                t0 = time.perf_counter_ns()
                remote = self._startup_get(a.clock_ns.remote(), "measuring clock offsets")
                samples.append((t0, remote, time.perf_counter_ns()))
            self.offsets.append(estimate_offset(samples))

    def init_caches_and_dispatch(self) -> None:
        import ray

        costs = self._startup_get([a.init_cache.remote(self.num_kv_blocks) for a in self.actors],
                                  "allocating the KV cache")
        self.startup_cost = startup_pipeline_cost(costs[:: self.tp])  # TP rank 0's of each stage
        if self.dispatch_kind == "connections":
            # The actors connect back to this process: on loopback when Ray is embedded, else on the
            # address the cluster knows this node by.
            host = "127.0.0.1" if self.owns_ray else ray.util.get_node_ip_address()
            actors = self.actors

            def connect(address: Any, authkey: bytes) -> None:
                ray.get([a.serve_connection.remote(address, authkey, i) for i, a in enumerate(actors)],
                        timeout=CONNECT_TIMEOUT_S)

            self.dispatch = ConnectionDispatch(len(actors), self.num_stages, self.tp, host, connect)
        elif self.dispatch_kind == "compiled":
            ring = self.config.scheduler.token_ring_on and self.num_stages > 1
            self.dispatch = CompiledGraphDispatch(self.actors, self.num_stages, self.tp,
                                                  self.num_stages + 1 if ring else self.num_stages)
        else:
            self.dispatch = ClassicDispatch(self.actors, self.num_stages, self.tp)

    # ---- the hot path --------------------------------------------------------------------------
    def drain_spans(self) -> list[dict[str, Any]]:
        import ray

        # Classic calls queue behind the in-flight microbatches, so this is bounded like them; under a
        # compiled graph the actor answers between its graph steps.
        batches = ray.get([a.drain_spans.remote() for a in self.actors],
                          timeout=self.config.parallel.stage_timeout_s)
        return self.on_engine_clock(batches)

    # ---- failure recovery and repartitioning ------------------------------------------------------
    def rebuild(self) -> None:
        self._teardown_dispatch()
        self._kill_actors()
        self.init_actors()
        self.init_clock_offsets()
        self.init_caches_and_dispatch()

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

    def stop_stages(self) -> None:
        import ray

        self._teardown_dispatch()
        if getattr(self, "actors", None):
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except Exception as e:  # a dead actor must not block the rest of the teardown
                logger.warning("stage shutdown: %s", e)
        self._kill_actors()

    def shutdown(self) -> None:
        import ray

        self.stop_stages()
        if self.owns_ray:
            ray.shutdown()

