"""Admission policies: which requests join a microbatch and how many tokens each computes.

Every policy shares the request model, the block manager and the pipeline; only admission differs
(ARCHITECTURE.md#how-a-microbatch-is-formed). A policy sees a `BatchBuilder`, which owns block allocation and
preemption, and calls `builder.add(req, num_tokens)`. Attributes tell the scheduler what else a policy takes
part in: `token_budgeted` (it consults the token budget, so the budget mode's time budget and TBT target apply
too; orca and static admit whole prompts under no token budget), `chunked_prefill` (it cuts prompts into
chunks, so no microbatch ever holds more than the budget: an invariant the scheduler checks; vllm runs a
prompt longer than the budget alone), and `balanced` (the scheduler hands it a decode quota and a fair share
of the work: `ppserve.sched.balance`), `pipelined_chunks` (a prompt's next chunk may follow its in-flight
chunk down the pipeline) and `seq_capped` (it keeps `scheduler.per_microbatch_seq_cap`, a per-microbatch
share of `max_num_seqs`).

Besides Sarathi-Serve's own baselines (`vllm` as vLLM v0, `orca`, `static`), today's peers run as
`vllm-v1` (and `vllm-v1-async`) and `sglang-pp`; each keeps its own rules: no balancing, and no token
ring but vLLM's async scheduling's own. `ring_at_once`: the policy's own ring (every microbatch formed
at once with the decodes on pending tokens, the extra slot always open).
"""

from __future__ import annotations

import math
from typing import Protocol

from ppserve.config import POLICIES as POLICY_NAMES
from ppserve.request import Request
from ppserve.sched.batch import BatchBuilder

__all__ = ["POLICIES", "Policy", "make_policy"]


class Policy(Protocol):
    name: str
    token_budgeted: bool
    chunked_prefill: bool
    balanced: bool
    pipelined_chunks: bool
    seq_capped: bool
    ring_at_once: bool

    def fill(self, b: BatchBuilder) -> None: ...


class _Rules:
    """The attributes every policy has, at the baselines' values; a policy states only where it differs."""

    token_budgeted = True
    chunked_prefill = True
    balanced = False
    pipelined_chunks = False
    seq_capped = True
    ring_at_once = False


class SarathiPolicy(_Rules):
    """Stall-free batching: decodes first, then unfinished prefill chunks, then new requests (FCFS),
    chunking prefills so the microbatch holds exactly its budget of tokens when work allows.

    Balanced (the default with a pipeline): while the pipeline has slack, the decodes are spread over
    the in-flight microbatches and the budget is a fair share of the work in reach
    (`ppserve.sched.balance`), so consecutive microbatches cost the same on every stage; a decode left
    out by its quota goes first in the next microbatch, and no decode ever waits behind a prefill. A
    prompt's next chunk may follow its in-flight chunk, with whatever budget is left last. Saturated,
    it is plain Sarathi-Serve (the scheduler sets no quota and no share)."""

    name = "sarathi"

    def __init__(self, balanced: bool = True) -> None:
        self.balanced = balanced
        self.pipelined_chunks = balanced

    def fill(self, b: BatchBuilder) -> None:
        # Phase 1: every schedulable decode (up to its quota) gets its one token, before any prefill.
        b.add_decodes()
        # Phase 2: prefills already under way, then new arrivals, each chunked to the budget left.
        for req in b.schedulable_running(decodes=False):
            n = b.budget.chunk(req.num_uncomputed_tokens, req.num_computed_tokens)
            if n == 0:
                break
            b.add(req, n, may_preempt=True)
        while (head := b.waiting_head()) is not None:
            n = b.budget.chunk(head.num_uncomputed_tokens, head.num_computed_tokens)
            if n == 0 or not b.admit(head, n):
                break
        # Phase 3 (balanced only): what is left goes to prompts whose previous chunk is still in flight.
        # Last, not with the other prefills: given the same rank, one prompt's chunks would take the
        # prefill part of consecutive microbatches, and its short last chunk (with the per-microbatch
        # sequence cap full of decodes) would leave every few microbatches short of the budget.
        for req in b.schedulable_following():
            n = b.budget.chunk(req.num_uncomputed_tokens, req.num_computed_tokens)
            if n == 0:
                break
            b.add(req, n, may_preempt=True)


class VllmPolicy(_Rules):
    """Prefill-prioritizing (vLLM v0 default): whole prompts in a prefill-only microbatch while they fit
    in the token budget; when no prompt can start, a decode-only microbatch."""

    name = "vllm"
    chunked_prefill = False

    def fill(self, b: BatchBuilder) -> None:
        # Prefills already under way (recompute after preemption) run whole, like new prompts.
        for req in b.schedulable_running(decodes=False):
            n = req.num_uncomputed_tokens
            alone = _runs_alone(b, n)
            if not (b.budget.can_fit(n) or alone):
                break
            b.add(req, n, may_preempt=True, over_budget=alone)
        while (head := b.waiting_head()) is not None:
            n = head.num_uncomputed_tokens
            alone = _runs_alone(b, n)
            if not (b.budget.can_fit(n) or alone) or not b.admit(head, n, over_budget=alone):
                break
        if b.budget.num_seqs > 0:
            return
        b.add_decodes()


class VllmV1Policy(_Rules):
    """vLLM v1's scheduler under pipeline parallelism, without async scheduling (vllm-project/vllm:
    `v1/core/sched/scheduler.py` `Scheduler.schedule`, `v1/engine/core.py` `step_with_batch_queue`).

    - p microbatches in flight (`max_concurrent_batches`), each formed as soon as a slot frees.
    - Running requests first, in admission order, each given what it has left up to the budget left:
      a decode its token once the last one is back (in flight it has none left and is skipped), a
      prompt its next chunk even while its previous chunk is in flight (tokens count as computed when
      scheduled). Decodes get no priority over older prompts' chunks.
    - Then, only if this formation preempted nothing, waiting requests in arrival order, chunked to the
      budget left, while a seat of `max_num_seqs` is free: a bound over all microbatches in flight, with
      no per-microbatch share (issue #41682: a burst fills one microbatch and leaves the others thin).
    - No balancing across microbatches, no token ring.

    Plainest readings: vLLM preempts the most recently admitted running request even in flight; here
    the most recent one not in flight (a stage may still read its KV). `long_prefill_token_threshold`
    is off. With async scheduling: `VllmV1AsyncPolicy`."""

    name = "vllm-v1"
    pipelined_chunks = True
    seq_capped = False

    def fill(self, b: BatchBuilder) -> None:
        for req in b.schedulable_in_order():
            if not b.budget.tokens_left or not b.budget.has_seat:
                break
            # A decode on its pending token (async scheduling) has nothing known left: its one token.
            left = req.num_uncomputed_tokens or int(req.request_id in b.split.ring)
            n = b.budget.chunk(left, req.num_computed_tokens)
            if n > 0 and not b.add(req, n, may_preempt=True):
                break  # no blocks even after preempting every request it may (or itself): the rest waits
        if b.num_preempted:
            return
        while (head := b.waiting_head()) is not None:
            n = b.budget.chunk(head.num_uncomputed_tokens, head.num_computed_tokens)
            if n == 0 or not b.admit(head, n):
                break


class VllmV1AsyncPolicy(VllmV1Policy):
    """vLLM v1 with async scheduling under pipeline parallelism (`AsyncScheduler`, the V2 model runner's
    `max_concurrent_batches` = pp + 1 and `next_decode_eligible_step`): p + 1 microbatches in flight, a
    decode scheduled again p steps after its last, on the token that microbatch is still computing,
    which the last stage hands to the first (PR #32618). Each microbatch is formed as soon as a slot
    frees, with every such decode, and the extra slot is always open: ppserve's token ring carries the
    tokens, without its own rules (formed just in time, closed while the seats bind). Otherwise as
    `VllmV1Policy`."""

    name = "vllm-v1-async"
    ring_at_once = True


class SglangPpPolicy(_Rules):
    """SGLang's scheduler under pipeline parallelism (sgl-project/sglang: `event_loop_pp` in
    `scheduler_pp_mixin.py`, `get_next_batch_to_run`, `PrefillAdder`, `DynamicChunkSizer`).

    - p microbatch slots, each with its own running batch, formed again once its previous microbatch
      is back; a request decodes only in the slot that ran its last prefill chunk (no rebalancing).
    - A slot tries a prefill first: the one prompt being chunked (its chunks follow each other down the
      pipeline), then, after its last chunk, waiting requests in arrival order while the slot holds
      fewer than `max_num_seqs // p` and the chunk budget (the token budget) lasts. A slot that runs a
      prefill skips its decodes that round (`enable_mixed_chunk` off); otherwise it runs them all.
    - Dynamic chunking: with a chunk's time from an empty prefix f(l) = a l^2 + b l, a chunk over L
      computed tokens gets the x with a x^2 + (2 a L + b) x = f(C), smoothed to C + 0.75 (x - C), at
      least C / 4, in multiples of max(block, 64) tokens.

    Plainest readings: a and b come from the step-cost model's slowest stage (SGLang profiles once at
    start-up; uncalibrated, chunks stay C); KV admission and preemption are ppserve's (blocks for the
    chunk now, not SGLang's `new_token_ratio` reservation; the most recently admitted request not in
    flight, where SGLang retracts the slot's request with the fewest outputs). No token ring."""

    name = "sglang-pp"
    pipelined_chunks = True
    seq_capped = False
    SMOOTH = 0.75

    def __init__(self) -> None:
        self._slot_of_request: dict[str, int] = {}  # a decoding request's slot
        self._slot_of_step: dict[int, int] = {}  # an in-flight microbatch's slot
        self._next_slot = 0

    def _free_slots(self, b: BatchBuilder) -> list[int]:
        """The slots with no microbatch in flight, in round-robin order from the one after the last
        formed (SGLang's loop visits every slot in turn, an idle one included)."""
        self._slot_of_step = {s: self._slot_of_step[s] for s in b.in_flight_step_ids
                              if s in self._slot_of_step}
        busy = set(self._slot_of_step.values())
        p = b.num_stages
        return [k % p for k in range(self._next_slot, self._next_slot + p) if k % p not in busy]

    def fill(self, b: BatchBuilder) -> None:
        bound = self._slot_of_request
        for rid in [rid for rid in bound if not b.is_running(rid)]:
            del bound[rid]  # finished or preempted: it prefills, and binds, again
        for slot in self._free_slots(b):
            self._fill_slot(b, slot)
            if b.chosen:
                self._slot_of_step[b.step_id] = slot
                self._next_slot = slot + 1
                return

    def _fill_slot(self, b: BatchBuilder, slot: int) -> None:
        bound = self._slot_of_request
        cap = max(b.max_num_seqs // b.num_stages, 1)
        in_slot = sum(1 for k in bound.values() if k == slot)
        ready = list(b.schedulable_in_order())
        chunked = next((r for r in ready if _prompt_left(r, 0)), None)
        admitting = chunked is None
        if chunked is not None:
            b.add(chunked, self._chunk_size(b, chunked), may_preempt=True)
            n = b.chosen.get(chunked.request_id)
            if n is not None and not _prompt_left(chunked, n):  # its last chunk: others may join
                bound[chunked.request_id] = slot
                in_slot += 1
                admitting = True
        while admitting and in_slot < cap and (head := b.waiting_head()) is not None:
            n = b.budget.chunk(head.num_uncomputed_tokens, head.num_computed_tokens)
            if n == 0 or not b.admit(head, n):
                break
            if _prompt_left(head, b.chosen[head.request_id]):
                break  # it is now the prompt being chunked
            bound[head.request_id] = slot
            in_slot += 1
        if not b.chosen:  # no prefill this round: the slot's own decodes
            for req in ready:  # one may have been preempted for an earlier one's block
                if bound.get(req.request_id) == slot and req is not chunked and b.is_running(req.request_id):
                    b.add(req, 1, may_preempt=True)

    def _chunk_size(self, b: BatchBuilder, req: Request) -> int:
        """The next chunk of the prompt being chunked: C, or with a calibrated cost SGLang's dynamic size."""
        left = len(req.prompt_token_ids) - req.num_computed_tokens
        c = b.budget.token_budget or left
        cost = b.pipeline_cost() if req.num_computed_tokens > 0 else None
        if cost is None:
            return min(left, c)
        stage = max(cost.stages, key=lambda st: st.chunk_s(c, 0, False))
        a, lin = stage.prefill_key_s / 2, stage.token_s + stage.prefill_key_s / 2
        if a <= 0:
            return min(left, c)
        target = a * c * c + lin * c
        bq = 2 * a * req.num_computed_tokens + lin
        x = (-bq + math.sqrt(bq * bq + 4 * a * target)) / (2 * a)
        size = max(int(c + self.SMOOTH * (x - c)), c // 4)
        align = max(b.block_size, 64)
        size = max(align, size // align * align)
        return min(left, size, c)


def _prompt_left(req: Request, scheduled: int) -> bool:
    """Whether prompt tokens remain after `scheduled` more (a chunk counts once it is computed)."""
    return req.num_computed_tokens + scheduled < len(req.prompt_token_ids)


def _runs_alone(b: BatchBuilder, num_tokens: int) -> bool:
    """A whole prompt longer than the budget runs alone in an empty microbatch, else it never starts."""
    left = b.budget.tokens_left
    return b.budget.num_seqs == 0 and left is not None and num_tokens > left


class OrcaPolicy(_Rules):
    """Iteration-level hybrid batches: all decodes plus whole (unchunked) prompts, no token budget."""

    name = "orca"
    token_budgeted = False
    chunked_prefill = False

    def fill(self, b: BatchBuilder) -> None:
        b.add_decodes()
        for req in b.schedulable_running(decodes=False):
            if not b.budget.has_seat:
                return
            b.add(req, req.num_uncomputed_tokens, may_preempt=True)
        while (head := b.waiting_head()) is not None:
            if not b.budget.has_seat or not b.admit(head, head.num_uncomputed_tokens):
                break


class StaticPolicy(_Rules):
    """Request-level batching (FasterTransformer): a batch runs to completion before new requests join.

    A batch is formed only when no request is running; then its whole prompts run, then its decodes."""

    name = "static"
    token_budgeted = False
    chunked_prefill = False

    def fill(self, b: BatchBuilder) -> None:
        if b.num_running == 0:
            while (head := b.waiting_head()) is not None:
                if not b.budget.has_seat or not b.admit(head, head.num_uncomputed_tokens, reserve_full=True):
                    break
            return
        for req in b.schedulable_running(decodes=False):
            if not b.budget.has_seat:
                return
            b.add(req, req.num_uncomputed_tokens, may_preempt=False)
        b.add_decodes(may_preempt=False)


# The registry: every policy class by its name. The names a config may use are config.POLICIES (the
# config validates before anything is built); the two must agree, which is checked here at import.
POLICIES: dict[str, type] = {p.name: p for p in (SarathiPolicy, VllmPolicy, OrcaPolicy, StaticPolicy,
                                                 VllmV1Policy, VllmV1AsyncPolicy, SglangPpPolicy)}
if set(POLICIES) != set(POLICY_NAMES):
    raise ImportError(f"policy classes {sorted(POLICIES)} and config.POLICIES {sorted(POLICY_NAMES)} "
                      "disagree")


def make_policy(name: str, balanced: bool = True) -> Policy:
    """The policy called `name`; `balanced` applies to the policies that can balance (sarathi)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
    policy: Policy = cls(balanced) if cls is SarathiPolicy else cls()
    return policy
