"""GPU assignment and stage placement from fake Ray maps (no Ray, no torch, no GPU)."""

from __future__ import annotations

import pytest

from ppserve.engine.placement import node_crossings, order_stages_by_node, resolve_gpus_per_worker
from ppserve.worker.devices import cuda_device_for_actor


def test_each_actor_gets_the_gpu_ray_assigned() -> None:
    # Eight actors of one node, each given one GPU: Ray sets CUDA_VISIBLE_DEVICES to that GPU alone.
    for gpu in range(8):
        assert cuda_device_for_actor([str(gpu)], str(gpu), 1, 1.0) == 0
    # Two GPUs visible (two assigned): the first assigned one, by its place in the visible list.
    assert cuda_device_for_actor(["5", "3"], "5,3", 2, 2.0) == 0
    assert cuda_device_for_actor(["3"], "5,3", 2, 1.0) == 1
    # Ray told not to set CUDA_VISIBLE_DEVICES: the id is the physical index.
    assert cuda_device_for_actor(["6"], None, 8, 1.0) == 6
    # Half a GPU each: two actors share one, each still on its own assignment.
    assert cuda_device_for_actor(["2"], "2", 1, 0.5) == 0


def test_cpu_actors_stay_on_cpu() -> None:
    assert cuda_device_for_actor([], None, 0, 0.0) is None


@pytest.mark.parametrize(("args", "needle"), [
    (([], None, 8, 0.0), "asked Ray for no GPU"),
    ((["0"], "0", 0, 1.0), "torch sees no CUDA device"),
    (([], "0", 1, 1.0), "assigned no GPU"),
    ((["4"], "0,1", 2, 1.0), "does not include GPU 4"),
    ((["9"], None, 8, 1.0), "not among the 8 device"),
])
def test_inconsistent_set_ups_are_refused_with_what_to_change(args: tuple, needle: str) -> None:
    with pytest.raises(RuntimeError, match=needle):
        cuda_device_for_actor(*args)


def test_gpus_per_worker_defaults_to_one_when_the_cluster_has_gpus() -> None:
    assert resolve_gpus_per_worker(None, 16.0) == 1.0
    assert resolve_gpus_per_worker(None, 0.0) == 0.0
    assert resolve_gpus_per_worker(0.5, 16.0) == 0.5
    assert resolve_gpus_per_worker(0, 16.0) == 0.0  # an explicit 0 is kept (and refused by the actor)
    with pytest.raises(ValueError, match="gpus_per_worker"):
        resolve_gpus_per_worker(-1, 0)


def test_stages_are_renumbered_so_consecutive_stages_share_nodes() -> None:
    nodes = ["A", "B", "A", "B"]  # Ray's choice for four interchangeable stage groups
    order = order_stages_by_node(nodes)
    assert order == [0, 2, 1, 3]
    assert node_crossings([nodes[g] for g in order]) == 1 < node_crossings(nodes) == 3
    assert order_stages_by_node(["B", "B", "A", "C", "A"]) == [0, 1, 2, 4, 3]
    assert order_stages_by_node([]) == []
