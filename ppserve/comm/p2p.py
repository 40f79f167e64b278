"""Hidden states over torch.distributed point-to-point: gloo between CPU processes, NCCL between GPUs.

The receiver knows the tensor's shape from the SchedulerOutput (its token count) and its stage index,
so nothing but two tensors crosses the link: the hidden states, then a row of step times (float64, on
the link's device; worker/stage_times.py). Sends are asynchronous with at most one message outstanding
(its buffers are kept alive until it completes). A receive can be posted ahead (`post_recv`: an
`irecv`), and its wait never blocks the host on CUDA: `work.wait()` orders the current stream after the
transfer, the layers that read the data wait on the device, and the step times ride to pinned host
memory behind it, read a step later (`LinkValues`). The time the device spent waiting is the stage's
`recv_wait` span, timed by CUDA events like its compute (worker/step_timer.py), not by the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ppserve.comm.channel import LinkValues


class TorchP2PChannel:
    """One end of the link: `peer` is the global rank at the other end; this side sends or receives.
    `group`: the communicator the link uses (None: the default one)."""

    def __init__(self, peer: int, device: torch.device, group: Any = None) -> None:
        self.peer = peer
        self.device = device
        self.group = group
        self._pending: list[Any] = []  # the outstanding message's work handles
        self._buffers: tuple[Tensor, ...] = ()

    def send(self, hidden: Tensor, times: tuple[float, ...], step: int = -1) -> None:
        self._wait_pending()  # at most one message outstanding; keeps its buffers alive until done
        values = torch.tensor(times, dtype=torch.float64)
        if self.device.type == "cuda":
            # Not torch.tensor(..., device=cuda): a copy from pageable memory waits for the stream, i.e. for
            # this step's compute, on every step. From pinned memory it is queued and the host goes on (the
            # caching host allocator keeps the pinned block until the copy is done).
            values = values.pin_memory().to(self.device, non_blocking=True)
        self._buffers = (hidden.contiguous(), values)
        self._pending = [dist.isend(t, dst=self.peer, group=self.group) for t in self._buffers]

    def post_recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
                  step: int = -1) -> _Posted:
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
        times = torch.empty(num_times, dtype=torch.float64, device=self.device)
        works = [dist.irecv(hidden, src=self.peer, group=self.group),
                 dist.irecv(times, src=self.peer, group=self.group)]
        return _Posted(hidden, times, works)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
             step: int = -1) -> tuple[Tensor, LinkValues]:
        return self.post_recv(num_tokens, hidden_size, dtype, num_times, step).wait()

    def _wait_pending(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []

    def close(self) -> None:
        try:
            self._wait_pending()
        except Exception:  # the peer may be gone already; closing anyway
            self._pending = []


class _Posted:
    def __init__(self, hidden: Tensor, times: Tensor, works: list[Any]) -> None:
        self.hidden, self.times, self.works = hidden, times, works

    def wait(self) -> tuple[Tensor, LinkValues]:
        for work in self.works:
            assert work is not None  # None only for a rank outside the group, which a stage never is
            work.wait()  # gloo: the data is here; NCCL: the current stream waits for it, the host does not
        if not self.times.is_cuda:
            return self.hidden, LinkValues(tuple(self.times.tolist()))
        host = torch.empty(self.times.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(self.times, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return self.hidden, LinkValues(host=host, event=event)
