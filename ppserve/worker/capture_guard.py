"""A guard for code that CUDA graphs capture: no host-to-device copy, no device-to-host sync.

Inside `torch.cuda.graph(...)` a `torch.tensor(list, device="cuda")` (a host copy), an `.item()` or a
`.tolist()` (a sync) either fails the capture or bakes a stale value into the graph. `no_host_transfers`
turns each of them into an error naming the call, in the thread that runs the guarded code, on any
device: so the captured path is checked on CPU machines too (its eager twin runs the same Python).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch


class HostTransferInCapture(RuntimeError):
    """A host copy or a sync in code that must be capturable."""


_FACTORIES = ("tensor", "as_tensor", "from_numpy")
_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "nonzero")


@contextlib.contextmanager
def no_host_transfers(what: str = "captured code") -> Iterator[None]:
    """Within the block (this thread only), tensor factories from host data and syncing tensor methods
    raise."""
    owner = threading.get_ident()
    saved: list[tuple[Any, str, Any]] = []

    def forbid(holder: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(holder, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == owner:
                raise HostTransferInCapture(f"{holder.__name__}.{name} in {what}: a host copy or a sync; "
                                            "use preallocated device buffers instead")
            return original(*args, **kwargs)

        saved.append((holder, name, original))
        setattr(holder, name, guarded)

    try:
        for name in _FACTORIES:
            forbid(torch, name)
        for name in _METHODS:
            forbid(torch.Tensor, name)
        yield
    finally:
        for holder, name, original in reversed(saved):
            setattr(holder, name, original)
