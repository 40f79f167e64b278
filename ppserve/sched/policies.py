"""Admission policies: which requests join a microbatch and how many tokens each computes.

Every policy shares the request model, the block manager and the pipeline; only admission differs
(DESIGN.md §4). A policy sees a `BatchBuilder`, which owns block allocation and preemption, and calls
`builder.add(req, num_tokens)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ppserve.sched.budget import BudgetFactory, TokenBudget

if TYPE_CHECKING:
    from ppserve.sched.scheduler import BatchBuilder


class Policy(Protocol):
    name: str

    def make_budget(
        self, token_budget: int, seq_cap: int | None, new_budget: BudgetFactory = TokenBudget
    ) -> TokenBudget:
        """This microbatch's budget; `new_budget` is the scheduler's budget mode (tokens, or predicted time)."""
        ...

    def fill(self, b: BatchBuilder) -> None: ...


class SarathiPolicy:
    """Stall-free batching: decodes first, then unfinished prefill chunks, then new requests (FCFS),
    chunking prefills so the microbatch holds exactly `token_budget` tokens when work allows."""

    name = "sarathi"

    def make_budget(
        self, token_budget: int, seq_cap: int | None, new_budget: BudgetFactory = TokenBudget
    ) -> TokenBudget:
        return new_budget(token_budget, seq_cap)

    def fill(self, b: BatchBuilder) -> None:
        # Phase 1: every schedulable decode gets its one token, so no decode is stalled by a prefill.
        for req in b.schedulable_running(decodes=True):
            if b.budget.chunk(1, req.num_computed_tokens) == 0:
                break
            b.add(req, 1, may_preempt=True)
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


class VllmPolicy:
    """Prefill-prioritizing (vLLM v0 default): whole prompts in a prefill-only microbatch while they fit
    in the token budget; when no prompt can start, a decode-only microbatch."""

    name = "vllm"

    def make_budget(
        self, token_budget: int, seq_cap: int | None, new_budget: BudgetFactory = TokenBudget
    ) -> TokenBudget:
        return new_budget(token_budget, seq_cap)

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
        for req in b.schedulable_running(decodes=True):
            if b.budget.chunk(1, req.num_computed_tokens) == 0:
                break
            b.add(req, 1, may_preempt=True)


def _runs_alone(b: BatchBuilder, num_tokens: int) -> bool:
    """A whole prompt longer than the budget runs alone in an empty microbatch, else it never starts."""
    left = b.budget.tokens_left
    return b.budget.num_seqs == 0 and left is not None and num_tokens > left


class OrcaPolicy:
    """Iteration-level hybrid batches: all decodes plus whole (unchunked) prompts, no token budget."""

    name = "orca"

    def make_budget(
        self, token_budget: int, seq_cap: int | None, new_budget: BudgetFactory = TokenBudget
    ) -> TokenBudget:
        return TokenBudget(None, seq_cap)  # no token budget, hence no time budget either

    def fill(self, b: BatchBuilder) -> None:
        for req in b.schedulable_running(decodes=True):
            if not b.budget.has_seat:
                return
            b.add(req, 1, may_preempt=True)
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

    def make_budget(
        self, token_budget: int, seq_cap: int | None, new_budget: BudgetFactory = TokenBudget
    ) -> TokenBudget:
        return TokenBudget(None, seq_cap)  # no token budget, hence no time budget either

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
        for req in b.schedulable_running(decodes=True):
            if not b.budget.has_seat:
                return
            b.add(req, 1, may_preempt=False)


POLICIES: dict[str, type] = {p.name: p for p in (SarathiPolicy, VllmPolicy, OrcaPolicy, StaticPolicy)}


def make_policy(name: str) -> Policy:
    try:
        policy: Policy = POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return policy
