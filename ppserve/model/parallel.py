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
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def max_over_group(self, value: float, device: torch.device | str) -> float:
        """The largest of every rank's `value`: a collective, so that a choice each rank makes from its own
        measurement (how many runs to time) is the same on all of them; a choice that differed would leave
        one rank in a collective its peers never call."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def all_gather_last_dim(self, x: Tensor) -> Tensor:
        """Concatenate every rank's shard of `x` along the last dimension (rank order)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        shards = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shards, x, group=self.group)
        return torch.cat(shards, dim=-1)

    def gather_last_dim_to_first(self, x: Tensor) -> Tensor | None:
        """`all_gather_last_dim` delivered to TP rank 0 only (None on the others): what one sampling
        rank needs, at 1/size of the traffic and memory of gathering everywhere."""
        if self.size == 1:
            return x
        x = x.contiguous()
        first = dist.get_global_rank(self.group, 0)  # type: ignore[arg-type]
        shards = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, shards, dst=first, group=self.group)  # type: ignore[arg-type]
        return torch.cat(shards, dim=-1) if shards is not None else None

    def broadcast_from_first(self, x: Tensor) -> Tensor:
        """TP rank 0's `x` into every rank's `x` (same shape and dtype on all), in place."""
        if self.size == 1:
            return x
        dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)  # type: ignore[arg-type]
        return x

    def shard_range(self, total: int) -> tuple[int, int]:
        """The [start, end) slice of an evenly divisible dimension of length `total` owned by this rank."""
        if total % self.size != 0:
            raise ValueError(f"dimension {total} is not divisible by TP size {self.size}")
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per
