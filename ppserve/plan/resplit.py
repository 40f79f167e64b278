"""A profile fitted on one pipeline, re-split over another pp x tp: the planner's cost model for a machine
it has measured (a fitted profile is fixed to the stage count it was measured at).

The fitted stages give one decoder layer's cost and what the last stage adds (`sched.cost.fit_layer_costs`,
from two stages or more); any layer split of the same model is then `LayerCosts.pipeline`. Over tp ranks
the per-token terms are divided by the tp ratio (ideal scaling: the matmuls and attention heads split)
and the fixed per-step floor is kept; the all-reduces a larger tp adds are not in a profile measured at a
smaller one, so a re-split to a larger tp is optimistic. The stage-to-stage transfer keeps its measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.plan.space import Deployment
from ppserve.sched.cost import LayerCosts, PipelineCost, StepCost, fit_layer_costs
from ppserve.sched.partition import even_partition, ranges_from_counts
from ppserve.sim.cost_model import CostModel, Profile, ProfileCostModel

__all__ = ["ProfileResplit", "layer_costs_of"]


def layer_costs_of(profile: Profile, layer_counts: Sequence[int]) -> LayerCosts:
    """One layer's and the head's cost from a profile measured with these layers per stage."""
    if len(layer_counts) != profile.cost.num_stages:
        raise ValueError(f"the profile has {profile.cost.num_stages} stages, the layer split "
                         f"{list(layer_counts)} has {len(layer_counts)}")
    return fit_layer_costs(profile.cost, ranges_from_counts(layer_counts))


def _scale_tp(cost: StepCost, ratio: float) -> StepCost:
    """Per-token terms over `ratio` times the ranks, the floor unchanged."""
    return StepCost(cost.floor_s, cost.token_s / ratio, cost.prefill_key_s / ratio, cost.decode_key_s / ratio,
                    cost.sample_s / ratio)


@dataclass(frozen=True)
class ProfileResplit:
    """The planner's cost-model factory over a measured profile (picklable: it goes to every worker)."""

    profile: Profile
    layer_counts: tuple[int, ...]  # layers per stage where the profile was measured
    tp: int = 1  # tensor-parallel ranks it was measured at

    def __post_init__(self) -> None:
        layer_costs_of(self.profile, self.layer_counts)  # fail early on a profile that cannot be split

    def cost_model(self, layer_counts: Sequence[int], tp: int) -> ProfileCostModel:
        lc = layer_costs_of(self.profile, self.layer_counts)
        ratio = tp / self.tp
        scaled = LayerCosts(_scale_tp(lc.layer, ratio), _scale_tp(lc.head, ratio))
        stages: PipelineCost = scaled.pipeline(ranges_from_counts(layer_counts))
        return ProfileCostModel(Profile(stages, self.profile.transfer_s if len(layer_counts) > 1 else 0.0,
                                        f"{self.profile.note}; re-split to {list(layer_counts)} at tp {tp}"))

    def __call__(self, ctx: object, d: Deployment) -> CostModel:
        counts = d.layer_counts or tuple(b - a for a, b in even_partition(sum(self.layer_counts), d.pp))
        return self.cost_model(counts, d.tp)
