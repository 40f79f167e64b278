"""The description of a decoder-only model, parsed once from its Hugging Face config.json.

The engine parses it (`ppserve.model.registry.describe_model`) and ships it to every worker in the
stage spec: the numbers every part of a pipeline needs (layers, heads, vocabulary, rope, the ids that
end a request). Each model family's file supplies the parser for its own config spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts model's sparse MLP (ppserve/model/moe.py): its routing and which layers have
    it."""

    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int  # each expert's SiLU-gated MLP width
    normalize_topk: bool  # renormalize the chosen experts' probabilities to sum to 1
    # the routing weights are cast to the model dtype (Qwen3-MoE) or kept float32 (Mixtral)
    weights_in_model_dtype: bool
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the sparse block; the others are dense

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


@dataclass(frozen=True)
class ModelArch:
    """Runtime facts about one model; plain values, so it pickles across Ray."""

    architecture: str  # the HF `architectures` name the registry knows it by
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None
    sliding_window: int | None = None  # attention looks back at most this many tokens (None: no limit)
    moe: MoeSpec | None = None  # the sparse MLP of a mixture-of-experts model (None: every MLP is dense)


def rope_from_config(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the transformers 4 or 5 config spelling."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


def eos_from_config(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))


def common_fields(cfg: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The fields every decoder-only config spells the same way (a family's parser adds its own)."""
    heads = int(cfg["num_attention_heads"])
    theta, scaling = rope_from_config(cfg)
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    return dict(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_from_config(cfg),
        torch_dtype=None if dtype is None else str(dtype),
    )


def require_silu(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
