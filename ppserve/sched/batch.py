"""One microbatch under construction: policies decide, the builder allocates, preempts and records.

The builder is handed its collaborators (the block manager, the running and waiting requests, how to
preempt) rather than the scheduler, so `sched/` has no import circle. Before it, `RunningSplit` sorts
the running requests once into those that may take a decode token now and those that may take a
prefill chunk (the balanced formation reads the same split), so a policy's `fill` costs time linear in
the number of requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from ppserve.request import Request, RequestStatus
from ppserve.sched.block_manager import BlockManager, blocks_for
from ppserve.sched.budget import TimeBudget, TokenBudget
from ppserve.sched.cost import PipelineCost

__all__ = ["BatchBuilder", "RunningSplit"]

_RUNNING = RequestStatus.RUNNING


class RunningSplit:
    """The running requests sorted once, before a microbatch is formed: those that may take a decode
    token now, those that may take a prefill chunk, and (with `pipeline_chunks`) those whose next chunk
    may follow their in-flight chunk down the pipeline. A request whose every known token is scheduled
    waits for its next token, unless it rides on the token ring (`ring`: its input token is still in
    flight, so it counts one token more than it knows). One with tokens left may take them now if it is
    in no in-flight microbatch; a *following* chunk is kept apart, because a policy gives it only what
    is left once everything else has been served (stages run microbatches in order, so the earlier
    chunk's KV is written before the next one reads it)."""

    def __init__(self, running: dict[str, Request], ring: dict[str, Request] | None = None,
                 pipeline_chunks: bool = False) -> None:
        self.ring: dict[str, Request] = ring or {}
        self.decodes: list[Request] = []  # one known token left: a decode (or a prompt's last token)
        self.prefills: list[Request] = []  # more than one: a prefill (or a recompute) under way
        self.following: list[Request] = []  # a prompt's next chunk behind its own in-flight chunk
        for req in running.values():
            left = len(req.prompt_token_ids) + len(req.output_token_ids) - req.num_computed_tokens
            if left <= 0:  # below 0: its drafts are in flight too
                if req.request_id in self.ring:
                    self.decodes.append(req)
                continue
            if req.num_in_flight:
                if pipeline_chunks:
                    self.following.append(req)
                continue
            (self.decodes if left == 1 else self.prefills).append(req)

    def decode_rank(self, req: Request) -> tuple[bool, int]:
        """Which decodes go first when not all fit: those whose token is back before those on the token
        ring (the ring's group follows its in-flight microbatch; a decode that is back would otherwise
        wait a whole round), then the longest waiting."""
        return req.request_id in self.ring, req.ready_seq


class BatchBuilder:
    def __init__(
        self,
        *,
        budget: TokenBudget,
        split: RunningSplit,
        blocks: BlockManager,
        running: dict[str, Request],
        waiting: deque[Request],
        preempt: Callable[[Request], None],
        max_num_seqs: int,
        max_total_tokens: Callable[[Request], int],
        clock: Callable[[], float],
        decode_quota: int | None = None,
        step_id: int = 0,
        in_flight_step_ids: tuple[int, ...] = (),
        num_stages: int = 1,
        pipeline_cost: Callable[[], PipelineCost | None] = lambda: None,
    ) -> None:
        self.budget = budget
        self._blocks = blocks
        self._running = running
        self._waiting = waiting
        self._preempt = preempt
        self._max_num_seqs = max_num_seqs
        self._max_total_tokens = max_total_tokens
        self._clock = clock
        self.split = split
        self.decodes, self.prefills, self.following = split.decodes, split.prefills, split.following
        self.decode_rank = split.decode_rank
        self.chosen: dict[str, int] = {}  # request id -> tokens this step, in batch order
        self.chosen_requests: list[Request] = []  # aligned with `chosen`
        # How many decodes this microbatch may take (balanced formation); None = as many as fit.
        self.decode_quota = decode_quota
        self._head_hits: tuple[Request | None, list[int]] = (None, [])  # the waiting head's cached blocks
        self.num_preempted = 0  # requests this microbatch's formation preempted for blocks
        # Where this microbatch sits in the pipeline, for a policy that keeps per-slot state (sglang-pp):
        # the step id it will get, those of the microbatches in flight (oldest first), the stage count,
        # and the step-cost model's current prediction (None until calibrated).
        self.step_id = step_id
        self.in_flight_step_ids = in_flight_step_ids
        self.num_stages = num_stages
        self.pipeline_cost = pipeline_cost

    # ---- what a policy reads ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def block_size(self) -> int:
        return self._blocks.block_size

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def schedulable_running(self, decodes: bool) -> Iterator[Request]:
        """Running requests that may take tokens now and are not in this batch yet: decodes, or prefills
        (not in flight)."""
        yield from self._schedulable(self.decodes if decodes else self.prefills)

    def schedulable_following(self) -> Iterator[Request]:
        """Prompts whose next chunk may follow their in-flight chunk down the pipeline (`pipeline_chunks`)."""
        yield from self._schedulable(self.following)

    def schedulable_in_order(self) -> Iterator[Request]:
        """Every running request that may take tokens now (a decode whose token is back, a prefill, a
        prompt's chunk following its in-flight one), in admission order, the order vLLM v1 serves its
        running list in."""
        ready = {r.request_id for r in (*self.decodes, *self.prefills, *self.following)}
        for req in list(self._running.values()):
            if req.request_id in ready and req.status is _RUNNING and req.request_id not in self.chosen:
                yield req

    def _schedulable(self, reqs: list[Request]) -> Iterator[Request]:
        for req in reqs:
            if req.status is _RUNNING and req.request_id not in self.chosen:
                yield req

    def waiting_head(self) -> Request | None:
        """The next request to admit, its cached prefix counted as computed (prefix caching: the
        policy then chunks only what is left; the scheduler undoes it if the head is not admitted)."""
        if not self._waiting:
            return None
        head = self._waiting[0]
        if not head.block_ids:  # a waiting request holds no KV
            self._head_hits = (head, self._blocks.lookup(head))
            head.num_computed_tokens = len(self._head_hits[1]) * self._blocks.block_size
        return head

    @property
    def looked_up_head(self) -> Request | None:
        """The last waiting head `waiting_head` counted a cached prefix for (None if none was looked up)."""
        return self._head_hits[0]

    # ---- what a policy does ----------------------------------------------------------------------
    def add_decodes(self, may_preempt: bool = True) -> None:
        """One token for each schedulable decode, oldest ready first, up to the decode quota and while
        the budget lasts (a decode the budget cannot take waits: no token is split)."""
        reqs = [r for r in self.schedulable_running(decodes=True)]
        limit = len(reqs) if self.decode_quota is None else min(self.decode_quota, len(reqs))
        budget = self.budget
        blocks = self._blocks
        block_size = blocks.block_size
        chosen, chosen_reqs = self.chosen, self.chosen_requests
        if type(budget) is not TokenBudget:  # a time budget prices each decode by its context
            assert isinstance(budget, TimeBudget), f"no decode pricing for {type(budget).__name__}"
            reqs.sort(key=self.decode_rank)
            taken = 0
            for req in reqs:
                done = req.num_computed_tokens
                if taken >= limit or not budget.decode_fits(done):
                    break
                if req.status is not _RUNNING:  # preempted for an earlier decode's block
                    continue
                # its last block has room: `add`, without the search
                if done < len(req.block_ids) * block_size:
                    budget.spend_decode(done)
                    # A prompt's last token may fill its last prompt block: keyed now, as `_take` does.
                    filled = min(done + 1, len(req.prompt_token_ids))
                    if blocks.enable_prefix_caching and filled // block_size > req.num_blocks_keyed:
                        blocks.cache_full_blocks(req, filled)
                    chosen[req.request_id] = 1
                    chosen_reqs.append(req)
                    taken += 1
                elif self.add(req, 1, may_preempt):
                    taken += 1
            return
        # A plain token budget: a decode costs one token and one seat whatever its context, so how many
        # fit is known up front, and only a decode that needs a new KV block goes through `add`.
        if budget.token_budget is not None:
            limit = min(limit, budget.token_budget - budget.tokens_used)
        if budget.max_seqs is not None:
            limit = min(limit, budget.max_seqs - budget.num_seqs)
        if limit < len(reqs):
            reqs.sort(key=self.decode_rank)  # not all fit: the longest waiting go first
        taken = fast = 0
        for req in reqs:
            if taken >= limit:
                break
            if req.status is not _RUNNING:  # preempted for an earlier decode's block
                continue
            if req.num_computed_tokens < len(req.block_ids) * block_size:  # its last block has room
                chosen[req.request_id] = 1
                chosen_reqs.append(req)
                fast += 1
                taken += 1
                continue
            budget.tokens_used += fast  # settle the account before `add` consults it
            budget.num_seqs += fast
            fast = 0
            if self.add(req, 1, may_preempt):
                taken += 1
        budget.tokens_used += fast
        budget.num_seqs += fast

    def add(self, req: Request, num_tokens: int, may_preempt: bool, over_budget: bool = False) -> bool:
        """Schedule `num_tokens` of a running request, preempting younger requests for blocks if allowed."""
        num_tokens = self._cap_to_budget(req, num_tokens, over_budget)
        if num_tokens <= 0:
            return False
        blocks = self._blocks
        need = blocks.blocks_needed(req, num_tokens)
        if need:
            while not blocks.can_allocate(need):
                victim = self._pick_victim() if may_preempt else None
                if victim is None:
                    return False
                self._preempt(victim)
                self.num_preempted += 1
                if victim is req:
                    return False
            blocks.allocate(req, num_tokens)
        self._take(req, num_tokens, over_budget)
        return True

    def admit(self, req: Request, num_tokens: int, over_budget: bool = False,
              reserve_full: bool = False) -> bool:
        """Move the head of the waiting queue to running if a seat and its blocks are free (FCFS: no
        skipping)."""
        assert self._waiting and self._waiting[0] is req
        num_tokens = self._cap_to_budget(req, num_tokens, over_budget)
        if num_tokens <= 0 or len(self._running) >= self._max_num_seqs:
            return False
        reserve = num_tokens
        if reserve_full:
            reserve = self._max_total_tokens(req) - req.num_computed_tokens
        blocks = self._blocks
        hits = self._head_hits[1] if self._head_hits[0] is req else []
        if not blocks.can_start(hits, blocks_for(req.num_computed_tokens + reserve,
                                                 blocks.block_size) - len(hits)):
            return False
        self._waiting.popleft()
        blocks.acquire_prefix(req, hits)
        blocks.allocate(req, reserve)
        req.status = _RUNNING
        self._running[req.request_id] = req
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self._clock()
        self._take(req, num_tokens, over_budget)
        return True

    # ---- bookkeeping -----------------------------------------------------------------------------
    def _cap_to_budget(self, req: Request, num_tokens: int, over_budget: bool) -> int:
        return num_tokens if over_budget else self.budget.chunk(num_tokens, req.num_computed_tokens)

    def _take(self, req: Request, num_tokens: int, over_budget: bool) -> None:
        if over_budget:
            # A whole prompt longer than the budget runs alone (vllm policy); account it as the full budget.
            self.budget.tokens_used = self.budget.token_budget or 0
            self.budget.num_seqs += 1
        else:
            # The chunk that completes the request's known tokens gets logits (the last stage's LM head); a
            # decode on the ring token has none left to know (num_uncomputed_tokens 0).
            self.budget.spend(num_tokens, req.num_computed_tokens,
                              sampled=num_tokens >= req.num_uncomputed_tokens)
        # Key the prompt blocks these tokens fill now, so a request admitted later in this step hits them
        # too. Blocks of generated tokens are keyed when the request lets its blocks go (BlockManager.free):
        # only a later request (the next turn, the request itself after preemption) can hit them, and a
        # decode step then pays no hashing at all.
        blocks = self._blocks
        filled = min(req.num_computed_tokens + num_tokens, len(req.prompt_token_ids))
        if blocks.enable_prefix_caching and filled // blocks.block_size > req.num_blocks_keyed:
            blocks.cache_full_blocks(req, filled)
        self.chosen[req.request_id] = num_tokens
        self.chosen_requests.append(req)

    def prefill_left(self) -> bool:
        """Whether prefill work in reach is left out of this microbatch (a prompt with tokens not
        scheduled, or a request waiting): the budget it did not take is kept for balance, not drafts."""
        if self._waiting:
            return True
        chosen = self.chosen
        return any(req.num_uncomputed_tokens > chosen.get(req.request_id, 0)
                   for req in (*self.prefills, *self.following) if req.status is _RUNNING)

    def add_drafts(self, req: Request, wanted: int, cap: int,
                   grant: Callable[[int, int, int], int] | None = None) -> int:
        """Raise a chosen decode to 1 + drafts tokens (at most `wanted` drafts, the microbatch at most
        `cap` tokens; `grant`: how the budget grants them, default `budget.grant_drafts`), with KV blocks
        for them; never preempts (drafts are optional). Returns how many."""
        rid = req.request_id
        assert self.chosen.get(rid) == 1, f"drafts for {rid}, which is not a decode of this microbatch"
        blocks = self._blocks
        done = req.num_computed_tokens
        have = len(req.block_ids) * blocks.block_size
        # No draft past the request's last possible token: all accepted, the step ends it there.
        wanted = min(wanted, have - done - 1 + blocks.num_free * blocks.block_size,
                     self._max_total_tokens(req) - req.num_tokens - 1)
        n = (grant or self.budget.grant_drafts)(wanted, done, cap) if wanted > 0 else 0
        if n <= 0:
            return 0
        if done + 1 + n > have:
            blocks.allocate(req, 1 + n)
        self.chosen[rid] = 1 + n
        return n

    def _pick_victim(self) -> Request | None:
        """The most recently admitted running request that is neither in flight nor already chosen."""
        for req in reversed(self._running.values()):
            if not req.num_in_flight and req.request_id not in self.chosen:
                return req
        return None


