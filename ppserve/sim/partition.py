"""The simulator's layer split, made the way the engine makes it (ARCHITECTURE.md#the-simulator).

`parallel.partition_mode` and `parallel.layer_partition` mean what they mean to `LLM(...)`: explicit
counts, `even`, `cost` (weights per token, robust over a decode and a full-budget prefill microbatch:
`ppserve.sched.partition.initial_ranges`, the engine's own function), or `calibrated`: the engine's
calibration workload (`ppserve.engine.calibration.calibration_workload`) runs through the simulator on
the even split, its microbatches' shapes and roofline stage times are fitted by the engine's
`fit_cost_profile`, and the exact cost partition minimizes the slowest stage at that run's mean
microbatch. Pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from ppserve.config import ParallelConfig, SchedulerConfig
from ppserve.engine.calibration import calibration_workload
from ppserve.sched.cost import BatchShape
from ppserve.sched.partition import fit_cost_profile, initial_ranges
from ppserve.sim.cost_model import HardwareSpec, ModelSpec, RooflineCostModel
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.workload import WorkloadRequest

__all__ = ["simulated_ranges"]


class _Recorder:
    """A cost model that passes through another and keeps every microbatch's shape and stage times."""

    def __init__(self, inner: RooflineCostModel) -> None:
        self.inner = inner
        self.num_stages = inner.num_stages
        self.samples: list[tuple[BatchShape, list[float]]] = []

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        t = self.inner.stage_time(stage, shape)
        if stage == 0:  # the pipeline prices a microbatch's stages in order
            self.samples.append((shape, []))
        self.samples[-1][1].append(t)
        return t

    def transfer_time(self, shape: BatchShape) -> float:
        return self.inner.transfer_time(shape)


def simulated_ranges(par: ParallelConfig, model: ModelSpec, hw: HardwareSpec, num_stages: int, tp: int,
                     sched: SchedulerConfig, max_model_len: int, num_blocks: int,
                     block_size: int) -> list[tuple[int, int]]:
    """The layer ranges the engine would run `model` with on `num_stages` stages, priced on `hw`."""
    par = replace(par, pipeline_parallel_size=num_stages)
    ranges = initial_ranges(par, model, sched.token_budget)
    if par.partition_mode != "calibrated" or num_stages < 2 or par.layer_partition:
        return ranges
    n, prompt_len, out_len = calibration_workload(sched, num_stages, max_model_len)
    recorder = _Recorder(RooflineCostModel(model, hw, num_stages, tp, tuple(e - s for s, e in ranges)))
    simulate([WorkloadRequest(0.0, prompt_len, out_len)] * n, recorder,
             SimConfig(sched, num_blocks, block_size, max_model_len))
    profile = fit_cost_profile(recorder.samples, ranges, source="simulated calibration run")
    return profile.ranges(model.num_layers, num_stages)
