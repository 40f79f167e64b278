"""What crosses the scheduler/worker boundary: frozen dataclasses of ids, ints and tuples.

New requests travel in full once; requests the workers already hold travel as diffs (new block ids,
newly sampled tokens). Results come back as plain builtins too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ppserve.request import FinishReason, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers do not hold yet (first schedule, or rescheduled after preemption)."""

    request_id: str
    token_ids: tuple[int, ...]  # prompt followed by every output token known so far
    num_prompt_tokens: int
    block_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens whose KV is already in the cache (0 after preemption)
    sampling: SamplingParams


class CachedRequestData(NamedTuple):
    """A diff for a request the workers already hold (a named tuple: one is built per request per step,
    and a tuple costs a third of a frozen dataclass to make)."""

    request_id: str
    new_token_ids: tuple[int, ...]  # output tokens sampled since the workers last heard of it
    new_block_ids: tuple[int, ...]
    num_computed_tokens: int
    # >= 0: first cut the block table to this many blocks (a tail only rejected drafts wrote, given back)
    num_blocks_kept: int = -1


@dataclass(frozen=True)
class SchedulerOutput:
    """One microbatch. `order` is the order of requests in the flattened token batch."""

    step_id: int
    order: tuple[str, ...]
    num_scheduled_tokens: tuple[int, ...]  # aligned with `order`
    # aligned with `order`: tokens with KV before this step (the context)
    num_computed_tokens: tuple[int, ...]
    new_requests: tuple[NewRequestData, ...]
    cached_requests: tuple[CachedRequestData, ...]
    sample_request_ids: tuple[str, ...]  # requests whose next token is due at the end of this step
    released_request_ids: tuple[str, ...] = ()  # workers drop their state for these (finished or preempted)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # The token ring (scheduler.token_ring): decodes whose input token is the one step
    # `ring_step_id` (an earlier microbatch, still in flight when this one was formed) samples for them.
    # Their diffs do not carry it: stage 0 takes it from the last stage's ring message, the last stage
    # from its own sample, and the stages between never read it.
    ring_request_ids: tuple[str, ...] = ()
    ring_step_id: int | None = None
    # Speculative decoding: a decode's draft tokens, computed after its input token (its scheduled tokens
    # are 1 + drafts) and verified by the last stage. No stage keeps them: the accepted ones come back
    # as the next diff's new tokens.
    draft_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.draft_token_ids.values())

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.order

    def chunks(self) -> list[tuple[int, int]]:
        """(tokens computed this step, tokens already in the KV cache) per request, in batch order: what a
        step-cost model prices."""
        return list(zip(self.num_scheduled_tokens, self.num_computed_tokens, strict=True))


@dataclass(frozen=True)
class StepResult:
    """What the pipeline returns for one microbatch: sampled tokens by request id, their log-probabilities
    for the requests that asked, and each stage's compute seconds for step `timed_step_id` (the slowest TP
    rank of the stage). That is this step or an earlier one: GPU stages read their times one step late,
    without waiting for the device (ARCHITECTURE.md#measuring-bubbles); None, with no seconds, when no time is
    ready."""

    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    stage_seconds: tuple[float, ...] = ()
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    timed_step_id: int | None = None
    grammar_mask_s: float = 0.0  # the last stage's seconds filling this microbatch's grammar masks
    # Speculative decoding: how many of a request's drafts were accepted (they come before its sampled
    # token), and their log-probabilities where asked
    num_accepted: dict[str, int] = field(default_factory=dict)
    draft_logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.timed_step_id is None) != (not self.stage_seconds):
            raise ValueError(f"step {self.step_id}: stage_seconds {self.stage_seconds!r} need the step they "
                             f"measure, and only they (timed_step_id={self.timed_step_id!r})")
        if self.timed_step_id is not None and self.timed_step_id > self.step_id:
            raise ValueError(f"step {self.step_id} reports the time of a later step, {self.timed_step_id}")


class RequestUpdate(NamedTuple):
    """What the scheduler reports back to the engine for one request after a step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # aligned with new_token_ids, when the request asked
