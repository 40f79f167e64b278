"""The engine thread's inbox: the commands the event loop sends it, one frozen dataclass per kind.

The AsyncEngine puts these on a FIFO queue; the engine thread applies them between steps and
dispatches on their type (AddRequests at the head of the queue also mid-step, before the core
schedules). A command with a `reply` future is answered on the event loop (its result, or the exception
applying it raised); one without is fire-and-forget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppserve.engine.messages import PromptInput
from ppserve.request import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Queue a request (all its n choices); the reply is its number of prompt tokens."""

    prompt: PromptInput
    sampling: SamplingParams
    request_id: str
    reply: asyncio.Future[int]


@dataclass(frozen=True)
class Cancel:
    """Abort one request (one choice's id); the reply, if asked for, says whether it was still running."""

    request_id: str
    reply: asyncio.Future[bool] | None = None


@dataclass(frozen=True)
class Call:
    """Run fn(engine) on the engine thread between steps; the reply is its result."""

    fn: Callable[[Any], Any]
    reply: asyncio.Future[Any]


@dataclass(frozen=True)
class Stop:
    """End the step loop: unfinished requests are cancelled and queued commands answered with an error."""


Command = AddRequest | Cancel | Call | Stop
