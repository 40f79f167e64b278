"""Layer ranges per pipeline stage: even, explicit, cost-aware, or calibrated (pure Python, no torch).

Cost-aware partitioning counts what the first and last stages do besides decoder layers: the
embedding lookup (nearly free) and the LM head, whose matmul runs only for tokens that get logits.
For SmolLM2 the tied 49152x576 head has as many weights as ~8 decoder layers, so for decode-heavy
work the last stage should hold fewer layers. The analytic `cost` mode prices the head as if every
token got logits; `calibrated` measures it instead: the stages' own compute times on a short run at
the configured budget (or a saved profile) give the per-layer and head costs (`fit_stage_costs`), and
the same exact split minimizes the slowest stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ppserve.sched.moe_cost import mlp_weights_per_token


@dataclass(frozen=True)
class StageCostModel:
    """Relative costs in units of one decoder layer per token."""

    layer: float = 1.0
    embedding: float = 0.0
    lm_head: float = 0.0  # per token that gets logits, already weighted by how often that happens

    @classmethod
    def for_llama(
        cls,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        vocab: int,
        logits_fraction: float = 1.0,
        head_dim: int = 0,
        mlp_weights: float | None = None,
    ) -> StageCostModel:
        """Weights-per-token ratio (matmul FLOPs are proportional to weights per token).

        `logits_fraction`: share of a microbatch's tokens that produce logits (1.0 for decode-only work,
        small for prefill-heavy work). `head_dim` 0: hidden / heads; `mlp_weights` None: a dense SwiGLU
        MLP (sched/moe_cost.py prices a mixture of experts)."""
        head_dim = head_dim or hidden // num_heads
        attn = hidden * (num_heads * head_dim) * 2 + hidden * (num_kv_heads * head_dim) * 2
        mlp = 3 * hidden * intermediate if mlp_weights is None else mlp_weights
        layer = attn + mlp
        return cls(layer=1.0, embedding=0.0, lm_head=logits_fraction * vocab * hidden / layer)


def _validate(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages: every stage needs a layer")


def ranges_from_counts(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def even_partition(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Split as evenly as possible; earlier stages take the remainder (the last holds the LM head)."""
    _validate(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return ranges_from_counts([base + (1 if s < extra else 0) for s in range(num_stages)])


def stage_costs(ranges: Sequence[tuple[int, int]], num_layers: int, cost: StageCostModel) -> list[float]:
    costs = []
    for start, end in ranges:
        c = (end - start) * cost.layer
        if start == 0:
            c += cost.embedding
        if end == num_layers:
            c += cost.lm_head
        costs.append(c)
    return costs


def cost_partition(num_layers: int, num_stages: int, cost: StageCostModel) -> list[tuple[int, int]]:
    """Contiguous split minimizing the most expensive stage (exact, by dynamic programming)."""
    _validate(num_layers, num_stages)
    inf = float("inf")
    # best[s][n]: the lowest max-stage cost placing the first n layers on the first s stages.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for n in range(s, num_layers - (num_stages - s) + 1):
            for m in range(s - 1, n):
                if best[s - 1][m] == inf:
                    continue
                c = stage_costs([(m, n)], num_layers, cost)[0]
                val = max(best[s - 1][m], c)
                # Ties go to the later cut, which gives earlier stages more layers (deterministic).
                if val < best[s][n] - 1e-12 or (abs(val - best[s][n]) <= 1e-12 and m > cut[s][n]):
                    best[s][n], cut[s][n] = val, m
    bounds, n = [], num_layers
    for s in range(num_stages, 0, -1):
        m = cut[s][n]
        bounds.append((m, n))
        n = m
    return bounds[::-1]


def partition_layers(
    num_layers: int,
    num_stages: int,
    explicit: Sequence[int] | None = None,
    mode: str = "even",
    cost: StageCostModel | None = None,
) -> list[tuple[int, int]]:
    """Layer ranges [start, end) per stage: `explicit` counts win, then `mode` (even | cost)."""
    _validate(num_layers, num_stages)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"layer_partition {counts} must have {num_stages} positive entries summing to {num_layers} layers"
            )
        return ranges_from_counts(counts)
    if mode == "even":
        return even_partition(num_layers, num_stages)
    if mode == "cost":
        return cost_partition(num_layers, num_stages, cost or StageCostModel())
    raise ValueError(f"partition mode must be even or cost, got {mode!r}")


class ModelShape(Protocol):
    """What the partitioner reads of a model description (ModelArch has it). Read-only members, so a
    frozen dataclass satisfies the protocol."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    # Also read where present: head_dim (when heads are not a split of the hidden size, Qwen3) and moe
    # (a mixture of experts' ExpertShape with its sparse_layers, sched/moe_cost.py; None when dense).


class PartitionSettings(Protocol):
    """What the partitioner reads of the parallel config (ParallelConfig, frozen: read-only members)."""

    @property
    def pipeline_parallel_size(self) -> int: ...
    @property
    def layer_partition(self) -> tuple[int, ...] | None: ...
    @property
    def partition_mode(self) -> str: ...


def initial_ranges(par: PartitionSettings, model: ModelShape) -> list[tuple[int, int]]:
    """The layer ranges a pipeline starts with: explicit counts, even, or cost-aware (the LM head priced
    as if every token got logits); `calibrated` starts even and is refined from measured stage times."""
    cost = None
    mode = par.partition_mode
    if mode == "cost":
        cost = StageCostModel.for_llama(model.hidden_size, model.intermediate_size, model.num_heads,
                                        model.num_kv_heads, model.vocab_size, logits_fraction=1.0,
                                        head_dim=getattr(model, "head_dim", 0),
                                        mlp_weights=mlp_weights_per_token(model))
    elif mode == "calibrated":
        mode = "even"
    return partition_layers(model.num_layers, par.pipeline_parallel_size, par.layer_partition, mode, cost)


@dataclass(frozen=True)
class MeasuredStageCosts:
    """Per-microbatch costs measured on a running pipeline: one decoder layer, and the last stage's LM
    head with sampling, each in mean seconds over the microbatches measured (so the shares of prefill
    and decode work of that run are built in). Saved as JSON; `cost_model()` feeds `cost_partition`."""

    layer_s: float
    head_s: float
    num_microbatches: int
    source: str = ""

    def cost_model(self) -> StageCostModel:
        return StageCostModel(layer=1.0, embedding=0.0, lm_head=self.head_s / self.layer_s if self.layer_s > 0 else 0.0)

    def to_json(self) -> dict[str, float | int | str]:
        return {"layer_s": self.layer_s, "head_s": self.head_s, "num_microbatches": self.num_microbatches,
                "source": self.source}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> MeasuredStageCosts:
        try:
            return cls(float(data["layer_s"]), float(data["head_s"]),  # type: ignore[arg-type]
                       int(data["num_microbatches"]), str(data.get("source", "")))  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a stage-cost profile (layer_s, head_s, num_microbatches): {e}") from None


def fit_stage_costs(stage_seconds: Sequence[Sequence[float]], ranges: Sequence[tuple[int, int]],
                    source: str = "") -> MeasuredStageCosts:
    """Per-layer and LM-head costs from each microbatch's compute seconds per stage.

    Every stage runs decoder layers; only the last adds the head (the embedding lookup on the first is
    negligible). So a microbatch's layer cost is the non-last stages' time over their layers, and its
    head cost is what the last stage took beyond its own layers at that rate. Needs two stages or more.
    """
    if len(ranges) < 2:
        raise ValueError("fitting stage costs needs a pipeline of two stages or more")
    counts = [end - start for start, end in ranges]
    front = sum(counts[:-1])
    layer_sum = head_sum = 0.0
    n = 0
    for seconds in stage_seconds:
        if len(seconds) != len(ranges):
            continue  # a microbatch measured on another pipeline (or not at all)
        layer = sum(seconds[:-1]) / front
        layer_sum += layer
        head_sum += max(0.0, seconds[-1] - counts[-1] * layer)
        n += 1
    if n == 0:
        raise ValueError("no microbatch with a compute time for every stage")
    return MeasuredStageCosts(layer_sum / n, head_sum / n, n, source)
