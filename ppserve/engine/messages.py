"""What enters the engine and what leaves it, shared by every front door (offline, gRPC, HTTP).

`PromptInput` is one of text, token ids or chat messages (the engine renders messages with the
model's chat template). `TokenDelta` is the engine's single per-step output: what one request gained
in one step, with the request's times on its final delta. Pure Python: no torch, grpc or protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.request import TokenLogprob

CHAT_ROLES = ("system", "user", "assistant")
MAX_CACHE_SALT_CHARS = 1024


class PipelineUnavailable(RuntimeError):
    """The pipeline is starting, being rebuilt, failed or shutting down: retry later."""


@dataclass(frozen=True)
class PromptInput:
    """What a client asked to complete: exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content), rendered by the chat template
    # Prefix caching: only prompts with the same salt share cached KV (tenants that must not share pick
    # different salts; vLLM's field). None and "" are the same: no salt.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("text", "token_ids", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a prompt is exactly one of text, token_ids or messages; got {given or 'none'}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.messages is not None:
            for i, (role, _) in enumerate(self.messages):
                if role not in CHAT_ROLES:
                    raise ValueError(f"messages[{i}].role {role!r} is unknown; expected one of "
                                     f"{', '.join(CHAT_ROLES)}")


@dataclass(frozen=True)
class RequestTimes:
    """Engine-clock times of one request: its arrival, first schedule and every output token."""

    arrival: float
    first_scheduled: float | None
    token_times: Sequence[float]


@dataclass(frozen=True)
class TokenDelta:
    """What one request gained in one step (or its end: cancelled, failed). Text is held back while it
    could still become a stop string; the final delta carries the request's times."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    token_times: tuple[float, ...]
    finished: bool
    finish_reason: str | None = None
    times: RequestTimes | None = None  # on the final delta only
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs
    num_cached_tokens: int = 0  # on the final delta: prompt tokens the prefix cache supplied
