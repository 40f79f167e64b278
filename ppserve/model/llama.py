"""The Llama family (Llama 2/3, SmolLM2, Qwen2, Mistral): its decoder layer, its weight names, its config.

The stage mechanics (embedding and head ownership, loading, the forward loop) are shared
(`ppserve.model.stage_model`); this file holds only what is Llama's own.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from ppserve.model import ops
from ppserve.model.arch import ModelArch, common_fields, require_silu
from ppserve.model.attention import AttentionBackend, AttentionMetadata
from ppserve.model.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from ppserve.model.parallel import TPContext
from ppserve.model.stage_model import StageModel, WeightMap


def parse_llama(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """The description of a Llama, Mistral or Qwen2 checkpoint from its config.json."""
    require_silu(cfg)
    return ModelArch(
        **common_fields(cfg, architecture),
        # Qwen2 always has q/k/v biases and its config does not say so.
        attention_bias=True if architecture == "Qwen2ForCausalLM" else bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                          arch.attention_bias, tp, dtype, device)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, False, tp, dtype,
                                        device)
        self.backend = backend
        self.scale = arch.head_dim ** -0.5

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata) -> Tensor:
        """rope: (cos, sin) [T, 1, D] for this step's positions, shared by all layers; x [T, H] -> [T, H]."""
        proj = self.qkv_proj
        qkv = proj(x)  # [T, (Hq + 2 Hkv) D]
        t, hq, hkv, d = qkv.shape[0], proj.num_heads_local, proj.num_kv_heads_local, proj.head_dim
        # q and k are adjacent in the fused output: rotate both heads groups in one op (in place for bf16).
        qk = RotaryEmbedding.apply(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), *rope, inplace=True)
        q, k = qk.split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return cast(Tensor, self.o_proj(out.reshape(t, -1)))  # [T, Hq * D] -> [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPContext, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter, inter], arch.mlp_bias, tp,
                                                       dtype, device)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, tp, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        act = self.gate_up_proj.silu_mul(x)  # bf16 on AMX: the activation in the GEMM's epilogue
        if act is not None:
            return cast(Tensor, self.down_proj(act))
        # [T, 2 I_local] -> [T, I_local]
        return cast(Tensor, self.down_proj(ops.silu_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual adds. Families with other blocks (Qwen3's normed q/k,
    a mixture of experts) pass their own `self_attn` / `mlp` modules."""

    # Set only on a layer whose tensors are named unlike its family's (an MoE layer), which then uses this
    # map (StageModel.weights_of); other layers have no such attribute.
    layer_weights: WeightMap

    def __init__(self, arch: ModelArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend, self_attn: nn.Module | None = None,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = (self_attn if self_attn is not None
                          else LlamaAttention(arch, tp, dtype, device, backend))
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp = mlp if mlp is not None else LlamaMLP(arch, tp, dtype, device)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, residual: Tensor | None, kv_cache: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (None before the first layer,
        where x is the stage's input). Returns (this layer's MLP output, the residual stream before it):
        each residual add happens inside the norm that follows it, one fused pass in bf16."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        residual, h = self.post_attention_layernorm.add_and_norm(residual,
                                                                 self.self_attn(rope, h, kv_cache, meta))
        return self.mlp(h), residual


# Checkpoint module inside a layer -> (our module path, shard id of our fused layer); a map is only
# looked up and its names sorted, so the order of its entries is free.
# These modules of Llama's layer every checkpoint stores whole, under our own names: a family built on
# these blocks (Phi-3) fuses other tensors but maps these the same way.
LLAMA_UNFUSED_WEIGHTS: WeightMap = {
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.down_proj": ("mlp.down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
}
LLAMA_WEIGHTS: WeightMap = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    **LLAMA_UNFUSED_WEIGHTS,
}


class LlamaForCausalLM(StageModel):
    """One pipeline stage of a Llama-family model."""

    layer_class = LlamaDecoderLayer
    layer_weights = LLAMA_WEIGHTS
