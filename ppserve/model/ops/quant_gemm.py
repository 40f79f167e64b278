"""A linear layer kept as integer (or FP8) codes and multiplied by torch's packed weight-only kernels.

`QuantizedLinear.build` packs a layer's codes (its TP shard of a quantized checkpoint's, quant/codes.py;
`int8_codes` of a float weight under `model.quantization: int8`) for the kernel the device has:

- int4 in groups of 32-256 (W4A16, GPTQ, AWQ): `_weight_int4pack_mm_for_cpu` (from INT4_DEQUANT_MIN_ROWS
  rows a bf16 GEMM on the weight dequantized from that packing, ops/int4_dequant.py), CUDA tinygemm
  `_weight_int4pack_mm`; both compute (q - 8) * scale + zero (code q, zero z: float zero (8 - z) * scale).
  GPTQ `desc_act`'s shuffled groups are sorted into runs at packing, the activations gathered to match.
- int8, one symmetric scale a row (W8A8, GPTQ 8-bit, on-the-fly int8): `_weight_int8pack_mm` on CPU;
  a W8A8 checkpoint's layers above a few rows quantize activations per token and run `_int_mm`, which
  on CUDA serves W8A8 at every row count (int8 tensor cores; no weight-only int8 kernel there).
- FP8 e4m3, a scale per tensor or channel: `torch._scaled_mm` with rowwise scales on CUDA of compute
  capability 8.9 and up, the activations quantized per token at each call (FP8-dynamic).

Otherwise None: the layer keeps the dequantized weight (FP8 on CPU, grouped or asymmetric int8, weight-only
int8 on CUDA; docs/decisions.md#quantized-weights-on-cpu). No kernel reads a value back to the host, so
CUDA graphs capture them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from ppserve.model.ops import int4_dequant
from ppserve.model.quant.codes import QuantCodes

INT4_GROUPS = (32, 64, 128, 256)
E4M3_MAX = 448.0
# From this many rows a W8A8 checkpoint's layers quantize activations and run `_int_mm` (int8 x int8);
# below, the weight-only int8 kernel is faster (docs/decisions.md#quantized-weights-on-cpu).
W8A8_MIN_ROWS = 5
# From this many rows a CPU int4 layer multiplies its weight dequantized to bf16 (int4_dequant.py): the
# kernel's time grows with the rows, the dequantization's does not (decisions.md#quantized-weights-on-cpu).
INT4_DEQUANT_MIN_ROWS = 128


def fp8_gemm_available(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA devices of compute capability 8.9 (Ada) and up. On CPU `_scaled_mm`
    runs far slower than bf16 (docs/decisions.md#quantized-weights-on-cpu), so FP8 is dequantized there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
# tinygemm's CUDA layout tiles K by inner_k_tiles x 16 columns.
CUDA_INNER_K_TILES = 8
# cuBLAS's int8 GEMM behind `_int_mm` takes more than 16 rows: fewer are padded with zero rows to this.
CUDA_INT_MM_MIN_ROWS = 32


def int_mm(x8: Tensor, w8: Tensor, min_rows: int = 1) -> Tensor:
    """int8 x [T, in] times int8 w [out, in] transposed -> int32 [T, out] by `_int_mm`, x padded with zero
    rows up to `min_rows` (a fixed shape for each row count, so a CUDA graph captures it)."""
    rows = x8.shape[0]
    if rows < min_rows:
        x8 = torch.cat([x8, x8.new_zeros(min_rows - rows, x8.shape[1])])
    return torch._int_mm(x8, w8.t())[:rows]


def join_rows(parts: Sequence[tuple[int, QuantCodes]], rows: int) -> QuantCodes | None:
    """The codes of rows [0, rows) from windows (row offset, codes), or None unless they tile it exactly
    with one bit width and group size."""
    if not parts:
        return None
    ordered = sorted(parts, key=lambda p: p[0])
    first = ordered[0][1]
    at = 0
    for offset, codes in ordered:
        if (offset != at or codes.bits != first.bits or codes.group_size != first.group_size
                or codes.kind != first.kind or codes.int8_activations != first.int8_activations):
            return None
        at += codes.q.shape[0]
    if at != rows:
        return None
    return QuantCodes(first.bits, first.group_size, torch.cat([c.q for _, c in ordered]),
                      torch.cat([c.scales for _, c in ordered]), torch.cat([c.zeros for _, c in ordered]),
                      first.kind, first.int8_activations, first.g_idx)


def _same_groups(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether two windows' columns fall in the same groups (projections of one input share GPTQ's
    `desc_act` order, as it comes from that input's statistics)."""
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def in_group_order(codes: QuantCodes) -> tuple[QuantCodes, Tensor] | None:
    """Shuffled-group codes (`g_idx`) with their columns sorted into runs of one group each, and the column
    order `perm` the activations must be gathered in; None unless every group present has the same
    number of columns (a TP shard of shuffled groups may hold parts of some)."""
    assert codes.g_idx is not None
    perm = torch.argsort(codes.g_idx, stable=True)
    groups, counts = torch.unique_consecutive(codes.g_idx[perm], return_counts=True)
    size = int(counts[0])
    if not bool((counts == size).all()):
        return None
    taken = groups.long()
    ordered = QuantCodes(codes.bits, size, codes.q[:, perm].contiguous(), codes.scales[:, taken].contiguous(),
                         codes.zeros[:, taken].contiguous(), codes.kind, codes.int8_activations)
    return ordered, perm


def int8_codes(weight: Tensor) -> QuantCodes:
    """Symmetric int8 codes of a float weight [out, in], one scale a row (round to nearest)."""
    w = weight.detach().float()
    scales = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp(-127, 127).to(torch.int16) + 128
    zeros = torch.full_like(scales, 128, dtype=torch.int16)
    return QuantCodes(8, w.shape[1], q.to(torch.uint8), scales, zeros)


class QuantizedLinear:
    """y = x W^T with W held packed for an integer weight-only kernel ('int4' or 'int8')."""

    def __init__(self, kind: str, packed: Tensor, scales: Tensor, group_size: int,
                 out_features: int, int8_activations: bool = False) -> None:
        self.kind, self.packed, self.scales = kind, packed, scales
        self.group_size, self.out_features = group_size, out_features
        # W8A8 checkpoints: above W8A8_MIN_ROWS rows, int8 activations through `_int_mm`
        self.int8_activations = int8_activations
        self.perm: Tensor | None = None  # shuffled groups: the column order the activations are gathered in
        # CPU int4 whose packing int4_dequant reads: many rows multiply the dequantized weight
        self.dequantizes = (kind == "int4" and packed.device.type == "cpu" and out_features % 64 == 0
                            and int4_dequant.layout_known())

    @staticmethod
    def build(codes: QuantCodes, dtype: torch.dtype, device: torch.device,
              float32_ok: bool = False) -> QuantizedLinear | None:
        """Packed for this device's kernel, or None where no kernel takes these codes in `dtype`. A float32
        model keeps a checkpoint's dequantized weight (plain F.linear, exact against transformers); only
        int8 made from its own weights (`float32_ok`) runs the int8 kernel in float32."""
        if dtype != torch.bfloat16 and not (float32_ok and dtype == torch.float32):
            return None
        if codes.g_idx is not None:
            ordered = in_group_order(codes)
            packed = None if ordered is None else QuantizedLinear.build(ordered[0], dtype, device, float32_ok)
            if packed is not None and ordered is not None:
                packed.perm = ordered[1].to(device)
            return packed
        out, inp = codes.q.shape
        if codes.kind == "float":
            return QuantizedLinear.fp8(codes, device) if fp8_gemm_available(device) else None
        q = codes.q.to(device)
        scales = codes.scales.to(device=device, dtype=torch.float32)
        int4_shape = codes.group_size in INT4_GROUPS and inp % codes.group_size == 0 and out % 16 == 0
        if codes.bits == 4 and dtype == torch.bfloat16 and int4_shape:
            zeros = (8 - codes.zeros.to(device=device, dtype=torch.float32)) * scales
            # [groups, out, 2]: each group's scale and float zero for every output row
            scales_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(dtype)
            if device.type == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            elif device.type == "cuda" and inp % (CUDA_INNER_K_TILES * 16) == 0 and out % 8 == 0:
                pairs = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # two codes a byte, the even one high
                packed = torch.ops.aten._convert_weight_to_int4pack(pairs, CUDA_INNER_K_TILES)
            else:
                return None
            return QuantizedLinear("int4", cast(Tensor, packed), scales_zeros, codes.group_size, out)
        if codes.bits != 8 or codes.group_size != inp or not codes.symmetric:
            return None
        signed = (q.to(torch.int16) - 128).to(torch.int8).contiguous()
        if device.type == "cpu":
            return QuantizedLinear("int8", signed, scales[:, 0].to(dtype).contiguous(), inp, out,
                                   codes.int8_activations and dtype == torch.bfloat16)
        if device.type == "cuda" and codes.int8_activations and inp % 8 == 0 and out % 8 == 0:
            # W8A8 on int8 tensor cores; CUDA has no weight-only int8 kernel, so every row count takes it
            return QuantizedLinear("int8", signed, scales[:, 0].to(dtype).contiguous(), inp, out, True)
        return None

    @staticmethod
    def fp8(codes: QuantCodes, device: torch.device) -> QuantizedLinear | None:
        """FP8 weights for `_scaled_mm` with rowwise scales (activations quantized per token at each call);
        None unless both sides are multiples of 16, as the kernel needs."""
        out, inp = codes.q.shape
        if out % 16 or inp % 16:
            return None
        weight = codes.q.to(device).contiguous()
        return QuantizedLinear("fp8", weight, codes.scales.to(device).reshape(1, out).contiguous(), inp, out)

    @property
    def nbytes(self) -> int:
        held = (self.packed, self.scales) if self.perm is None else (self.packed, self.scales, self.perm)
        return sum(t.numel() * t.element_size() for t in held)

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x [T, in] in bf16 -> [T, out]."""
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2.index_select(1, self.perm) if self.perm is not None else x2.contiguous()
        if self.kind == "fp8":
            # per-token scales: each row's largest magnitude maps to e4m3's largest value
            x_scale = (x2.float().abs().amax(1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
            x8 = (x2.float() / x_scale).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(x8, self.packed.t(), scale_a=x_scale, scale_b=self.scales, out_dtype=x.dtype)
        elif self.kind == "int8" and self.int8_activations and (x2.shape[0] >= W8A8_MIN_ROWS
                                                                  or x2.device.type == "cuda"):
            xf = x2.float()
            x_scale = (xf.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
            x8 = torch.round(xf / x_scale).to(torch.int8)
            acc = int_mm(x8, self.packed, CUDA_INT_MM_MIN_ROWS if x2.device.type == "cuda" else 1)
            y = (acc.float() * x_scale * self.scales.float()).to(x.dtype)
        elif self.kind == "int8":
            y = cast(Tensor, torch.ops.aten._weight_int8pack_mm(x2, self.packed, self.scales))
        elif x2.device.type == "cpu" and x2.shape[0] >= INT4_DEQUANT_MIN_ROWS and self.dequantizes:
            y = int4_dequant.dequantized_matmul(x2, self.packed, self.scales, self.group_size,
                                                self.out_features)
        elif x2.device.type == "cpu":
            y = cast(Tensor, torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size,
                                                                         self.scales))
        else:
            y = cast(Tensor, torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size,
                                                                 self.scales))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.out_features)
