"""Qwen3-MoE: Qwen3's attention (q/k RMSNorm before RoPE) with a sparse MLP on most layers.

A layer is sparse when its index is not in `mlp_only_layers` and (index + 1) is a multiple of
`decoder_sparse_step`, as transformers decides; the other layers keep Qwen3's dense MLP, so one stage
may hold both kinds. The router is a softmax over all experts and top-k, renormalized when
`norm_topk_prob` is set, the routing weights cast to the model dtype.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from torch import nn

from ppserve.model.arch import ModelArch
from ppserve.model.attention import AttentionBackend
from ppserve.model.llama import LlamaDecoderLayer
from ppserve.model.moe import QWEN_EXPERT_NAMES, SparseMoeBlock, check_moe_config, expert_weights, moe_spec
from ppserve.model.parallel import TPContext
from ppserve.model.qwen3 import QWEN3_WEIGHTS, qwen3_fields, qwen3_layer
from ppserve.model.stage_model import StageModel, WeightMap


def parse_qwen3_moe(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """The description of a Qwen3-MoE checkpoint from its config.json."""
    check_moe_config(cfg)
    fields = qwen3_fields(cfg, architecture)
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    sparse = tuple(i for i in range(fields["num_layers"])
                   if num_experts > 0 and i not in dense_only and (i + 1) % step == 0)
    moe = None if not sparse else moe_spec(
        num_experts, int(cfg.get("num_experts_per_tok", 1)), int(cfg["moe_intermediate_size"]),
        normalize_topk=bool(cfg.get("norm_topk_prob", False)), weights_in_model_dtype=True,
        sparse_layers=sparse)
    return ModelArch(**fields, moe=moe)


@lru_cache(maxsize=8)
def sparse_layer_weights(num_experts: int) -> WeightMap:
    """A sparse layer's map: Qwen3's attention and norms, the router and the experts (either layout)."""
    attention = {hf: entry for hf, entry in QWEN3_WEIGHTS.items() if not hf.startswith("mlp.")}
    return {**attention, **expert_weights("mlp", num_experts, QWEN_EXPERT_NAMES)}


class Qwen3MoeForCausalLM(StageModel):
    """One pipeline stage of a Qwen3-MoE model."""

    layer_class = LlamaDecoderLayer  # built by make_layer, dense or sparse
    layer_weights = QWEN3_WEIGHTS  # a dense layer's; a sparse layer carries its own

    @classmethod
    def make_layer(cls, arch: ModelArch, layer: int, tp: TPContext, dtype: torch.dtype,
                   device: torch.device | str, backend: AttentionBackend) -> nn.Module:
        if arch.moe is None or not arch.moe.is_sparse(layer):
            return qwen3_layer(arch, tp, dtype, device, backend)
        block = qwen3_layer(arch, tp, dtype, device, backend,
                            mlp=SparseMoeBlock(arch.hidden_size, arch.moe, tp, dtype, device))
        block.layer_weights = sparse_layer_weights(arch.moe.num_experts)
        return block
