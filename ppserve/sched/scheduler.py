"""The scheduler state machine: `schedule() -> SchedulerOutput`, then `step_done(out, result)`.

No torch, ray, grpc, I/O or clock reads of its own (the clock is injected). It owns the only KV block
allocator and enforces the pipeline invariants: at most `num_stages` microbatches in flight (one per
stage), a decoding request in at most one of them (a prompt's consecutive prefill chunks may follow each
other; only the last one samples). With the token ring (`scheduler.token_ring`, pp > 1, `TokenRing`)
one microbatch more may be formed, and the decodes the oldest in-flight microbatch samples may ride in
it, their input token handed from the last stage to stage 0 without the engine.

The policy decides which requests join a microbatch and how many tokens each computes (for `sarathi`:
every schedulable decode first, then the prefill chunks under way, then new requests in arrival order,
chunked so the microbatch holds exactly its budget). With a pipeline the formation is balanced
(`BalancedFormation`): each microbatch gets a decode quota and a budget that is an equal share of the
work in reach, so consecutive microbatches cost the same on every stage
(ARCHITECTURE.md#how-a-microbatch-is-formed). Per-request work is incremental and linear in the number
of requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppserve.config import SchedulerConfig, SpeculativeConfig
from ppserve.request import FinishReason, Request, RequestStatus
from ppserve.sched.balance import BalancedFormation
from ppserve.sched.batch import BatchBuilder, RunningSplit
from ppserve.sched.block_manager import BlockManager, blocks_for
from ppserve.sched.budget import BudgetMode, TokenBudget, make_budget_mode
from ppserve.sched.cost import BatchShape, OnlinePipelineCost, PipelineCost
from ppserve.sched.output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput, StepResult
from ppserve.sched.policies import Policy, make_policy
from ppserve.sched.proposers import Proposer
from ppserve.sched.speculation import Speculator
from ppserve.sched.token_ring import TokenRing

_RUNNING = RequestStatus.RUNNING


@dataclass(frozen=True)
class StepOutcome:
    """What the engine learns from the scheduler once a microbatch is back: each request's new tokens,
    and when to form the next microbatch (the token ring's extra one: the scheduler's clock; None: now)."""

    updates: list[RequestUpdate]
    formation_due: float | None


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
        speculative: SpeculativeConfig | None = None,
        proposer: Proposer | None = None,
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
        self._released: list[str] = []  # ids whose worker state must be dropped, sent with the next output
        self._next_step = 0
        self.num_preemptions = 0
        capped = config.per_microbatch_seq_cap and self.policy.seq_capped
        self._seq_cap = max(1, config.max_num_seqs // num_stages) if capped else None
        self.balanced = self.policy.balanced and num_stages > 1
        # A prompt's next chunk may follow its in-flight chunk down the pipeline.
        self.pipelined_chunks = self.policy.pipelined_chunks and num_stages > 1
        # Each microbatch's decode quota and budget, so that consecutive microbatches cost the same.
        self.formation = BalancedFormation(
            num_stages, config.max_num_seqs, config.balance_rounds, self._seq_cap, self.cost, self.blocks,
            self.in_flight, self.waiting, self.running, lambda: self.clock()) if self.balanced else None
        # One microbatch more than the stages, its decodes taking the tokens the oldest in-flight
        # microbatch samples, straight from the last stage (sched/token_ring.py).
        # A policy whose own rules include a ring (vLLM's async scheduling) forms each microbatch as soon
        # as a slot frees, with every decode that may ride on its pending token, the slot always open.
        at_once = self.policy.ring_at_once
        self.ring = TokenRing(num_stages, config.max_num_seqs, self._seq_cap,
                              None if at_once else config.ring_margin_ms, max_model_len,
                              always_open=at_once) if config.token_ring_on and num_stages > 1 else None
        self.max_in_flight = self.ring.max_in_flight if self.ring is not None else num_stages
        # Speculative decoding (sched/speculation.py): drafts for decodes, priced in the budget. Only with
        # a token budget to take them from.
        spec_on = (speculative is not None and speculative.enabled) or proposer is not None
        ringed = self.ring is not None
        self.spec = (Speculator(speculative or SpeculativeConfig(), proposer, token_ring=ringed)
                     if spec_on and self.policy.token_budgeted else None)
        self._blocks_kept: dict[str, int] = {}  # a request's block table cut after rejected drafts

    # ---- requests in and out -------------------------------------------------------------------
    def max_total_tokens(self, req: Request) -> int:
        """Prompt plus the most output tokens it may get (max_tokens None: the context's limit)."""
        return min(req.num_prompt_tokens + (req.sampling.max_tokens or self.max_model_len),
                   self.max_model_len)

    def add_request(self, req: Request) -> None:
        """Queue a request; ValueError if it can never run (too long for the context or the KV cache)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use by a request that has not "
                             "finished")
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
        if self.formation is not None:
            self.formation.arrived(self.clock())
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
        self._blocks_kept.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.release(req, finished=reason in (FinishReason.STOP, FinishReason.LENGTH))
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
        self._blocks_kept.pop(req.request_id, None)
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
        if self.formation is not None:
            self.formation.forget()
        if self.ring is not None:
            self.ring.forget()
        self._released = []  # the old workers are gone: nothing of theirs to drop
        self._blocks_kept.clear()
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

        With the token ring, a full pipeline's extra slot takes the ring decodes and whatever else is
        ready, or work that waits for no token (a prompt's next chunk): a microbatch's round trip is
        longer than p stage times, and a pipeline of chunks held to p microbatches would idle stage 0
        for the difference every round. With a stage slot free the microbatch is formed without ring
        decodes first and takes them only when it would otherwise be empty: ring decodes make it wait
        at stage 0 for the oldest microbatch, and beside work that could start now they would hold it
        back. The extra slot stays closed while requests wait beyond the free seats, or every seat is
        taken under a per-microbatch sequence cap (`TokenRing.slot_open`)."""
        if not self.has_room():
            return None
        ring = self.ring.candidates(self.in_flight, self.requests) if self.ring is not None else {}
        if ring and self.spec is not None:
            ring = self._off_ring_speculators(ring)
        if len(self.in_flight) >= self.num_stages:
            return self._form(ring) if self._ring_slot_open() else None
        if self.policy.ring_at_once:
            return self._form(ring)
        return self._form({}) or (self._form(ring) if ring else None)

    def _off_ring_speculators(self, ring: dict[str, Request]) -> dict[str, Request]:
        """The ring candidates less the decodes that speculate: one whose drafts are in the oldest
        microbatch (its next input depends on how many are accepted), or one that would draft now."""
        assert self.spec is not None
        drafted = self.in_flight[0].draft_token_ids
        spec = self.spec
        return {rid: req for rid, req in ring.items() if rid not in drafted and not spec.wants_drafts(req)}

    def _ring_slot_open(self) -> bool:
        return self.ring is not None and self.ring.slot_open(len(self.waiting), len(self.running))

    def _form(self, ring: dict[str, Request]) -> SchedulerOutput | None:
        """Fill a microbatch (`ring`: the decodes it may take on the token ring) and emit it, if not empty."""
        if self.policy.token_budgeted:
            mode = self.budget_mode
            budget = mode.new_budget(mode.token_budget, self._seq_cap)
        else:
            budget = TokenBudget(None, self._seq_cap)  # whole prompts: no token budget, so no time budget
        split = RunningSplit(self.running, ring, pipeline_chunks=self.pipelined_chunks)
        quota = None
        if self.formation is not None:
            budget, quota = self.formation.plan(split, budget)
        b = BatchBuilder(
            budget=budget, split=split, blocks=self.blocks, running=self.running, waiting=self.waiting,
            preempt=self._preempt, max_num_seqs=self.config.max_num_seqs,
            max_total_tokens=self.max_total_tokens,
            clock=self.clock, decode_quota=quota, step_id=self._next_step,
            in_flight_step_ids=tuple(out.step_id for out in self.in_flight), num_stages=self.num_stages,
            pipeline_cost=self._calibrated_cost,
        )
        self.policy.fill(b)
        # Looked up for admission but not admitted: holds nothing. The one looked up, not the queue's head
        # now: a decode's block may have preempted a request to the front after the lookup (vllm, orca).
        for head in (b.looked_up_head, self.waiting[0] if self.waiting else None):
            if head is not None and head.status is RequestStatus.WAITING and not head.block_ids:
                head.num_computed_tokens = 0
        if not b.chosen:
            return None
        drafts = (self.spec.extend(b, ring, self.budget_mode.token_budget, self.config.budget_mode == "time",
                                   self._calibrated_cost()) if self.spec is not None else {})
        return self._emit(b, ring, drafts)

    def _calibrated_cost(self) -> PipelineCost | None:
        return self.cost.current if self.cost.calibrated else None

    def _emit(self, b: BatchBuilder, ring: dict[str, Request],
              drafts: dict[str, tuple[int, ...]]) -> SchedulerOutput:
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
                toks = (() if k == num_outputs else (outputs[-1],) if k == num_outputs - 1
                        else tuple(outputs[k:]))
                k = req.num_blocks_sent
                blocks = () if k == num_blocks else tuple(req.block_ids[k:])
                if self._blocks_kept and rid in self._blocks_kept:
                    cached.append(CachedRequestData(rid, toks, blocks, done, self._blocks_kept.pop(rid)))
                else:
                    cached.append(CachedRequestData(rid, toks, blocks, done))
            else:
                new.append(NewRequestData(
                    request_id=rid, token_ids=tuple(req.all_token_ids),
                    num_prompt_tokens=len(req.prompt_token_ids),
                    block_ids=tuple(req.block_ids), num_computed_tokens=done, sampling=req.sampling,
                ))
                req.sent_to_workers = True
            # the workers get the ring's token without a diff
            req.num_output_tokens_sent = num_outputs + pending
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
            if done + n == num_tokens or (drafts and rid in drafts):  # a speculating decode verifies
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
            draft_token_ids=drafts,
        )
        self._released = []
        self._next_step += 1
        self.in_flight.append(out)
        if self.ring is not None and self.ring.clock is not None:
            stage0_s = self.cost.current.stage_times(BatchShape.of(out))[0] if self.cost.calibrated else None
            self.ring.formed(out.step_id, self.clock(), stage0_s)
        return out

    def formation_due(self, dispatch_s: float = 0.0) -> float | None:
        """With the token ring, when only its extra slot is free: when the next microbatch should be formed
        (the injected clock's seconds), `dispatch_s` (the control plane's latency to the stages) plus
        `scheduler.ring_margin_ms` before stage 0 is predicted to need it, so that what arrives meanwhile
        joins it. None: now (no ring, a stage slot free, the extra slot closed, or no prediction)."""
        if self.ring is None:
            return None
        return self.ring.due(self.in_flight, dispatch_s, self._ring_slot_open())

    def step_done(self, out: SchedulerOutput, result: StepResult, timed: SchedulerOutput | None = None,
                  dispatch_s: float | None = None) -> StepOutcome:
        """The one call after a collect: take `out`'s result back (`update_from_output`), learn from the
        stage times it carries, which measure `timed` (`observe_step`; None: times for no microbatch this
        caller holds), and say when to form the next microbatch (`formation_due`, asked when `dispatch_s`
        is given: a caller that can wait)."""
        updates = self.update_from_output(out, result)
        self.observe_step(out, result.stage_seconds if timed is not None else (), timed=timed)
        due = self.formation_due(dispatch_s) if dispatch_s is not None else None
        return StepOutcome(updates, due)

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
        if self.formation is not None:
            self.formation.returned(out.step_id)
        if self.ring is not None and self.ring.clock is not None:
            self.ring.returned(out.step_id, self.clock())
        requests = self.requests
        seq = self._next_step
        max_len = self.max_model_len
        updates: list[RequestUpdate] = []
        drafted = out.draft_token_ids
        if self.spec is not None:
            self.spec.stepped(sampled)
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
            if drafted and rid in drafted:
                updates.append(self._verified(req, drafted[rid], token, result))
                req.ready_seq = seq
                continue
            outputs = req.output_token_ids
            outputs.append(token)
            req.ready_seq = seq
            sp = req.sampling
            reason = None
            if (token in req.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
                reason = FinishReason.STOP
            elif (len(outputs) >= (sp.max_tokens or max_len)
                  or len(req.prompt_token_ids) + len(outputs) >= max_len):
                reason = FinishReason.LENGTH
            if reason is not None:
                self._finish(req, reason)
            lp = result.logprobs.get(rid)
            updates.append(RequestUpdate(rid, (token,), reason is not None, reason,
                                         () if lp is None else (lp,)))
        return updates

    def _verified(self, req: Request, drafts: tuple[int, ...], token: int,
                  result: StepResult) -> RequestUpdate:
        """A speculating decode back: its accepted drafts and the token after them join its outputs, one
        by one under the stop rules; the KV of rejected drafts is dropped (the computed count rolls back
        and a block table tail only they wrote is given back)."""
        assert self.spec is not None
        rid = req.request_id
        accepted = result.num_accepted.get(rid, 0)
        if not 0 <= accepted <= len(drafts):
            raise AssertionError(f"step {result.step_id}: {accepted} of {len(drafts)} drafts accepted for "
                                 f"{rid}")
        self.spec.verified(rid, len(drafts), accepted)
        # KV holds its input token and the accepted drafts; the rejected positions are garbage.
        req.num_computed_tokens -= len(drafts) - accepted
        new = (*drafts[:accepted], token)
        lps = (*result.draft_logprobs.get(rid, ()), result.logprobs[rid]) if rid in result.logprobs else ()
        outputs = req.output_token_ids
        sp = req.sampling
        limit = min(sp.max_tokens or self.max_model_len, self.max_model_len - len(req.prompt_token_ids))
        reason = None
        for i, t in enumerate(new):
            outputs.append(t)
            if (t in req.eos_token_ids and not sp.ignore_eos) or t in sp.stop_token_ids:
                reason = FinishReason.STOP
            elif len(outputs) >= limit:
                reason = FinishReason.LENGTH
            if reason is not None:
                new, lps = new[:i + 1], lps[:i + 1]
                break
        if reason is not None:
            self._finish(req, reason)
        else:
            keep = blocks_for(req.num_computed_tokens + 1, self.blocks.block_size)
            if len(req.block_ids) > keep and self.blocks.truncate(req, keep):
                self._blocks_kept[rid] = keep
                req.num_blocks_sent = min(req.num_blocks_sent, keep)
        return RequestUpdate(rid, new, reason is not None, reason, lps)

    @property
    def needs_step_feedback(self) -> bool:
        """Whether `observe_step` does anything: callers may skip measuring stage times when not."""
        return self.balanced or self.budget_mode.needs_feedback or self.spec is not None

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
            if self.spec is not None and self.cost.calibrated:
                self.spec.observe_cost(measured, stage_seconds, self.cost.current)  # before the fit moves
            if self.balanced or self.budget_mode.needs_feedback:
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
            if ringed and (self.ring is None or out.ring_step_id is None or out.ring_step_id >= out.step_id
                           or (source is not None and not ringed <= set(source.sample_request_ids))):
                raise AssertionError(f"microbatch {out.step_id} takes ring tokens {sorted(ringed)} that step "
                                     f"{out.ring_step_id} does not sample before it")
            for rid in out.order:
                req = self.requests.get(rid)
                if req is not None and not req.is_finished:
                    if rid in sampling and rid not in ringed:
                        raise AssertionError(f"request {rid} is in an in-flight microbatch after the one "
                                             "that samples it")
                    if counts.get(rid) and not self.pipelined_chunks and rid not in ringed:
                        raise AssertionError(f"request {rid} is in two in-flight microbatches")
                counts[rid] = counts.get(rid, 0) + 1
            sampling.update(out.sample_request_ids)
            if self.policy.chunked_prefill and out.total_tokens > self.budget_mode.token_cap:
                raise AssertionError(f"microbatch {out.step_id} holds {out.total_tokens} > budget tokens")
        for rid, n in counts.items():
            req = self.requests.get(rid)
            if req is not None and req.num_in_flight != n:
                raise AssertionError(f"request {rid} counts {req.num_in_flight} in-flight microbatches, not "
                                     f"{n}")
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
