"""A quantized layer's integer codes in one canonical form, and windows of it that follow a TP shard.

Every integer format ppserve reads (compressed-tensors int4/int8, GPTQ, AWQ) is brought to unsigned codes
`q` [out, in] in [0, 2^bits), a scale and an unsigned zero point per (output row, group of `group_size`
input columns), with w = (q - zero) * scale; where the groups are not consecutive runs of columns (GPTQ's
`desc_act`), `g_idx` names each column's group. The loader attaches the window of codes that matches each
dequantized window it hands a layer (`attach`), so a layer can keep the codes of exactly its TP shard
and run an integer kernel on them (ppserve/model/ops/quant_gemm.py) instead of the float weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

ATTR = "quant_codes"  # the attribute a dequantized window carries its codes in
CODE_PARTS = "quant_code_parts"  # the attribute a layer's weight collects (row offset, codes) in


@dataclass(frozen=True)
class QuantCodes:
    """q [rows, cols] uint8 codes; scales [rows, groups] float; zeros [rows, groups] int16 (unsigned
    domain); `group_size` columns per group (cols itself for one group a row). FP8 weights (`kind`
    'float') keep q as the stored float8_e4m3fn values, w = q * scale, one scale a row, zeros unused.
    `g_idx` [cols]: each column's group where groups are not consecutive runs (scales and zeros then hold
    a column per group, in group order; `group_size` is the columns per group)."""

    bits: int
    group_size: int
    q: Tensor
    scales: Tensor
    zeros: Tensor
    kind: str = "int"
    int8_activations: bool = False  # the checkpoint's scheme multiplies int8 activations (W8A8)
    g_idx: Tensor | None = None

    @property
    def symmetric(self) -> bool:
        return bool((self.zeros == (1 << (self.bits - 1))).all())

    def window(self, index: Any) -> QuantCodes:
        """The codes of weight window `index` (a row slice, or a row and a column slice). Columns must
        start and end on group boundaries: a TP shard that splits a group has no scale of its own. With
        `g_idx` any columns may be taken (every group's scales kept): the kernel decides whether they
        regroup (`QuantizedLinear.build`)."""
        parts = index if isinstance(index, tuple) else (index,)
        rows = parts[0].indices(self.q.shape[0])
        q, scales, zeros = self.q[rows[0]:rows[1]], self.scales[rows[0]:rows[1]], self.zeros[rows[0]:rows[1]]
        if len(parts) > 1 and self.g_idx is not None:
            cols = parts[1]
            return replace(self, q=q[:, cols], scales=scales, zeros=zeros, g_idx=self.g_idx[cols])
        if len(parts) > 1:
            start, stop, _ = parts[1].indices(self.q.shape[1])
            g = self.group_size
            if start % g or stop % g:
                raise ValueError(f"quantization group size {g} does not divide the tensor-parallel shard "
                                 f"[{start}, {stop}) of its {self.q.shape[1]} input columns: use a TP size "
                                 f"that splits the columns on group boundaries")
            q = q[:, start:stop]
            if scales.shape[1] > 1 or g != self.q.shape[1]:
                scales, zeros = scales[:, start // g:stop // g], zeros[:, start // g:stop // g]
            else:  # one group a row: the shard keeps the row's scale, its columns are its group
                g = stop - start
            return QuantCodes(self.bits, g, q, scales, zeros, self.kind, self.int8_activations)
        return replace(self, q=q, scales=scales, zeros=zeros)


def attach(window: Tensor, codes: QuantCodes | None) -> Tensor:
    if codes is not None:
        setattr(window, ATTR, codes)
    return window


def codes_of(t: Any) -> QuantCodes | None:
    codes: QuantCodes | None = getattr(t, ATTR, None)
    return codes


def from_signed(bits: int, q: Tensor, scale: Tensor, zero: Tensor | None, in_features: int,
                int8_activations: bool = False) -> QuantCodes:
    """compressed-tensors' codes (signed, zero points signed too; scales per tensor [1], per channel
    [out, 1] or per group [out, groups]) in canonical form."""
    out = q.shape[0]
    mid = 1 << (bits - 1)
    scales = scale.reshape(1, 1).expand(out, 1) if scale.numel() == 1 else scale.reshape(out, -1)
    zeros = (torch.full(scales.shape, mid, dtype=torch.int16) if zero is None
             else zero.reshape(scales.shape).to(torch.int16) + mid)
    group = in_features // scales.shape[1]
    return QuantCodes(bits, group, (q.to(torch.int16) + mid).to(torch.uint8), scales.contiguous(), zeros,
                      int8_activations=int8_activations)


def from_fp8(weight: Tensor, scale: Tensor) -> QuantCodes | None:
    """compressed-tensors' FP8 weight (e4m3, a scale per tensor [1] or per channel [out, 1]) as codes, or
    None for other float8 types or block scales."""
    out = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or scale.numel() not in (1, out):
        return None
    scales = scale.reshape(-1, 1).expand(out, 1).float().contiguous()
    return QuantCodes(8, weight.shape[1], weight, scales, torch.zeros(out, 1, dtype=torch.int16), "float")


def from_grouped(bits: int, q_in_out: Tensor, scales: Tensor, zeros: Tensor, group_size: int,
                 g_idx: Tensor | None = None) -> QuantCodes:
    """GPTQ's and AWQ's codes (q [in, out] unsigned, scales and zeros [groups, out]; `g_idx` where the
    groups are shuffled) in canonical form."""
    return QuantCodes(bits, group_size, q_in_out.t().to(torch.uint8).contiguous(), scales.t().contiguous(),
                      zeros.t().to(torch.int16).contiguous(), g_idx=g_idx)
