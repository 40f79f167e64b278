"""Hidden states over torch.distributed point-to-point: gloo between CPU processes, NCCL between GPUs.

The receiver knows the tensor's shape from the SchedulerOutput (its token count) and its stage index,
so nothing but two tensors crosses the link: the hidden states, then a row of step times (float64, on
the link's device; worker/stage_times.py). Sends are asynchronous with at most one message outstanding (its buffers are
kept alive until it completes). A receive waits on its work handles and, on CUDA, for the stream
NCCL wrote into: `dist.recv` on NCCL returns once the receive is *enqueued*, and a span that ended
there would book the wait for the data as compute.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class TorchP2PChannel:
    """One end of the link: `peer` is the global rank at the other end; this side sends or receives."""

    def __init__(self, peer: int, device: torch.device) -> None:
        self.peer = peer
        self.device = device
        self._pending: list[Any] = []  # the outstanding message's work handles
        self._buffers: tuple[Tensor, ...] = ()

    def send(self, hidden: Tensor, times: tuple[float, ...]) -> None:
        self._wait_pending()  # at most one message outstanding; keeps its buffers alive until done
        values = torch.tensor(times, dtype=torch.float64)
        if self.device.type == "cuda":
            # Not torch.tensor(..., device=cuda): a copy from pageable memory waits for the stream, i.e. for
            # this step's compute, on every step. From pinned memory it is queued and the host goes on (the
            # caching host allocator keeps the pinned block until the copy is done).
            values = values.pin_memory().to(self.device, non_blocking=True)
        self._buffers = (hidden.contiguous(), values)
        self._pending = [dist.isend(t, dst=self.peer) for t in self._buffers]

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             num_times: int) -> tuple[Tensor, tuple[float, ...]]:
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
        times = torch.empty(num_times, dtype=torch.float64, device=self.device)
        for work in [dist.irecv(hidden, src=self.peer), dist.irecv(times, src=self.peer)]:
            assert work is not None  # None only for a rank outside the group, which a stage never is
            work.wait()
        self._data_ready(hidden)
        return hidden, tuple(times.tolist())

    @staticmethod
    def _data_ready(hidden: Tensor) -> None:
        """Block until the received data is there. On NCCL `work.wait()` only makes the current stream
        wait for the transfer; without this the host would go on (and the stage's receive span end)
        while the data is still on its way, and the wait would be booked as the next compute span."""
        if hidden.is_cuda:
            torch.cuda.current_stream(hidden.device).synchronize()

    def _wait_pending(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending = []

    def close(self) -> None:
        try:
            self._wait_pending()
        except Exception:  # the peer may be gone already; closing anyway
            self._pending = []
