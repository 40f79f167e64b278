"""Device facts of a stage worker: which CUDA device it owns, and the dtypes it computes and caches in.

Which device: the GPU Ray assigned to the actor, never "GPU 0 of the node".

Ray (2.60) sets CUDA_VISIBLE_DEVICES for an actor only when the actor requested GPUs; an actor that
requested none sees every GPU of its node, and `cuda:0` would put every such actor of a node on the
same GPU. So the device comes from Ray's assignment, and the two inconsistent set-ups (CUDA visible
without a GPU requested, a GPU requested without CUDA) are refused with what to change.
`cuda_device_for_actor` is plain logic: the caller passes what Ray and torch report.

Which dtypes: `resolve_dtype` turns model.dtype (`auto` or a name) into a torch dtype from the checkpoint
and the device, `resolve_kv_dtype` does the same for cache.dtype.

Which thread: `torch.cuda.set_device` is per thread. A stage actor is built on one thread, but Ray runs
its calls, its compiled graph's loop and the connection control plane's reader on others, where the
current device is cuda:0 again: `bind_thread_device` makes every such thread use the actor's device.
Which kernels: the CPU C kernels are never built in a CUDA worker (`kernel_settings_for`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ppserve.model.arch import ModelArch
from ppserve.model.ops.settings import KernelSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def current_device() -> torch.device:
    """This process's device: its current CUDA device (set from Ray's assignment) when CUDA is there, else
    the CPU."""
    return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
            else torch.device("cpu"))


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """`auto`: on GPU the checkpoint's half dtype, and bf16 for a float32 checkpoint (the default model's
    safetensors are float32 only because they are dequantized from its GGUF: serving them in fp32 would
    halve the GPU's speed for nothing, and fp32 is there on request); bf16 on CPUs with native bf16, else
    float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        dtype = DTYPES.get(arch.torch_dtype or "bfloat16", torch.bfloat16)
        return torch.bfloat16 if dtype == torch.float32 else dtype
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def kernel_settings_for(settings: KernelSettings, device: torch.device) -> KernelSettings:
    """The kernel settings a worker on `device` uses: on CUDA the CPU C kernels are off (their tensors
    live on the GPU, so building them would only cost a compiler run at start-up)."""
    return replace(settings, native=False) if device.type == "cuda" else settings


_thread_device = threading.local()


def bind_thread_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of the calling thread (once per thread; a no-op on CPU)."""
    if device.type != "cuda" or getattr(_thread_device, "index", None) == device.index:
        return
    torch.cuda.set_device(device)
    _thread_device.index = device.index


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """cache.dtype: `auto` is the model's own dtype."""
    return dtype if name == "auto" else DTYPES[name]


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
                "parallel.gpus_per_worker (leave it unset: 1 when the cluster has GPUs), or hide the GPUs "
                "from the workers with CUDA_VISIBLE_DEVICES=''"
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
        raise RuntimeError("Ray assigned no GPU to this stage actor although it asked for "
                           f"{requested_gpus:g}")
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
        raise RuntimeError(f"GPU {ids[0]} (local index {index}) is not among the {visible_device_count} "
                           "device(s) torch sees in this actor")
    return index
