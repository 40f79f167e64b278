"""Balanced microbatch formation: how big the next microbatch is, so that the pipeline stays full.

A pipeline of p stages keeps p microbatches in flight (p + 1 with the token ring); it is balanced when
consecutive microbatches cost the same on every stage (ARCHITECTURE.md#how-a-microbatch-is-formed).
`BalancedFormation` gives each microbatch two numbers:

- a **decode quota**, min(ceil(D / p), ceil(R / F)) of the R ready decodes (D decoding in all, F free
  slots): the decodes form p groups of about D / p that follow each other round the pipeline;
- a **budget**, an equal share of the work in reach ((in flight + schedulable now) / p), in predicted
  time on the slowest stage once the step-cost model is calibrated, in tokens before. Saturated (the
  work fills every share, or requests wait beyond the free seats) the budget stays whole: plain
  Sarathi-Serve. A share is never thinner than a minimum chunk (the chunk that costs a step's floor)
  beside the decodes, except while several prompts fill an empty pipeline, which is cut into the
  number of equal microbatches that ends it soonest and keeps that share until its first decode is
  back. While requests keep arriving the work is shared over `scheduler.balance_rounds` rounds, never
  thinner than `ROUNDS_MIN_CHUNKS` minimum chunks; a share in time cuts a prompt into equal chunks.

Why, with the measurements: docs/decisions.md#balanced-formation. Pure Python, no clock reads of its own.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppserve.request import Request
from ppserve.sched.batch import RunningSplit
from ppserve.sched.block_manager import BlockManager
from ppserve.sched.budget import TimeBudget, TokenBudget
from ppserve.sched.cost import OnlinePipelineCost, PipelineCost, WorkFeatures
from ppserve.sched.output import SchedulerOutput

__all__ = ["MIN_REST_OF_BUDGET", "MIN_SHARE_OF_BUDGET", "ROUNDS_MIN_CHUNKS", "ArrivalWatch",
           "BalancedFormation",
           "decode_quota", "fair_share", "fill_microbatches", "min_chunk_tokens"]

# A token share is never cut below this part of the budget: beside a microbatch's decodes a stage's
# time is mostly its per-step floor, so a smaller chunk balances almost nothing and only spreads a
# short prompt over more microbatches (up to p - 1 more steps of TTFT). A share in predicted time keeps
# the same floor, or less where a chunk that size costs more than the step's floor (`min_chunk_tokens`).
MIN_SHARE_OF_BUDGET = 0.25

# A share in predicted time never leaves a prompt a rest of this part of the budget or less: the chunk
# takes it whole (the token budget allowing). A tiny rest costs its request a microbatch of its own and
# the pipeline a short one; a rest as large as the quarter-budget floor, taken whole, overfills.
MIN_REST_OF_BUDGET = 1 / 16

# Shared over more than one round, a chunk is at least this many minimum chunks (in tokens, before the
# cost model is calibrated, this many quarter budgets), or one round's share where that is thinner: a
# chunk near the floor's cost barely shortens its microbatch and only adds steps to its prompt.
ROUNDS_MIN_CHUNKS = 2.0

# Requests count as still arriving while the last one came less than this many mean gaps ago: a
# Poisson stream leaves a longer silence 5 % of the time (e^-3). The mean gap is a moving average of
# the last ~10 gaps (weight 0.1): it follows a change of rate within a few arrivals.
STREAM_GAPS = 3.0
GAP_WEIGHT = 0.1


@dataclass
class ArrivalWatch:
    """Whether requests are still arriving as a stream, from their arrival times on the scheduler's
    clock: the last arrival came less than `STREAM_GAPS` mean gaps ago. Requests that all came at one
    instant (a batch, a burst) make no stream: their gaps are zero."""

    last_s: float | None = None
    mean_gap_s: float | None = None

    def arrived(self, now_s: float) -> None:
        if self.last_s is not None:
            gap = max(0.0, now_s - self.last_s)
            self.mean_gap_s = (gap if self.mean_gap_s is None
                               else self.mean_gap_s + GAP_WEIGHT * (gap - self.mean_gap_s))
        self.last_s = now_s

    def streaming(self, now_s: float) -> bool:
        if self.last_s is None or self.mean_gap_s is None:
            return False
        return now_s - self.last_s < STREAM_GAPS * self.mean_gap_s


def decode_quota(num_decoding: int, num_ready: int, num_stages: int, free_slots: int) -> int:
    """How many of the `num_ready` schedulable decodes the next microbatch takes (see the module doc);
    `free_slots` is how many of the `num_stages` in-flight slots are empty."""
    if num_ready <= 0 or free_slots <= 0:
        return 0
    per_group = math.ceil(max(num_decoding, num_ready) / num_stages)
    per_free_slot = math.ceil(num_ready / free_slots)
    return max(1, min(per_group, per_free_slot))


def fair_share(work_in_reach: float, num_shares: int, cap: float, floor: float = 0.0) -> float:
    """The next microbatch's share of the work in reach (split `num_shares` ways), at least `floor` and
    at most `cap` (the budget)."""
    return min(cap, max(floor, work_in_reach / num_shares))


def fill_microbatches(stages: Sequence[tuple[float, float]], num_stages: int) -> int:
    """How many equal microbatches an empty pipeline's fill is cut into; `stages`: per stage, its floor per
    step and the fill's work there (seconds).

    m microbatches of a work W with a floor f each keep a pipeline of p stages busy until about
    (m + p - 1) (f + W / m): few, and the stages behind the first wait for a long one; many, and each pays
    its floor. That ends soonest at m = sqrt((p - 1) W / f), taken here on the stage that wants the most,
    rounded down: each microbatch also costs what the model leaves out (its dispatch, its hops). A stage
    whose fit has no floor (an online fit can put it at zero) asks for one round, p microbatches, as a
    share does: the formula would ask for as many microbatches as tokens."""
    count = 1
    for floor_s, work_s in stages:
        wanted = math.floor(math.sqrt((num_stages - 1) * work_s / floor_s)) if floor_s > 0 else num_stages
        count = max(count, wanted)
    return count


def min_chunk_tokens(cost: PipelineCost, token_budget: int) -> int:
    """The smallest chunk a share in predicted time cuts a prompt to beside its decodes: the longest
    chunk that adds at most a stage's per-step floor to that stage, on the stage where that chunk is
    longest, and never more than a quarter of the budget (`MIN_SHARE_OF_BUDGET`, the token share's floor).

    The floor argument is about time, not tokens: a chunk that costs much less than the step's floor
    balances nothing and only spreads a prompt over more microbatches. On a GPU the floor is the
    weights' read and a token's cost its compute, so the chunk is about the ridge point. Where a token
    costs more next to the floor the chunk is smaller: a quarter budget kept whole would be a long
    microbatch for the other stages to wait behind."""
    cap = math.ceil(token_budget * MIN_SHARE_OF_BUDGET)
    if not cost.stages:
        return cap
    return max(stage.max_tokens(stage.floor_s, 0, cap) for stage in cost.stages)


class BalancedFormation:
    """The balanced formation's state and steps: for each microbatch, its decode quota and its budget.

    It reads the scheduler's queues (the in-flight microbatches, the waiting and running requests) and
    prices work with the scheduler's online step cost; what it keeps of its own: the arrivals
    (`ArrivalWatch`), each in-flight microbatch's features (priced once), and an empty pipeline's fill
    share, kept until its first decode is back so the fill's microbatches come out equal."""

    def __init__(self, num_stages: int, max_num_seqs: int, balance_rounds: int, seq_cap: int | None,
                 cost: OnlinePipelineCost, blocks: BlockManager, in_flight: deque[SchedulerOutput],
                 waiting: deque[Request], running: dict[str, Request], clock: Callable[[], float]) -> None:
        self.num_stages = num_stages
        self.max_num_seqs = max_num_seqs
        self.balance_rounds = balance_rounds
        self.seq_cap = seq_cap
        self.cost = cost
        self.blocks = blocks
        self.in_flight = in_flight
        self.waiting = waiting
        self.running = running
        self.clock = clock
        self.arrivals = ArrivalWatch()  # whether requests keep arriving: the share's rounds
        self._in_flight_work: dict[int, WorkFeatures] = {}  # by step id (`_work_of`)
        self._min_chunk_memo: tuple[tuple[PipelineCost, int] | None, int] = (None, 0)
        self._fill_share_s: float | None = None

    # ---- what the scheduler tells it -------------------------------------------------------------
    def arrived(self, now_s: float) -> None:
        self.arrivals.arrived(now_s)

    def returned(self, step_id: int) -> None:
        self._in_flight_work.pop(step_id, None)

    def forget(self) -> None:
        """The in-flight microbatches were abandoned (a pipeline rebuild)."""
        self._fill_share_s = None
        self._in_flight_work.clear()

    # ---- one microbatch --------------------------------------------------------------------------
    def plan(self, split: RunningSplit, budget: TokenBudget) -> tuple[TokenBudget, int]:
        """The next microbatch's budget (`budget`, the budget mode's, whole or shrunk to a share, or a
        time budget in its place) and its decode quota.

        The quota applies always: it moves a decode to the next microbatch only when its group is over
        ~1/p of the decodes. The share applies unless the pipeline is saturated: the work in reach fills
        every share to the token budget, or requests wait beyond the free seats (`max_num_seqs` bounds
        the work then, not demand, and a smaller budget would only cut throughput)."""
        stages = self.num_stages
        in_flight = self.in_flight
        num_ready = len(split.decodes)
        # Decode next once back. The ring's candidates are ready already: each is sampled by the oldest
        # in-flight microbatch and rides in no other, so they count once among the samples in flight.
        awaiting = sum(len(mb.sample_request_ids) for mb in in_flight) - len(split.ring)
        free_slots = max(1, stages - len(in_flight))  # the token ring's extra slot is the oldest's group's
        quota = decode_quota(num_ready + awaiting, num_ready, stages, free_slots)
        if self.seq_cap is not None and split.following:
            # Under a per-microbatch sequence cap a decode group could fill every seat: a prompt whose
            # next chunk follows its in-flight chunk keeps one (a decode left out goes first next time),
            # or its chunks would ride once a round in one long microbatch among decode-only ones.
            quota = max(1, min(quota, self.seq_cap - 1))
        seats = max(0, self.max_num_seqs - len(self.running))
        if len(self.waiting) > seats:
            return budget, quota
        cap = budget.token_budget
        assert cap is not None and cap >= 1, "a balanced policy has a token budget"
        reach = split.prefills + split.following + list(itertools.islice(self.waiting, seats))
        # An empty pipeline (nothing in flight, no decode) that several prompts fill: one round, cut in
        # predicted time into the microbatches that end it soonest (`_time_share`); with no decodes to
        # keep level, thinner chunks over several rounds would only delay the prompts.
        filling = not in_flight and not num_ready and len(reach) > 1
        rounds = self.balance_rounds
        shares = stages * (rounds if rounds > 1 and not filling and self.arrivals.streaming(self.clock())
                           else 1)
        tokens = sum(mb.total_tokens for mb in self._peers_in_flight()) + num_ready
        calibrated = self.cost.calibrated
        if filling or num_ready or not reach or not in_flight or not calibrated:
            self._fill_share_s = None  # a fill under way ends with its first decode back
        if self._fill_share_s is not None:  # the fill goes on: its microbatches stay equal
            return self._time_budget(budget, cap, self._fill_share_s), quota
        # Beyond this every share is the whole budget: saturated. A fill in predicted time sees all of its
        # work and decides that itself (`_time_share`).
        limit = math.inf if filling and calibrated else shares * cap
        work: list[tuple[int, int]] = []  # per prefill in reach: (tokens it will compute, tokens before them)
        seen: set[bytes] = set()
        for req in reach:
            if tokens >= limit:
                return budget, quota
            cached = self.blocks.prefix_in_reach(req, seen)  # a prefix held in reach is not work
            work.append((req.num_uncomputed_tokens - cached, req.num_computed_tokens + cached))
            tokens += work[-1][0]
        if tokens >= limit:
            return budget, quota
        if calibrated:
            shared = self._time_share(split, quota, work, shares, budget, cap, filling)
            return (budget if shared is None else shared), quota
        # In tokens, a share keeps the quarter-budget floor, except in an empty pipeline's fill: there the
        # floor only makes the first microbatch longer than the rest, with every stage behind it waiting.
        floor = 0.0 if filling else cap * MIN_SHARE_OF_BUDGET
        # over k rounds (never while filling): ROUNDS_MIN_CHUNKS floors, at most one round's
        if shares > stages:
            floor = max(floor, min(tokens / stages, ROUNDS_MIN_CHUNKS * floor))
        budget.limit(math.ceil(fair_share(tokens, shares, cap, floor=floor)))
        return budget, quota

    def _peers_in_flight(self) -> list[SchedulerOutput]:
        """The in-flight microbatches the next one shares a round of the pipeline with: the newest p - 1.
        With the token ring the oldest of p is leaving the last stage (its decodes may be in reach again)."""
        in_flight = self.in_flight
        return list(in_flight)[max(0, len(in_flight) - (self.num_stages - 1)):]

    def _time_share(self, split: RunningSplit, quota: int, prefills: list[tuple[int, int]], shares: int,
                    budget: TokenBudget, cap: int, filling: bool) -> TimeBudget | None:
        """A budget for an equal share, in predicted time, of the work in reach (in flight, the ready
        decodes, the prefills in reach): on each stage its floor plus its part of that work's time, the
        slowest stage's share being the one that counts; never more tokens than the token budget.
        `prefills`: per prefill in reach, (tokens it will compute, tokens before them). `filling`: an
        empty pipeline's fill, cut into `fill_microbatches` equal parts; None where the token budget
        cuts it finer (saturated: the whole budget, as in plain Sarathi-Serve)."""
        cost = self.cost.current
        # Every stage prices the same work with its own coefficients (the step cost is linear in the
        # features), so the work's features are summed once, not once per stage.
        work = WorkFeatures()
        for mb in self._peers_in_flight():
            work.merge(self._work_of(mb))
        for req in split.decodes:
            work.add(1, req.num_computed_tokens, True)
        # each prompt's rest as one piece: its keys add up the same in chunks
        for num_tokens, context in prefills:
            work.add(num_tokens, context, True)
        if filling:
            by_budget = math.ceil(sum(n for n, _ in prefills) / cap)
            count = fill_microbatches([(stage.floor_s, work.seconds(stage)) for stage in cost.stages],
                                      self.num_stages)
            if count <= by_budget:
                return None
            shares = count
        share_s = max(stage.floor_s + work.seconds(stage) / shares for stage in cost.stages)
        # Never below the decodes this microbatch takes (the share must not move a decode its quota
        # admits) plus a minimum chunk (`min_chunk_tokens`): beside the decodes a stage's time is mostly
        # its floor, and a chunk much cheaper than the floor only delays a prompt.
        decodes = sorted(split.decodes, key=split.decode_rank)[:quota]
        min_chunk = 0 if filling else self._min_chunk(cost, cap)
        chunk = max(0, min_chunk - len(decodes))
        taken = WorkFeatures()  # the decodes this microbatch takes; each floor below adds its chunk to a copy
        for r in decodes:
            taken.add(1, r.num_computed_tokens, True)
        least = taken.plus(chunk, 0, False) if chunk else taken
        floor_s = max(stage.floor_s + least.seconds(stage) for stage in cost.stages)
        share_s = max(share_s, floor_s * (1 + 1e-9))  # the tolerance: summed in another order
        if shares > self.num_stages:  # over k rounds (one round while filling)
            # Over k rounds a chunk is never thinner than ROUNDS_MIN_CHUNKS minimum chunks, unless one
            # round's share is thinner still.
            thick = max(0, min(cap, round(ROUNDS_MIN_CHUNKS * min_chunk)) - len(decodes))
            if thick > chunk:
                one_round_s = max(stage.floor_s + work.seconds(stage) / self.num_stages
                                  for stage in cost.stages)
                thicker = taken.plus(thick, 0, False)
                rounds_floor_s = max(stage.floor_s + thicker.seconds(stage) for stage in cost.stages)
                share_s = max(share_s, min(one_round_s, rounds_floor_s))
        if filling:
            self._fill_share_s = share_s
        return self._time_budget(budget, cap, share_s)

    def _time_budget(self, budget: TokenBudget, cap: int, share_s: float) -> TimeBudget:
        """The microbatch's budget for a time share: the token budget, and `share_s` on every stage."""
        if isinstance(budget, TimeBudget):  # budget_mode: time caps it already
            budget.limit(cap, share_s)
            return budget
        min_rest = math.ceil(cap * MIN_REST_OF_BUDGET)
        return TimeBudget(cap, budget.max_seqs, self.cost.current, share_s, min_rest=min_rest,
                          even_chunks=True)

    def _min_chunk(self, cost: PipelineCost, token_budget: int) -> int:
        """`min_chunk_tokens`, solved again only when the fit or the budget changed (a refit makes a new
        `PipelineCost`; between refits every schedule would solve the same equation on every stage)."""
        key = (cost, token_budget)
        if self._min_chunk_memo[0] != key:
            self._min_chunk_memo = (key, min_chunk_tokens(cost, token_budget))
        return self._min_chunk_memo[1]

    def _work_of(self, mb: SchedulerOutput) -> WorkFeatures:
        """An in-flight microbatch's features, summed once: every schedule while it is in flight prices
        it again."""
        work = self._in_flight_work.get(mb.step_id)
        if work is None:
            work = self._in_flight_work[mb.step_id] = WorkFeatures()
            sampled = set(mb.sample_request_ids)
            for rid, n, ctx in zip(mb.order, mb.num_scheduled_tokens, mb.num_computed_tokens, strict=True):
                work.add(n, ctx, rid in sampled)
        return work
