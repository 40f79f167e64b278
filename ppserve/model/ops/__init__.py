"""Kernel dispatch in one table: each op runs the native kernel where it accepts the input, torch otherwise.

float32 never enters a native kernel but `argmax` and the MoE dispatch (exact: an index and a permutation),
so float32 output stays identical to transformers. Which kernels a process may use is
`settings.KernelSettings` (config fields, environment overrides). The table is the comment below.
"""

# The op table, one row per op: op | native (CPU, ppserve/model/csrc) | otherwise
# - `rms_norm`, `add_rms_norm` | elementwise_bf16.c (bf16: one pass, residual add fused) | torch, in float32
#   like the reference
# - `silu_mul` | elementwise_bf16.c (bf16) | `F.silu(gate) * up`
# - `rope_` (in place), `rope` | elementwise_bf16.c (bf16, heads contiguous) |
#   `x * cos + rotate_half(x) * sin`
# - `qk_norm_rope_` (Qwen3's q/k heads) | elementwise_bf16.c (bf16: per-head norm and rotation in place, one
#   call) | `rms_norm` over the heads, then `rope`
# - `argmax` | argmax.c (float32 logits) | `torch.argmax` (same indices: first maximum, NaN wins)
# - MoE router (`moe.TopKRouter`) | moe_route.c (bf16, up to 16 experts: logits, softmax, top-k, weights in
#   one call) | the torch chain (`choose`)
# - MoE dispatch / combine (`ops/moe.py`) | moe_route.c (sort and gather: any dtype; weighted sum: bf16) |
#   sort, searchsorted, index ops
# - linear (`gemm.PackedWeight`) | gemm_amx.c (bf16, AMX) | oneDNN prepacked or plain `F.linear`, timed per
#   shape
# - quantized linear (`quant_gemm.QuantizedLinear`, a quantized checkpoint's codes or `model.quantization:
#   int8`) | none: torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` (CUDA: int4 tinygemm) |
#   the dequantized weight on the linear path above
# - attention (`model/attention.py`) | paged_attention.c (decode), prefill_attention_amx.c (bf16 chunks, AMX)
#   | SDPA; flash-attn on CUDA

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model.ops import native

__all__ = ["add_rms_norm", "argmax", "qk_norm_rope_", "rms_norm", "rope", "rope_", "silu_mul"]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [T, H] -> RMSNorm(x) * weight."""
    k = native.elementwise()
    if k is not None and k.accepts(x):
        return k.rms_norm(x, weight, eps)  # one pass instead of eight
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + y, rms_norm(x + y)); neither input is modified."""
    k = native.elementwise()
    if k is not None and k.accepts(x) and k.accepts(y):
        return k.add_rms_norm(x, y, weight, eps)
    total = x + y
    return total, rms_norm(total, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    k = native.elementwise()
    if k is not None and k.accepts(gate_up):
        return k.silu_mul(gate_up)  # one pass, no silu(gate) temporary
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated (HF rotate_half convention) into a new tensor; cos, sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`rope`, in place where the native kernel takes x (returns the rotated tensor either way)."""
    k = native.elementwise()
    if k is not None and k.accepts(x):
        k.rope_(x, cos, sin)
        return x
    return rope(x, cos, sin)


def qk_norm_rope_(qk: Tensor, q_weight: Tensor, k_weight: Tensor, q_heads: int, cos: Tensor, sin: Tensor,
                  eps: float) -> Tensor:
    """Qwen3's query and key heads qk [T, Hq + Hk, D]: each head through its RMSNorm (q_weight [D] for the
    first q_heads, k_weight [D] for the rest), then rotated; in place where the native kernel takes qk (the
    rotated tensor is returned either way). In torch ops (float32) one norm over all heads with the two
    weights stacked per head: elementwise the same arithmetic as two norms and a cat, bit for bit, in
    half the ops."""
    k = native.elementwise()
    if k is not None and k.accepts(qk):
        k.qk_norm_rope_(qk, q_weight, k_weight, q_heads, cos, sin, eps)  # one call, not ~10 ops
        return qk
    heads, d = qk.shape[1], qk.shape[2]
    weight = torch.cat((q_weight.expand(q_heads, d), k_weight.expand(heads - q_heads, d)))
    return rope(rms_norm(qk, weight, eps), cos, sin)


def argmax(logits: Tensor) -> list[int]:
    """Row-wise argmax of logits [N, V]: the native kernel where it runs, several times torch's speed on
    CPU float32 (docs/decisions.md#native-argmax)."""
    k = native.greedy_argmax()
    if k is not None and k.accepts(logits):
        return k(logits)
    return logits.argmax(dim=-1).tolist()
