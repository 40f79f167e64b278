"""Admission policies: which requests join a microbatch and how many tokens each computes.

Every policy shares the request model, the block manager and the pipeline; only admission differs
(ARCHITECTURE.md#how-a-microbatch-is-formed). A policy sees a `BatchBuilder`, which owns block allocation and
preemption, and calls `builder.add(req, num_tokens)`. Attributes tell the scheduler what else a policy takes
part in: `token_budgeted` (it consults the token budget, so the budget mode's time budget and TBT target apply
too; orca and static admit whole prompts under no token budget), `chunked_prefill` (it cuts prompts into
chunks, so no microbatch ever holds more than the budget: an invariant the scheduler checks; vllm runs a
prompt longer than the budget alone), and `balanced` (the scheduler hands it a decode quota and a fair share
of the work, and lets a prompt's chunks follow each other down the pipeline: `ppserve.sched.balance`).
"""

from __future__ import annotations

from typing import Protocol

from ppserve.config import POLICIES as POLICY_NAMES
from ppserve.sched.batch import BatchBuilder

__all__ = ["POLICIES", "Policy", "make_policy"]


class Policy(Protocol):
    name: str
    token_budgeted: bool
    chunked_prefill: bool
    balanced: bool

    def fill(self, b: BatchBuilder) -> None: ...


class SarathiPolicy:
    """Stall-free batching: decodes first, then unfinished prefill chunks, then new requests (FCFS),
    chunking prefills so the microbatch holds exactly its budget of tokens when work allows.

    Balanced (the default with a pipeline): while the pipeline has slack, the decodes are spread over
    the in-flight microbatches and the budget is a fair share of the work in reach
    (`ppserve.sched.balance`), so consecutive microbatches cost the same on every stage; a decode left
    out by its quota goes first in the next microbatch, and no decode ever waits behind a prefill. A
    prompt's next chunk may follow its in-flight chunk, with whatever budget is left last. Saturated,
    it is plain Sarathi-Serve (the scheduler sets no quota and no share)."""

    name = "sarathi"
    token_budgeted = True
    chunked_prefill = True

    def __init__(self, balanced: bool = True) -> None:
        self.balanced = balanced

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


class VllmPolicy:
    """Prefill-prioritizing (vLLM v0 default): whole prompts in a prefill-only microbatch while they fit
    in the token budget; when no prompt can start, a decode-only microbatch."""

    name = "vllm"
    token_budgeted = True
    chunked_prefill = False
    balanced = False

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


def _runs_alone(b: BatchBuilder, num_tokens: int) -> bool:
    """A whole prompt longer than the budget runs alone in an empty microbatch, else it never starts."""
    left = b.budget.tokens_left
    return b.budget.num_seqs == 0 and left is not None and num_tokens > left


class OrcaPolicy:
    """Iteration-level hybrid batches: all decodes plus whole (unchunked) prompts, no token budget."""

    name = "orca"
    token_budgeted = False
    chunked_prefill = False
    balanced = False

    def fill(self, b: BatchBuilder) -> None:
        b.add_decodes()
        for req in b.schedulable_running(decodes=False):
            if not b.budget.has_seat:
                return
            b.add(req, req.num_uncomputed_tokens, may_preempt=True)
        while (head := b.waiting_head()) is not None:
            if not b.budget.has_seat or not b.admit(head, head.num_uncomputed_tokens):
                break


class StaticPolicy:
    """Request-level batching (FasterTransformer): a batch runs to completion before new requests join.

    A batch is formed only when no request is running; then its whole prompts run, then its decodes."""

    name = "static"
    token_budgeted = False
    chunked_prefill = False
    balanced = False

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
POLICIES: dict[str, type] = {p.name: p for p in (SarathiPolicy, VllmPolicy, OrcaPolicy, StaticPolicy)}
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
