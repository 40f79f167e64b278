"""Many rows of an int4 layer on CPU: dequantize its packed weight to bf16 a block at a time and multiply.

torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) costs time in proportion to the rows, so at prefill
sizes a bf16 GEMM on the dequantized weight wins even counting the dequantization, which costs the same at
any row count (docs/decisions.md#quantized-weights-on-cpu). The weight is read straight from the kernel's
packed layout, so no second copy of the codes is kept: `_convert_weight_to_int4pack_for_cpu` stores
[out, in] codes as bytes [out/64, in, 32], the low nibble of byte (b, k, j) row 64b + j's code at column
k, the high nibble row 64b + 32 + j's. That layout is torch's internal choice, so `layout_known` checks it
on a probe once per process; where it differs, the int4 kernel serves every row count.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Output rows dequantized at once: bounds the transient bf16 block to in_features x this many values.
BLOCK_ROWS = 4096


def unpacked_t(packed: Tensor, out: int, inp: int, first: int = 0, last: int | None = None) -> Tensor:
    """The codes of output rows [64 first, 64 last) from the packed layout, transposed: [in, rows], bf16."""
    last = out // 64 if last is None else last
    b = packed.view(out // 64, inp, 32)[first:last].transpose(0, 1)  # [in, blocks, 32]
    codes = torch.empty(inp, last - first, 2, 32, dtype=torch.bfloat16, device=packed.device)
    codes[:, :, 0] = b & 15
    codes[:, :, 1] = b >> 4
    return codes.view(inp, (last - first) * 64)


@functools.cache
def layout_known() -> bool:
    """Whether this torch packs int4 for CPU as `unpacked_t` reads it (one probe, once)."""
    probe = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
        return packed.shape == (128, 32) and torch.equal(unpacked_t(packed, 128, 64).t().int(), probe)
    except (RuntimeError, NotImplementedError):
        return False


def dequantized_matmul(x: Tensor, packed: Tensor, scales_zeros: Tensor, group_size: int, out: int) -> Tensor:
    """x [T, in] bf16 times the packed int4 weight [out, in] transposed, as the kernel computes it,
    ((q - 8) * scale + zero), on a dequantized bf16 block of at most BLOCK_ROWS output rows at a time."""
    inp = x.shape[1]
    y = torch.empty(x.shape[0], out, dtype=x.dtype, device=x.device)
    step = max(1, BLOCK_ROWS // 64)
    for first in range(0, out // 64, step):
        last = min(out // 64, first + step)
        cols = slice(64 * first, 64 * last)
        q = unpacked_t(packed, out, inp, first, last).view(inp // group_size, group_size, -1)
        scale = scales_zeros[:, cols, 0].contiguous()  # [groups, rows]: contiguous broadcasts fastest
        zero = (scales_zeros[:, cols, 1].float() - 8 * scale.float()).to(q.dtype)
        w = torch.addcmul(zero.unsqueeze(1), q, scale.unsqueeze(1)).view(inp, -1)  # one pass over the codes
        if first == 0 and last == out // 64:
            return torch.matmul(x, w)
        y[:, cols] = torch.matmul(x, w)
    return y
