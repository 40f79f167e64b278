"""Speculative decoding's scheduling side: which decodes carry drafts, and how many.

A speculating decode computes its last token and its k drafts as k + 1 query tokens over its KV, like a
short prefill chunk; the last stage verifies them (worker/rejection.py) and the request keeps the
accepted ones and one token more: output exactly that of decoding without drafts.

The rule (`Speculator.extend`, once the policy has filled the microbatch):
- drafts are the last work placed: every decode has its token and every prefill its chunk first, so no
  decode stalls behind a prefill and no draft displaces a prompt;
- while prefill work waits they take only what is left of the microbatch's budget (the balanced share;
  saturated, nothing is left); with no prefill in reach, the room up to the whole token budget;
- per request, draft i is kept while a**i (a: its estimated per-draft acceptance, a decayed count with a
  prior that decays back toward the prior every decode step, so a failing request tries again later) is
  at least a threshold rising from `min_accept_prob` in an empty microbatch to 1 at a full budget:
  full k where the stages would idle, fewer as the budget fills, none at the budget;
- a decode with drafts does not ride the token ring (its next input depends on how many are accepted),
  nor one the proposer would draft for now: it waits for its tokens and speculates instead.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from ppserve.config import SpeculativeConfig
from ppserve.request import Request
from ppserve.sched.batch import BatchBuilder
from ppserve.sched.budget import TokenBudget
from ppserve.sched.proposers import Proposer, make_proposer

__all__ = ["SpecCounters", "Speculator"]

PRIOR_ACCEPTANCE = 0.5  # a new request's per-draft acceptance estimate
PRIOR_WEIGHT = 2.0  # drafts' worth of evidence the prior counts for
DECAY = 0.9  # per decode step: older verifications count less


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

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        assert config.method is not None or proposer is not None, "speculation needs a method"
        self.k = config.num_speculative_tokens
        self.min_accept = config.min_accept_prob
        self.proposer = proposer if proposer is not None else proposer_for(config)
        self._evidence: dict[str, tuple[float, float]] = {}  # request id -> decayed (accepted, tried)
        self.counters = SpecCounters()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether a request may speculate: not under a grammar (its masks follow one token a step)."""
        return req.sampling.structured_outputs is None

    def acceptance(self, request_id: str) -> float:
        accepted, tried = self._evidence.get(request_id, (0.0, 0.0))
        return (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def num_drafts(self, request_id: str, fill: float) -> int:
        """How many drafts the request's estimate keeps at this microbatch fill (0..1 of the budget)."""
        threshold = self.min_accept + (1.0 - self.min_accept) * min(1.0, max(0.0, fill))
        a = self.acceptance(request_id)
        n, chance = 0, a
        while n < self.k and chance >= threshold:
            n += 1
            chance *= a
        return n

    def wants_drafts(self, req: Request) -> bool:
        """Whether the request would carry drafts now (kept off the token ring: it speculates instead)."""
        return self.eligible(req) and self.num_drafts(req.request_id, 0.0) > 0 and bool(
            self.proposer.propose(req, 1))

    def propose(self, req: Request, fill: float) -> list[int]:
        n = self.num_drafts(req.request_id, fill) if self.eligible(req) else 0
        return self.proposer.propose(req, n) if n else []

    def extend(self, b: BatchBuilder, ring: Iterable[str], token_budget: int | None,
               timed: bool = False) -> dict[str, tuple[int, ...]]:
        """Give the microbatch's decodes their drafts (the module's rule); returns them by request id.
        `token_budget`: the whole token budget (the room drafts may take with no prefill in reach);
        `timed`: the budget mode caps time (budget_mode: time), so drafts keep to the microbatch's."""
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
        full = max(1, token_budget)
        on_ring = set(ring)
        drafts: dict[str, tuple[int, ...]] = {}
        for req, n in zip(list(b.chosen_requests), list(b.chosen.values()), strict=True):
            rid = req.request_id
            if n != 1 or rid in on_ring or req.num_uncomputed_tokens != 1:
                continue
            room = cap - budget.tokens_used
            if room <= 0:
                break
            proposal = self.propose(req, budget.tokens_used / full)[:room]
            if proposal:
                taken = b.add_drafts(req, len(proposal), cap, grant)
                if taken:
                    drafts[rid] = tuple(proposal[:taken])
        return drafts

    def stepped(self, request_ids: Iterable[str]) -> None:
        """One decode step passed for these requests: their evidence decays toward the prior."""
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
