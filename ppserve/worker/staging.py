"""One host-to-device copy per step: a step's integer inputs packed end to end in a persistent staging buffer.

Each `torch.tensor(list, device=cuda)` is a pageable host copy and a sync point, and a step has about
ten such inputs. `StepStaging.upload` writes every part (token ids, positions, slots, offsets, the
block-table diff, ...) into one pinned host buffer, copies it to the device in one non-blocking transfer
and hands back device views of each part. Two host buffers alternate, each guarded by an event: one is
rewritten only once its previous copy has left (long done by then: a step later), so the host never
waits for the GPU here. The device buffer is reused in stream order: a step's copy lands after the
previous step's kernels that read it. On CPU the packed tensor is the input itself (no copy at all).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor


class StepStaging:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._host: list[Tensor] = [torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._device_buf = torch.empty(0, dtype=torch.int64, device=self.device)
        self._turn = 0
        self.uploads = 0  # host-to-device copies made (one per call on CUDA): what tests count

    def upload(self, parts: Sequence[Sequence[int]]) -> list[Tensor]:
        """int64 device tensors with the values of `parts`, in order, from one copy."""
        flat = array("q")
        for part in parts:
            flat.extend(part)
        n = len(flat)
        packed = torch.frombuffer(flat, dtype=torch.int64) if n else torch.empty(0, dtype=torch.int64)
        if self.cuda:
            packed = self._to_device(packed, n)
        views, at = [], 0
        for part in parts:
            views.append(packed[at: at + len(part)])
            at += len(part)
        return views

    def _to_device(self, packed: Tensor, n: int) -> Tensor:
        turn = self._turn
        self._turn ^= 1
        done = self._copied[turn]
        if done is not None and not done.query():
            # this buffer's previous copy (two steps ago) is still running: rare, and needed
            done.synchronize()
        host = self._host[turn]
        if host.numel() < n:
            host = self._host[turn] = torch.empty(max(n, 2 * host.numel(), 1024), dtype=torch.int64,
                                                  pin_memory=True)
        host[:n].copy_(packed)
        if self._device_buf.numel() < n:
            self._device_buf = torch.empty(host.numel(), dtype=torch.int64, device=self.device)
        out = self._device_buf[:n]
        out.copy_(host[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event
        self.uploads += 1
        return out
