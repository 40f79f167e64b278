"""The sparse MLP every mixture-of-experts family shares: a top-k router and E SiLU-gated experts.

A token's router logits (one replicated linear layer) go through a softmax in float32; the k most
probable experts are chosen with `torch.topk`, so exact ties are decided as transformers decides them,
and their probabilities are optionally renormalized (Qwen3-MoE's `norm_topk_prob`; Mixtral always).
The experts run grouped by expert (`ops.moe.experts`). A bf16 router of up to 16 experts on CPU runs that
chain as one native call (`native.MoeRouting.route`, csrc/moe_route.c) that hands ties, near ties and
NaNs back to torch, so ties still fall as transformers decides them.

Tensor parallelism: each TP rank holds a 1/tp slice of every expert's intermediate dimension; the router
is replicated; the block ends in one all-reduce, as the dense MLP's down projection does. Checkpoints in
both layouts load: per-expert tensors (`experts.{e}.gate_proj`, Mixtral's `experts.{e}.w1 / w3 / w2`)
and transformers' fused ones (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]);
`expert_weights` builds the weight map for either. Experts a quantized checkpoint stores per expert keep
their codes, like the linear layers, and in bf16 run torch's integer or FP8 kernels with their float
copies released (`ExpertWeights.pack_codes`). Expert parallelism would replace the slice of every
expert by whole experts per rank; see ppserve/ARCHITECTURE.md#models-and-weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppserve.model.arch import MoeSpec
from ppserve.model.checkpoint_tensor import CheckpointTensor, as_tensor
from ppserve.model.ops import moe as moe_ops
from ppserve.model.ops import native, settings
from ppserve.model.ops.quant_gemm import QuantizedLinear, int8_codes, join_rows
from ppserve.model.parallel import TPContext
from ppserve.model.quant.codes import QuantCodes, codes_of
from ppserve.model.stage_model import SelfCheckedShard, WeightMap

# MoE config fields ppserve does not implement, each with the value that means "not used".
_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (None, 0),  # a shared expert beside the routed ones (Qwen2-MoE)
    "n_shared_experts": (None, 0),  # DeepSeek's shared experts
    "n_group": (None, 1),  # grouped top-k routing (DeepSeek-V3)
    "topk_group": (None, 1),
    "topk_method": (None, "greedy"),
    "first_k_dense_replace": (None, 0),
}


def check_moe_config(cfg: dict[str, Any]) -> None:
    """Refuse what the router and experts here do not implement, naming the field."""
    for field, unused in _UNSUPPORTED_FIELDS.items():
        if cfg.get(field) not in unused:
            raise ValueError(f"unsupported MoE config: {field}={cfg[field]!r} (ppserve's MoE block has "
                             "routed experts only, softmax top-k routing)")
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ValueError(f"unsupported MoE config: scoring_func={scoring!r} (only softmax)")


def moe_spec(num_experts: int, top_k: int, expert_intermediate_size: int, normalize_topk: bool,
             weights_in_model_dtype: bool, sparse_layers: tuple[int, ...]) -> MoeSpec:
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"MoE config: num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    if expert_intermediate_size < 1:
        raise ValueError(f"MoE config: expert intermediate size {expert_intermediate_size} must be positive")
    return MoeSpec(num_experts, top_k, expert_intermediate_size, normalize_topk, weights_in_model_dtype,
                   sparse_layers)


class TopKRouter(nn.Module):
    """Replicated router: hidden [T, H] -> (routing weights [T, k], expert ids [T, k])."""

    def __init__(self, hidden_size: int, spec: MoeSpec, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.loaded = False  # what the checkpoint delivered (it may store the router under two names)
        self.weight_f32: Tensor | None = None  # set by prepack() for bf16 on CPU

    def prepack(self) -> None:
        """After every load: for bf16 on CPU, a float32 copy of the router's small [E, H] weight (the routing
        kernel's operand too): at a router's tiny shape oneDNN's bf16 GEMM costs several times the float32
        one (docs/decisions.md#router-weight-float32). Products of bf16 values are exact in float32, and
        the logits are rounded to bf16 as the bf16 GEMM rounds them, so only the order of the float32 sums
        differs from it."""
        w = self.weight
        self.weight_f32 = w.detach().float() if w.device.type == "cpu" and w.dtype == torch.bfloat16 else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.weight_f32 is not None and x.dtype == torch.bfloat16:
            kernel = native.moe_routing()
            if kernel is not None and kernel.routes(x, self.weight_f32):
                # One call for the chain `choose` runs; a batch with a near tie goes back to it (moe_route.c).
                return kernel.route(x, self.weight_f32, self.spec.top_k, self.spec.normalize_topk,
                                    not self.spec.weights_in_model_dtype, self.choose)
            logits = F.linear(x.float(), self.weight_f32).to(x.dtype)  # [T, E]
        else:
            logits = F.linear(x, self.weight)
        return self.choose(logits)

    def choose(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """Router logits [T, E] -> (routing weights [T, k], expert ids [T, k]), in torch ops."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.normalize_topk:
            top /= top.sum(dim=-1, keepdim=True)  # topk made it: no second tensor needed
        return (top.to(logits.dtype) if self.spec.weights_in_model_dtype else top), ids

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        _copy(param, as_tensor(full), "router weight")
        self.loaded = True

    def missing_weights(self) -> list[str]:
        return [] if self.loaded else ["router (gate)"]


@dataclass(frozen=True)
class RouterShard(SelfCheckedShard):
    """The router's tensor, stored as `{prefix}.gate` per expert layout or `mlp.gate` fused."""


@dataclass(frozen=True)
class ExpertShard(SelfCheckedShard):
    """Which part of which expert a checkpoint tensor holds. `expert` None: all experts at once (the fused
    layout). `part`: 0 gate, 1 up (or "gate_up", both, fused), "down"."""

    expert: int | None
    part: int | str


class ExpertWeights(nn.Module):
    """This TP rank's slice of every expert's gate/up rows (w13 [E, 2 I_local, H]) or down columns
    (w2 [E, H, I_local]); `weight` is either, by `kind`."""

    def __init__(self, kind: str, spec: MoeSpec, hidden_size: int, tp: TPContext, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.kind, self.tp = kind, tp
        inter = spec.expert_intermediate_size
        self.start, self.end = tp.shard_range(inter)
        self.inter, self.local = inter, self.end - self.start
        shape = (spec.num_experts, 2 * self.local, hidden_size) if kind == "gate_up" else \
            (spec.num_experts, hidden_size, self.local)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        parts = 2 if kind == "gate_up" else 1
        self.loaded = [[False] * parts for _ in range(spec.num_experts)]  # what the checkpoint delivered
        self.codes: dict[tuple[int, int], QuantCodes] = {}  # (expert, part): a quantized checkpoint's codes
        self.quant: moe_ops.QuantizedExperts | None = None  # set by the block's prepack()

    def pack_codes(self) -> moe_ops.QuantizedExperts | None:
        """Every expert packed for torch's kernel (`QuantizedLinear.build`) from the codes a quantized
        checkpoint gave at the last load (or, under `model.quantization: int8`, int8 codes of the float
        weights, as the linear layers make them), or None where some expert lacks codes or a kernel in
        this dtype on this device. The codes are dropped either way."""
        codes, self.codes = self.codes, {}
        w = self.weight
        on_the_fly = not codes and settings.current().quantization == "int8"
        if not on_the_fly and len(codes) != sum(len(row) for row in self.loaded):
            return None
        each = []
        for e in range(len(self.loaded)):
            if on_the_fly:
                joined: QuantCodes | None = int8_codes(w[e])
            elif self.kind == "gate_up":
                joined = join_rows([(0, codes[e, 0]), (self.local, codes[e, 1])], 2 * self.local)
            else:
                joined = codes[e, 0]
            packed = None if joined is None else QuantizedLinear.build(joined, w.dtype, w.device,
                                                                        float32_ok=on_the_fly)
            if packed is None:
                return None
            each.append(packed)
        return moe_ops.QuantizedExperts(tuple(each))

    def weight_loader(self, param: nn.Parameter, full: Tensor | CheckpointTensor,
                      shard_id: object = None) -> None:
        if not isinstance(shard_id, ExpertShard):
            raise ValueError(f"expert weights need an ExpertShard, got {shard_id!r}")
        a, b, inter = self.start, self.end, self.inter
        if shard_id.expert is None:  # fused: [E, 2I, H] or [E, H, I]
            if self.kind == "gate_up":
                _copy(param[:, :self.local], full[:, a:b, :], "experts.gate_up_proj (gate)")
                _copy(param[:, self.local:], full[:, inter + a:inter + b, :], "experts.gate_up_proj (up)")
            else:
                _copy(param, full[:, :, a:b], "experts.down_proj")
            self.loaded = [[True] * len(row) for row in self.loaded]
            return
        e = shard_id.expert
        if self.kind == "down":
            window = _copy(param[e], full[:, a:b], f"expert {e} down projection")
            part = 0
        else:
            part = int(shard_id.part)
            window = _copy(param[e, part * self.local:(part + 1) * self.local], full[a:b],
                           f"expert {e} gate/up part {part}")
        self.loaded[e][part] = True
        codes = codes_of(window)
        if codes is not None:
            self.codes[e, part] = codes

    def missing_weights(self) -> list[str]:
        names = {"gate_up": ("gate", "up"), "down": ("down",)}[self.kind]
        return [f"expert {e} {names[p]}" for e, row in enumerate(self.loaded) for p, ok in enumerate(row)
                if not ok]


def _copy(dst: Tensor, src: Tensor | CheckpointTensor, what: str) -> Tensor:
    """Copy `src` into `dst` and return the window read (it may carry a quantized checkpoint's codes)."""
    src = as_tensor(src)
    if dst.shape != src.shape:
        raise ValueError(f"{what}: expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)
    return src


class SparseMoeBlock(nn.Module):
    """Router + experts + the one all-reduce: hidden [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, spec: MoeSpec, tp: TPContext, dtype: torch.dtype,
                 device: torch.device | str, kernel: str | None = None) -> None:
        super().__init__()
        # None: the process's kernel settings (model.moe_kernel), which a stage worker sets before building.
        self.tp, self.kernel = tp, kernel if kernel is not None else settings.current().moe_kernel
        self.gate = TopKRouter(hidden_size, spec, dtype, device)
        self.experts = nn.Module()
        self.experts.gate_up = ExpertWeights("gate_up", spec, hidden_size, tp, dtype, device)
        self.experts.down = ExpertWeights("down", spec, hidden_size, tp, dtype, device)
        # set by prepack() where the panel GEMM takes the experts
        self.panels: moe_ops.PanelExperts | None = None

    def prepack(self) -> None:
        """After every load: the experts on torch's quantized kernels where a quantized checkpoint's codes
        take them (`ExpertWeights.pack_codes`), else their panel layout (bf16 on a CPU with AMX or
        AVX512-BF16), derived from the loaded weights and held outside the state dict, as the linear
        layers' `PackedWeight` is."""
        gate_up, down = self._experts()
        gate_up_q, down_q = gate_up.pack_codes(), down.pack_codes()
        if gate_up.quant is None and gate_up_q is not None and down_q is not None:
            for experts, quant in ((gate_up, gate_up_q), (down, down_q)):
                experts.quant = quant  # the float copy released: a one-element stand-in keeps its shape
                experts.weight.data = experts.weight.data.new_empty(1).expand(experts.weight.shape)
        self.panels = None if self.quantized else moe_ops.pack_experts(gate_up.weight, down.weight)

    def _experts(self) -> tuple[ExpertWeights, ExpertWeights]:
        """The experts' gate_up and down weights (`experts` is a plain nn.Module, which types its children
        Tensor | Module)."""
        return cast(ExpertWeights, self.experts.gate_up), cast(ExpertWeights, self.experts.down)

    @property
    def quantized(self) -> tuple[moe_ops.QuantizedExperts, moe_ops.QuantizedExperts] | None:
        """Both projections on the quantized kernels, or None: both or neither are packed, as one without
        the other would keep most of the float memory anyway."""
        gate_up, down = self._experts()
        return None if gate_up.quant is None or down.quant is None else (gate_up.quant, down.quant)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture this block: the Triton kernel reads nothing back to the host,
        the grouped path may (its per-expert loop reads the token counts of a step's experts), and
        quantized experts always run that loop (docs/decisions.md#quantized-experts)."""
        kernel = moe_ops.resolve_kernel(self.kernel, self.gate.weight.device)
        return kernel == "triton" and self.quantized is None

    @property
    def interpreted(self) -> bool:
        """Whether the experts run the Triton kernel under its interpreter (off CUDA: a correctness check)."""
        device = self.gate.weight.device
        kernel = moe_ops.resolve_kernel(self.kernel, device)
        return device.type != "cuda" and kernel == "triton" and self.quantized is None

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = self.gate(x)
        gate_up, down = self._experts()
        out = moe_ops.experts(x, ids, weights, gate_up.weight, down.weight, self.kernel, self.panels,
                              self.quantized)
        return self.tp.all_reduce(out)  # each rank summed its slice of every expert


# Checkpoint names of one expert's three projections: (gate, up, down).
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


def expert_weights(prefix: str, num_experts: int, names: tuple[str, str, str],
                   ours: str = "mlp") -> WeightMap:
    """Weight-map entries of a sparse block stored under checkpoint module `prefix` ("mlp",
    "block_sparse_moe"): the router, every expert's per-expert tensors, and the fused layout's two tensors
    (transformers writes them under "mlp")."""
    gate, up, down = names
    entries: WeightMap = {
        f"{prefix}.gate": (f"{ours}.gate", RouterShard()), "mlp.gate": (f"{ours}.gate", RouterShard()),
        "mlp.experts.gate_up_proj": (f"{ours}.experts.gate_up", ExpertShard(None, "gate_up")),
        "mlp.experts.down_proj": (f"{ours}.experts.down", ExpertShard(None, "down"))}
    for e in range(num_experts):
        entries[f"{prefix}.experts.{e}.{gate}"] = (f"{ours}.experts.gate_up", ExpertShard(e, 0))
        entries[f"{prefix}.experts.{e}.{up}"] = (f"{ours}.experts.gate_up", ExpertShard(e, 1))
        entries[f"{prefix}.experts.{e}.{down}"] = (f"{ours}.experts.down", ExpertShard(e, "down"))
    return entries
