"""The deployments `ppserve plan` may choose from, and why the others were ruled out.

A deployment is a pipeline of `pp` stages of `tp` ranks, `replicas` copies of it (data parallel: each
serves its share of the requests), a scheduling policy, a token budget and a cap on running requests.
Enumeration checks what needs no simulation: tp splits the heads (KV heads split or replicated) and
fits in a node (a stage's all-reduces stay on NVLink), a replica packs onto nodes, the weights fit,
and the KV cache left beside them holds a useful number of requests. Pure Python, no simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ppserve.sched.partition import even_partition
from ppserve.sim.cost_model import HardwareSpec, ModelSpec, kv_cache_blocks

__all__ = ["Cluster", "Deployment", "Rejection", "SearchSpace", "WorkloadShape", "enumerate_deployments"]


@dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `gpus_per_node` accelerators of one kind."""

    hardware: HardwareSpec
    gpus_per_node: int
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"need gpus_per_node >= 1 and nodes >= 1, got {self.gpus_per_node}, "
                             f"{self.nodes}")
        # The hardware table's node size is what the cost model packs stages by: keep them one fact.
        if self.hardware.gpus_per_node != self.gpus_per_node:
            object.__setattr__(self, "hardware", replace(self.hardware, gpus_per_node=self.gpus_per_node))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class WorkloadShape:
    """What enumeration needs to know of the workload: its mean and longest request, in tokens."""

    mean_tokens: float
    max_tokens: int

    @classmethod
    def of(cls, lengths: Sequence[tuple[int, int]]) -> WorkloadShape:
        """From (prompt_len, output_len) pairs."""
        if not lengths:
            raise ValueError("the workload has no requests")
        totals = [p + o for p, o in lengths]
        return cls(sum(totals) / len(totals), max(totals))


# The policies the planner prices: every one a server runs but static batching (request-level batches
# are no serving deployment). Today's peers (vllm-v1, vllm-v1-async, sglang-pp) take the budget grid.
PLANNABLE = ("sarathi", "vllm", "orca", "vllm-v1", "vllm-v1-async", "sglang-pp")


@dataclass(frozen=True)
class SearchSpace:
    """The knobs tried for every (pp, tp) that fits. vllm's token budget is vLLM v0's (whole prompts up to
    the context) and its `max_num_seqs` is Sarathi-Serve's "max batch size" for it."""

    policies: tuple[str, ...] = ("sarathi", "vllm")
    token_budgets: tuple[int, ...] = (256, 512, 1024, 2048)  # sarathi
    max_num_seqs: tuple[int, ...] = (256,)  # sarathi
    vllm_max_num_seqs: tuple[int, ...] = (32, 64, 128)
    max_pp: int | None = None  # None: up to the number of GPUs (and layers)
    block_size: int = 16
    # A KV cache is useful if it holds the longest request and this many requests of mean length.
    min_kv_requests: int = 8

    def __post_init__(self) -> None:
        unknown = set(self.policies) - set(PLANNABLE)
        if unknown or not self.policies:
            raise ValueError(f"policies must be among {', '.join(PLANNABLE)}; got {list(self.policies)}")
        for name in ("token_budgets", "max_num_seqs", "vllm_max_num_seqs"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {list(values)}")
        if self.block_size < 1 or self.min_kv_requests < 1 or (self.max_pp is not None and self.max_pp < 1):
            raise ValueError(f"need block_size, min_kv_requests and max_pp >= 1, got {self}")


@dataclass(frozen=True)
class Deployment:
    """One candidate: a pipeline shape, its copies, and the scheduler's settings."""

    pp: int
    tp: int
    replicas: int
    policy: str
    token_budget: int
    max_num_seqs: int
    layer_counts: tuple[int, ...] = field(default=())  # decoder layers per stage
    num_blocks: int = 0  # KV blocks of block_size tokens one replica's scheduler may hand out
    block_size: int = 16
    budget_from_slo: bool = False  # the token budget is the TBT SLO's (plan/slo_budget.py), not the grid's
    # the largest budget this shape's TBT SLO allows, where the planner priced it
    slo_budget: int | None = None

    @property
    def gpus(self) -> int:
        return self.pp * self.tp * self.replicas

    @property
    def label(self) -> str:
        slo = " from SLO" if self.budget_from_slo else ""
        knobs = (f"max {self.max_num_seqs}" if self.policy == "vllm"
                 else f"budget {self.token_budget}{slo}, seqs {self.max_num_seqs}")
        return f"tp{self.tp}·pp{self.pp} x{self.replicas} {self.policy} ({knobs})"


@dataclass(frozen=True)
class Rejection:
    """A (pp, tp) shape ruled out before any simulation, and why."""

    pp: int
    tp: int
    reason: str

    @property
    def label(self) -> str:
        return f"tp{self.tp}·pp{self.pp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shape_rejection(model: ModelSpec, cluster: Cluster, pp: int, tp: int) -> str | None:
    """Why a replica of pp stages of tp ranks cannot run on this cluster (None: it can, bar memory)."""
    try:
        model.check_tp(tp)
    except ValueError as e:
        return str(e)
    if tp > cluster.gpus_per_node:
        return (f"tp={tp} exceeds the {cluster.gpus_per_node} GPUs of a node (a stage's all-reduces stay on "
                "NVLink)")
    if pp > model.num_layers:
        return f"pp={pp} exceeds {model.name}'s {model.num_layers} layers"
    size, node = pp * tp, cluster.gpus_per_node
    if size % node and node % size:
        return f"a replica of {size} GPUs does not pack onto nodes of {node}"
    return None


def _memory_rejection(model: ModelSpec, cluster: Cluster, space: SearchSpace, work: WorkloadShape,
                      pp: int, tp: int, counts: Sequence[int]) -> tuple[str | None, int]:
    """Why the weights and a useful KV cache do not fit (None: they do), and the KV blocks that fit."""
    try:
        blocks = kv_cache_blocks(model, cluster.hardware, pp, tp, space.block_size, counts)
    except ValueError as e:
        return str(e), 0
    tokens = blocks * space.block_size
    need = max(work.max_tokens, math.ceil(space.min_kv_requests * work.mean_tokens))
    if tokens < need:
        return (f"KV cache of {tokens} tokens per replica is smaller than the longest request "
                f"({work.max_tokens}) or {space.min_kv_requests} requests of mean length "
                f"({work.mean_tokens:.0f})"), blocks
    return None, blocks


def enumerate_deployments(model: ModelSpec, cluster: Cluster, space: SearchSpace,
                          work: WorkloadShape) -> tuple[list[Deployment], list[Rejection]]:
    """Every feasible deployment that uses the whole cluster (replicas x pp x tp = its GPUs), and
    every (pp, tp) shape ruled out, with its reason. Layers are split evenly over the stages."""
    total = cluster.num_gpus
    feasible: list[Deployment] = []
    rejected: list[Rejection] = []
    for tp in _divisors(total):
        for pp in _divisors(total // tp):
            if space.max_pp is not None and pp > space.max_pp:
                continue
            reason = _shape_rejection(model, cluster, pp, tp)
            counts: tuple[int, ...] = ()
            blocks = 0
            if reason is None:
                counts = tuple(b - a for a, b in even_partition(model.num_layers, pp))
                reason, blocks = _memory_rejection(model, cluster, space, work, pp, tp, counts)
            if reason is not None:
                rejected.append(Rejection(pp, tp, reason))
                continue
            replicas = total // (pp * tp)
            for policy, budget, seqs in _knobs(space, model.max_model_len):
                feasible.append(Deployment(pp, tp, replicas, policy, budget, seqs, counts, blocks,
                                           space.block_size))
    return feasible, rejected


def _knobs(space: SearchSpace, max_model_len: int) -> list[tuple[str, int, int]]:
    """(policy, token budget, max_num_seqs) for each policy in the space."""
    out: list[tuple[str, int, int]] = []
    for policy in space.policies:
        if policy == "vllm":
            # vLLM v0 without chunked prefill batches prompts up to max(max_model_len, 2048) tokens.
            out += [(policy, max(max_model_len, 2048), seqs) for seqs in space.vllm_max_num_seqs]
        else:
            out += [(policy, budget, seqs) for budget in space.token_budgets for seqs in space.max_num_seqs]
    return out
