"""The stage-channel seam: how a stage hands its hidden states to the next one.

A channel is one directed link between two consecutive stages (the same TP rank on both sides).
Microbatches cross it in order, one message each: the hidden states [T, H], and a few float64
values: a row of step times (a step id and its compute seconds on every stage so far,
worker/stage_times.py), so the last stage can report the whole pipeline's times without the engine
asking each stage. The sender never waits for the receiver longer than one
outstanding send, and `recv` returns only when the data is there (a receive that merely posts a
request would book the wait as compute in the stage's spans).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
from torch import Tensor


class StageChannel(Protocol):
    def send(self, hidden: Tensor, times: tuple[float, ...]) -> None:
        """Ship one microbatch's hidden states [T, H] and its row of step times (may return before delivery)."""

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             num_times: int) -> tuple[Tensor, tuple[float, ...]]:
        """The next microbatch's hidden states [num_tokens, hidden_size] and the `num_times` values
        sent with them, once they have arrived."""

    def close(self) -> None:
        """Finish what is outstanding; the channel is not used afterwards."""


class InProcChannel:
    """Both stages live in this process: a FIFO of tensors, no copy."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Tensor, tuple[float, ...]]] = deque()

    def send(self, hidden: Tensor, times: tuple[float, ...]) -> None:
        self._queue.append((hidden, times))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             num_times: int) -> tuple[Tensor, tuple[float, ...]]:
        if not self._queue:
            raise RuntimeError("in-process channel: the previous stage sent nothing for this microbatch")
        hidden, times = self._queue.popleft()
        if hidden.shape != (num_tokens, hidden_size) or len(times) != num_times:
            raise RuntimeError(f"in-process channel: got hidden states {tuple(hidden.shape)} with {len(times)} "
                               f"time values, expected {(num_tokens, hidden_size)} with {num_times}")
        return hidden, times

    def close(self) -> None:
        self._queue.clear()
