"""Step-time cost models for the simulator: how long one microbatch takes on one pipeline stage.

Three interchangeable models share one small interface (`stage_time`, `transfer_time`, `num_stages`):
- `RooflineCostModel`: analytic, from a model table and a hardware table (configs/models, configs/hardware).
  Per decoder layer: the hardware profile's fixed cost of running a layer (`layer_overhead_s`: launches
  and host-side work, a floor under small steps), linear layers at max(FLOPs / achievable FLOP/s (FP8's
  or INT8's for a scheme multiplying 8-bit activations), weight bytes / achievable bandwidth) with tensor
  parallelism dividing both; attention from each request's chunk and context (a prefill chunk is
  FLOP-heavy, a decode reads its whole KV cache, at the decode kernel's own achieved bandwidth
  `decode_attn_bw_eff`); two ring all-reduces per layer over NVLink when tp > 1. The last stage adds the
  LM head for sampled tokens; the embedding is ignored (a gather). Stages pass the hidden state on.
  `pipeline_cost()` gives the same physics in the scheduler's vocabulary (a `StepCost` per stage,
  sched/cost.py), which the simulated scheduler starts from.
- `ProfileCostModel`: a `StepCost` per stage, fitted by `fit_profile` from spans measured on the real
  pipeline and stored as JSON.
- `ConstantCostModel`: every microbatch costs the same on every stage (test oracle).

Pure Python (pyyaml for the tables): no torch, numpy optional and unused.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import yaml

from ppserve.metrics.spans import Span
from ppserve.sched.cost import BatchShape, PipelineCost, StepCost, StepCostFit, features, solve_linear
from ppserve.sched.moe_cost import Experts, moe_mlp_weights
from ppserve.sched.partition import even_partition

__all__ = [
    "BatchShape",
    "CostModel",
    "ConstantCostModel",
    "HardwareSpec",
    "ModelSpec",
    "Profile",
    "ProfileCostModel",
    "RooflineCostModel",
    "fit_profile",
    "load_hardware",
    "load_model_spec",
    "kv_cache_blocks",
    "CONFIG_DIR",
    "LINEAR_COMPUTES",
]

# The tables are data, not code: shipped in the package as ppserve/configs (the checkout's top-level
# configs/ is a link to it), so an installed wheel finds them the same way.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


# ---------------------------------------------------------------------------------------------
# What a microbatch looks like to a cost model


class CostModel(Protocol):
    @property
    def num_stages(self) -> int: ...

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        """Seconds stage `stage` computes this microbatch."""
        ...

    def transfer_time(self, shape: BatchShape) -> float:
        """Seconds to move this microbatch's hidden states from one stage to the next."""
        ...


@runtime_checkable
class PricedCostModel(CostModel, Protocol):
    """A cost model that can say what it charges in the scheduler's vocabulary (sched/cost.py), which
    the simulated scheduler then starts from instead of learning it from scratch."""

    def pipeline_cost(self) -> PipelineCost: ...


@runtime_checkable
class PlacedCostModel(CostModel, Protocol):
    """A cost model that knows where its stages sit, so each stage boundary has its own link."""

    def boundary_transfer_time(self, stage: int, shape: BatchShape) -> float:
        """Seconds to move this microbatch's hidden states from stage `stage` to stage `stage + 1`."""
        ...


@dataclass(frozen=True)
class ConstantCostModel:
    """Every microbatch costs `step_s` on every stage and `transfer_s` between stages."""

    num_stages: int
    step_s: float
    transfer_s: float = 0.0

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        return self.step_s

    def transfer_time(self, shape: BatchShape) -> float:
        return self.transfer_s

    def pipeline_cost(self) -> PipelineCost:
        return PipelineCost((StepCost(floor_s=self.step_s),) * self.num_stages)


# ---------------------------------------------------------------------------------------------
# Tables

# What a decoder layer's matmuls multiply in: '' the model dtype (bf16; weight-only schemes dequantize
# to it), 'fp8' or 'int8' where the checkpoint's scheme quantizes activations too (FP8-dynamic, W8A8).
LINEAR_COMPUTES = ("", "fp8", "int8")


def _resolve(kind: str, name_or_path: str | os.PathLike[str]) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"{kind} file {str(p)!r} does not exist")
        return p
    candidate = CONFIG_DIR / kind / f"{name_or_path}.yaml"
    if not candidate.exists():
        known = sorted(q.stem for q in (CONFIG_DIR / kind).glob("*.yaml"))
        raise ValueError(f"unknown {kind} {str(name_or_path)!r}; known: {known} (or pass a file path)")
    return candidate


def _from_mapping(cls: type, data: dict[str, Any], source: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    # YAML 1.1 reads "312.0e12" (no exponent sign) as a string: coerce numbers by the field's type.
    types = {f.name: f.type for f in fields(cls)}
    coerced: dict[str, Any] = {}
    for k, v in data.items():
        try:
            number = types[k] in ("float", "float | None") and v is not None
            coerced[k] = float(v) if number else int(v) if types[k] == "int" else v
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {k} must be a number, got {v!r}") from None
    return cls(**coerced)


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and its links; see configs/hardware/*.yaml for values and sources."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bw: float  # HBM bytes/s
    mem_bytes: float  # HBM capacity
    nvlink_bw: float  # intra-node bytes/s per direction per GPU
    inter_node_bw: float  # bytes/s per GPU between nodes
    nvlink_latency_s: float = 8e-6
    inter_node_latency_s: float = 10e-6
    mfu_eff: float = 0.65
    attn_eff: float = 0.5
    bw_eff: float = 0.8
    link_eff: float = 0.7
    kv_mem_fraction: float = 0.9
    gpus_per_node: int = 8  # GPUs sharing one node's NVLink; beyond them, links go over inter_node_bw
    # Seconds each decoder layer adds to every forward on top of its kernels' roofline time: the fixed
    # cost of running a layer (kernel launches and the host-side work an eager forward does per layer,
    # with the synchronisations that keep it from overlapping the GPU). The roofline's FLOP and byte
    # terms cannot see it; it is what puts a floor under a small decode step. One number per hardware
    # profile (the machine with its serving stack), sourced in the profile.
    layer_overhead_s: float = 0.0
    # The fraction of mem_bw the decode attention kernel achieves reading the paged KV cache (one query
    # token per sequence against its whole context). Unset: bw_eff, the weights' streaming rate. Serving
    # stacks' paged decode kernels reach far less than a dense weight read (small per-sequence blocks,
    # a block-table gather per 16 tokens); where a table calibrates it, it cites the measurement.
    decode_attn_bw_eff: float | None = None
    # Seconds each sequence (each chunk) in a step adds to each decoder layer: per-sequence work that
    # neither FLOPs nor bytes price (a100-pcie.yaml fits it on Sarathi-Serve's measured batch growth; the
    # alternative reading of that growth is `decode_attn_bw_eff`, reproduce_sarathi_serve.py's `kv-read`).
    seq_overhead_s: float = 0.0
    # Dense FLOP/s (OP/s) of the FP8 and INT8 tensor cores, for the matmuls of a model whose scheme
    # multiplies 8-bit activations (ModelSpec.linear_compute). 0: the device has none, and such a
    # kernel falls back to bf16 on dequantized weights, at peak_flops.
    fp8_flops: float = 0.0
    int8_ops: float = 0.0

    # Achieved fractions of a peak: a value above 1 or at 0 is a typo, not a faster machine.
    EFFICIENCIES = ("mfu_eff", "attn_eff", "bw_eff", "link_eff", "kv_mem_fraction", "decode_attn_bw_eff")

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware {self.name}: gpus_per_node must be >= 1, got {self.gpus_per_node!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"hardware {self.name}: {f.name} must be a finite number >= 0, got {v!r}")
        for name in ("peak_flops", "mem_bw"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hardware {self.name}: {name} must be > 0")
        for name in self.EFFICIENCIES:
            v = getattr(self, name)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"hardware {self.name}: {name} is a fraction of the peak and must be in "
                                 f"(0, 1], got {v!r}")

    def matmul_flops(self, compute: str = "") -> float:
        """Dense FLOP/s of a matmul multiplying in `compute` (LINEAR_COMPUTES): its tensor cores' peak, or
        peak_flops where the device has none."""
        if compute not in LINEAR_COMPUTES:
            raise ValueError(f"hardware {self.name}: unknown matmul precision {compute!r}; known: "
                             f"{LINEAR_COMPUTES}")
        peak = self.fp8_flops if compute == "fp8" else self.int8_ops if compute == "int8" else 0.0
        return peak or self.peak_flops

    @property
    def decode_attn_bw(self) -> float:
        """Bytes/s the decode attention kernel reads the KV cache at."""
        eff = self.bw_eff if self.decode_attn_bw_eff is None else self.decode_attn_bw_eff
        return self.mem_bw * eff


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a decoder-only transformer; see configs/models/*.yaml."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    mlp: str = "swiglu"  # swiglu (3 matrices) | gelu (2 matrices)
    max_model_len: int = 4096
    dtype_bytes: int = 2
    # Bytes per decoder-layer matmul weight as stored (0: dtype_bytes): 1 for FP8 or INT8, about 0.56 for
    # INT4 in groups of 128 with their scales. Embeddings, norms, activations and the KV cache keep
    # dtype_bytes.
    linear_weight_bytes: float = 0.0
    # The precision those matmuls multiply in (LINEAR_COMPUTES): 'fp8' or 'int8' run at the hardware's
    # FP8/INT8 peak where it has one. Attention, embeddings and the LM head stay in dtype_bytes' precision.
    linear_compute: str = ""
    tied_embeddings: bool = False
    # 0: hidden_size // num_heads. Set it where heads are not a split of the hidden size (Qwen3-32B:
    # hidden 5120, 64 heads of 128, so the query projection is 8192 wide).
    head_dim: int = 0
    # A mixture of experts (0 experts: dense). Every layer's MLP is then sparse: num_experts SwiGLU experts
    # of expert_intermediate_size, experts_per_token of them per token, and a replicated router.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.num_experts and not (1 <= self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0 and self.mlp == "swiglu"):
            raise ValueError(f"model {self.name}: an MoE needs 1 <= experts_per_token <= num_experts, "
                             "expert_intermediate_size > 0 and a swiglu mlp")
        if self.linear_weight_bytes < 0:
            raise ValueError(f"model {self.name}: linear_weight_bytes must be >= 0, got "
                             f"{self.linear_weight_bytes}")
        if self.linear_compute not in LINEAR_COMPUTES:
            raise ValueError(f"model {self.name}: linear_compute must be one of {LINEAR_COMPUTES} ('' the "
                             f"model dtype), got {self.linear_compute!r}")
        if self.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"model {self.name}: mlp must be swiglu or gelu, got {self.mlp!r}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_kv_heads {self.num_kv_heads} must divide num_heads "
                             f"{self.num_heads}")
        if self.head_dim < 0:
            raise ValueError(f"model {self.name}: head_dim must be >= 0 (0 = hidden_size / num_heads), got "
                             f"{self.head_dim}")
        if not self.head_dim:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"model {self.name}: num_heads {self.num_heads} does not divide hidden_size "
                                 f"{self.hidden_size}; give head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def matmul_bytes(self) -> float:
        """Bytes one decoder-layer matmul weight occupies and a step reads."""
        return self.linear_weight_bytes or float(self.dtype_bytes)

    @property
    def q_dim(self) -> int:
        """Width of the query projection (all heads); equals hidden_size unless head_dim says otherwise."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tp(self, tp: int) -> None:
        """Raise unless `tp` ranks can split this model: query heads evenly, KV heads evenly or replicated."""
        if tp < 1 or self.num_heads % tp:
            raise ValueError(f"tp={tp} does not divide {self.name}'s {self.num_heads} heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"tp={tp} neither divides nor is a multiple of {self.name}'s "
                             f"{self.num_kv_heads} KV heads")

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tp rank holds: a share of them, or one replicated head when tp exceeds them
        (each rank needs the KV head its query heads read; vLLM and Megatron replicate it the same way)."""
        return max(1, self.num_kv_heads // tp)

    def kv_dim_per_rank(self, tp: int) -> int:
        return self.kv_heads_per_rank(tp) * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls (norms and biases are negligible)."""
        return self.layer_params_per_rank(1)

    def layer_params_per_rank(self, tp: int) -> int:
        """One decoder layer's matmul weights on one of `tp` ranks: the query, output and MLP matrices
        split (every expert's slice, for an MoE), the K and V projections split or, past the KV head
        count, replicated; an MoE's router replicated."""
        h = self.hidden_size
        if self.moe is None:
            mlp, router = (3 if self.mlp == "swiglu" else 2) * h * self.intermediate_size, 0
        else:
            mlp, router = self.num_experts * 3 * h * self.expert_intermediate_size, h * self.num_experts
        return (2 * h * self.q_dim + mlp) // tp + 2 * h * self.kv_dim_per_rank(tp) + router

    @property
    def moe(self) -> Experts | None:
        return (Experts(self.num_experts, self.experts_per_token, self.expert_intermediate_size)
                if self.num_experts else None)

    def step_params_per_rank(self, tp: int, num_tokens: int) -> tuple[float, float]:
        """(weights each token multiplies, weights read) of one layer on one rank in a step of `num_tokens`:
        both are every weight for a dense layer; an MoE's token multiplies k experts and the step reads
        only the experts its tokens touched (sched/moe_cost.py)."""
        params = float(self.layer_params_per_rank(tp))
        if self.moe is None:
            return params, params
        h = self.hidden_size
        per_token, read = moe_mlp_weights(h, self.moe, num_tokens)
        router = h * self.num_experts
        attention = params - (self.num_experts * 3 * h * self.expert_intermediate_size) / tp - router
        return attention + (per_token - router) / tp + router, attention + (read - router) / tp + router

    @property
    def active_params(self) -> int:
        """Weights one token multiplies (an MoE's active parameters; all of them for a dense model)."""
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        per_token = self.step_params_per_rank(1, 1)[0]
        return int(self.num_layers * per_token) + self.vocab_size * self.hidden_size + head

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + self.vocab_size * self.hidden_size + head


def load_hardware(name_or_path: str | os.PathLike[str]) -> HardwareSpec:
    path = _resolve("hardware", name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    spec: HardwareSpec = _from_mapping(HardwareSpec, data, str(path))
    return spec


def load_model_spec(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    path = _resolve("models", name_or_path)
    spec: ModelSpec = _from_mapping(ModelSpec, yaml.safe_load(path.read_text()) or {}, str(path))
    return spec


def stage_weight_bytes(model: ModelSpec, layers: int, first: bool, last: bool, tp: int) -> float:
    """Weight bytes on one tp rank of a stage holding `layers` decoder layers: the embedding on the
    first stage, the LM head on the last (a tied head is one matrix when one stage holds both ends)."""
    table = model.vocab_size * model.hidden_size / tp
    ends = (table if first else 0.0) + (table if last and not (first and model.tied_embeddings) else 0.0)
    return layers * model.layer_params_per_rank(tp) * model.matmul_bytes + ends * model.dtype_bytes


def kv_cache_blocks(model: ModelSpec, hw: HardwareSpec, num_stages: int, tp: int, block_size: int,
                    layer_counts: Sequence[int] | None = None) -> int:
    """KV blocks that fit on the tightest GPU: memory after its weight shard, times the KV fraction.

    Every stage holds KV for every token of a request, so the scheduler's block count is what the
    tightest stage can hold (the one with the most layers, or an end with a big vocabulary).
    """
    model.check_tp(tp)
    counts = list(layer_counts or [b - a for a, b in even_partition(model.num_layers, num_stages)])
    kv_token_layer = 2 * model.kv_dim_per_rank(tp) * model.dtype_bytes
    blocks: list[float] = []
    for s, layers in enumerate(counts):
        weights = stage_weight_bytes(model, layers, s == 0, s == num_stages - 1, tp)
        free = (hw.mem_bytes - weights) * hw.kv_mem_fraction
        if free <= 0:
            raise ValueError(f"{model.name} does not fit on {num_stages * tp} x {hw.name}: stage {s} holds "
                             f"{weights / 1e9:.1f} GB of weights per GPU, the GPU {hw.mem_bytes / 1e9:.1f} "
                             "GB")
        blocks.append(free // (kv_token_layer * layers * block_size) if layers else math.inf)
    return max(1, int(min(blocks)))


# ---------------------------------------------------------------------------------------------
# Analytic roofline model


def _linearization_grid() -> list[BatchShape]:
    """Microbatches that vary every feature of the step-cost model (sched/cost.py) apart: decode
    batches, prefill chunks that do and do not sample, and chunks beside decodes, at several contexts."""
    grid = []
    for ctx in (128, 1024, 4096):
        for k in (1, 4, 16, 64):
            grid.append(BatchShape(((1, ctx),) * k, k, 0, k))
    for ctx in (0, 1024, 3072):
        for n in (32, 128, 512):
            for sampled in (0, 1):
                grid.append(BatchShape(((n, ctx),), sampled, n, 0))
            for k in (8, 32):
                grid.append(BatchShape(((n, ctx),) + ((1, 2 * ctx + 256),) * k, k, n, k))
    return grid


def _roofline(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    # A kernel is bound by whichever resource it exhausts first.
    return max(flops / flops_per_s, nbytes / bytes_per_s)


@dataclass(frozen=True)
class RooflineCostModel:
    """Analytic per-stage step time for `model` split over `num_stages` stages (even layers by default) and tp
    ranks."""

    model: ModelSpec
    hw: HardwareSpec
    num_stages: int
    tp: int
    layer_counts: tuple[int, ...] = field(default=())
    # Placement: the stages' tp groups packed in order on nodes of this many GPUs, so a stage boundary
    # inside a node goes over NVLink and one between nodes over the NIC. 0: every boundary crosses nodes
    # (one stage per node, the layout of Sarathi-Serve's and Megatron's multi-node pipelines).
    gpus_per_node: int = 0

    _last_layer_time: tuple[BatchShape | None, float] = field(default=(None, 0.0), init=False, repr=False,
                                                              compare=False)

    def __post_init__(self) -> None:
        self.model.check_tp(self.tp)
        if not self.layer_counts:
            counts = tuple(b - a for a, b in even_partition(self.model.num_layers, self.num_stages))
            object.__setattr__(self, "layer_counts", counts)
        if len(self.layer_counts) != self.num_stages or sum(self.layer_counts) != self.model.num_layers:
            raise ValueError(f"layer_counts {list(self.layer_counts)} must split {self.model.num_layers} "
                             f"over {self.num_stages}")

    # The pieces, per layer and per tp rank; public so tests and tools can look at them.
    def linear_time(self, num_tokens: int) -> float:
        m, hw = self.model, self.hw
        if num_tokens == 0:
            return 0.0
        per_token, read = m.step_params_per_rank(self.tp, num_tokens)  # an MoE reads the experts touched
        flops = 2.0 * num_tokens * per_token
        # Weights dominate the bytes; activations in and out of each matmul matter only for huge chunks.
        act = 4.0 * num_tokens * (m.hidden_size + m.intermediate_size / self.tp) * m.dtype_bytes
        nbytes = read * m.matmul_bytes + act
        flops_s = hw.matmul_flops(m.linear_compute) * hw.mfu_eff  # the LM head keeps peak_flops
        return _roofline(flops, nbytes, flops_s, hw.mem_bw * hw.bw_eff)

    def attention_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        m, hw = self.model, self.hw
        heads_dim = m.q_dim / self.tp  # query heads x head_dim on this rank
        kv_dim = m.kv_dim_per_rank(self.tp)  # a replicated KV head is read in full on every rank
        flops_s, bytes_s = hw.peak_flops * hw.attn_eff, hw.mem_bw * hw.bw_eff
        t = 0.0
        dec_flops = dec_bytes = 0.0
        for new, ctx in chunks:
            # Causal attention: token i of the chunk sees ctx + i + 1 keys; QK^T and PV are 2 FLOPs
            # per multiply-add each, hence 4 * keys * heads_dim per query token.
            keys = new * ctx + new * (new + 1) / 2
            flops = 4.0 * keys * heads_dim
            nbytes = 2.0 * (ctx + new) * kv_dim * m.dtype_bytes + 2.0 * new * heads_dim * m.dtype_bytes
            if new == 1:
                # Decodes share one batched kernel: add them up, bound by reading all their KV.
                dec_flops += flops
                dec_bytes += nbytes
            else:
                t += _roofline(flops, nbytes, flops_s, bytes_s)
        if dec_bytes:
            t += _roofline(dec_flops, dec_bytes, flops_s, hw.decode_attn_bw)
        return t

    def allreduce_time(self, num_tokens: int) -> float:
        """One ring all-reduce of the [tokens, hidden] activation over the stage's tp ranks."""
        if self.tp == 1 or num_tokens == 0:
            return 0.0
        hw = self.hw
        msg = num_tokens * self.model.hidden_size * self.model.dtype_bytes
        return hw.nvlink_latency_s + 2.0 * (self.tp - 1) / self.tp * msg / (hw.nvlink_bw * hw.link_eff)

    def lm_head_time(self, num_sampled: int) -> float:
        m, hw = self.model, self.hw
        if num_sampled == 0:
            return 0.0
        params = m.vocab_size * m.hidden_size / self.tp
        return _roofline(2.0 * num_sampled * params, params * m.dtype_bytes,
                         hw.peak_flops * hw.mfu_eff, hw.mem_bw * hw.bw_eff)

    def layer_time(self, shape: BatchShape) -> float:
        n = shape.num_tokens
        return (self.hw.layer_overhead_s + self.hw.seq_overhead_s * len(shape.chunks) + self.linear_time(n)
                + self.attention_time(shape.chunks) + 2 * self.allreduce_time(n))

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        # Every stage's layers price the same shape: the simulator asks for it once per stage in turn,
        # so the last shape's layer time is kept (by identity: a shape is immutable).
        last = self._last_layer_time
        if last[0] is not shape:
            last = (shape, self.layer_time(shape))
            object.__setattr__(self, "_last_layer_time", last)
        t = self.layer_counts[stage] * last[1]
        if stage == self.num_stages - 1:
            t += self.lm_head_time(shape.num_sampled)
        return t

    def crosses_nodes(self, stage: int) -> bool:
        """Whether the boundary from `stage` to `stage + 1` leaves the node."""
        if not self.gpus_per_node:
            return True
        return (stage * self.tp) // self.gpus_per_node != ((stage + 1) * self.tp) // self.gpus_per_node

    def boundary_transfer_time(self, stage: int, shape: BatchShape) -> float:
        hw = self.hw
        # Every tp rank holds the full (all-reduced) hidden state and sends it over its own link in parallel.
        nbytes = shape.num_tokens * self.model.hidden_size * self.model.dtype_bytes
        if self.crosses_nodes(stage):
            return hw.inter_node_latency_s + nbytes / (hw.inter_node_bw * hw.link_eff)
        return hw.nvlink_latency_s + nbytes / (hw.nvlink_bw * hw.link_eff)

    def transfer_time(self, shape: BatchShape) -> float:
        """The slowest boundary's transfer (what a placement-blind caller should assume)."""
        if self.num_stages == 1:
            return 0.0
        return max(self.boundary_transfer_time(s, shape) for s in range(self.num_stages - 1))

    def pipeline_cost(self) -> PipelineCost:
        """The roofline in the scheduler's vocabulary: each stage's `StepCost`, least squares over a grid
        of microbatches (decodes, prefill chunks and mixes, short to long contexts) priced by
        `stage_time`. Linear where the roofline bends (a matmul turns from bandwidth- to compute-bound
        at ~100 tokens), so it is the scheduler's prior, not the simulator's truth."""
        fits = [StepCostFit(forgetting=1.0, ridge=1e-9, min_samples=1) for _ in range(self.num_stages)]
        for shape in _linearization_grid():
            x = features(shape.chunks, shape.num_sampled)
            for stage, fit in enumerate(fits):
                fit.observe(x, self.stage_time(stage, shape))
        return PipelineCost(tuple(f.cost for f in fits))


# ---------------------------------------------------------------------------------------------
# Profiles fitted from measured spans

PROFILE_FORMAT = "ppserve-sim-profile"
PROFILE_VERSION = 2  # 1 held (a, b, c) per stage over prefill and decode tokens


@dataclass(frozen=True)
class Profile:
    """A stage's `StepCost` per stage plus a stage-to-stage transfer time, as measured on a real pipeline."""

    cost: PipelineCost
    transfer_s: float = 0.0
    note: str = ""
    num_samples: tuple[int, ...] = ()  # microbatches each stage's fit saw
    rms_residual_s: tuple[float, ...] = ()  # each stage's fit's RMS residual

    def save(self, path: str | os.PathLike[str]) -> None:
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "transfer_s": self.transfer_s,
                "note": self.note, "stages": self.cost.to_json(), "num_samples": list(self.num_samples),
                "rms_residual_s": list(self.rms_residual_s)}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{path} is not a ppserve simulator profile (format {data.get('format')!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path} is a version {data.get('version')!r} profile; this ppserve reads "
                             f"version {PROFILE_VERSION} (per-stage step costs): fit it again with `ppserve "
                             "simulate --fit-from`")
        if not data.get("stages"):
            raise ValueError(f"profile {path} has no stages")
        return cls(PipelineCost.from_json(data["stages"]), float(data.get("transfer_s", 0.0)),
                   str(data.get("note", "")),
                   tuple(int(n) for n in data.get("num_samples", ())),
                   tuple(float(r) for r in data.get("rms_residual_s", ())))


@dataclass(frozen=True)
class ProfileCostModel:
    """Prices each stage with the profile's `StepCost` (sched/cost.py), the scheduler's own vocabulary."""

    profile: Profile

    @property
    def num_stages(self) -> int:
        return self.profile.cost.num_stages

    def stage_time(self, stage: int, shape: BatchShape) -> float:
        return self.profile.cost.stages[stage].predict(shape)

    def transfer_time(self, shape: BatchShape) -> float:
        return self.profile.transfer_s

    def pipeline_cost(self) -> PipelineCost:
        return self.profile.cost


def _least_squares(rows: Sequence[tuple[float, float, float]],
                   ys: Sequence[float]) -> tuple[float, float, float]:
    """Fit y = a + b*p + c*d; columns that never vary (all zero) are left out (coefficient 0)."""
    cols = [0] + [k for k in (1, 2) if any(r[k] for r in rows)]
    while True:
        ata = [[math.fsum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
        aty = [math.fsum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in cols]
        sol = solve_linear(ata, aty)
        if sol is not None or len(cols) == 1:
            break
        cols.pop()  # collinear (e.g. every microbatch the same size): drop the last variable
    coef = [0.0, 0.0, 0.0]
    for k, v in zip(cols, sol or [math.fsum(ys) / len(ys)], strict=True):
        coef[k] = v
    return coef[0], coef[1], coef[2]


def fit_profile(spans: Iterable[Span], note: str = "") -> Profile:
    """Fit each stage's compute time = floor + token_s * tokens + sample_s * decode tokens from compute spans.

    A microbatch's time on a stage is the longest of its tp ranks (the stage waits for all of them).
    Spans carry token counts but not context lengths, so attention's growth with context is folded
    into the per-token terms (a known limitation: fit on a workload like the one you simulate), and
    every decode counts as a sampled token (the last chunks of prompts, which also sample, are few).
    The transfer time is the smallest gap between a microbatch leaving stage s and starting stage
    s+1: that gap is pure transfer whenever the next stage was already idle.
    """
    per: dict[int, dict[int, Span]] = defaultdict(dict)
    durations: dict[tuple[int, int], int] = {}
    first_start: dict[tuple[int, int], int] = {}
    last_end: dict[tuple[int, int], int] = {}
    for s in spans:
        if s.kind != "compute" or s.stage < 0:
            continue
        key = (s.stage, s.step_id)
        per[s.stage][s.step_id] = s
        durations[key] = max(durations.get(key, 0), s.duration_ns)
        first_start[key] = min(first_start.get(key, s.start_ns), s.start_ns)
        last_end[key] = max(last_end.get(key, s.end_ns), s.end_ns)
    if not per:
        raise ValueError("fit_profile needs compute spans")
    if sorted(per) != list(range(len(per))):
        raise ValueError(f"compute spans cover stages {sorted(per)}; expected 0..{len(per) - 1}")
    stages, counts, rmss = [], [], []
    for stage in range(len(per)):
        rows = [(1.0, float(s.num_prefill_tokens + s.num_decode_tokens), float(s.num_decode_tokens))
                for s in per[stage].values()]
        ys = [durations[(stage, step)] * 1e-9 for step in per[stage]]
        a, b, c = _least_squares(rows, ys)
        cost = StepCost.of([a, b, 0.0, 0.0, c])  # clamped at >= 0, as every step cost
        resid = [y - cost.of_features((1.0, r[1], 0.0, 0.0, r[2])) for r, y in zip(rows, ys, strict=True)]
        stages.append(cost)
        counts.append(len(rows))
        rmss.append(math.sqrt(math.fsum(e * e for e in resid) / len(resid)))
    gaps = [
        first_start[(st + 1, step)] - last_end[(st, step)]
        for (st, step) in last_end
        if (st + 1, step) in first_start
    ]
    transfer = max(0, min(gaps)) * 1e-9 if gaps else 0.0
    return Profile(PipelineCost(tuple(stages)), transfer, note, tuple(counts), tuple(rmss))
