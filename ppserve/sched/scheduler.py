"""The scheduler state machine: `schedule() -> SchedulerOutput`, `update_from_output(out, result)`.

No torch, ray, grpc, I/O or clock reads of its own (the clock is injected). It owns the only KV block
allocator and enforces the pipeline invariants: at most `num_stages` microbatches in flight (one per stage), a
decoding request in at most one of them (a prompt's consecutive prefill chunks may follow each other;
only the last one samples). With the token ring (`scheduler.async_scheduling`, pp > 1) one microbatch
more may be formed, and the decodes the oldest in-flight microbatch samples may ride in it too, their
input token handed from the last stage to stage 0 without the engine (`_ring_candidates`).

How a microbatch is formed (ARCHITECTURE.md §3-§4). The policy decides which requests join and how many
tokens each computes; for `sarathi` that is: every schedulable decode first (one token each, never
stalled by a prefill), then the prefill chunks already under way, then new requests in arrival
order, chunked so the microbatch holds exactly its budget. With a pipeline (p = num_stages > 1) the
formation is *balanced* (`ppserve.sched.balance`): the decodes are spread over the in-flight
microbatches, about 1/p of all decoding requests each, those in flight counted; while the pipeline
has slack, the budget shrinks to an equal share of the work in reach, (in flight + schedulable) / p,
in predicted time on the slowest stage (`self.cost`, the step-cost model fitted online from every
microbatch's stage times, sched/cost.py; in tokens until it is calibrated); saturated (the work in
reach fills every share to the token budget, or requests wait beyond the free seats) the budget stays
whole, in tokens: exactly plain Sarathi-Serve, full budget and every ready decode its quota admits.
A prompt's next chunk may join the next microbatch while its previous chunk is still in flight, with
only the budget the other work leaves (ranked with the other prefills, one prompt's chunks took the
prefill part of consecutive microbatches, and its short last chunk beside a sequence cap full of
decodes left every few microbatches short: bubbles in a saturated pipeline). So the pipeline holds p microbatches whenever there are p units of
work, and consecutive microbatches cost the same on every stage. The other policies keep their own
rules (the baselines are measured as they are).

Per-request work is incremental and linear in the number of requests: one pass sorts the running
requests, decodes carry one token and, every block_size tokens, one block id.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence

from ppserve.config import SchedulerConfig
from ppserve.request import FinishReason, Request, RequestStatus
from ppserve.sched.balance import (
    MIN_REST_OF_BUDGET,
    MIN_SHARE_OF_BUDGET,
    ROUNDS_MIN_CHUNKS,
    ArrivalWatch,
    decode_quota,
    fair_share,
    fill_microbatches,
    min_chunk_tokens,
)
from ppserve.sched.batch import BatchBuilder
from ppserve.sched.block_manager import BlockManager, blocks_for
from ppserve.sched.budget import BudgetMode, TimeBudget, TokenBudget, make_budget_mode
from ppserve.sched.cost import BatchShape, OnlinePipelineCost, PipelineCost, WorkFeatures
from ppserve.sched.output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.policies import Policy, make_policy
from ppserve.sched.ring_clock import RingClock

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        num_stages: int = 1,
        clock: Callable[[], float] = lambda: 0.0,
        budget_mode: BudgetMode | None = None,
        cost_prior: PipelineCost | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.config = config
        self.policy: Policy = make_policy(config.policy, balanced=config.balance)
        # What a microbatch costs on each stage (sched/cost.py), learned from every microbatch's measured
        # stage times; `cost_prior` (a saved profile, a calibration, the simulator's roofline) until then.
        self.cost = OnlinePipelineCost(num_stages, cost_prior)
        # How big each microbatch's budget is (fixed tokens unless the config asks for time or a TBT target).
        self.budget_mode = budget_mode or make_budget_mode(config, num_stages, self.cost)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.max_model_len = max_model_len
        self.num_stages = num_stages  # the pipeline depth: one microbatch per stage keeps every stage busy
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # by id, in admission order
        self.in_flight: deque[SchedulerOutput] = deque()
        self._in_flight_work: dict[int, WorkFeatures] = {}  # by step id: what `_time_share` prices (`_work_of`)
        self._min_chunk_memo: tuple[tuple[PipelineCost, int] | None, int] = (None, 0)
        # An empty pipeline's fill in predicted time: the time share each of its microbatches takes, kept
        # until its first decode is back (`_balance`), so the fill's microbatches come out equal.
        self._fill_share_s: float | None = None
        self._released: list[str] = []  # ids whose worker state must be dropped, sent with the next output
        self._next_step = 0
        self.num_preemptions = 0
        self.balanced = self.policy.balanced and num_stages > 1
        # The token ring (ARCHITECTURE.md §3): one microbatch more than the stages may be formed, its
        # decodes taking the tokens the oldest in-flight microbatch samples, straight from the last stage.
        self.async_scheduling = config.token_ring and num_stages > 1
        self.max_in_flight = num_stages + 1 if self.async_scheduling else num_stages
        # With the ring, when its extra microbatch is due: just before stage 0 needs it (`formation_due`).
        self.ring_clock = RingClock(config.ring_margin_ms * 1e-3, 2 * self.max_in_flight) \
            if self.async_scheduling and config.ring_margin_ms is not None else None
        self._seq_cap: int | None = None
        self.arrivals = ArrivalWatch()  # whether requests keep arriving: the balanced share's rounds
        if config.per_microbatch_seq_cap:
            self._seq_cap = max(1, config.max_num_seqs // num_stages)

    # ---- requests in and out -------------------------------------------------------------------
    def max_total_tokens(self, req: Request) -> int:
        """Prompt plus the most output tokens it may get (max_tokens None: the context's limit)."""
        return min(req.num_prompt_tokens + (req.sampling.max_tokens or self.max_model_len), self.max_model_len)

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if it can never run (too long for the context or the KV cache)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use by a request that has not finished")
        if not req.prompt_token_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {req.num_prompt_tokens} tokens; the model's context holds {self.max_model_len} "
                "(prompt plus at least one new token)"
            )
        need = blocks_for(self.max_total_tokens(req), self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt plus max_tokens needs {need} KV blocks but the cache has {self.blocks.num_blocks}; "
                "lower max_tokens or the prompt length"
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise OverflowError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        req.status = RequestStatus.WAITING
        self.arrivals.arrived(self.clock())
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Finish a request now (cancel, stop string, error); its KV blocks are freed at once.

        An in-flight microbatch may still hold it: stages process microbatches in order, so a block
        reused by a later microbatch is written only after the earlier one is done with it.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, reason)
        return True

    def cancel(self, request_id: str) -> bool:
        return self.finish_request(request_id, FinishReason.CANCELLED)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is _RUNNING:
            del self.running[req.request_id]
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.sent_to_workers:
            self._released.append(req.request_id)
            req.sent_to_workers = False
        # An in-flight request is forgotten when its (last) microbatch returns; otherwise now.
        if not req.num_in_flight:
            del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, keep prompt and generated tokens, requeue at the front."""
        assert not req.num_in_flight, "an in-flight request cannot be preempted"
        del self.running[req.request_id]
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        if req.sent_to_workers:
            self._released.append(req.request_id)
            req.sent_to_workers = False
        req.num_blocks_sent = 0
        self.waiting.appendleft(req)

    def requeue_all_for_recompute(self) -> list[str]:
        """After the pipeline was rebuilt: every unfinished request goes back to waiting, by recompute.

        The new workers hold nothing, so in-flight microbatches are dropped (their tokens never came
        back), every KV block is freed, and each request is re-sent in full with its prompt and the
        output tokens already produced (and streamed), so nothing is duplicated or lost. Waiting order
        is arrival order. Returns the ids requeued.
        """
        self.in_flight.clear()
        self._fill_share_s = None
        self._in_flight_work.clear()
        if self.ring_clock is not None:
            self.ring_clock.forget()
        self._released = []  # the old workers are gone: nothing of theirs to drop
        for rid, req in list(self.requests.items()):
            req.num_in_flight = 0
            if req.is_finished:  # cancelled or stopped while its microbatch was in flight
                del self.requests[rid]
        unfinished = sorted(
            list(self.running.values()) + list(self.waiting), key=lambda r: r.arrival_time
        )  # sorted() is stable: equal arrival times keep their queue order
        self.running.clear()
        self.waiting.clear()
        for req in unfinished:
            self.blocks.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            req.sent_to_workers = False
            req.num_output_tokens_sent = 0
            req.num_blocks_sent = 0
            self.waiting.append(req)
        self.blocks.reset_cache()  # the new workers' KV is empty: no cached block holds anything
        return [r.request_id for r in unfinished]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the stages' KV was discarded, e.g. by a repartition while idle)."""
        if self.has_unfinished:
            raise RuntimeError("the prefix cache can only be reset while no request holds KV")
        self.blocks.reset_cache()

    # ---- one microbatch ------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def has_room(self) -> bool:
        return len(self.in_flight) < self.max_in_flight

    def schedule(self) -> SchedulerOutput | None:
        """Form the next microbatch, or None when the pipeline is full or nothing can run now.

        With the token ring: a full pipeline's extra slot takes the ring decodes and whatever else is
        ready; with no ring decode it still takes work that waits for no token (a prompt's next chunk):
        a microbatch's round trip (every stage, every hop) is longer than p stage times, and a pipeline
        of prefill chunks held to p microbatches idles stage 0 for the difference every round (Sarathi's
        GPT-3 case with the ring, regime suite: bubble 5.84 -> 5.28 %, throughput +0.6 %). With a free
        slot the microbatch is formed without ring decodes first, and takes them only when it would
        otherwise be empty. Ring decodes make a microbatch wait at stage 0 for the oldest one to leave
        the last stage: beside work that could start now (the prompts filling an empty pipeline) they
        would hold it back, where without them a free slot only waits for work. The extra slot stays
        closed while requests wait beyond the free seats, or every seat is taken under a per-microbatch
        sequence cap (`_ring_slot_open`)."""
        if not self.has_room():
            return None
        ring = self._ring_candidates()
        if len(self.in_flight) >= self.num_stages:
            return self._form(ring) if self._ring_slot_open() else None
        return self._form({}) or (self._form(ring) if ring else None)

    def _form(self, ring: dict[str, Request]) -> SchedulerOutput | None:
        """Fill a microbatch (`ring`: the decodes it may take on the token ring) and emit it, if not empty."""
        if self.policy.token_budgeted:
            mode = self.budget_mode
            budget = mode.new_budget(mode.token_budget, self._seq_cap)
        else:
            budget = TokenBudget(None, self._seq_cap)  # whole prompts: no token budget, so no time budget
        b = BatchBuilder(
            budget=budget, blocks=self.blocks, running=self.running, waiting=self.waiting, preempt=self._preempt,
            max_num_seqs=self.config.max_num_seqs, max_total_tokens=self.max_total_tokens, clock=self.clock,
            pipeline_chunks=self.balanced, ring=ring,
        )
        if self.balanced:
            self._balance(b)
        self.policy.fill(b)
        # Looked up for admission but not admitted: holds nothing. The one looked up, not the queue's head
        # now: a decode's block may have preempted a request to the front after the lookup (vllm, orca).
        for head in (b.looked_up_head, self.waiting[0] if self.waiting else None):
            if head is not None and head.status is RequestStatus.WAITING and not head.block_ids:
                head.num_computed_tokens = 0
        if not b.chosen:
            return None
        return self._emit(b, ring)

    def _ring_slot_open(self) -> bool:
        """Whether the token ring's extra slot (the p + 1-th microbatch in flight) may be used: not while
        requests wait beyond the free seats, nor while every seat is taken under a per-microbatch sequence
        cap. There `max_num_seqs` bounds the work, not demand, and p decode groups of the cap fill the
        seats: the extra microbatch can only hold one group's next step, waiting at stage 0 for that
        group's token, beside one prompt's chunk in the seat the cap leaves, so the prompts' chunks split
        over p + 1 microbatches unevenly, a short one among full ones, which every stage after the first
        pays as idle time. The pipeline runs plain Sarathi-Serve there (Sarathi's GPT-3 case with the ring:
        bubble 5.29 %, 4.41 % with the slot closed only while requests wait beyond the seats, 4.32 % as
        now, the same run as without the ring; ARCHITECTURE.md §3). Without a cap a full house keeps the
        slot: it still takes the engine's turnaround off each decode group's cycle (`ppserve demo`, whose
        eight requests take its eight seats: 17.3 % mean bubble against 18.9 % with the slot closed there,
        five runs each)."""
        seats = self.config.max_num_seqs - len(self.running)
        return len(self.waiting) <= max(0, seats) and (seats > 0 or self._seq_cap is None)

    def _ring_candidates(self) -> dict[str, Request]:
        """With the token ring: the requests the oldest in-flight microbatch samples that may decode again
        before it comes back (their only microbatch in flight; that token not their last by length). Only
        the oldest's: stage 0 waits for its ring message, and that microbatch is the next to leave the
        last stage. A stop token is seen only when the result comes back: such a request then loses the
        one token computed for it (`update_from_output` skips finished requests)."""
        if not self.async_scheduling or not self.in_flight:
            return {}
        oldest = self.in_flight[0]
        ring: dict[str, Request] = {}
        max_len = self.max_model_len
        for rid in oldest.sample_request_ids:
            req = self.requests.get(rid)
            if req is None or req.status is not _RUNNING or req.num_in_flight != 1:
                continue
            outputs = len(req.output_token_ids) + 1  # with the token in flight
            if outputs >= (req.sampling.max_tokens or max_len) or len(req.prompt_token_ids) + outputs >= max_len:
                continue
            ring[rid] = req
        return ring

    def _peers_in_flight(self) -> list[SchedulerOutput]:
        """The in-flight microbatches the next one shares a round of the pipeline with: the newest p - 1.
        With the token ring the oldest of p is leaving the last stage (its decodes may be in reach again)."""
        return list(self.in_flight)[max(0, len(self.in_flight) - (self.num_stages - 1)):] if self.num_stages > 1 else []

    def _balance(self, b: BatchBuilder) -> None:
        """Give the builder its decode quota and, unless the pipeline is saturated, shrink its budget to
        an equal share of the work in reach: in predicted time on the slowest stage once the cost model
        is calibrated, in tokens before (sched/balance.py, ARCHITECTURE.md §3).

        Saturated means the work in reach fills every share to the token budget, or requests wait beyond
        the free seats (`max_num_seqs` bounds the work then, not demand: new work joins as seats free,
        so a budget shrunk to what the seats hold would only cut throughput). Then the budget stays
        whole, in tokens, as in plain Sarathi-Serve. The quota applies either way: it only moves a
        decode to the next microbatch when its group is over ~1/p of the decodes, which keeps the
        decode groups even where plain Sarathi-Serve would leave them as they fell."""
        stages = self.num_stages
        num_ready = len(b.decodes)
        ring = b.ring
        # Decode next once back. The ring's candidates are ready already: each is sampled by the oldest
        # in-flight microbatch and rides in no other, so they count once among the samples in flight.
        awaiting = sum(len(mb.sample_request_ids) for mb in self.in_flight) - len(ring)
        free_slots = max(1, stages - len(self.in_flight))  # the token ring's extra slot is the oldest's group's
        b.decode_quota = decode_quota(num_ready + awaiting, num_ready, stages, free_slots)
        if self._seq_cap is not None and b.following:
            # Under a per-microbatch sequence cap a decode group can fill every seat of the microbatch;
            # a prompt whose next chunk follows its in-flight chunk keeps one, and a decode the quota
            # leaves out goes first next time. Without it, with the token ring, the ring's group (the
            # oldest microbatch's samples) took the cap exactly: a prompt's chunks rode once a round,
            # each time in one long microbatch among decode-only ones, which the ring pays as a stall
            # of (p - 1) x the difference (Sarathi's GPT-3 case: 35 ms gaps every 8 microbatches,
            # bubble 8.8 %, now 5.8 %). Without the ring the rotating quota left that seat already.
            b.decode_quota = max(1, min(b.decode_quota, self._seq_cap - 1))
        seats = max(0, self.config.max_num_seqs - len(self.running))
        if len(self.waiting) > seats:
            return
        budget = b.budget
        cap = budget.token_budget
        assert cap is not None, "a balanced policy has a token budget"
        # The microbatches the work in reach is shared among: k rounds while requests keep arriving, one
        # round when they have stopped (sched/balance.py, "Rounds, while requests keep arriving").
        reach = self._prefills_in_reach(b)
        # An empty pipeline (nothing in flight, no decode) that several prompts fill: see below.
        filling = not self.in_flight and not num_ready and len(reach) > 1
        # Not while filling: with no decodes to keep level, thinner chunks only delay the prompts (`ppserve
        # demo`, eight prompts arriving over gRPC a few at a time: TTFT p50 89-103 -> 140-145 ms at k = 4).
        rounds = self.config.balance_rounds
        shares = stages * (rounds if rounds > 1 and not filling and self.arrivals.streaming(self.clock()) else 1)
        tokens = sum(mb.total_tokens for mb in self._peers_in_flight()) + num_ready
        calibrated = self.cost.calibrated
        if filling or num_ready or not reach or not self.in_flight or not calibrated:
            self._fill_share_s = None  # a fill under way ends with its first decode back
        if self._fill_share_s is not None:  # the fill goes on: its microbatches stay equal (see below)
            b.budget = self._time_budget(budget, self._fill_share_s)
            return
        # Beyond this every share is the whole budget: saturated. A fill in predicted time sees all of its
        # work and decides that itself (`_time_share`).
        limit = math.inf if filling and calibrated else shares * cap
        work: list[tuple[int, int]] = []  # per prefill in reach: (tokens it will compute, tokens before them)
        seen: set[bytes] = set()
        for req in reach:
            if tokens >= limit:
                return
            # A prefix another request in reach (or the cache) holds is not work: counted, eight chat
            # prompts with one system prompt split 153 + 41 computed tokens instead of evenly.
            cached = self.blocks.prefix_in_reach(req, seen)
            work.append((req.num_uncomputed_tokens - cached, req.num_computed_tokens + cached))
            tokens += work[-1][0]
        if tokens >= limit:
            return
        # An empty pipeline (nothing in flight, no decode) that several prompts fill: there the floor
        # only makes the first microbatch longer than the rest, and every stage behind it waits for all
        # of it (the demo's eight prompts, 194 tokens to compute: 128 + 66; an even split cuts one
        # prompt at most). A lone prompt keeps it: cut below it, its chunks pay
        # the step's floor each (regime suite, sparse arrivals: TTFT p50 +10 % without it). In predicted
        # time the fill is cut into the number of equal microbatches that ends it soonest
        # (`fill_microbatches`), not into p, and keeps that share until its first decode is back.
        if calibrated:
            shared = self._time_share(b, work, shares, budget, filling)
            if shared is not None:
                b.budget = shared
            return
        floor = 0.0 if filling else cap * MIN_SHARE_OF_BUDGET
        if shares > stages:  # over k rounds (never while filling): ROUNDS_MIN_CHUNKS floors, at most one round's share
            floor = max(floor, min(tokens / stages, ROUNDS_MIN_CHUNKS * floor))
        budget.limit(math.ceil(fair_share(tokens, shares, cap, floor=floor)))

    def _time_share(self, b: BatchBuilder, prefills: list[tuple[int, int]], shares: int, budget: TokenBudget,
                    filling: bool = False) -> TimeBudget | None:
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
        for req in b.decodes:
            work.add(1, req.num_computed_tokens, True)
        for num_tokens, context in prefills:  # each prompt's rest, as one piece: its keys add up the same in chunks
            work.add(num_tokens, context, True)
        if filling:
            by_budget = math.ceil(sum(n for n, _ in prefills) / (budget.token_budget or 1))
            count = fill_microbatches([(stage.floor_s, work.seconds(stage)) for stage in cost.stages],
                                      self.num_stages)
            if count <= by_budget:
                return None
            shares = count
        share_s = max(stage.floor_s + work.seconds(stage) / shares for stage in cost.stages)
        # Never below the decodes this microbatch takes (the share must not move a decode its quota
        # admits) plus a minimum chunk (`min_chunk_tokens`): beside the decodes a stage's time is mostly
        # its floor, and a chunk much cheaper than the floor only delays a prompt.
        # Nor may it leave a prompt a tiny rest (MIN_REST_OF_BUDGET): that would cost a microbatch of its own.
        quota = b.decode_quota if b.decode_quota is not None else len(b.decodes)
        decodes = sorted(b.decodes, key=b.decode_rank)[:quota]
        min_chunk = 0 if filling else self._min_chunk(cost, budget.token_budget or 0)
        chunk = max(0, min_chunk - len(decodes))
        taken = WorkFeatures()  # the decodes this microbatch takes; each floor below adds its chunk to a copy
        for r in decodes:
            taken.add(1, r.num_computed_tokens, True)
        least = taken.plus(chunk, 0, False) if chunk else taken
        floor_s = max(stage.floor_s + least.seconds(stage) for stage in cost.stages)
        share_s = max(share_s, floor_s * (1 + 1e-9))  # the tolerance: summed in another order
        if shares > self.num_stages:  # over k rounds (`_balance` shares one round while filling)
            # Over k rounds a chunk is never thinner than ROUNDS_MIN_CHUNKS minimum chunks, unless one
            # round's share is thinner still (sched/balance.py, "Rounds"): thinner, it barely shortens
            # the microbatch beside the floor and only adds steps to its prompt's TTFT.
            thick = max(0, min(budget.token_budget or 0, round(ROUNDS_MIN_CHUNKS * min_chunk)) - len(decodes))
            if thick > chunk:
                one_round_s = max(stage.floor_s + work.seconds(stage) / self.num_stages for stage in cost.stages)
                thicker = taken.plus(thick, 0, False)
                rounds_floor_s = max(stage.floor_s + thicker.seconds(stage) for stage in cost.stages)
                share_s = max(share_s, min(one_round_s, rounds_floor_s))
        if filling:
            self._fill_share_s = share_s
        return self._time_budget(budget, share_s)

    def _time_budget(self, budget: TokenBudget, share_s: float) -> TimeBudget:
        """The microbatch's budget for a time share: the token budget, and `share_s` on every stage."""
        if isinstance(budget, TimeBudget):  # budget_mode: time caps it already
            budget.limit(budget.token_budget or 0, share_s)
            return budget
        min_rest = math.ceil((budget.token_budget or 0) * MIN_REST_OF_BUDGET)
        return TimeBudget(budget.token_budget, budget.max_seqs, self.cost.current, share_s, min_rest=min_rest,
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
        it again (p - 1 peers of dozens of requests each, the simulator's hottest loop at pp = 8)."""
        work = self._in_flight_work.get(mb.step_id)
        if work is None:
            work = self._in_flight_work[mb.step_id] = WorkFeatures()
            sampled = set(mb.sample_request_ids)
            for rid, n, ctx in zip(mb.order, mb.num_scheduled_tokens, mb.num_computed_tokens, strict=True):
                work.add(n, ctx, rid in sampled)
        return work

    def _prefills_in_reach(self, b: BatchBuilder) -> list[Request]:
        """Prefills under way (in flight or not), then the waiting requests that could take the free
        seats (arrival order)."""
        seats = max(0, self.config.max_num_seqs - len(self.running))
        return b.prefills + b.following + list(itertools.islice(self.waiting, seats))

    def _emit(self, b: BatchBuilder, ring: dict[str, Request]) -> SchedulerOutput:
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        sample: list[str] = []
        ringed: list[str] = []
        computed: list[int] = []
        prefill_tokens = decode_tokens = 0
        kv = self.blocks
        block_size = kv.block_size
        writer_of = kv.writer_of
        for req, n in zip(b.chosen_requests, b.chosen.values(), strict=True):
            rid = req.request_id
            done = req.num_computed_tokens
            outputs = req.output_token_ids
            num_outputs = len(outputs)
            num_blocks = len(req.block_ids)
            num_tokens = len(req.prompt_token_ids) + num_outputs
            pending = 0
            if rid in ring:  # its input is the token the oldest in-flight microbatch samples (the token ring)
                pending = 1
                num_tokens += 1
                ringed.append(rid)
            if req.sent_to_workers:
                # The usual diff is one new token and no block: spare the slicing.
                k = req.num_output_tokens_sent
                toks = () if k == num_outputs else (outputs[-1],) if k == num_outputs - 1 else tuple(outputs[k:])
                k = req.num_blocks_sent
                blocks = () if k == num_blocks else tuple(req.block_ids[k:])
                cached.append(CachedRequestData(rid, toks, blocks, done))
            else:
                new.append(NewRequestData(
                    request_id=rid, token_ids=tuple(req.all_token_ids), num_prompt_tokens=len(req.prompt_token_ids),
                    block_ids=tuple(req.block_ids), num_computed_tokens=done, sampling=req.sampling,
                ))
                req.sent_to_workers = True
            req.num_output_tokens_sent = num_outputs + pending  # the workers get the ring's token without a diff
            req.num_blocks_sent = num_blocks
            if num_tokens - done > 1:
                prefill_tokens += n
            else:
                decode_tokens += n
            computed.append(done)
            # No stage writes into a block another request filled (one lookup for a decode's one block).
            if n > 1 or writer_of.get(req.block_ids[done // block_size]) != rid:
                kv.check_writable(req, done, n)
            req.num_computed_tokens = done + n
            if done + n == num_tokens:
                sample.append(rid)
            req.num_in_flight += 1
        out = SchedulerOutput(
            step_id=self._next_step,
            order=tuple(b.chosen),
            num_scheduled_tokens=tuple(b.chosen.values()),
            num_computed_tokens=tuple(computed),
            new_requests=tuple(new),
            cached_requests=tuple(cached),
            sample_request_ids=tuple(sample),
            released_request_ids=tuple(self._released),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
            ring_request_ids=tuple(ringed),
            ring_step_id=self.in_flight[0].step_id if ringed else None,
        )
        self._released = []
        self._next_step += 1
        self.in_flight.append(out)
        if self.ring_clock is not None:
            stage0_s = self.cost.current.stage_times(BatchShape.of(out))[0] if self.cost.calibrated else None
            self.ring_clock.formed(out.step_id, self.clock(), stage0_s)
        return out

    def formation_due(self, dispatch_s: float = 0.0) -> float | None:
        """With the token ring, when only its extra slot is free: when the next microbatch should be formed
        (the injected clock's seconds), `dispatch_s` (the control plane's latency to the stages) plus
        `scheduler.ring_margin_ms` before stage 0 is predicted to need it, so that what arrives meanwhile
        joins it (sched/ring_clock.py). None: now (no ring, a stage slot free, the extra slot closed, or no
        prediction)."""
        if self.ring_clock is None or len(self.in_flight) != self.num_stages or not self._ring_slot_open():
            return None
        due = self.ring_clock.due_s(self.in_flight)
        return None if due is None else due - dispatch_s

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        """Take a finished microbatch back (oldest first), append sampled tokens, apply stop rules."""
        if not self.in_flight or self.in_flight[0].step_id != out.step_id:
            raise AssertionError(f"microbatch {out.step_id} returned out of order")
        if result.step_id != out.step_id:
            raise AssertionError(f"result for step {result.step_id} handed in for step {out.step_id}")
        sampled = result.sampled_token_ids
        missing = [rid for rid in out.sample_request_ids if rid not in sampled]
        if missing:
            raise AssertionError(f"step {out.step_id}: no token came back for {sorted(missing)}")
        self.in_flight.popleft()
        self._in_flight_work.pop(out.step_id, None)
        if self.ring_clock is not None:
            self.ring_clock.returned(out.step_id, self.clock())
        requests = self.requests
        seq = self._next_step
        max_len = self.max_model_len
        updates: list[RequestUpdate] = []
        for rid in out.order:
            req = requests.get(rid)
            if req is None:
                continue
            req.num_in_flight -= 1
            if req.status is RequestStatus.FINISHED:  # cancelled or stopped while in flight
                if not req.num_in_flight:
                    del requests[rid]
                continue
            token = sampled.get(rid)
            if token is None:  # a prefill chunk that was not the prompt's last
                continue
            outputs = req.output_token_ids
            outputs.append(token)
            req.ready_seq = seq
            sp = req.sampling
            reason = None
            if (token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
                reason = FinishReason.STOP
            elif len(outputs) >= (sp.max_tokens or max_len) or len(req.prompt_token_ids) + len(outputs) >= max_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(req, reason)
            lp = result.logprobs.get(rid)
            updates.append(RequestUpdate(rid, (token,), reason is not None, reason, () if lp is None else (lp,)))
        return updates

    @property
    def needs_step_feedback(self) -> bool:
        """Whether `observe_step` does anything: callers may skip measuring stage times when not."""
        return self.balanced or self.budget_mode.needs_feedback

    def observe_step(self, out: SchedulerOutput, stage_seconds: Sequence[float] = (),
                     timed: SchedulerOutput | None = None) -> None:
        """Feedback after `update_from_output(out, ...)`: the measured compute seconds on each stage of
        `timed` (an earlier microbatch when the stages read their times late; `out` when None; empty
        seconds when unknown). Fits the cost model on the timed microbatch's composition (balanced
        formation, time budgets) and feeds the budget mode's TBT controller with `out`; the scheduler
        itself reads no clock but the injected one."""
        if not self.needs_step_feedback:
            return
        measured = out if timed is None else timed
        if stage_seconds and not measured.is_empty:
            self.cost.observe(BatchShape.of(measured), stage_seconds)
        if not self.budget_mode.needs_feedback:
            return
        finished = [rid for rid in out.order if rid not in self.requests]
        self.budget_mode.observe(out, stage_seconds, self.clock(), finished)

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        if len(self.in_flight) > self.max_in_flight:
            raise AssertionError(f"{len(self.in_flight)} microbatches in flight > {self.max_in_flight}")
        sampling: set[str] = set()  # requests whose token is due from an in-flight microbatch
        counts: dict[str, int] = {}
        by_step = {out.step_id: out for out in self.in_flight}
        for out in self.in_flight:
            ringed = set(out.ring_request_ids)
            source = by_step.get(out.ring_step_id) if out.ring_step_id is not None else None
            if ringed and (not self.async_scheduling or out.ring_step_id is None or out.ring_step_id >= out.step_id
                           or (source is not None and not ringed <= set(source.sample_request_ids))):
                raise AssertionError(f"microbatch {out.step_id} takes ring tokens {sorted(ringed)} that step "
                                     f"{out.ring_step_id} does not sample before it")
            for rid in out.order:
                req = self.requests.get(rid)
                if req is not None and not req.is_finished:
                    if rid in sampling and rid not in ringed:
                        raise AssertionError(f"request {rid} is in an in-flight microbatch after the one that samples it")
                    if counts.get(rid) and not self.balanced and rid not in ringed:
                        raise AssertionError(f"request {rid} is in two in-flight microbatches")
                counts[rid] = counts.get(rid, 0) + 1
            sampling.update(out.sample_request_ids)
            if self.policy.chunked_prefill and out.total_tokens > self.budget_mode.token_cap:
                raise AssertionError(f"microbatch {out.step_id} holds {out.total_tokens} > budget tokens")
        for rid, n in counts.items():
            req = self.requests.get(rid)
            if req is not None and req.num_in_flight != n:
                raise AssertionError(f"request {rid} counts {req.num_in_flight} in-flight microbatches, not {n}")
        # Shared blocks: every held block's reference count is the number of running requests holding it;
        # a waiting request holds nothing and has nothing computed.
        self.blocks.check([r.block_ids for r in self.running.values()])
        for req in self.waiting:
            if req.block_ids or req.num_computed_tokens:
                raise AssertionError(f"waiting request {req.request_id} holds KV blocks or computed tokens")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        if not self.has_unfinished and self.blocks.num_used:
            raise AssertionError(f"idle but {self.blocks.num_used} KV blocks are still in use")
