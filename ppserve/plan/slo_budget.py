"""The token budget a TBT SLO allows on a deployment: Sarathi-Serve's rule, priced by the planner's cost
model.

Sarathi-Serve chooses its token budget from the TBT SLO: the largest microbatch whose step still hands every
decode its next token in time (the paper: 512 tokens for its strict SLOs, 2048 for the relaxed ones, on
A100s). The planner's grid of budgets (256 ... 2048) is such a GPU's choice. Where a step costs more (a
slower machine, a deeper pipeline, a bigger model per GPU), every budget of the grid can let one long prompt
fill a step that outlasts the SLO, and the capacity search then turns on whether long prompts happen to
arrive beside decodes (docs/decisions.md#slo-token-budget).

A decode's next token comes when its microbatch has gone round the pipeline: with p microbatches in flight,
about p steps of the slowest stage. The SLO's budget is the largest B (of at most `cap` tokens) with

    p * max over stages of t_s(a chunk of B tokens after `context` cached tokens, one sampled) <= margin * SLO

`context` is half the workload's mean prompt. A full microbatch's decodes are priced as its chunk's tokens
are; `margin` leaves room for a decode's own terms and the stream's spread. B is rounded down to whole KV
blocks where it holds one, and found by bisection (the step-cost models are monotone in the chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from ppserve.plan.space import Deployment
from ppserve.sched.cost import BatchShape
from ppserve.sim.cost_model import CostModel

__all__ = ["SLO_BUDGET_MARGIN", "slo_token_budget", "with_slo_budgets"]

# The part of the TBT SLO a budget-full step may take around the pipeline: the rest is for decodes priced
# above a chunk's token, the p99's tail and the control plane. A budget a little short of the best costs a
# little throughput, one a little over it fails the SLO at every rate (docs/decisions.md#slo-token-budget).
SLO_BUDGET_MARGIN = 0.65


def slo_token_budget(cost: CostModel, tbt_slo_s: float, context: int, cap: int, block_size: int = 16,
                     margin: float = SLO_BUDGET_MARGIN) -> int | None:
    """The largest token budget (at most `cap`) whose full step keeps a decode's next token within
    `margin` x `tbt_slo_s` on the deployment `cost` prices (see the module doc); None when not even a
    one-token step does."""
    if not (tbt_slo_s > 0 and 0 < margin <= 1):
        raise ValueError(f"need a TBT SLO > 0 and a margin in (0, 1], got {tbt_slo_s!r} and {margin!r}")
    if cap < 1 or block_size < 1 or context < 0:
        raise ValueError(f"need cap >= 1, block_size >= 1 and context >= 0, got {cap}, {block_size}, "
                         f"{context}")
    limit = margin * tbt_slo_s

    def round_trip(tokens: int) -> float:
        shape = BatchShape(((tokens, context),), 1, tokens, 0)
        return cost.num_stages * max(cost.stage_time(s, shape) for s in range(cost.num_stages))

    if round_trip(1) > limit:
        return None
    lo, hi = 1, cap  # round_trip(lo) fits; find the largest that does
    if round_trip(hi) <= limit:
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if round_trip(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo - lo % block_size if lo >= block_size else lo


def with_slo_budgets(deployments: Sequence[Deployment], cost_model: Callable[[Deployment], CostModel],
                     tbt_slo_s: float, mean_prompt: float) -> list[Deployment]:
    """The deployments, each sarathi one told its SLO's budget (`slo_budget`: the search's first round
    stands a shape for by the budget nearest 512 that it allows), and for each sarathi setting where every
    budget of the grid outlasts the TBT SLO (its SLO budget is below the grid's smallest), the same
    deployment at the SLO's budget (`budget_from_slo`), after the setting's first.

    A deployment is added only there: where the grid holds a budget the SLO allows it brackets the best
    budget already, and an SLO budget between grid budgets buys nothing but search time
    (docs/decisions.md#slo-token-budget)."""
    budgets: dict[tuple[object, ...], int | None] = {}
    grids: dict[tuple[object, ...], set[int]] = {}
    for d in deployments:
        grids.setdefault(_setting(d), set()).add(d.token_budget)
    out: list[Deployment] = []
    for d in deployments:
        if d.policy != "sarathi":
            out.append(d)
            continue
        key = _setting(d)
        grid = grids[key]
        first = key not in budgets
        if first:
            budgets[key] = slo_token_budget(cost_model(d), tbt_slo_s, int(mean_prompt) // 2, max(grid),
                                            d.block_size)
        budget = budgets[key]
        out.append(replace(d, slo_budget=budget))
        if first and budget is not None and budget < min(grid):
            out.append(replace(d, token_budget=budget, budget_from_slo=True, slo_budget=budget))
    return out


def _setting(d: Deployment) -> tuple[object, ...]:
    """A deployment without its token budget: what one SLO budget is computed for."""
    return d.pp, d.tp, d.replicas, d.policy, d.max_num_seqs, d.layer_counts, d.num_blocks, d.block_size
