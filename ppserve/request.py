"""The request model shared by scheduler, engine and server: sampling parameters, request state, outputs.

Pure Python (no torch, ray or grpc): the scheduler and the simulator use it unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ppserve.structured.spec import StructuredOutputs, coerce

# Upper bounds that protect the engine from absurd requests; the server may tighten them.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)
MAX_N = 16  # sequences per request

# A sampled token's log-probability and the most likely alternatives: (logprob, ((token id, logprob), ...)).
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Frozen: it crosses process boundaries as is.

    Penalties follow the usual definitions (applied in this order, before temperature, top-k and top-p):
    repetition (CTRL / transformers: a logit of a token seen in the prompt or the output is divided by
    the penalty when positive, multiplied when negative), frequency and presence (OpenAI: minus
    count * frequency_penalty and minus presence_penalty for each token already generated); with
    `min_tokens` the end-of-sequence and stop token ids cannot be sampled, and stop strings do not
    end the request, before that many tokens.
    """

    max_tokens: int | None = 16  # None: as many as the context leaves after the prompt
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k
    min_p: float = 0.0  # keep tokens at least min_p times as likely as the most likely one; 0 disables
    seed: int | None = None  # per-request seed: sampling is reproducible for a given seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the k most likely
    n: int = 1  # sequences to generate from the prompt (each its own request: see the front doors)
    # The output must match this (a JSON schema, regex, choice, grammar or tool calls; vLLM's dict works
    # too): the last stage masks the tokens the grammar does not allow (ARCHITECTURE.md#structured-outputs).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so the object stays hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        so: Any = self.structured_outputs
        object.__setattr__(self, "structured_outputs", coerce(so))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field and the limit."""
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"a stop string has {len(s)} characters; the limit is "
                                 f"{MAX_STOP_STRING_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; the limit is "
                             f"{MAX_STOP_TOKEN_IDS}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not (math.isfinite(r) and r > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured_outputs is not None:
            # The grammar ends the output with end-of-sequence where it accepts: nothing may keep it out.
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with structured outputs: the output ends "
                                 "where the grammar is complete")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with structured outputs: the grammar decides "
                                 "where the output may end")

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, min_tokens)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0
                or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_params(sp: SamplingParams) -> list[SamplingParams]:
    """The n sequences of one request as n single-sequence SamplingParams. ppserve runs each choice as
    its own request (with prefix caching on, the choices share their prompt's full KV blocks);
    with a seed, choice i samples with seed + i, so the choices differ yet each is reproducible."""
    if sp.n == 1:
        return [sp]
    return [dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class Request:
    """Scheduler-owned mutable state of one request.

    Token accounting follows one model for every policy: the request's tokens are its prompt followed
    by its outputs; `num_computed_tokens` of them have KV in the cache. A policy only decides how many
    more tokens to compute this step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # In-flight microbatches holding this request (pipeline invariant: at most one that samples it; a
    # prompt's consecutive prefill chunks may ride in several).
    num_in_flight: int = 0
    ready_seq: int = 0  # when its last token came back (scheduler step count): older decodes go first
    first_scheduled_time: float | None = None
    # Set when the workers hold this request's per-request state (sent in full once, then diffs).
    sent_to_workers: bool = False
    # Output tokens not yet sent to the workers (they need them to embed the next decode).
    num_output_tokens_sent: int = 0
    num_blocks_sent: int = 0
    # Prefix caching (sched/block_manager.py): requests share cached KV only when their salts are equal.
    cache_salt: str | None = None
    block_keys: list[bytes] = field(default_factory=list)  # chained keys of its full blocks, hashed once
    num_blocks_keyed: int = 0  # of its block_ids, how many are registered in the prefix cache (or dups)
    num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted (usage)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than one token lacks KV: a (re)computation of the prompt is under way."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def in_flight(self) -> bool:
        """Part of a microbatch that has not come back yet."""
        return self.num_in_flight > 0


@dataclass(frozen=True)
class RequestOutput:
    """What a caller of the offline API gets back for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    arrival_time: float
    first_scheduled_time: float | None
    token_times: list[float]  # engine-clock seconds at which each output token became known
    index: int = 0  # which of the prompt's n choices (SamplingParams.n)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when SamplingParams.logprobs is set
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival_time if self.token_times else None
