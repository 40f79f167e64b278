"""The stage-channel seam: how a stage hands its hidden states to the next one.

A channel is one directed link between two stages (the same TP rank on both sides; the token ring's
link runs from the last stage back to stage 0). Microbatches cross it in order, one message each: a
tensor (the hidden states [T, H], or the ring's sampled tokens) and a few float64 values: a row of step
times (a step id and its compute seconds on every stage so far, worker/stage_times.py), so the last
stage can report the whole pipeline's times without the engine asking each stage.

The contract is the strictest a GPU transport may show, NCCL's: a send may block until the peer has
posted the matching receive, the first contact of a pair may block both sides until both arrive, and
messages match their receives in posting order. A receive can be posted ahead of its wait
(`post_recv`), which is how a stage keeps a peer's send from blocking on it. `comm/rendezvous.py`
enforces exactly this contract on CPU, so CI shows what NCCL would do; the other channels are kinder.
The `step` of a send or receive only labels it (the rendezvous link checks that the two agree).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor


class LinkValues:
    """The float64 values that came with a message. On a host link they are there at once; over NCCL
    they land in device memory and are copied to pinned host memory behind the data, readable once
    that copy's event is done (`ready`): a stage reads them a step late rather than wait for its
    device (worker/stage_times.py tolerates rows that come late)."""

    def __init__(self, values: tuple[float, ...] | None = None, host: Tensor | None = None,
                 event: Any = None) -> None:
        self._values = values
        self._host = host
        self._event = event

    def ready(self) -> bool:
        return self._values is not None or self._event is None or bool(self._event.query())

    def get(self) -> tuple[float, ...]:
        """The values; waits for the copy if it is not done (only off the hot path: call `ready` first)."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            assert self._host is not None
            self._values = tuple(float(v) for v in self._host.tolist())
            self._host = self._event = None
        return self._values


class PostedRecv(Protocol):
    def wait(self) -> tuple[Tensor, LinkValues]:
        """The message's tensor and values, once they have arrived."""


class Deferred:
    """A receive that a channel completes when it is waited on (links whose data waits in a buffer)."""

    def __init__(self, receive: Callable[[], tuple[Tensor, LinkValues]]) -> None:
        self._receive = receive

    def wait(self) -> tuple[Tensor, LinkValues]:
        return self._receive()


class StageChannel(Protocol):
    def send(self, hidden: Tensor, times: tuple[float, ...], step: int = -1) -> None:
        """Ship one message: a tensor [T, H] and its float64 values (may return before delivery, may
        block until the peer has posted the receive)."""

    def post_recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
                  step: int = -1) -> PostedRecv:
        """Post the receive of the next message [num_tokens, hidden_size] with `num_times` values; the
        data is there once the returned handle's `wait` returns."""

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
             step: int = -1) -> tuple[Tensor, LinkValues]:
        """`post_recv(...).wait()`."""

    def close(self) -> None:
        """Finish what is outstanding; the channel is not used afterwards."""


class InProcChannel:
    """Both stages live in this process: a FIFO of tensors, no copy."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Tensor, tuple[float, ...]]] = deque()

    def send(self, hidden: Tensor, times: tuple[float, ...], step: int = -1) -> None:
        self._queue.append((hidden, times))

    def post_recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
                  step: int = -1) -> PostedRecv:
        return Deferred(lambda: self.recv(num_tokens, hidden_size, dtype, num_times, step))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
             step: int = -1) -> tuple[Tensor, LinkValues]:
        if not self._queue:
            raise RuntimeError("in-process channel: the previous stage sent nothing for this microbatch")
        hidden, times = self._queue.popleft()
        if hidden.shape != (num_tokens, hidden_size) or len(times) != num_times:
            raise RuntimeError(f"in-process channel: got hidden states {tuple(hidden.shape)} with "
                               f"{len(times)} time values, expected {(num_tokens, hidden_size)} with "
                               f"{num_times}")
        return hidden, LinkValues(times)

    def close(self) -> None:
        self._queue.clear()
