"""Mixtral (Mistral AI): Llama's attention with a sparse MLP on every layer, top-2 of 8 experts.

The router is the softmax over the chosen logits: a softmax in float32 over all experts, the top k,
renormalized; the routing weights stay float32, as in transformers. `intermediate_size` is each expert's
width. The Hub stores experts as `block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up, down);
transformers' fused layout (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) loads too.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, ClassVar

import torch
from torch import nn

from ppserve.model.arch import ModelArch, common_fields, require_silu
from ppserve.model.attention import AttentionBackend
from ppserve.model.llama import LLAMA_WEIGHTS, LlamaDecoderLayer
from ppserve.model.moe import MIXTRAL_EXPERT_NAMES, SparseMoeBlock, check_moe_config, expert_weights, moe_spec
from ppserve.model.parallel import TPContext
from ppserve.model.stage_model import StageModel, WeightMap


def parse_mixtral(cfg: dict[str, Any], architecture: str) -> ModelArch:
    """The description of a Mixtral checkpoint from its config.json."""
    require_silu(cfg)
    check_moe_config(cfg)
    fields = common_fields(cfg, architecture)
    moe = moe_spec(int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2)),
                   fields["intermediate_size"], normalize_topk=True, weights_in_model_dtype=False,
                   sparse_layers=tuple(range(fields["num_layers"])))
    window = cfg.get("sliding_window")
    return ModelArch(**fields, attention_bias=False, mlp_bias=False,
                     sliding_window=None if window is None else int(window), moe=moe)


@lru_cache(maxsize=8)
def mixtral_layer_weights(num_experts: int) -> WeightMap:
    attention = {hf: entry for hf, entry in LLAMA_WEIGHTS.items() if not hf.startswith("mlp.")}
    return {**attention, **expert_weights("block_sparse_moe", num_experts, MIXTRAL_EXPERT_NAMES)}


class MixtralForCausalLM(StageModel):
    """One pipeline stage of a Mixtral model."""

    layer_class = LlamaDecoderLayer
    # set per model in make_layer (the expert count names the tensors)
    layer_weights: ClassVar[WeightMap] = {}

    @classmethod
    def make_layer(cls, arch: ModelArch, layer: int, tp: TPContext, dtype: torch.dtype,
                   device: torch.device | str, backend: AttentionBackend) -> nn.Module:
        assert arch.moe is not None  # parse_mixtral always sets it
        block = LlamaDecoderLayer(arch, tp, dtype, device, backend,
                                  mlp=SparseMoeBlock(arch.hidden_size, arch.moe, tp, dtype, device))
        block.layer_weights = mixtral_layer_weights(arch.moe.num_experts)
        return block
