"""The scheduler: pure Python, no torch, ray or grpc. Reused unchanged by the simulator."""

from ppserve.sched.block_manager import BlockManager
from ppserve.sched.output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.scheduler import Scheduler

__all__ = [
    "BlockManager",
    "CachedRequestData",
    "NewRequestData",
    "RequestUpdate",
    "Scheduler",
    "SchedulerOutput",
    "StepResult",
]
