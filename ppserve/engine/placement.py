"""Where the stages go: GPUs per actor, and stage order over the nodes Ray chose. Pure Python.

Each stage's TP ranks are one STRICT_PACK placement group (one node, NVLink between them). Which node
hosts which stage is Ray's choice; since every stage asks for the same bundles, the stages can be
renumbered afterwards so that consecutive stages share a node wherever possible: hidden states then
cross the slower inter-node link as few times as the layout allows (with 4 stages on 2 nodes, once
instead of up to three times).
"""

from __future__ import annotations

from collections.abc import Sequence


def resolve_gpus_per_worker(setting: float | None, cluster_gpus: float, world_size: int = 1) -> float:
    """parallel.gpus_per_worker: unset means one GPU per actor when the cluster has GPUs, else none.

    GPU actors of a pipeline talk over NCCL (the TP groups and the stage links), and NCCL refuses, or
    hangs on, two ranks of one communicator on one GPU: with more than one actor a GPU share must be
    whole, so a fraction (which Ray would happily pack two to a GPU) is refused here, before any actor
    starts."""
    if setting is not None:
        if setting < 0:
            raise ValueError(f"parallel.gpus_per_worker must be >= 0, got {setting!r}")
        if world_size > 1 and setting != int(setting):
            raise ValueError(
                f"parallel.gpus_per_worker={setting:g} with {world_size} actors: GPU actors talk over NCCL, "
                "which cannot put two ranks of one group on one GPU; use a whole number of GPUs per actor "
                "(1), or run on one GPU with parallel.executor=inproc")
        return float(setting)
    return 1.0 if cluster_gpus > 0 else 0.0


def order_stages_by_node(group_nodes: Sequence[str]) -> list[int]:
    """Given the node of each (interchangeable) placement group, the group each stage should use:
    groups of one node kept together, nodes in the order they first appear."""
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(group_nodes):
        by_node.setdefault(node, []).append(i)
    return [i for groups in by_node.values() for i in groups]


def node_crossings(stage_nodes: Sequence[str]) -> int:
    """How many consecutive stage pairs sit on different nodes."""
    return sum(a != b for a, b in zip(stage_nodes, stage_nodes[1:], strict=False))
