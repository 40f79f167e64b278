"""A checkpoint tensor read lazily: only the rows and columns a tensor-parallel rank keeps leave the disk.

The loader hands every layer's `weight_loader` a `CheckpointTensor` (a safetensors slice) instead of
the whole tensor. The layers index it exactly as they would index the full tensor (`full[a:b]`,
`full[:, a:b]`), and only that window is read, so a rank of TP size t reads about 1/t of each sharded
matrix (an 8-way 70B stage reads its 1/8, not all of it and then drops 7/8). Fused checkpoint
tensors (Phi-3's qkv_proj) split into row windows that stay lazy too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ppserve.model.quant.codes import attach, codes_of


class CheckpointTensor:
    """A window of rows [row_start, row_start + rows) of a safetensors tensor, read on indexing."""

    def __init__(self, source: Any, dtype: torch.dtype | None = None, row_start: int = 0,
                 rows: int | None = None) -> None:
        self._source = source  # safetensors' slice object: get_shape() and [a:b, c:d] indexing
        full: list[int] = list(source.get_shape())
        self._row_start = row_start
        if full:
            self.shape = torch.Size([full[0] - row_start if rows is None else rows, *full[1:]])
        else:
            self.shape = torch.Size([])
        self._dtype = dtype

    def to(self, dtype: torch.dtype) -> CheckpointTensor:
        """Read later as `dtype` (nothing is read now)."""
        return CheckpointTensor(self._source, dtype, self._row_start, self.shape[0] if self.shape else None)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[CheckpointTensor]:
        """Consecutive row windows of these sizes (dim 0 only: how fused projections are stacked)."""
        if dim != 0:
            raise ValueError("a checkpoint tensor splits along its rows only")
        if sum(sizes) != self.shape[0]:
            raise ValueError(f"split sizes {list(sizes)} do not add up to {self.shape[0]} rows")
        out, start = [], self._row_start
        for n in sizes:
            out.append(CheckpointTensor(self._source, self._dtype, start, n))
            start += n
        return out

    def __getitem__(self, index: slice | tuple[slice, ...]) -> Tensor:
        """Read the window `index` (plain slices without step, as the layers take their shards)."""
        parts = index if isinstance(index, tuple) else (index,)
        if not parts or any(not isinstance(p, slice) or p.step not in (None, 1) for p in parts):
            raise TypeError(f"checkpoint tensors take plain slices, got {index!r}")
        if len(self.shape) == 0:
            return self._read(())
        start, stop, _ = parts[0].indices(self.shape[0])
        rows = slice(self._row_start + start, self._row_start + max(start, stop))
        return self._read((rows, *parts[1:]))

    def materialize(self) -> Tensor:
        """The whole window."""
        return self[:] if len(self.shape) else self._read(())

    def _read(self, index: tuple[slice, ...]) -> Tensor:
        t: Tensor = self._source[index] if index else self._source[:]
        if self._dtype is None:
            return t
        return attach(t.to(self._dtype), codes_of(t))  # a quantized window's codes stay with it


def as_tensor(x: Tensor | CheckpointTensor) -> Tensor:
    """A real tensor: a checkpoint tensor is read in full."""
    return x.materialize() if isinstance(x, CheckpointTensor) else x
