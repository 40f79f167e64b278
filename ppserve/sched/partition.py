"""Layer ranges per pipeline stage: even, explicit, cost-aware, or calibrated (pure Python, no torch).

Cost-aware partitioning prices each stage in the one step-cost vocabulary (`ppserve.sched.cost`):
its decoder layers, and on the last stage what comes after them (final norm, LM head, sampling),
whose matmul runs only for tokens that get logits (`LayerCosts`). For SmolLM2 the tied 49152x576 head
has as many weights as ~8 decoder layers, so for decode-heavy work the last stage should hold fewer
layers; prefill-heavy work (a full budget of prompt tokens, a handful of logits) barely runs the head
and wants an even split. One split serves both for a deployment's life, so the analytic `cost` mode,
pricing by weights per token (`weight_costs`), takes the split whose worst slowdown against each
regime's own best split is least (`robust_partition`, over a decode and a full-budget prefill
microbatch; docs/decisions.md#robust-layer-partition). `calibrated` measures instead: the stages' own
compute times on a short run at the configured budget (or a saved `CostProfile`) give the per-layer and head
costs (`fit_cost_profile`), and the same exact split minimizes the slowest stage at that run's mean decode
microbatch (measured, so the per-layer costs the weights do not show, norms, attention, op launches, are in
it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ppserve.sched.cost import (
    BatchShape,
    Features,
    LayerCosts,
    OnlinePipelineCost,
    StepCost,
    features,
    fit_layer_costs,
)
from ppserve.sched.model_shape import ModelShape
from ppserve.sched.moe_cost import mlp_weights_per_token

# What the analytic split prices: a microbatch in which every token gets logits (decode-heavy serving).
DECODE_REFERENCE = features(((1, 0),), 1)


def _validate(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages: every stage needs a "
                         "layer")


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


def stage_costs(ranges: Sequence[tuple[int, int]], costs: LayerCosts,
                reference: Sequence[float]) -> list[float]:
    """Each stage's predicted time for a microbatch with the features `reference` (sched.cost.features)."""
    return [c.of_features(reference) for c in costs.pipeline(ranges).stages]


def _bottleneck_split(num_layers: int, num_stages: int,
                      stage_cost: Callable[[int, int], float]) -> list[tuple[int, int]]:
    """The contiguous split minimizing the largest `stage_cost(start, end)` over its stages (exact, by
    dynamic programming; the stage ending at `num_layers` is the last, with the head)."""
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
                val = max(best[s - 1][m], stage_cost(m, n))
                # Ties go to the later cut, which gives earlier stages more layers (deterministic).
                if val < best[s][n] - 1e-12 * abs(val) or (abs(val - best[s][n]) <= 1e-12 * abs(val)
                                                           and m > cut[s][n]):
                    best[s][n], cut[s][n] = val, m
    bounds, n = [], num_layers
    for s in range(num_stages, 0, -1):
        m = cut[s][n]
        bounds.append((m, n))
        n = m
    return bounds[::-1]


def cost_partition(num_layers: int, num_stages: int, costs: LayerCosts,
                   reference: Sequence[float] = DECODE_REFERENCE) -> list[tuple[int, int]]:
    """Contiguous split minimizing the slowest stage's time at `reference` (exact, by dynamic programming)."""
    _validate(num_layers, num_stages)
    layer = costs.layer.of_features(reference)
    head = costs.head.of_features(reference)
    return _bottleneck_split(num_layers, num_stages,
                             lambda m, n: (n - m) * layer + (head if n == num_layers else 0.0))


def robust_partition(num_layers: int, num_stages: int, costs: LayerCosts,
                     references: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """The split whose worst slowdown over `references` is least: each reference's slowest stage divided by
    the slowest stage of that reference's own best split (`cost_partition`), the largest of those ratios
    minimized (exact: a stage's cost is its largest ratio, and the same dynamic programme minimizes the
    largest stage cost). One split serves a deployment's whole life, decode-heavy and prefill-heavy
    alike, and the two want different splits wherever the head is large next to a layer (module doc)."""
    _validate(num_layers, num_stages)
    priced = []
    for ref in references:
        layer, head = costs.layer.of_features(ref), costs.head.of_features(ref)
        best = max(stage_costs(cost_partition(num_layers, num_stages, costs, ref), costs, ref))
        if best > 0:
            priced.append((layer / best, head / best))
    if not priced:
        return cost_partition(num_layers, num_stages, costs, DECODE_REFERENCE)
    return _bottleneck_split(num_layers, num_stages, lambda m, n: max(
        (n - m) * layer + (head if n == num_layers else 0.0) for layer, head in priced))


def prefill_reference(token_budget: int) -> Features:
    """A prefill-heavy microbatch: one chunk of the whole token budget from an empty cache, one token
    sampled (a saturated Sarathi-Serve microbatch, where the head runs for a handful of rows)."""
    return features(((max(1, token_budget), 0),), 1)


def partition_layers(
    num_layers: int,
    num_stages: int,
    explicit: Sequence[int] | None = None,
    mode: str = "even",
    costs: LayerCosts | None = None,
    reference: Sequence[float] = DECODE_REFERENCE,
) -> list[tuple[int, int]]:
    """Layer ranges [start, end) per stage: `explicit` counts win, then `mode` (even | cost, by `costs`
    at `reference`; without costs every layer costs the same and the head nothing)."""
    _validate(num_layers, num_stages)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != num_stages or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"layer_partition {counts} must have {num_stages} positive entries summing to {num_layers} "
                "layers"
            )
        return ranges_from_counts(counts)
    if mode == "even":
        return even_partition(num_layers, num_stages)
    if mode == "cost":
        return cost_partition(num_layers, num_stages, costs or LayerCosts(StepCost(token_s=1.0), StepCost()),
                              reference)
    raise ValueError(f"partition mode must be even or cost, got {mode!r}")


class PartitionSettings(Protocol):
    """What the partitioner reads of the parallel config (ParallelConfig, frozen: read-only members)."""

    @property
    def pipeline_parallel_size(self) -> int: ...
    @property
    def layer_partition(self) -> tuple[int, ...] | None: ...
    @property
    def partition_mode(self) -> str: ...


def weight_costs(model: ModelShape) -> LayerCosts:
    """Relative costs by weights per token (matmul FLOPs are proportional to them): a decoder layer's
    attention and MLP weights per token, the LM head's vocab x hidden per token that gets logits. The
    one place a model's per-layer cost is computed from its shape."""
    head_dim = getattr(model, "head_dim", 0) or model.hidden_size // model.num_heads
    attn = (model.hidden_size * (model.num_heads * head_dim) * 2
            + model.hidden_size * (model.num_kv_heads * head_dim) * 2)
    mlp = mlp_weights_per_token(model)  # a sparse layer's k experts and router, not all its experts
    return LayerCosts(StepCost(token_s=float(attn + mlp)),
                      StepCost(sample_s=float(model.vocab_size * model.hidden_size)))


def initial_ranges(par: PartitionSettings, model: ModelShape,
                   token_budget: int = 512) -> list[tuple[int, int]]:
    """The layer ranges a pipeline starts with: explicit counts, even, or cost-aware by weights per token
    (`weight_costs`), robust over a decode microbatch and a full `token_budget` prefill chunk
    (`robust_partition`); `calibrated` starts even and is refined from measured stage times."""
    mode = par.partition_mode
    if mode == "cost" and par.layer_partition is None:
        return robust_partition(model.num_layers, par.pipeline_parallel_size, weight_costs(model),
                                (DECODE_REFERENCE, prefill_reference(token_budget)))
    if mode == "calibrated":
        mode = "even"
    return partition_layers(model.num_layers, par.pipeline_parallel_size, par.layer_partition, mode)


PROFILE_FORMAT = "ppserve-cost-profile"
PROFILE_VERSION = 2


@dataclass(frozen=True)
class CostProfile:
    """Per-layer and head costs measured on a running pipeline (`LayerCosts`, in seconds), with the mean
    features of the run's decode-only microbatches (`fit_cost_profile`): the partitioner's reference, and,
    through `LayerCosts.pipeline`, the prior of the scheduler's online cost model. Saved as JSON (a
    calibration's cache, `parallel.partition_profile`)."""

    costs: LayerCosts
    reference: tuple[float, ...]
    num_microbatches: int
    source: str = ""

    def ranges(self, num_layers: int, num_stages: int) -> list[tuple[int, int]]:
        return partition_layers(num_layers, num_stages, mode="cost", costs=self.costs,
                                reference=self.reference)

    @property
    def head_in_layers(self) -> float:
        """The head's cost at the reference in decoder layers (what a log line can say)."""
        layer = self.costs.layer.of_features(self.reference)
        return self.costs.head.of_features(self.reference) / layer if layer > 0 else 0.0

    def to_json(self) -> dict[str, object]:
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, **self.costs.to_json(),
                "reference": list(self.reference),
                "num_microbatches": self.num_microbatches, "source": self.source}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> CostProfile:
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"not a ppserve cost profile (format {data.get('format')!r}, expected "
                             f"{PROFILE_FORMAT!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"cost profile version {data.get('version')!r}, this ppserve reads "
                             f"{PROFILE_VERSION} (version 1 priced the split at the mean microbatch, not "
                             "the mean decode)")
        try:
            reference = tuple(float(x) for x in data["reference"])  # type: ignore[attr-defined]
            num = int(data["num_microbatches"])  # type: ignore[call-overload]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"cost profile: bad or missing reference / num_microbatches: {e}") from None
        if len(reference) != len(DECODE_REFERENCE):
            raise ValueError(f"cost profile: reference needs {len(DECODE_REFERENCE)} features, got "
                             f"{len(reference)}")
        return cls(LayerCosts.from_json(data), reference, num, str(data.get("source", "")))


def fit_cost_profile(samples: Sequence[tuple[BatchShape, Sequence[float]]], ranges: Sequence[tuple[int, int]],
                     source: str = "") -> CostProfile:
    """Per-layer and head costs from microbatches' shapes and compute seconds per stage: each stage's
    `StepCost` fitted (sched.cost.StepCostFit, every sample weighed alike), then `fit_layer_costs`.
    Samples measured on another pipeline (another number of stages) are skipped. Needs two stages."""
    if len(ranges) < 2:
        raise ValueError("fitting stage costs needs a pipeline of two stages or more")
    # Offline: every sample weighs alike, no drift; solved once, when read at the end.
    fit = OnlinePipelineCost(len(ranges), forgetting=1.0, ridge=1e-9, min_samples=1, refit_every=1,
                               decode_only_weight=1.0)
    every: list[Features] = []
    decodes: list[Features] = []
    for shape, seconds in samples:
        if len(seconds) != len(ranges) or not shape.chunks:
            continue
        fit.observe(shape, seconds)
        every.append(features(shape.chunks, shape.num_sampled))
        if not shape.num_prefill_tokens:
            decodes.append(every[-1])
    if not every:
        raise ValueError("no microbatch with a compute time for every stage")
    # The split is priced at the run's mean decode-only microbatch, as the analytic `cost` mode prices
    # one decode: serving spends almost all of its microbatches decoding, and a split tuned to the run's
    # mean microbatch, which its prefill weighs towards many tokens and few logits, undercounts the head.
    # A run without a decode-only microbatch falls back to its mean microbatch.
    ref = decodes or every
    reference = tuple(sum(col) / len(ref) for col in zip(*ref, strict=True))
    return CostProfile(fit_layer_costs(fit.current, ranges, reference), reference, len(every), source)
