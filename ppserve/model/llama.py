"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) for one pipeline stage's layer range."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppserve.model.attention import AttentionBackend, AttentionMetadata, SdpaBackend
from ppserve.model.cpu_kernels import load_elementwise
from ppserve.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from ppserve.model.parallel import TPContext

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPE_TO_ARCH = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


def _rope_from_config(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either the transformers 4 or 5 config spelling."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return float(theta), scaling


@dataclass(frozen=True)
class LlamaArch:
    """Runtime facts about a Llama-family model, read from a Hugging Face config.json dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    architecture: str
    torch_dtype: str | None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> LlamaArch:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(cfg.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch or cfg.get('model_type')!r}; "
                             f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))
        theta, scaling = _rope_from_config(cfg)
        is_qwen2 = SUPPORTED_ARCHITECTURES[arch] == "qwen2"
        dtype = cfg.get("torch_dtype", cfg.get("dtype"))
        return cls(
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
            # Qwen2 always has q/k/v biases and its config does not say so.
            attention_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
            torch_dtype=None if dtype is None else str(dtype),
        )


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                          arch.attention_bias, tp, dtype, device)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, False, tp, dtype, device)
        self.backend = backend
        self.scale = arch.head_dim ** -0.5

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        """rope: (cos, sin) [T, 1, D] for this step's positions, shared by all layers; x [T, H] -> [T, H]."""
        proj = self.qkv_proj
        qkv = proj(x)  # [T, (Hq + 2 Hkv) D]
        t, hq, hkv, d = qkv.shape[0], proj.num_heads_local, proj.num_kv_heads_local, proj.head_dim
        # q and k are adjacent in the fused output: rotate both heads groups in one op (in place for bf16).
        qk = RotaryEmbedding.apply(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), *rope, inplace=True)
        q, k = qk.split([hq, hkv], dim=1)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1))  # [T, Hq * D] -> [T, H]


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter, inter], arch.mlp_bias, tp,
                                                       dtype, device)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, arch.mlp_bias, tp, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        act = self.gate_up_proj.silu_mul(x)  # bf16 on AMX: the activation in the GEMM's epilogue
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)  # [T, 2 I_local]
        fused = load_elementwise()
        if fused is not None and fused.applies(gate_up):
            return self.down_proj(fused.silu_mul(gate_up))  # bf16: one pass, no silu(gate) temporary
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [T, I_local]
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPContext, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(arch, tp, dtype, device, backend)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(arch, tp, dtype, device)

    def forward(self, rope: tuple[Tensor, Tensor], x: Tensor, residual: Tensor | None, kv_cache: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (None before the first layer,
        where x is the stage's input). Returns (this layer's MLP output, the residual stream before it):
        each residual add happens inside the norm that follows it, one fused pass in bf16."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm.add_and_norm(residual, x)
        residual, h = self.post_attention_layernorm.add_and_norm(residual, self.self_attn(rope, h, kv_cache, meta))
        return self.mlp(h), residual


# HF parameter name inside a layer -> (our module path, shard id for fused layers)
_LAYER_PARAM_MAP: dict[str, tuple[str, object]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "self_attn.o_proj": ("self_attn.o_proj", None),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", None),
    "input_layernorm": ("input_layernorm", None),
    "post_attention_layernorm": ("post_attention_layernorm", None),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Decoder layers [layer_start, layer_end) of a Llama-family model for one pipeline stage and TP rank.

    The first stage owns the embedding, the last the final norm and LM head (with tied embeddings the
    last stage keeps its own copy of the embedding matrix as the head).
    """

    def __init__(self, arch: LlamaArch, layer_start: int, layer_end: int, tp: TPContext = TPContext(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        if not 0 <= layer_start < layer_end <= arch.num_layers:
            raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside [0, {arch.num_layers})")
        self.arch = arch
        self.tp = tp
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == arch.num_layers
        backend = attn_backend if attn_backend is not None else SdpaBackend()
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp, dtype, device)
                             if self.is_first else None)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, tp, dtype, device, backend)
                                    for _ in range(layer_start, layer_end))
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, device)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device) if self.is_last else None
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp, dtype, device) if self.is_last else None
        if self.embed_tokens is not None and self.lm_head is not None and arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one stage holds both ends: share the matrix

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_kv_heads_local(self) -> int:
        return max(1, self.arch.num_kv_heads // self.tp.size)

    def forward(self, input_ids: Tensor | None, hidden_states: Tensor | None, positions: Tensor,
                kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """First stage: input_ids [T]; other stages: hidden_states [T, H]. Returns [T, H]
        (after the final norm on the last stage)."""
        if len(kv_caches) != self.num_local_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_local_layers} layers")
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first stage needs input_ids")
            x = self.embed_tokens(input_ids)
        else:
            if hidden_states is None:
                raise ValueError("a non-first stage needs hidden_states")
            x = hidden_states
        rope = self.rotary.cos_sin(positions, x.dtype)  # once per step, not once per layer
        residual: Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, cache, meta)
        assert residual is not None  # a stage has at least one layer
        if self.norm is not None:
            return self.norm.add_and_norm(residual, x)[1]
        return residual + x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, H] normed hidden states -> [N, vocab] float32 logits (gathered over TP ranks)."""
        if self.lm_head is None:
            raise RuntimeError("compute_logits called on a stage without the LM head")
        return self.lm_head(hidden)

    def hf_names_needed(self) -> list[str]:
        """The HF tensor names this stage must receive (used to report missing ones)."""
        names = []
        if self.is_first:
            names.append("model.embed_tokens.weight")
        for i in range(self.layer_start, self.layer_end):
            for hf in _LAYER_PARAM_MAP:
                names.append(f"model.layers.{i}.{hf}.weight")
                if self._has_bias(hf):
                    names.append(f"model.layers.{i}.{hf}.bias")
        if self.is_last:
            names.append("model.norm.weight")
            names.append("model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight")
        return sorted(set(names))

    def _has_bias(self, hf: str) -> bool:
        if hf.startswith("self_attn.") and hf != "self_attn.o_proj":
            return self.arch.attention_bias
        if hf.startswith("mlp."):
            return self.arch.mlp_bias
        return False

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors, keeping only this stage's layers and this TP rank's shards."""
        seen: set[str] = set()
        for name, tensor in weights:
            if self._load_one(name, tensor):
                seen.add(name)
        if self.is_last and self.arch.tie_word_embeddings and "lm_head.weight" in seen:
            seen.add("model.embed_tokens.weight")  # an explicit head copy satisfies the tie
        missing = [n for n in self.hf_names_needed() if n not in seen]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for layers "
                             f"[{self.layer_start}, {self.layer_end}): {shown}")
        self.prepack()

    def prepack(self) -> None:
        """Rebuild every linear layer's fast-path weight layout from its (just loaded) weight."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepack"):
                module.prepack()

    def _load_one(self, name: str, tensor: Tensor) -> bool:
        """Load one tensor if this stage needs it; returns whether it was used."""
        if name == "model.embed_tokens.weight":
            used = False
            if self.embed_tokens is not None:
                self.embed_tokens.weight_loader(self.embed_tokens.weight, tensor)
                used = True
            if self.lm_head is not None and self.arch.tie_word_embeddings:
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                used = True
            return used
        if name == "lm_head.weight":
            if self.lm_head is None:
                return False
            self.lm_head.weight_loader(self.lm_head.weight, tensor)
            return True
        if name == "model.norm.weight":
            if self.norm is None:
                return False
            self.norm.weight_loader(self.norm.weight, tensor)
            return True
        match = _LAYER_NAME.match(name)
        if match is None:
            logger.debug("ignoring tensor %s", name)
            return False
        layer_idx, hf_module, kind = int(match.group(1)), match.group(2), match.group(3)
        if not self.layer_start <= layer_idx < self.layer_end or hf_module not in _LAYER_PARAM_MAP:
            return False
        module_path, shard_id = _LAYER_PARAM_MAP[hf_module]
        module = self.layers[layer_idx - self.layer_start].get_submodule(module_path)
        param = getattr(module, kind)
        if param is None:
            raise ValueError(f"{name}: this architecture has no {kind} for {hf_module}")
        module.weight_loader(param, tensor.to(param.dtype), shard_id)
        return True
