"""Speculative decoding's scheduling side: which decodes carry drafts, and how many.

A speculating decode computes its last token and its k drafts as k + 1 query tokens over its KV, a short
prefill chunk; the last stage verifies them (worker/rejection.py): output exactly as without drafts.

The rule (`Speculator.extend`, once the policy has filled the microbatch):
- drafts are placed last: every decode has its token and every prefill its chunk first; while prefill
  work waits they take only what the microbatch's budget has left (the balanced share; saturated,
  nothing), with no prefill in reach the room up to the whole token budget;
- per request, draft i is kept while a**i, its chance of acceptance (a: the request's per-draft
  acceptance, a decayed count that drifts back to a prior every decode step, so a failing request
  tries again later), is at least `min_accept_prob` and, with a margin, the draft's seconds (the step
  cost's, or what speculated microbatches measured where more) over the step's seconds per token it
  emits: full k where a step costs its floor, fewer as tokens cost time, none where each token costs
  its share (before the step cost is calibrated the bar rises with the budget's fill);
- a decode with drafts does not ride the token ring (its next input depends on how many are accepted),
  nor one the proposer would draft for now: it waits for its tokens, a trip through the engine, so
  with a ring a decode drafts only while it expects at least `RING_GAIN` accepted drafts a step.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ppserve.config import SpeculativeConfig
from ppserve.request import Request
from ppserve.sched.batch import BatchBuilder
from ppserve.sched.budget import TokenBudget
from ppserve.sched.cost import BatchShape, PipelineCost
from ppserve.sched.output import SchedulerOutput
from ppserve.sched.proposers import Proposer, make_proposer

__all__ = ["SpecCounters", "Speculator"]

PRIOR_ACCEPTANCE = 0.5  # a request's per-draft acceptance before any of its drafts was verified
PRIOR_WEIGHT = 2.0  # drafts' worth of evidence the prior counts for
DECAY = 0.9  # per decode step: a request's older verifications count less
# A verification costs more than the linear step cost says (its rows take the chunk attention path, each
# draft is sampled, the proposer runs on the host): a draft must be worth this many times its price.
DRAFT_COST_MARGIN = 2.0
DRAFT_COST_SMOOTHING = 0.2  # weight of each microbatch's measured draft cost in its running estimate
DRAFT_COST_DECAY = 0.98  # per microbatch back: the measured draft cost fades unless measured again
# With the token ring a decode that drafts leaves it, and its next token waits for the trip through the
# engine: it drafts only while it expects at least this many accepted drafts a step.
RING_GAIN = 0.5


@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters: verifications with drafts, drafts proposed, drafts accepted,
    and drafts accepted at each position (index 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, object]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens
                else None,
                "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts
                else None}


def proposer_for(config: SpeculativeConfig) -> Proposer:
    """The proposer `speculative.method` names, with its options."""
    if config.method == "suffix":
        return make_proposer("suffix", max_tree_depth=config.suffix_decoding_max_tree_depth,
                             max_cached_requests=config.suffix_decoding_max_cached_requests,
                             max_spec_factor=config.suffix_decoding_max_spec_factor,
                             min_token_prob=config.suffix_decoding_min_token_prob)
    return make_proposer(config.method or "", prompt_lookup_max=config.prompt_lookup_max,
                         prompt_lookup_min=config.prompt_lookup_min)


class Speculator:
    """The scheduler's speculation state: the proposer, each request's acceptance estimate, counters."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None,
                 token_ring: bool = False) -> None:
        assert config.method is not None or proposer is not None, "speculation needs a method"
        self.k = config.num_speculative_tokens
        self.min_accept = config.min_accept_prob
        self.adaptive = config.adaptive
        self.token_ring = token_ring  # the pipeline has a token ring that a drafting decode leaves
        self.proposer = proposer if proposer is not None else proposer_for(config)
        self._evidence: dict[str, tuple[float, float]] = {}  # request id -> decayed (accepted, tried)
        self.counters = SpecCounters()
        # Seconds a draft adds to a step, measured: a speculated microbatch's slowest stage less the
        # predicted time of the same microbatch without its drafts, per draft (None before any).
        self.draft_cost_s: float | None = None
        self._plain_residual_s = 0.0  # measured less predicted seconds of microbatches without drafts
        self._last_threshold = self.min_accept  # the bar of the last decode-only microbatch

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether a request may speculate: not under a grammar (its masks follow one token a step)."""
        return req.sampling.structured_outputs is None

    def acceptance(self, request_id: str) -> float:
        """The request's per-draft acceptance: its decayed verifications and the prior."""
        accepted, tried = self._evidence.get(request_id, (0.0, 0.0))
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def threshold(self, b: BatchBuilder, cost: PipelineCost | None, token_budget: int) -> float:
        """The chance of acceptance a draft needs in this microbatch (the module's rule): its predicted
        seconds over the step's seconds per token it emits, at least `min_accept_prob`; before the step
        cost is calibrated, rising with the budget's fill instead."""
        if cost is None:
            fill = min(1.0, b.budget.tokens_used / max(1, token_budget))
            return self.min_accept + (1.0 - self.min_accept) * fill
        chunks = tuple(zip(b.chosen.values(), (r.num_computed_tokens for r in b.chosen_requests),
                           strict=True))
        sampled = sum(1 for r, n in zip(b.chosen_requests, b.chosen.values(), strict=True)
                      if n >= r.num_uncomputed_tokens)
        if not sampled:
            return 1.0
        step_s = cost.pace(BatchShape(chunks, sampled))
        context = max((ctx for n, ctx in chunks if n == 1), default=0)
        draft_s = max(s.token_s + s.sample_s + s.prefill_key_s * (context + 1) for s in cost.stages)
        if self.draft_cost_s is not None:  # what drafts cost here, measured, where the fit says less
            draft_s = max(draft_s, self.draft_cost_s)
        if step_s <= 0:
            return 1.0
        return min(1.0, max(self.min_accept, DRAFT_COST_MARGIN * draft_s * sampled / step_s))

    def observe_cost(self, out: SchedulerOutput, stage_seconds: Sequence[float], cost: PipelineCost) -> None:
        """Learn what a draft costs from the measured stage times of decode-only microbatches: a speculated
        one's slowest stage less the predicted seconds of it without its drafts, per draft, less the error
        the prediction makes on those without drafts (learned from them)."""
        drafts = out.draft_token_ids
        if out.num_prefill_tokens:  # a prefill's error would drown the drafts' cost
            return
        chunks = tuple((1, ctx) if rid in drafts else (n, ctx)
                       for rid, n, ctx in zip(out.order, out.num_scheduled_tokens, out.num_computed_tokens,
                                              strict=True))
        residual = max(stage_seconds) - cost.pace(BatchShape(chunks, len(out.sample_request_ids)))
        if not drafts:
            self._plain_residual_s += DRAFT_COST_SMOOTHING * (residual - self._plain_residual_s)
            return
        per_draft = max(0.0, (residual - self._plain_residual_s) / out.num_draft_tokens)
        old = self.draft_cost_s
        self.draft_cost_s = per_draft if old is None else old + DRAFT_COST_SMOOTHING * (per_draft - old)

    def num_drafts(self, request_id: str, threshold: float) -> int:
        """How many drafts the request's estimate keeps: draft i while a**i >= threshold (all k when
        not adaptive)."""
        if not self.adaptive:
            return self.k
        a = self.acceptance(request_id)
        n, chance, expected = 0, a, 0.0
        while n < self.k and chance >= threshold:
            n += 1
            expected += chance
            chance *= a
        return 0 if self.token_ring and expected < RING_GAIN else n

    def wants_drafts(self, req: Request) -> bool:
        """Whether the request would carry drafts now, at the bar the last decode-only microbatch set (kept
        off the token ring: it speculates instead; where the load leaves drafts no room it stays on it)."""
        return self.eligible(req) and self.num_drafts(req.request_id, self._last_threshold) > 0 and bool(
            self.proposer.propose(req, 1))

    def propose(self, req: Request, threshold: float) -> list[int]:
        n = self.num_drafts(req.request_id, threshold) if self.eligible(req) else 0
        return self.proposer.propose(req, n) if n else []

    def extend(self, b: BatchBuilder, ring: Iterable[str], token_budget: int | None,
               timed: bool = False, cost: PipelineCost | None = None) -> dict[str, tuple[int, ...]]:
        """Give the microbatch's decodes their drafts (the module's rule); returns them by request id.
        `token_budget`: the whole token budget (the room drafts may take with no prefill in reach);
        `timed`: the budget mode caps time (budget_mode: time), so drafts keep to the microbatch's;
        `cost`: the calibrated step cost (None before)."""
        budget = b.budget
        cap = budget.token_budget
        if cap is None or token_budget is None:
            return {}
        grant = budget.grant_drafts
        if not b.prefill_left():
            # The balanced share's time is an equal part of the work, not a limit of its own: with no
            # prefill to balance against, drafts may take the token budget.
            cap = max(cap, token_budget)
            if not timed:
                grant = functools.partial(TokenBudget.grant_drafts, budget)
        threshold: float | None = None  # priced once, at the first decode that may draft
        if all(n == 1 for n in b.chosen.values()):
            # A decode-only microbatch sets the bar the token ring's decodes are judged by (wants_drafts).
            threshold = self._last_threshold = self.threshold(b, cost, token_budget)
        on_ring = set(ring)
        drafts: dict[str, tuple[int, ...]] = {}
        for req, n in zip(list(b.chosen_requests), list(b.chosen.values()), strict=True):
            rid = req.request_id
            if n != 1 or rid in on_ring or req.num_uncomputed_tokens != 1 or not self.eligible(req):
                continue
            room = cap - budget.tokens_used
            if room <= 0:
                break
            if threshold is None:
                threshold = self.threshold(b, cost, token_budget)
            proposal = self.propose(req, threshold)[:room]
            if proposal:
                taken = b.add_drafts(req, len(proposal), cap, grant)
                if taken:
                    drafts[rid] = tuple(proposal[:taken])
        return drafts

    def stepped(self, request_ids: Iterable[str]) -> None:
        """A microbatch is back, a decode step for these requests: their evidence decays toward the
        prior."""
        if self.draft_cost_s is not None:  # forgets toward the prediction, so drafts priced out try again
            self.draft_cost_s *= DRAFT_COST_DECAY
        evidence = self._evidence
        for rid in request_ids:
            e = evidence.get(rid)
            if e is not None:
                evidence[rid] = (e[0] * DECAY, e[1] * DECAY)

    def verified(self, request_id: str, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of `proposed` drafts kept. Drafts tried: the accepted
        ones and the first rejected (the rest were never reached)."""
        self.counters.record(proposed, accepted)
        tried = accepted + (1 if accepted < proposed else 0)
        a, t = self._evidence.get(request_id, (0.0, 0.0))
        self._evidence[request_id] = (a + accepted, t + tried)

    def release(self, req: Request, finished: bool) -> None:
        self._evidence.pop(req.request_id, None)
        self.proposer.release(req, finished)
