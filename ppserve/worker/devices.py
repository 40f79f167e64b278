"""Which CUDA device a stage actor owns: the GPU Ray assigned to it, never "GPU 0 of the node".

Ray (2.60) sets CUDA_VISIBLE_DEVICES for an actor only when the actor requested GPUs; an actor that
requested none sees every GPU of its node, and `cuda:0` would put every such actor of a node on the
same GPU. So the device comes from Ray's assignment, and the two inconsistent set-ups (CUDA visible
without a GPU requested, a GPU requested without CUDA) are refused with what to change. Pure Python:
the caller passes what Ray and torch report.
"""

from __future__ import annotations

from collections.abc import Sequence


def cuda_device_for_actor(assigned_gpu_ids: Sequence[str | int], cuda_visible_devices: str | None,
                          visible_device_count: int, requested_gpus: float) -> int | None:
    """The local CUDA device index this actor must use, or None to run on CPU.

    `assigned_gpu_ids`: the GPU ids Ray assigned (runtime context accelerator ids); `cuda_visible_devices`:
    the actor's CUDA_VISIBLE_DEVICES (None when unset); `visible_device_count`: torch's device count (0
    without CUDA); `requested_gpus`: parallel.gpus_per_worker as resolved.
    """
    if requested_gpus <= 0:
        if visible_device_count > 0:
            raise RuntimeError(
                f"this stage actor sees {visible_device_count} CUDA device(s) but asked Ray for no GPU "
                "(parallel.gpus_per_worker=0): every such actor of a node would run on the same GPU. Set "
                "parallel.gpus_per_worker (leave it unset: 1 when the cluster has GPUs), or hide the GPUs from "
                "the workers with CUDA_VISIBLE_DEVICES=''"
            )
        return None
    if visible_device_count == 0:
        raise RuntimeError(
            f"this stage actor asked Ray for {requested_gpus:g} GPU(s) but torch sees no CUDA device (a "
            "CPU-only torch, or no driver on this node): install a CUDA build of torch on every node, or set "
            "parallel.gpus_per_worker=0 to run on CPUs"
        )
    ids = [str(i) for i in assigned_gpu_ids]
    if not ids:
        raise RuntimeError(f"Ray assigned no GPU to this stage actor although it asked for {requested_gpus:g}")
    if cuda_visible_devices is None:
        # Ray was told not to set CUDA_VISIBLE_DEVICES (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): the ids
        # are physical indices.
        index = int(ids[0])
    else:
        visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
        if ids[0] not in visible:
            raise RuntimeError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} does not include GPU {ids[0]}, the one Ray "
                "assigned to this actor: do not override CUDA_VISIBLE_DEVICES for Ray workers"
            )
        index = visible.index(ids[0])
    if index >= visible_device_count:
        raise RuntimeError(f"GPU {ids[0]} (local index {index}) is not among the {visible_device_count} device(s) "
                           "torch sees in this actor")
    return index
