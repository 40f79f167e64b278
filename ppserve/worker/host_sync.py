"""Host syncs inside a stage's step: the one allowed, and a guard that catches every other.

A stage's step must never make the host wait for its device: a host that waits cannot queue the next
step's launches behind the current one, so launch latency shows on every step and no stage runs ahead
of its GPU. The one read a step needs is the last stage's sampled token ids (the engine needs them);
it is marked with `allowed_read()`. Everything else that would wait, explicitly (`synchronize`) or not
(`.tolist()`, `.item()`, `int(t)`, a boolean mask, `nonzero`, a pageable copy), is a defect.

`strict_steps()` says whether the guard is on (`PPSERVE_STRICT_HOST_SYNC=1`: the GPU check, and tests);
`step_guard(device)` is what `StageActor.execute` runs a step under: on CUDA torch's own sync debug
mode set to error (it sees the implicit syncs too), on CPU a torch-function mode that fails on the
calls that would sync on a GPU, so the discipline holds without a device.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

STRICT_ENV = "PPSERVE_STRICT_HOST_SYNC"  # also read by worker/stage_actor.py, which imports no torch at load

_state = threading.local()


class HostSyncError(RuntimeError):
    """A stage's step read from its device outside the one allowed read."""


def strict_steps() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def _allowed() -> bool:
    return bool(getattr(_state, "allowed", 0))


@contextmanager
def allowed_read() -> Iterator[None]:
    """The step's one read of the device (the last stage's sampled ids)."""
    _state.allowed = getattr(_state, "allowed", 0) + 1
    cuda_mode = None
    if getattr(_state, "cuda_guard", False):
        cuda_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        _state.allowed -= 1
        if cuda_mode is not None:
            torch.cuda.set_sync_debug_mode(cuda_mode)


def _syncing_calls() -> set[Any]:
    """Tensor methods and torch functions that wait for the device when their input lives on one."""
    T = torch.Tensor
    names = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero", "cpu",
             "synchronize", "unique", "masked_select")
    calls: set[Any] = {getattr(T, n) for n in names if hasattr(T, n)}
    calls |= {torch.nonzero, torch.unique, torch.masked_select, torch.cuda.synchronize}
    return calls


class CpuSyncGuard(TorchFunctionMode):
    """Fails on a call that would make the host wait for a GPU, outside `allowed_read()`. Host-side
    tensors that never were on a device (pinned staging buffers) do not occur in these calls in a step."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.calls = _syncing_calls()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        why = self._why(func, args, kwargs)
        if why and not _allowed():
            name = getattr(func, "__qualname__", repr(func))
            self.seen.append(name)
            raise HostSyncError(f"{self.where}: {name} {why} inside a stage's step (a sync on a GPU); only "
                                "the last stage's sampled ids may be read")
        return func(*args, **kwargs)

    def _why(self, func: Any, args: Any, kwargs: dict[str, Any]) -> str:
        if func in self.calls:
            return "reads the device back to the host"
        if func is torch.repeat_interleave and "output_size" not in kwargs and not isinstance(
                args[0] if args else None, int):
            return "sizes its output from device data"
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            return "copies host data from pageable memory to the device"
        if func is torch.Tensor.__getitem__ and len(args) > 1 and _is_mask(args[1]):
            return "indexes with a boolean mask (its size comes from the device)"
        return ""


def _is_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def step_guard(device: torch.device, where: str) -> Iterator[None]:
    """Run a stage's step under the guard for its device (see the module docstring)."""
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        _state.cuda_guard = True
        try:
            yield
        finally:
            _state.cuda_guard = False
            torch.cuda.set_sync_debug_mode(previous)
        return
    with CpuSyncGuard(where):
        yield
