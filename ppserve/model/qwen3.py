"""Qwen3 (dense): Llama's decoder with an RMSNorm over each query and key head before the rotary embedding.

The norm (one weight of head_dim, shared by the heads, replicated over TP ranks) must come before RoPE,
which the Llama attention applies fused and in place, so this attention normalizes q and k first and
then rotates them. Everything else (the SiLU-gated MLP, the weight names of the projections) is Llama's.
Qwen3's optional sliding window (`use_sliding_window`) is refused.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from ppserve.model import ops
from ppserve.model.arch import ModelArch, common_fields, require_silu
from ppserve.model.attention import AttentionBackend, AttentionMetadata
from ppserve.model.layers import RMSNorm
from ppserve.model.llama import LLAMA_WEIGHTS, LlamaAttention, LlamaDecoderLayer
from ppserve.model.parallel import TPContext
from ppserve.model.stage_model import StageModel, WeightMap


def qwen3_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The ModelArch fields Qwen3 and Qwen3-MoE share."""
    require_silu(cfg)
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported Qwen3 config: use_sliding_window=true "
                         "(ppserve attends the whole context)")
    return dict(**common_fields(cfg, architecture), attention_bias=bool(cfg.get("attention_bias", False)),
                mlp_bias=False)


def parse_qwen3(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """The description of a Qwen3 checkpoint from its config.json."""
    return ModelArch(**qwen3_fields(cfg, architecture))


class Qwen3Attention(LlamaAttention):
    def __init__(self, arch: ModelArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend) -> None:
        super().__init__(arch, tp, dtype, device, backend)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype, device)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        proj = self.qkv_proj
        qkv = proj(x)  # [T, (Hq + 2 Hkv) D]
        t, hq, hkv, d = qkv.shape[0], proj.num_heads_local, proj.num_kv_heads_local, proj.head_dim
        # Each q and k head normed, before the rotation; in place in the fused output where the kernel takes
        # it.
        qk = ops.qk_norm_rope_(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), self.q_norm.weight,
                               self.k_norm.weight, hq, *rope, self.q_norm.eps)
        q, k = qk.split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return cast(Tensor, self.o_proj(out.reshape(t, -1)))


def qwen3_layer(arch: ModelArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                backend: AttentionBackend, mlp: nn.Module | None = None) -> LlamaDecoderLayer:
    """A Qwen3 decoder layer: normed-q/k attention, then `mlp` (Llama's dense MLP when None)."""
    return LlamaDecoderLayer(arch, tp, dtype, device, backend,
                             Qwen3Attention(arch, tp, dtype, device, backend), mlp)


QWEN3_ATTENTION_NORMS: WeightMap = {
    "self_attn.q_norm": ("self_attn.q_norm", None),
    "self_attn.k_norm": ("self_attn.k_norm", None),
}
QWEN3_WEIGHTS: WeightMap = {**LLAMA_WEIGHTS, **QWEN3_ATTENTION_NORMS}


class Qwen3ForCausalLM(StageModel):
    """One pipeline stage of a Qwen3 model."""

    layer_class = LlamaDecoderLayer
    layer_weights = QWEN3_WEIGHTS

    @classmethod
    def make_layer(cls, arch: ModelArch, layer: int, tp: TPContext, dtype: torch.dtype,
                   device: torch.device | str, backend: AttentionBackend) -> nn.Module:
        return qwen3_layer(arch, tp, dtype, device, backend)
