"""Layer ranges per pipeline stage: even, explicit, or cost-aware (pure Python, no torch).

Cost-aware partitioning counts what the first and last stages do besides decoder layers: the
embedding lookup (nearly free) and the LM head, whose matmul runs only for tokens that get logits.
For SmolLM2 the tied 49152x576 head has as many weights as ~8 decoder layers, so for decode-heavy
work the last stage should hold fewer layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
    ) -> StageCostModel:
        """Weights-per-token ratio (matmul FLOPs are proportional to weights per token).

        `logits_fraction`: share of a microbatch's tokens that produce logits (1.0 for decode-only work,
        small for prefill-heavy work)."""
        head_dim = hidden // num_heads
        attn = hidden * (num_heads * head_dim) * 2 + hidden * (num_kv_heads * head_dim) * 2
        mlp = 3 * hidden * intermediate
        layer = attn + mlp
        return cls(layer=1.0, embedding=0.0, lm_head=logits_fraction * vocab * hidden / layer)


def _validate(num_layers: int, pp: int) -> None:
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
    if num_layers < pp:
        raise ValueError(f"cannot split {num_layers} layers over {pp} stages: every stage needs a layer")


def ranges_from_counts(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def even_partition(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Split as evenly as possible; earlier stages take the remainder (the last holds the LM head)."""
    _validate(num_layers, pp)
    base, extra = divmod(num_layers, pp)
    return ranges_from_counts([base + (1 if s < extra else 0) for s in range(pp)])


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


def cost_partition(num_layers: int, pp: int, cost: StageCostModel) -> list[tuple[int, int]]:
    """Contiguous split minimizing the most expensive stage (exact, by dynamic programming)."""
    _validate(num_layers, pp)
    inf = float("inf")
    # best[s][n]: the lowest max-stage cost placing the first n layers on the first s stages.
    best = [[inf] * (num_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        for n in range(s, num_layers - (pp - s) + 1):
            for m in range(s - 1, n):
                if best[s - 1][m] == inf:
                    continue
                c = stage_costs([(m, n)], num_layers, cost)[0]
                val = max(best[s - 1][m], c)
                # Ties go to the later cut, which gives earlier stages more layers (deterministic).
                if val < best[s][n] - 1e-12 or (abs(val - best[s][n]) <= 1e-12 and m > cut[s][n]):
                    best[s][n], cut[s][n] = val, m
    bounds, n = [], num_layers
    for s in range(pp, 0, -1):
        m = cut[s][n]
        bounds.append((m, n))
        n = m
    return bounds[::-1]


def partition_layers(
    num_layers: int,
    pp: int,
    explicit: Sequence[int] | None = None,
    mode: str = "even",
    cost: StageCostModel | None = None,
) -> list[tuple[int, int]]:
    """Layer ranges [start, end) per stage: `explicit` counts win, then `mode` (even | cost)."""
    _validate(num_layers, pp)
    if explicit is not None:
        counts = list(explicit)
        if len(counts) != pp or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"layer_partition {counts} must have {pp} positive entries summing to {num_layers} layers"
            )
        return ranges_from_counts(counts)
    if mode == "even":
        return even_partition(num_layers, pp)
    if mode == "cost":
        return cost_partition(num_layers, pp, cost or StageCostModel())
    raise ValueError(f"partition mode must be even or cost, got {mode!r}")
