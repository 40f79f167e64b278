"""The scheduler state machine: `schedule() -> SchedulerOutput`, `update_from_output(out, result)`.

No torch, ray, grpc, I/O or clock reads of its own (the clock is injected). It owns the only KV block
allocator and enforces the pipeline invariants: at most `max_in_flight` microbatches in flight, and a
request in at most one of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence

from ppserve.config import SchedulerConfig
from ppserve.request import FinishReason, Request, RequestStatus
from ppserve.sched.block_manager import BlockManager, blocks_for
from ppserve.sched.budget import BudgetMode, make_budget_mode
from ppserve.sched.output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.policies import Policy, make_policy


class BatchBuilder:
    """One microbatch under construction. Policies decide; this object allocates, preempts and records."""

    def __init__(self, sched: Scheduler, policy: Policy) -> None:
        self.sched = sched
        seq_cap = None
        if sched.config.per_microbatch_seq_cap:
            seq_cap = max(1, sched.config.max_num_seqs // sched.max_in_flight)
        mode = sched.budget_mode
        self.budget = policy.make_budget(mode.token_budget, seq_cap, mode.new_budget)
        self.chosen: dict[str, int] = {}  # request id -> tokens this step, in batch order

    @property
    def num_running(self) -> int:
        return len(self.sched.running)

    def schedulable_running(self, decodes: bool) -> Iterator[Request]:
        """Running requests not in flight and not yet in this batch: decodes, or prefills under way."""
        for req in list(self.sched.running):
            if req.in_flight or req.request_id in self.chosen or req.status is not RequestStatus.RUNNING:
                continue
            if req.is_prefill != decodes:
                yield req

    def waiting_head(self) -> Request | None:
        return self.sched.waiting[0] if self.sched.waiting else None

    def add(self, req: Request, num_tokens: int, may_preempt: bool, over_budget: bool = False) -> bool:
        """Schedule `num_tokens` of a running request, preempting younger requests for blocks if allowed."""
        num_tokens = self._cap_to_budget(req, num_tokens, over_budget)
        if num_tokens <= 0:
            return False
        need = self.sched.blocks.blocks_needed(req, num_tokens)
        while not self.sched.blocks.can_allocate(need):
            victim = self._pick_victim() if may_preempt else None
            if victim is None:
                return False
            self.sched._preempt(victim)
            if victim is req:
                return False
        self.sched.blocks.allocate(req, num_tokens)
        self._take(req, num_tokens, over_budget)
        return True

    def admit(self, req: Request, num_tokens: int, over_budget: bool = False, reserve_full: bool = False) -> bool:
        """Move the head of the waiting queue to running if a seat and its blocks are free (FCFS: no skipping)."""
        assert self.sched.waiting and self.sched.waiting[0] is req
        num_tokens = self._cap_to_budget(req, num_tokens, over_budget)
        if num_tokens <= 0 or len(self.sched.running) >= self.sched.config.max_num_seqs:
            return False
        reserve = num_tokens
        if reserve_full:
            reserve = self.sched.max_total_tokens(req) - req.num_computed_tokens
        if not self.sched.blocks.can_allocate(self.sched.blocks.blocks_needed(req, reserve)):
            return False
        self.sched.waiting.popleft()
        self.sched.blocks.allocate(req, reserve)
        req.status = RequestStatus.RUNNING
        self.sched.running.append(req)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.sched.clock()
        self._take(req, num_tokens, over_budget)
        return True

    def _cap_to_budget(self, req: Request, num_tokens: int, over_budget: bool) -> int:
        return num_tokens if over_budget else self.budget.chunk(num_tokens, req.num_computed_tokens)

    def _take(self, req: Request, num_tokens: int, over_budget: bool) -> None:
        if over_budget:
            # A whole prompt longer than the budget runs alone (vllm policy); account it as the full budget.
            self.budget.tokens_used = self.budget.token_budget or 0
            self.budget.num_seqs += 1
        else:
            self.budget.spend(num_tokens, req.num_computed_tokens)
        self.chosen[req.request_id] = num_tokens

    def _pick_victim(self) -> Request | None:
        """The most recently arrived running request that is neither in flight nor already chosen."""
        for req in reversed(self.sched.running):
            if not req.in_flight and req.request_id not in self.chosen:
                return req
        return None


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_in_flight: int = 1,
        clock: Callable[[], float] = lambda: 0.0,
        budget_mode: BudgetMode | None = None,
    ) -> None:
        self.config = config
        self.policy = make_policy(config.policy)
        # How big each microbatch's budget is (fixed tokens unless the config asks for time or a TBT target).
        self.budget_mode = budget_mode or make_budget_mode(config, max_in_flight)
        self.blocks = BlockManager(num_blocks, block_size)
        self.max_model_len = max_model_len
        self.max_in_flight = max_in_flight  # pp_size: one microbatch per stage keeps every stage busy
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: deque[SchedulerOutput] = deque()
        self._released: list[str] = []  # ids whose worker state must be dropped, sent with the next output
        self._next_step = 0
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------
    def max_total_tokens(self, req: Request) -> int:
        return min(req.num_prompt_tokens + req.sampling.max_tokens, self.max_model_len)

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
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.sent_to_workers:
            self._released.append(req.request_id)
            req.sent_to_workers = False
        # An in-flight request is forgotten when its microbatch returns; otherwise now.
        if not req.in_flight:
            del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, keep prompt and generated tokens, requeue at the front."""
        assert not req.in_flight, "an in-flight request cannot be preempted"
        self.running.remove(req)
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
        self._released = []  # the old workers are gone: nothing of theirs to drop
        for rid, req in list(self.requests.items()):
            req.in_flight = False
            if req.is_finished:  # cancelled or stopped while its microbatch was in flight
                del self.requests[rid]
        unfinished = sorted(
            list(self.running) + list(self.waiting), key=lambda r: r.arrival_time
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
        return [r.request_id for r in unfinished]

    # ---- one microbatch ------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight)

    def has_room(self) -> bool:
        return len(self.in_flight) < self.max_in_flight

    def schedule(self) -> SchedulerOutput | None:
        """Form the next microbatch, or None when the pipeline is full or nothing can run now."""
        if not self.has_room():
            return None
        b = BatchBuilder(self, self.policy)
        self.policy.fill(b)
        if not b.chosen:
            return None
        return self._emit(b)

    def _emit(self, b: BatchBuilder) -> SchedulerOutput:
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        sample: list[str] = []
        prefill_tokens = decode_tokens = 0
        for rid, n in b.chosen.items():
            req = self.requests[rid]
            if req.sent_to_workers:
                cached.append(
                    CachedRequestData(
                        request_id=rid,
                        new_token_ids=tuple(req.output_token_ids[req.num_output_tokens_sent :]),
                        new_block_ids=tuple(req.block_ids[req.num_blocks_sent :]),
                        num_computed_tokens=req.num_computed_tokens,
                    )
                )
            else:
                new.append(
                    NewRequestData(
                        request_id=rid,
                        token_ids=tuple(req.all_token_ids),
                        num_prompt_tokens=req.num_prompt_tokens,
                        block_ids=tuple(req.block_ids),
                        num_computed_tokens=req.num_computed_tokens,
                        sampling=req.sampling,
                    )
                )
                req.sent_to_workers = True
            req.num_output_tokens_sent = len(req.output_token_ids)
            req.num_blocks_sent = len(req.block_ids)
            if req.is_prefill:
                prefill_tokens += n
            else:
                decode_tokens += n
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                sample.append(rid)
            req.in_flight = True
        out = SchedulerOutput(
            step_id=self._next_step,
            order=tuple(b.chosen),
            num_scheduled_tokens=tuple(b.chosen.values()),
            new_requests=tuple(new),
            cached_requests=tuple(cached),
            sample_request_ids=tuple(sample),
            released_request_ids=tuple(self._released),
            num_prefill_tokens=prefill_tokens,
            num_decode_tokens=decode_tokens,
        )
        self._released = []
        self._next_step += 1
        self.in_flight.append(out)
        return out

    def update_from_output(self, out: SchedulerOutput, result: StepResult) -> list[RequestUpdate]:
        """Take a finished microbatch back (oldest first), append sampled tokens, apply stop rules."""
        if not self.in_flight or self.in_flight[0].step_id != out.step_id:
            raise AssertionError(f"microbatch {out.step_id} returned out of order")
        self.in_flight.popleft()
        if result.step_id != out.step_id:
            raise AssertionError(f"result for step {result.step_id} handed in for step {out.step_id}")
        updates: list[RequestUpdate] = []
        for rid in out.order:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.in_flight = False
            if req.is_finished:  # cancelled or stopped while in flight: forget it now
                del self.requests[rid]
                continue
            if rid not in result.sampled_token_ids:
                continue
            token = result.sampled_token_ids[rid]
            req.output_token_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, reason)
            updates.append(RequestUpdate(rid, (token,), reason is not None, reason))
        missing = set(out.sample_request_ids) - set(result.sampled_token_ids)
        if missing:
            raise AssertionError(f"step {out.step_id}: no token came back for {sorted(missing)}")
        return updates

    @property
    def needs_step_feedback(self) -> bool:
        """Whether `observe_step` does anything: callers may skip measuring stage times when not."""
        return self.budget_mode.needs_feedback

    def observe_step(self, out: SchedulerOutput, stage_seconds: Sequence[float] = ()) -> None:
        """Feedback after `update_from_output(out, ...)`: the measured compute seconds of `out` on each
        stage (empty when unknown). Calibrates the budget mode's cost model or its TBT controller; the
        scheduler itself reads no clock but the injected one."""
        finished = [rid for rid in out.order if rid not in self.requests]
        self.budget_mode.observe(out, stage_seconds, self.clock(), finished)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if not sp.ignore_eos and token in req.eos_token_ids:
            return FinishReason.STOP
        if token in sp.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_token_ids) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # ---- invariants ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.blocks.check()
        if len(self.in_flight) > self.max_in_flight:
            raise AssertionError(f"{len(self.in_flight)} microbatches in flight > {self.max_in_flight}")
        seen: set[str] = set()
        for out in self.in_flight:
            for rid in out.order:
                req = self.requests.get(rid)
                if rid in seen and req is not None and not req.is_finished:
                    raise AssertionError(f"request {rid} is in two in-flight microbatches")
                seen.add(rid)
            if out.total_tokens > self.budget_mode.token_cap and self.policy.name == "sarathi":
                raise AssertionError(f"microbatch {out.step_id} holds {out.total_tokens} > budget tokens")
        used = sum(len(r.block_ids) for r in self.running)
        if used != self.blocks.num_used:
            raise AssertionError(f"running requests hold {used} blocks but the allocator counts {self.blocks.num_used}")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs {self.config.max_num_seqs}")
        if not self.has_unfinished and self.blocks.num_used:
            raise AssertionError(f"idle but {self.blocks.num_used} KV blocks are still in use")

