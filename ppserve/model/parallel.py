"""Tensor-parallel context: which TP rank this process is and the two collectives the model layers use."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class TPContext:
    """One TP rank's view of its group. At size 1 every collective is the identity."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup; None when size == 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"TP size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} outside [0, {self.size})")

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the group in place and return it."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)  # type: ignore[arg-type]
        return x

    def all_reduce_max(self, x: Tensor) -> Tensor:
        """Element-wise maximum of `x` over the group, in place."""
        if self.size == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)  # type: ignore[arg-type]
        return x

    def all_gather_last_dim(self, x: Tensor) -> Tensor:
        """Concatenate every rank's shard of `x` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shards, x, group=self.group)  # type: ignore[arg-type]
        return torch.cat(shards, dim=-1)

    def shard_range(self, total: int) -> tuple[int, int]:
        """The [start, end) slice of an evenly divisible dimension of length `total` owned by this rank."""
        if total % self.size != 0:
            raise ValueError(f"dimension {total} is not divisible by TP size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per
