"""What enters the engine and what leaves it, shared by every front door (offline, gRPC, HTTP).

`PromptInput` is one of text, token ids or chat messages (the engine renders messages with the
model's chat template; a turn is a `(role, content)` pair or a `ChatTurn`, which can carry tool
calls). `TokenDelta` is the engine's single per-step output: what one request gained in one step,
with the request's times on its final delta. Pure Python: no torch, grpc or protobuf.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ppserve.request import TokenLogprob

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_CACHE_SALT_CHARS = 1024


class PipelineUnavailable(RuntimeError):
    """The pipeline is starting, being rebuilt, failed or shutting down: retry later."""


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant turn made: `arguments` is JSON text, as OpenAI's messages carry it."""

    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's shape, with the arguments decoded where they are JSON: chat templates write them
        with `tojson`, and a JSON string there would be quoted twice."""
        try:
            args: Any = json.loads(self.arguments)
        except json.JSONDecodeError:
            args = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(frozen=True)
class ChatTurn:
    """One chat message beyond `(role, content)`: an assistant turn's tool calls (its content may then
    be None), a tool turn's `tool_call_id`, a participant's `name`."""

    role: str
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (only the fields that are set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChatTurn:
        """An OpenAI-style message dict: role, content, and optionally tool_calls ({id, function: {name,
        arguments}}), tool_call_id and name."""
        calls = []
        for i, c in enumerate(d.get("tool_calls") or ()):
            fn = c.get("function") or {}
            args = fn.get("arguments", "{}")
            if not isinstance(fn.get("name"), str):
                raise ValueError(f"tool_calls[{i}].function.name must be a string")
            calls.append(ToolCall(id=str(c.get("id") or f"call_{i}"), name=fn["name"],
                                  arguments=args if isinstance(args, str) else json.dumps(args)))
        return cls(role=d["role"], content=d.get("content"), tool_calls=tuple(calls),
                   tool_call_id=d.get("tool_call_id"), name=d.get("name"))


Turn: TypeAlias = "tuple[str, str] | ChatTurn"  # (role, content), or a turn with tool fields


def turn_role(turn: Turn) -> str:
    return turn.role if isinstance(turn, ChatTurn) else turn[0]


def turn_dict(turn: Turn) -> dict[str, Any]:
    """A turn as the chat template's message dict."""
    return turn.as_dict() if isinstance(turn, ChatTurn) else {"role": turn[0], "content": turn[1]}


@dataclass(frozen=True)
class PromptInput:
    """What a client asked to complete: exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Turn, ...] | None = None  # rendered by the chat template
    # The tools a chat offers (OpenAI's `tools` list as JSON text: the prompt stays hashable); the chat
    # template writes them into the prompt. Only with messages.
    tools: str | None = None
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
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with chat messages, not a text or token-id prompt")
        if self.messages is not None:
            for i, turn in enumerate(self.messages):
                role = turn_role(turn)
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


def chat_turn(role: str, content: str | None, tool_calls: Sequence[ToolCall] = (),
              tool_call_id: str | None = None, name: str | None = None) -> ChatTurn:
    """A chat message with tool fields as the engine's turn; ValueError where tool_calls sit on a turn
    that is not the assistant's, or a tool turn does not say which call it answers."""
    if tool_calls and role != "assistant":
        raise ValueError(f"tool_calls belong to assistant messages, not {role!r} ones")
    if role == "tool" and tool_call_id is None:
        raise ValueError("a tool message needs tool_call_id: the call it answers")
    return ChatTurn(role=role, content=content, tool_calls=tuple(tool_calls), tool_call_id=tool_call_id,
                    name=name)
