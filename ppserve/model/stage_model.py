"""What every model family shares: one pipeline stage's slice of a decoder-only model.

A stage holds decoder layers [layer_start, layer_end); the first stage also owns the token embedding,
the last the final norm and the LM head (with tied embeddings the last stage keeps its own copy of
the embedding matrix as the head). This module owns that ownership, the forward loop over the
layers, which checkpoint tensors a stage needs, loading them (this stage's layers, this TP rank's
shards) and prepacking. A family's file supplies only its decoder layer class and its weight-name
map: checkpoint module name inside a layer -> (our module path, shard id), or a `Fused` entry for a
checkpoint tensor that holds several of our shards.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, cast

import torch
from torch import Tensor, nn

from ppserve.model.arch import ModelArch
from ppserve.model.attention import AttentionBackend, AttentionMetadata, SdpaBackend
from ppserve.model.checkpoint_tensor import CheckpointTensor, as_tensor
from ppserve.model.layers import ParallelLMHead, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from ppserve.model.parallel import TPContext
from ppserve.model.quant.codes import CODE_PARTS

logger = logging.getLogger(__name__)

# The HF layer tensor naming; a fused expert tensor (experts.gate_up_proj) is a parameter without a suffix.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?$")
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass(frozen=True)
class Fused:
    """A checkpoint tensor holding several of our shards stacked along dim 0 (e.g. a fused qkv_proj):
    `shards` are their ids in order, `rows(arch)` their heights in the full (unsharded) tensor."""

    shards: tuple[Any, ...]
    rows: Callable[[ModelArch], tuple[int, ...]]


class SelfCheckedShard:
    """A shard id whose module checks its own completeness (`missing_weights()`), for tensors a checkpoint
    may store in either of two layouts (an MoE layer's experts: one tensor per expert, or all fused)."""


WeightMap = dict[str, tuple[str, Any]]  # checkpoint module in a layer -> (our module path, shard id | Fused)


class _LoadsWeights(Protocol):
    """A module a weight map names: it copies its shard of a checkpoint tensor into a parameter."""

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None: ...


class _Prepacks(Protocol):
    """A module with a fast-path weight layout to rebuild after loading."""

    def prepack(self) -> None: ...


class StageModel(nn.Module):
    """Decoder layers [layer_start, layer_end) of one model for one pipeline stage and TP rank."""

    # Set by each family: its decoder layer (built as layer_class(arch, tp, dtype, device, backend)) and
    # its weight-name map. A layer's forward is (rope, x, residual, kv_cache, meta) -> (x, residual).
    # A family whose layers differ (dense and sparse MLPs) overrides `make_layer`; a layer with its own
    # `layer_weights` attribute uses that map instead of the family's.
    layer_class: ClassVar[type[nn.Module]]
    layer_weights: ClassVar[WeightMap]

    @classmethod
    def make_layer(cls, arch: ModelArch, layer: int, tp: TPContext, dtype: torch.dtype,
                   device: torch.device | str, backend: AttentionBackend) -> nn.Module:
        """Decoder layer number `layer` (global index)."""
        return cls.layer_class(arch, tp, dtype, device, backend)

    def __init__(self, arch: ModelArch, layer_start: int, layer_end: int, tp: TPContext = TPContext(),
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
        self.attn_backend = backend  # every layer's (one object: its per-step work is shared)
        self.embed_tokens = (VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp, dtype, device)
                             if self.is_first else None)
        self.layers = nn.ModuleList(self.make_layer(arch, i, tp, dtype, device, backend)
                                    for i in range(layer_start, layer_end))
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling, device)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype, device) if self.is_last else None
        self.lm_head = (ParallelLMHead(arch.vocab_size, arch.hidden_size, tp, dtype, device) if self.is_last
                        else None)
        if self.embed_tokens is not None and self.lm_head is not None and arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # one stage holds both ends: share the matrix

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: no module reads a value back to the host
        (a module that might says so with its own `capturable`, as an MoE block on its grouped path does)."""
        return all(getattr(m, "capturable", True) for m in self.modules() if m is not self)

    @property
    def interpreted(self) -> bool:
        """Whether any of this stage's kernels runs under Triton's interpreter (the CPU check of a GPU
        kernel): its steps are orders of magnitude slower than serving's, so timing them is not worth a
        long start-up (worker/startup_cost.py)."""
        return self.attn_backend.interpreted(next(self.parameters()).device) or any(
            getattr(m, "interpreted", False) for m in self.modules() if m is not self)

    @property
    def num_kv_heads_local(self) -> int:
        return max(1, self.arch.num_kv_heads // self.tp.size)

    # ---- one step --------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor | None, hidden_states: Tensor | None, positions: Tensor,
                kv_caches: list[Tensor], meta: AttentionMetadata) -> Tensor:
        """First stage: input_ids [T]; other stages: hidden_states [T, H]. Returns [T, H]
        (after the final norm on the last stage)."""
        if len(kv_caches) != self.num_local_layers:
            raise ValueError(f"got {len(kv_caches)} KV caches for {self.num_local_layers} layers")
        x: Tensor
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
        logits: Tensor = self.lm_head(hidden)
        return logits

    def logits_for_sampling(self, hidden: Tensor) -> Tensor | None:
        """`compute_logits` gathered to TP rank 0 only, which samples for the stage; None on other ranks."""
        if self.lm_head is None:
            raise RuntimeError("logits_for_sampling called on a stage without the LM head")
        return self.lm_head.logits_on_first_rank(hidden)

    # ---- weights ---------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes this stage's weights hold: every parameter's storage once (a tied head shares the
        embedding's; a linear layer served by an integer kernel keeps only a stand-in), plus the packed
        integer weights."""
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.parameters()}
        packed: int = sum(q.nbytes for m in self.modules() if (q := getattr(m, "quant", None)) is not None)
        return sum(storages.values()) + packed

    def hf_names_needed(self) -> list[str]:
        """The checkpoint tensor names this stage must receive (used to report missing ones)."""
        names = [EMBED] if self.is_first else []
        for i, layer in zip(range(self.layer_start, self.layer_end), self.layers, strict=True):
            for hf, (path, shard) in self.weights_of(layer).items():
                if isinstance(shard, SelfCheckedShard):
                    continue  # its module reports what it lacks (`missing_weights`)
                names.append(f"model.layers.{i}.{hf}.weight")
                if getattr(layer.get_submodule(path), "bias", None) is not None:
                    names.append(f"model.layers.{i}.{hf}.bias")
        if self.is_last:
            names += [NORM, EMBED if self.arch.tie_word_embeddings else HEAD]
        return sorted(set(names))

    def weights_of(self, layer: nn.Module) -> WeightMap:
        """The weight-name map of one of this stage's layers."""
        own: WeightMap | None = getattr(layer, "layer_weights", None)
        return own if own is not None else self.layer_weights

    def load_weights(self, weights: Iterable[tuple[str, Tensor | CheckpointTensor]]) -> None:
        """Load checkpoint-named tensors (real, or read lazily: only this rank's shard is read), keeping
        only this stage's layers and this TP rank's shards."""
        seen: set[str] = set()
        for name, tensor in weights:
            if self._load_one(name, tensor):
                seen.add(name)
        if self.is_last and self.arch.tie_word_embeddings and HEAD in seen:
            seen.add(EMBED)  # an explicit head copy satisfies the tie
        missing = [n for n in self.hf_names_needed() if n not in seen]
        for i, layer in zip(range(self.layer_start, self.layer_end), self.layers, strict=True):
            for path, module in layer.named_modules():
                if hasattr(module, "missing_weights"):
                    missing += [f"model.layers.{i}.{path}: {what}" for what in module.missing_weights()]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) for layers "
                             f"[{self.layer_start}, {self.layer_end}): {shown}")
        self.prepack()

    def prepack(self) -> None:
        """Rebuild every linear layer's fast-path weight layout from its (just loaded) weight; integer codes
        no layer packed (a quantized tensor loaded into a float-only module) are dropped."""
        for module in self.modules():
            if module is not self and hasattr(module, "prepack"):
                cast(_Prepacks, module).prepack()  # nn.Module types the attribute Tensor | Module
        for param in self.parameters():
            if hasattr(param, CODE_PARTS):
                delattr(param, CODE_PARTS)

    def _load_one(self, name: str, tensor: Tensor | CheckpointTensor) -> bool:
        """Load one tensor if this stage needs it; returns whether it was used."""
        if name == EMBED:
            used = False
            if self.embed_tokens is not None:
                self.embed_tokens.weight_loader(self.embed_tokens.weight, tensor)
                used = True
            if self.lm_head is not None and self.arch.tie_word_embeddings:
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
                used = True
            return used
        if name in (HEAD, NORM):
            end = self.lm_head if name == HEAD else self.norm
            if end is None:
                return False
            end.weight_loader(end.weight, tensor)
            return True
        match = LAYER_NAME.match(name)
        if match is None:
            logger.debug("ignoring tensor %s", name)
            return False
        layer_idx, hf_module, kind = int(match.group(1)), match.group(2), match.group(3) or "weight"
        if not self.layer_start <= layer_idx < self.layer_end:
            return False
        layer = self.layers[layer_idx - self.layer_start]
        weights = self.weights_of(layer)
        if hf_module not in weights:
            return False
        module_path, shard = weights[hf_module]
        module = cast(_LoadsWeights, layer.get_submodule(module_path))
        param = getattr(module, kind)
        if param is None:
            if kind == "bias" and not bool(as_tensor(tensor).any()):
                return True  # GPTQ exporters write zero biases for layers that have none
            raise ValueError(f"{name}: this architecture has no {kind} for {hf_module}")
        if isinstance(shard, Fused):
            rows = shard.rows(self.arch)
            if sum(rows) != tensor.shape[0]:
                raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {' + '.join(map(str, rows))}")
            parts = list(zip(shard.shards, tensor.split(list(rows), dim=0), strict=True))
        else:
            parts = [(shard, tensor)]
        for shard_id, part in parts:
            try:
                module.weight_loader(param, part.to(param.dtype), shard_id)
            except ValueError as e:
                where = f" (TP rank {self.tp.rank} of {self.tp.size})" if self.tp.size > 1 else ""
                raise ValueError(f"{name}{where}: {e}") from e
        return True
