"""Where one (stage, TP rank) worker runs: the one description executors report and stats carry.

It lives in the worker layer so that the stage actor (which knows its node) and the engine's
executors and statistics (which gather the descriptions) name the same fields. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict


class NodeInfo(TypedDict):
    """What a stage actor reports of its process at start-up (StageActor.node_info)."""

    node_ip: str
    node_id: str
    pid: int


@dataclass(frozen=True)
class WorkerInfo:
    """One (stage, tp rank): its decoder layers [layer_start, layer_end) and where its process runs."""

    stage: int
    tp_rank: int
    layer_start: int
    layer_end: int
    node_ip: str = ""  # "local" for the in-process executor
    node_id: str = ""  # Ray's node id; empty without Ray
    pid: int = 0
