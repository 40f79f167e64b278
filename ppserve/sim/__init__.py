"""Discrete-event simulator: ppserve's own scheduler over a step-time cost model
(ARCHITECTURE.md#the-simulator, #measuring-bubbles).

Pure Python: never imports torch, ray or grpc, so it runs anywhere the unit tests run.
"""

from ppserve.sched.cost import BatchShape
from ppserve.sim.cost_model import (
    ConstantCostModel,
    CostModel,
    HardwareSpec,
    ModelSpec,
    Profile,
    ProfileCostModel,
    RooflineCostModel,
    fit_profile,
    kv_cache_blocks,
    load_hardware,
    load_model_spec,
)
from ppserve.sim.simulator import SimConfig, SimResult, simulate
from ppserve.sim.workload import WorkloadRequest, poisson_arrivals, read_trace, with_poisson_arrivals

__all__ = [
    "BatchShape",
    "ConstantCostModel",
    "CostModel",
    "HardwareSpec",
    "ModelSpec",
    "Profile",
    "ProfileCostModel",
    "RooflineCostModel",
    "SimConfig",
    "SimResult",
    "WorkloadRequest",
    "fit_profile",
    "kv_cache_blocks",
    "load_hardware",
    "load_model_spec",
    "poisson_arrivals",
    "read_trace",
    "simulate",
    "with_poisson_arrivals",
]
