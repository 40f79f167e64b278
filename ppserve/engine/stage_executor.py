"""What the Ray and the multi-process executors share: stages in other processes, reached over a
control plane (dispatch.py), each with its clock offset to this process and its place in the layout."""

from __future__ import annotations

from typing import Any

from ppserve.config import EngineConfig
from ppserve.engine.dispatch import ControlPlane
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.worker.info import WorkerInfo


class RemoteStagesExecutor:
    asynchronous = True  # the stages compute while the engine forms the next microbatch
    # From submit to stage 0 holding the microbatch on the connection control plane
    # (benchmarks/bench_control_plane.py); what the token ring's just-in-time formation forms ahead by,
    # with scheduler.ring_margin_ms.
    dispatch_latency_s = 0.5e-3

    config: EngineConfig
    ranges: list[tuple[int, int]]
    dispatch: ControlPlane | None
    offsets: list[int]  # each stage process's clock minus this one's, in ns (metrics/spans.py)
    layout: list[dict[str, Any]]  # per process: stage, tp_rank, layers and its NodeInfo fields

    # ---- the hot path --------------------------------------------------------------------------
    def submit(self, out: SchedulerOutput) -> None:
        assert self.dispatch is not None
        self.dispatch.submit(out)

    def collect(self, timeout_s: float | None = None) -> StepResult:
        assert self.dispatch is not None
        return self.dispatch.collect(timeout_s or self.config.parallel.stage_timeout_s)

    def on_engine_clock(self, batches: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """Every process's spans (in `layout` order), moved onto this process's clock."""
        return [{**d, "start_ns": d["start_ns"] + offset, "end_ns": d["end_ns"] + offset}
                for offset, spans in zip(self.offsets, batches, strict=True) for d in spans]

    def describe(self) -> list[WorkerInfo]:
        return [WorkerInfo(stage=lay["stage"], tp_rank=lay["tp_rank"], layer_start=lay["layers"][0],
                           layer_end=lay["layers"][1], node_ip=lay["node_ip"], node_id=lay["node_id"],
                           pid=lay["pid"]) for lay in self.layout]

    # ---- failure recovery and repartitioning ------------------------------------------------------
    def rebuild(self) -> None:
        """Replace the whole pipeline: new processes, new process groups, empty caches. Survivors go too:
        their process group includes the dead rank and cannot be repaired. The KV block count stays, as
        the scheduler's allocator keeps its size."""
        raise NotImplementedError

    def stop_stages(self) -> None:
        """Stop the control plane, let every stage close its links and process group, kill what is left."""
        raise NotImplementedError

    def repartition(self, ranges: list[tuple[int, int]]) -> None:
        """Rebuild with other layer ranges (after a calibration run); nothing may be in flight."""
        self.ranges = list(ranges)
        self.stop_stages()
        self.rebuild()

    def _teardown_dispatch(self) -> None:
        if self.dispatch is not None:
            self.dispatch.teardown()  # in-flight results are lost with the old stages
            self.dispatch = None
