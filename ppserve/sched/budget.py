"""Budget accounting for one microbatch, and the modes that decide how big that budget is.

A policy consults one budget object per microbatch (`chunk`, `spend`, `can_fit`, `has_seat`,
`tokens_left`). `TokenBudget` counts tokens (the default, ARCHITECTURE.md#how-a-microbatch-is-formed);
`TimeBudget` also counts predicted seconds from an online step-cost model, so a chunk late in a long prompt,
or a batch of long-context decodes, gets fewer tokens than one from an empty cache
(ARCHITECTURE.md#how-a-microbatch-is-formed).

A `BudgetMode` is the small object the scheduler owns that makes these budgets and takes feedback
after each microbatch (`Scheduler.observe_step`): `FixedTokenBudget` (default, ignores feedback),
`TimeBudgetMode` (calibrates its cost model from stage times), `AdaptiveTokenBudget` (the largest token
budget whose full microbatches meet a time-between-tokens target, corrected by the measured p99).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

from ppserve.config import SchedulerConfig
from ppserve.metrics.latency import percentile
from ppserve.sched.cost import BatchShape, OnlinePipelineCost, PipelineCost
from ppserve.sched.output import SchedulerOutput

__all__ = [
    "AdaptiveTokenBudget",
    "BudgetFactory",
    "BudgetMode",
    "FixedTokenBudget",
    "TimeBudget",
    "TimeBudgetMode",
    "TokenBudget",
    "make_budget_mode",
]


class TokenBudget:
    """Grants tokens to requests for one microbatch.

    `token_budget=None` means no token limit (orca/static admit whole prompts); `max_seqs` caps the number
    of requests in the microbatch. `context` (tokens already in the request's KV cache) is ignored here;
    subclasses that price attention use it.
    """

    def __init__(self, token_budget: int | None, max_seqs: int | None = None) -> None:
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.tokens_used = 0
        self.num_seqs = 0

    @property
    def tokens_left(self) -> int | None:
        return None if self.token_budget is None else self.token_budget - self.tokens_used

    @property
    def has_seat(self) -> bool:
        return self.max_seqs is None or self.num_seqs < self.max_seqs

    def can_fit(self, num_tokens: int, context: int = 0) -> bool:
        left = self.tokens_left
        return self.has_seat and (left is None or num_tokens <= left)

    def chunk(self, wanted: int, context: int = 0) -> int:
        """How many of `wanted` tokens fit now (0 when no seat or no tokens are left)."""
        if not self.has_seat:
            return 0
        left = self.tokens_left
        return wanted if left is None else max(0, min(wanted, left))

    def spend(self, num_tokens: int, context: int = 0, sampled: bool = False) -> None:
        """Take `num_tokens` of one request (`sampled`: they complete its known tokens, so it gets logits)."""
        left = self.tokens_left
        if num_tokens <= 0 or (left is not None and num_tokens > left) or not self.has_seat:
            raise AssertionError(f"budget overdrawn: {num_tokens} tokens with {left} left, seats "
                                 f"{self.num_seqs}")
        self.tokens_used += num_tokens
        self.num_seqs += 1

    def grant_drafts(self, wanted: int, context: int, cap: int) -> int:
        """Take up to `wanted` draft tokens for a decode already in the microbatch (after `context` cached
        tokens and its own token), within `cap` tokens in all; returns how many."""
        n = max(0, min(wanted, cap - self.tokens_used))
        self.tokens_used += n
        return n

    def limit(self, tokens: int, seconds: float | None = None) -> None:
        """Shrink this budget to a share of it (balanced formation): at most `tokens` tokens (and, for a
        time budget, `seconds` predicted). Never grows it."""
        if self.token_budget is not None:
            self.token_budget = min(self.token_budget, max(1, tokens))


class TimeBudget(TokenBudget):
    """A token budget that also keeps the microbatch's predicted time on every stage within
    `time_budget_s`, so the slowest stage's predicted time (the pipeline's pace) stays within it.

    The token count stays a hard cap. Each stage starts at its floor; a chunk costs its tokens, its
    attention keys and, when it completes its request's known tokens, its sampling (the last stage's LM
    head). An empty microbatch always gets at least one token, so a request whose chunk alone is
    predicted over the budget (a decode with a huge context) still makes progress. `min_rest` > 0 makes
    the time a soft limit for the end of a prompt: a chunk that starts never leaves its request fewer than
    `min_rest` tokens, it takes them all if the token budget allows (a rest that small would cost a
    whole microbatch of its own later, and the request's first token a round of the pipeline).
    `even_chunks` cuts a prompt that does not fit whole into equal chunks: of the rest's tokens, the
    chunk takes an equal part of as many chunks as the time granted now would need, at most one token
    over the grant where `min_rest` > 1 (a rest of 463 tokens at a grant of 217 goes as 155 now, not as
    217 now and 246 later). The balanced share sets it (sched/balance.py, "Equal chunks").
    """

    def __init__(self, token_budget: int | None, max_seqs: int | None, cost: PipelineCost,
                 time_budget_s: float, min_rest: int = 0, even_chunks: bool = False) -> None:
        super().__init__(token_budget, max_seqs)
        self.cost = cost
        self.time_budget_s = time_budget_s
        self.min_rest = min_rest
        self.even_chunks = even_chunks
        self.stage_used_s = [s.floor_s for s in cost.stages]

    @property
    def time_used_s(self) -> float:
        """The predicted time of the microbatch so far on its slowest stage."""
        return max(self.stage_used_s)

    @property
    def time_left_s(self) -> float:
        return self.time_budget_s - self.time_used_s

    def chunk(self, wanted: int, context: int = 0) -> int:
        n = super().chunk(wanted, context)
        if n == 0:
            return 0
        timed = self._timed_chunk(wanted, n, context)
        # Only a chunk that starts would leave a rest: a request the time leaves out (timed == 0) waits
        # whole for the next microbatch. Taken whole instead, every prompt shorter than min_rest would
        # ignore the time budget (several short prompts would make one long microbatch).
        if n == wanted and 0 < timed and wanted - timed < self.min_rest:
            return n
        if self.even_chunks and 0 < timed < wanted:
            # As many chunks as the grant needs, at one token over it each: the grant is a share rounded
            # down to whole tokens, and a prompt of exactly two shares (113 tokens at 56) would go in three.
            # Not where the share lets no rest past it (min_rest <= 1, a token budget of 16 or less): a
            # prompt of 3 tokens at a grant of 1 went as 2 + 1 there, twice the time granted.
            pieces = -(-wanted // (timed + (1 if self.min_rest > 1 else 0)))
            return min(n, -(-wanted // pieces))
        return timed

    def _timed_chunk(self, wanted: int, n: int, context: int) -> int:
        budget_s = self.time_budget_s
        pairs = list(zip(self.cost.stages, self.stage_used_s, strict=True))
        for stage, used in pairs:
            n = min(n, stage.max_tokens(budget_s - used, context, n))
        if n == wanted and any(used + stage.chunk_s(n, context, True) > budget_s for stage, used in pairs):
            n -= 1  # the whole rest samples (the LM head runs for it): one token less does not
        return n if n > 0 or self.num_seqs > 0 else 1

    def can_fit(self, num_tokens: int, context: int = 0) -> bool:
        return super().can_fit(num_tokens, context) and self.chunk(num_tokens, context) == num_tokens

    def spend(self, num_tokens: int, context: int = 0, sampled: bool = False) -> None:
        super().spend(num_tokens, context, sampled)
        for i, stage in enumerate(self.cost.stages):
            self.stage_used_s[i] += stage.chunk_s(num_tokens, context, sampled)

    def grant_drafts(self, wanted: int, context: int, cap: int) -> int:
        """Drafts within the token cap and the predicted time: each is a sampled token more on its
        decode's chunk (its logits are computed to verify it)."""
        n = max(0, min(wanted, cap - self.tokens_used))
        base = [stage.chunk_s(1, context, True) for stage in self.cost.stages]
        while n > 0:
            extra = [stage.chunk_s(1 + n, context, True) + stage.sample_s * n - b
                     for stage, b in zip(self.cost.stages, base, strict=True)]
            if all(used + e <= self.time_budget_s for used, e in zip(self.stage_used_s, extra, strict=True)):
                for i, e in enumerate(extra):
                    self.stage_used_s[i] += e
                break
            n -= 1
        self.tokens_used += n
        return n

    # A decode is most of what a busy microbatch holds, and a time budget prices each one by its
    # context: these two are `chunk(1, context) == 1` and `spend(1, context, sampled=True)` with the same
    # arithmetic, in the same order (the same float results), without the general chunk's search.
    # `BatchBuilder.add_decodes` calls them once per decode, the planner's simulations most of all.
    def decode_fits(self, context: int) -> bool:
        """Whether a decode after `context` cached tokens fits (a seat, a token and, on every stage, its
        time with its sampling); an empty microbatch always takes one."""
        if self.max_seqs is not None and self.num_seqs >= self.max_seqs:
            return False
        if self.token_budget is not None and self.token_budget - self.tokens_used < 1:
            return False
        if self.num_seqs == 0:
            return True
        budget_s = self.time_budget_s
        keys = context + 1
        for stage, used in zip(self.cost.stages, self.stage_used_s, strict=True):
            seconds = budget_s - used
            keys_s = stage.decode_key_s * keys
            if seconds < 0 or stage.token_s + keys_s > seconds:  # `max_tokens`, unsampled
                return False
            if used + ((stage.token_s + stage.sample_s) + keys_s) > budget_s:  # sampled, as `_timed_chunk`
                return False
        return True

    def spend_decode(self, context: int) -> None:
        """Take one decode after `context` cached tokens (it samples); `decode_fits` said it fits."""
        self.tokens_used += 1
        self.num_seqs += 1
        keys = context + 1
        used = self.stage_used_s
        for i, stage in enumerate(self.cost.stages):
            used[i] += (stage.token_s + stage.sample_s) + stage.decode_key_s * keys

    def limit(self, tokens: int, seconds: float | None = None) -> None:
        super().limit(tokens, seconds)
        if seconds is not None:
            self.time_budget_s = min(self.time_budget_s, seconds)


class BudgetFactory(Protocol):
    def __call__(self, token_budget: int | None, max_seqs: int | None) -> TokenBudget: ...


class BudgetMode(Protocol):
    """How big each microbatch's budget is, and what the scheduler learns after each microbatch."""

    @property
    def token_budget(self) -> int:
        """The token budget for the next microbatch."""
        ...

    @property
    def token_cap(self) -> int:
        """The most tokens any microbatch may hold under this mode (checked as an invariant)."""
        ...

    @property
    def needs_feedback(self) -> bool:
        """Whether `observe` does anything (callers may skip measuring times when it does not)."""
        ...

    def new_budget(self, token_budget: int | None, max_seqs: int | None) -> TokenBudget: ...

    def observe(self, out: SchedulerOutput, stage_seconds: Sequence[float], now: float,
                finished: Collection[str]) -> None:
        """A microbatch came back: its compute seconds per stage, the scheduler's clock, and the ids of
        requests that are gone now."""
        ...


class _BudgetModeBase:
    """What the modes share, each overriding what it does differently: the token budget in force,
    which is also the cap; microbatch budgets that count tokens alone; feedback ignored."""

    needs_feedback = False

    def __init__(self, token_budget: int) -> None:
        self._token_budget = token_budget

    @property
    def token_budget(self) -> int:
        return self._token_budget

    @property
    def token_cap(self) -> int:
        return self._token_budget

    def new_budget(self, token_budget: int | None, max_seqs: int | None) -> TokenBudget:
        return TokenBudget(token_budget, max_seqs)

    def observe(self, out: SchedulerOutput, stage_seconds: Sequence[float], now: float,
                finished: Collection[str]) -> None:
        return None


class FixedTokenBudget(_BudgetModeBase):
    """The default: every microbatch gets the configured token budget; feedback is ignored."""


class TimeBudgetMode(_BudgetModeBase):
    """Microbatches capped at a predicted time on the slowest stage, with `token_budget` as a hard cap.

    The cost model is the scheduler's `OnlinePipelineCost`, which learns every stage's time from each
    microbatch's measured stage times (the pipeline runs at the pace of its slowest stage).
    `time_budget_s=None` means "what a chunk of `token_budget` tokens from an empty cache costs" under
    the current fit: a microbatch of short contexts keeps its token budget, one of long contexts gets
    fewer tokens. Until the model is calibrated the budget counts tokens alone.
    """

    needs_feedback = True  # its cost model learns from the stage times

    def __init__(self, token_budget: int, time_budget_s: float | None = None,
                 cost: OnlinePipelineCost | None = None) -> None:
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0, got {time_budget_s!r}")
        super().__init__(token_budget)
        self.time_budget_s = time_budget_s
        self.cost = cost if cost is not None else OnlinePipelineCost(1)

    def current_time_budget_s(self) -> float:
        if self.time_budget_s is not None:
            return self.time_budget_s
        return self.cost.current.pace(BatchShape(((self._token_budget, 0),)))

    def new_budget(self, token_budget: int | None, max_seqs: int | None) -> TokenBudget:
        if token_budget is None or not self.cost.calibrated:  # no token budget: no time budget either
            return TokenBudget(token_budget, max_seqs)
        return TimeBudget(token_budget, max_seqs, self.cost.current, self.current_time_budget_s())


class AdaptiveTokenBudget(_BudgetModeBase):
    """Chooses the token budget from a time-between-tokens (TBT) target: the largest budget whose
    full microbatches still meet it, corrected by the TBT actually measured.

    Model: a decode's next token is scheduled when its microbatch returns and comes back after the
    `num_stages` microbatches in flight ahead of it went through the slowest stage, so with every microbatch
    full, TBT ~= num_stages * T(budget), T the pace of the scheduler's `OnlinePipelineCost` (as in the time
    mode) for one chunk of `budget` tokens at the recent mean prefill context. The budget is the largest with
    num_stages * T(budget) <= tbt_slo_s * safety * k, within [min_budget, max_budget].

    Feedback: TBT is measured on the scheduler's own (injected) clock, the gap between two returns
    that brought a token to the same request. Every `min_samples` gaps, k becomes min(1, model bound /
    measured p99) for the largest budget in force meanwhile (transfers, engine overhead and model error
    the cost model does not see); misses act at once, recovery is gradual. k never exceeds 1, so a
    lightly loaded engine, whose TBT is short whatever the budget, cannot talk the budget into spikes.
    Without stage times (the cost model never calibrates) a p99 over the target scales k by
    (target / p99) ** gain, so the budget can only shrink from its start.
    """

    needs_feedback = True

    def __init__(self, tbt_slo_s: float, start: int, num_stages: int = 1, min_budget: int = 1,
                 max_budget: int = 8192,
                 safety: float = 0.9, min_samples: int = 512, gain: float = 1.0,
                 cost: OnlinePipelineCost | None = None) -> None:
        if tbt_slo_s <= 0 or not 0 < safety <= 1 or min_samples < 1 or gain <= 0 or num_stages < 1:
            raise ValueError(
                f"bad adaptive budget settings: tbt_slo_s={tbt_slo_s!r} safety={safety!r} "
                f"min_samples={min_samples!r} gain={gain!r} num_stages={num_stages!r}"
            )
        if not 1 <= min_budget <= max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {min_budget!r}, {max_budget!r}")
        super().__init__(min(max(start, min_budget), max_budget))  # the budget in force, from the start
        self.tbt_slo_s = tbt_slo_s
        self.target_s = tbt_slo_s * safety
        self.num_stages = num_stages
        self.min_budget = min_budget
        self.max_budget = max_budget
        self.min_samples = min_samples
        self.gain = gain
        self.cost = cost if cost is not None else OnlinePipelineCost(num_stages)
        self.correction = 1.0  # k above
        self._start = self._token_budget
        self._context = 0.0  # running mean context of prefill chunks, weighted by their tokens
        self._last_token: dict[str, float] = {}
        self._gaps: list[float] = []
        # the largest budget in force while the current gaps were measured
        self._window_budget = self._token_budget
        self.history: list[tuple[int, float]] = []  # (budget in force, measured p99 TBT) per feedback round

    @property
    def token_cap(self) -> int:
        return self.max_budget

    def observe(self, out: SchedulerOutput, stage_seconds: Sequence[float], now: float,
                finished: Collection[str]) -> None:
        for rid in out.sample_request_ids:
            last = self._last_token.get(rid)
            if last is not None:
                self._gaps.append(now - last)
            self._last_token[rid] = now
        for rid in finished:
            self._last_token.pop(rid, None)
        if stage_seconds and not out.is_empty:  # the scheduler feeds the cost model; this tracks the context
            chunks = out.chunks()
            prefill = [(n, ctx) for n, ctx in chunks if n > 1]
            if prefill:
                tokens = sum(n for n, _ in prefill)
                mean_ctx = sum(n * ctx for n, ctx in prefill) / tokens
                self._context += 0.05 * (mean_ctx - self._context)
        self._window_budget = max(self._window_budget, self._token_budget)
        if len(self._gaps) >= self.min_samples:
            self._correct(percentile(self._gaps, 99))
        self._token_budget = self._choose()

    def _correct(self, p99_s: float) -> None:
        self.history.append((self._window_budget, p99_s))
        if self.cost.calibrated:
            # How far the model's bound for the largest budget in force undershot what was measured
            # (transfers, engine overhead, model error): trust the model that much less. Misses act at
            # once, recovery is gradual; an early transient under the start budget is no model error.
            bound = self.num_stages * self._step_s(self._window_budget)
            k = min(1.0, bound / p99_s) if p99_s > 0 else 1.0
            self.correction = k if k < self.correction else self.correction + 0.25 * (k - self.correction)
        elif p99_s > self.target_s:  # no stage times: steer by the measured TBT alone, downward only
            self.correction *= (self.target_s / p99_s) ** self.gain
        self._gaps = []
        self._window_budget = self._token_budget

    def _choose(self) -> int:
        if not self.cost.calibrated:  # no stage times (yet): only the measured TBT steers, from the start
            return min(self.max_budget, max(self.min_budget, round(self._start * self.correction)))
        per_step = self.target_s * self.correction / self.num_stages
        ctx = round(self._context)
        n = min(s.max_tokens(per_step - s.floor_s, ctx, self.max_budget) for s in self.cost.current.stages)
        return min(self.max_budget, max(self.min_budget, n))

    def _step_s(self, budget: int) -> float:
        """The pace of a microbatch that is one chunk of `budget` tokens at the recent prefill context."""
        return self.cost.current.pace(BatchShape(((budget, round(self._context)),)))


def make_budget_mode(config: SchedulerConfig, num_stages: int = 1,
                     cost: OnlinePipelineCost | None = None) -> BudgetMode:
    """The budget mode a scheduler config asks for (fixed token budget unless told otherwise); `cost` is
    the scheduler's live cost model, which the time and TBT modes price with."""
    cost = cost if cost is not None else OnlinePipelineCost(num_stages)
    mode: BudgetMode
    if config.tbt_slo_ms is not None:
        # Never below one decode seat per request of a full microbatch: a smaller budget would
        # stall decodes and lengthen TBT, the opposite of what the controller wants.
        floor = min(config.max_token_budget, max(1, math.ceil(config.max_num_seqs / num_stages)))
        mode = AdaptiveTokenBudget(config.tbt_slo_ms * 1e-3, config.token_budget, num_stages,
                                   min_budget=floor,
                                   max_budget=config.max_token_budget, cost=cost)
    elif config.budget_mode == "time":
        tb = None if config.time_budget_ms is None else config.time_budget_ms * 1e-3
        mode = TimeBudgetMode(config.token_budget, tb, cost)
    else:
        mode = FixedTokenBudget(config.token_budget)
    return mode
