"""What a mixture-of-experts layer costs a step (pure Python): the experts a microbatch actually touches.

Each token picks k of a layer's E experts, so a step of T tokens computes T * k expert MLPs but reads only
the weights of the distinct experts it touched: about min(E, T * k) of E. With the router's choices
spread evenly (what load-balanced training aims for) the expected count is E * (1 - (1 - k / E) ** T),
which is k for one decode, approaches E for a large prefill chunk, and never exceeds min(E, T * k). The
partition's weight-per-token costs (sched/partition.py) and the simulator's roofline
(sim/cost_model.py) price a sparse layer's MLP with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppserve.sched.model_shape import ExpertShape, ModelShape


def experts_touched(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Expected distinct experts of one layer that `num_tokens` tokens route to (k each, spread evenly)."""
    if num_tokens <= 0:
        return 0.0
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def moe_mlp_weights(hidden: int, moe: ExpertShape, num_tokens: int) -> tuple[float, float]:
    """(weights multiplied per token, weights read per step) of one sparse layer's MLP at `num_tokens`:
    k experts' gate, up and down matrices plus the router per token; the touched experts' matrices and
    the router read once."""
    expert = 3 * hidden * moe.expert_intermediate_size
    router = hidden * moe.num_experts
    per_token = moe.top_k * expert + router
    read = experts_touched(moe.num_experts, moe.top_k, num_tokens) * expert + router
    return float(per_token), read


@dataclass(frozen=True)
class Experts:
    """An ExpertShape of plain numbers (the simulator's model tables)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int


def mlp_weights_per_token(model: ModelShape, num_tokens: int = 1) -> float:
    """Mean over the model's layers of the MLP weights a token multiplies in a step of `num_tokens`
    tokens: a dense layer's three matrices; a sparse layer's k experts and router per token (and, as
    `num_tokens` grows, the touched experts' reads shared among them: max of the two, per token). A model
    without `moe` (or with None) is dense."""
    dense = 3.0 * model.hidden_size * model.intermediate_size
    moe = getattr(model, "moe", None)
    if moe is None:
        return dense
    per_token, read = moe_mlp_weights(model.hidden_size, moe, num_tokens)
    sparse = max(per_token, read / max(num_tokens, 1))
    num_sparse = len(getattr(moe, "sparse_layers", range(model.num_layers)))
    return (num_sparse * sparse + (model.num_layers - num_sparse) * dense) / model.num_layers
