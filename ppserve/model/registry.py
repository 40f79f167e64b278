"""Model families by their Hugging Face `architectures` name: how to read the config, which class to build.

The engine reads config.json once (`describe_model`) and ships the description to every worker, which
builds its stage with `build_stage_model`. Adding a family is a new file with its decoder layer, its
weight-name map and its config parser, plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ppserve.model.arch import ModelArch
from ppserve.model.attention import AttentionBackend
from ppserve.model.llama import LlamaForCausalLM, parse_llama
from ppserve.model.mixtral import MixtralForCausalLM, parse_mixtral
from ppserve.model.parallel import TPContext
from ppserve.model.phi3 import Phi3ForCausalLM, parse_phi3
from ppserve.model.quant.config import parse_quantization
from ppserve.model.qwen3 import Qwen3ForCausalLM, parse_qwen3
from ppserve.model.qwen3_moe import Qwen3MoeForCausalLM, parse_qwen3_moe
from ppserve.model.stage_model import StageModel


@dataclass(frozen=True)
class ModelFamily:
    parse: Callable[[dict[str, Any], str], ModelArch]  # (config.json, architecture name) -> description
    model_class: type[StageModel]


REGISTRY: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily(parse_llama, LlamaForCausalLM),
    "MistralForCausalLM": ModelFamily(parse_llama, LlamaForCausalLM),
    "Qwen2ForCausalLM": ModelFamily(parse_llama, LlamaForCausalLM),
    "Phi3ForCausalLM": ModelFamily(parse_phi3, Phi3ForCausalLM),
    "Qwen3ForCausalLM": ModelFamily(parse_qwen3, Qwen3ForCausalLM),
    "Qwen3MoeForCausalLM": ModelFamily(parse_qwen3_moe, Qwen3MoeForCausalLM),
    "MixtralForCausalLM": ModelFamily(parse_mixtral, MixtralForCausalLM),
}
# Configs without an `architectures` list name their family by model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "mixtral": "MixtralForCausalLM"}


def architecture_of(hf_config: dict[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    name = archs[0] if archs else _BY_MODEL_TYPE.get(hf_config.get("model_type", ""), "")
    if name not in REGISTRY:
        raise ValueError(f"unsupported architecture {name or hf_config.get('model_type')!r}; "
                         f"supported: {', '.join(sorted(REGISTRY))}")
    return str(name)


def describe_model(hf_config: dict[str, Any]) -> ModelArch:
    """The model's description from its config.json (ValueError naming what is not supported)."""
    parse_quantization(hf_config)  # an unsupported quantization fails here, before any worker starts
    name = architecture_of(hf_config)
    return REGISTRY[name].parse(hf_config, name)


def build_stage_model(arch: ModelArch, layer_start: int, layer_end: int, tp: TPContext = TPContext(),
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      attn_backend: AttentionBackend | None = None) -> StageModel:
    """One stage's (empty) model; load it with `load_weights`."""
    return REGISTRY[arch.architecture].model_class(arch, layer_start, layer_end, tp, dtype, device,
                                                   attn_backend)
