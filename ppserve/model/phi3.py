"""Phi-3 (Microsoft): Llama's decoder blocks over fused checkpoints.

Phi-3 stores each layer's query, key and value projections as one `qkv_proj` tensor and the MLP's
gate and up projections as one `gate_up_proj` tensor; the blocks themselves compute what Llama's do
(RMSNorm, rotary attention with grouped KV heads, SiLU-gated MLP), so this file is the weight-name map
that splits the fused tensors into our shards, and the config parser. Partial rotary embeddings and
the long-context "longrope" scaling of some Phi-3 checkpoints are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

from ppserve.model.arch import ModelArch, common_fields, require_silu
from ppserve.model.llama import LLAMA_UNFUSED_WEIGHTS, LlamaDecoderLayer
from ppserve.model.stage_model import Fused, StageModel, WeightMap


def parse_phi3(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """The description of a Phi-3 checkpoint from its config.json."""
    require_silu(cfg)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"Phi-3 with partial_rotary_factor {partial} is not supported (only 1.0)")
    fields = common_fields(cfg, architecture)
    scaling = fields["rope_scaling"]
    if scaling is not None and scaling.get("rope_type") in ("longrope", "su", "yarn"):
        raise ValueError(f"Phi-3's {scaling['rope_type']!r} rope scaling is not supported")
    window = cfg.get("sliding_window")
    return ModelArch(**fields, attention_bias=False, mlp_bias=False,
                     sliding_window=None if window is None else int(window))


def _qkv_rows(a: ModelArch) -> tuple[int, ...]:
    return a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim


def _gate_up_rows(a: ModelArch) -> tuple[int, ...]:
    return a.intermediate_size, a.intermediate_size


PHI3_WEIGHTS: WeightMap = {
    "self_attn.qkv_proj": ("self_attn.qkv_proj", Fused(("q", "k", "v"), _qkv_rows)),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", Fused((0, 1), _gate_up_rows)),
    **LLAMA_UNFUSED_WEIGHTS,
}


class Phi3ForCausalLM(StageModel):
    """One pipeline stage of a Phi-3 model."""

    layer_class = LlamaDecoderLayer
    layer_weights = PHI3_WEIGHTS
