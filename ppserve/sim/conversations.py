"""Multi-turn conversations with shared prefixes: each turn re-sends the conversation's history.

Turn t's prompt is the previous turn's prompt, its answer and a new user message; a conversation may
open with one of `num_system_prompts` shared system prompts. Prompts are spelled out as token runs
(`WorkloadRequest.content`), so the block manager and the router's keys see exactly what is shared:
the system prompt across conversations, the whole history with the next turn. Answers are SIM_TOKEN
runs, what the simulated steps sample, so a turn hits its predecessor's answer blocks too.

Lengths: each turn's new message and answer are one row of a length pool (the Azure conversation
trace's rows in order, or its log-normal stand-in). The trace has no conversation ids, so how rows
group into conversations is this module's choice: 1 + a geometric number of turns (mean
`mean_turns`), a conversation ending early where its next turn would not fit the context.

Arrivals are Poisson at the probe's rate, as for every other workload; which conversation an arrival
continues is decided when it arrives (`ConversationArrivals.request`): the one whose last answer
finished longest ago, at least `think_s` before, else a new one. So the rate is exact and no turn is
sent before the answer it follows, which a schedule fixed in advance cannot promise under load. That
needs the finish times, so this workload runs in the routed simulator (sim/replicas.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppserve.sim.simulator import SIM_TOKEN
from ppserve.sim.workload import WorkloadRequest, poisson_arrivals

__all__ = ["ConversationSpec", "ConversationArrivals", "conversation_requests"]

# Token ids of system prompt s and of conversation c's user messages: apart from each other, from
# SIM_TOKEN and from the simulator's own per-request tokens, so only what the workload shares is shared.
SYSTEM_TOKEN_BASE = 1 << 40
USER_TOKEN_BASE = 1 << 41


@dataclass(frozen=True)
class ConversationSpec:
    """How rows of lengths become conversations (their lengths come from the pool)."""

    mean_turns: float = 4.0  # turns per conversation, 1 + geometric
    # the user's pause between an answer and the next turn; short, so that a probe of a minute sees the
    # later turns of its conversations (a longer one matters once the KV cache evicts histories)
    think_s: float = 2.0
    num_system_prompts: int = 0  # shared system prompts (0: none); a new conversation draws one
    system_len: int = 0  # tokens of each system prompt
    seed: int = 0  # turn counts and system prompts drawn from it

    def __post_init__(self) -> None:
        if not (self.mean_turns >= 1 and math.isfinite(self.mean_turns)):
            raise ValueError(f"mean_turns must be finite and >= 1, got {self.mean_turns!r}")
        if not (self.think_s >= 0 and math.isfinite(self.think_s)):
            raise ValueError(f"think_s must be finite and >= 0, got {self.think_s!r}")
        if self.num_system_prompts < 0 or self.system_len < 0 or (self.system_len > 0) != (
                self.num_system_prompts > 0):
            raise ValueError("num_system_prompts and system_len must both be 0 or both be > 0, got "
                             f"{self.num_system_prompts}, {self.system_len}")

    def draw_turns(self, rng: random.Random) -> int:
        """1 + Geometric(1 / mean_turns): a conversation goes on after each turn with 1 - 1 / mean_turns."""
        turns, go_on = 1, 1.0 - 1.0 / self.mean_turns
        while rng.random() < go_on:
            turns += 1
        return turns


class _Conversation:
    __slots__ = ("uid", "runs", "length", "turns_left", "last_rid")

    def __init__(self, uid: int, runs: list[tuple[int, int]], turns_left: int) -> None:
        self.uid = uid
        self.runs = runs  # the history the next turn re-sends
        self.length = sum(n for _, n in runs)
        self.turns_left = turns_left
        self.last_rid = ""


class _Builder:
    """Conversations over a stream of (message, answer) lengths, in the spec's seeded order."""

    def __init__(self, spec: ConversationSpec, max_model_len: int) -> None:
        if spec.system_len >= max_model_len - 1:
            raise ValueError(f"system prompts of {spec.system_len} tokens leave no room in a context of "
                             f"{max_model_len}")
        self.spec = spec
        self.max_model_len = max_model_len
        self.rng = random.Random(spec.seed)
        self.num_started = 0

    def start(self) -> _Conversation:
        spec = self.spec
        runs: list[tuple[int, int]] = []
        if spec.num_system_prompts:
            runs.append((SYSTEM_TOKEN_BASE + self.rng.randrange(spec.num_system_prompts), spec.system_len))
        conv = _Conversation(self.num_started, runs, spec.draw_turns(self.rng))
        self.num_started += 1
        return conv

    def fits(self, conv: _Conversation, row: WorkloadRequest) -> bool:
        return conv.length + row.prompt_len + row.output_len <= self.max_model_len

    def turn(self, conv: _Conversation, row: WorkloadRequest, arrival_s: float,
             first: bool) -> WorkloadRequest:
        """The conversation's next turn with the row's lengths (a first turn clipped to the context);
        its history grows by the message and the answer."""
        message, answer = row.prompt_len, row.output_len
        if first:
            message = min(message, self.max_model_len - 1 - conv.length)
            answer = max(1, min(answer, self.max_model_len - conv.length - message))
        conv.runs.append((USER_TOKEN_BASE + conv.uid, message))
        req = WorkloadRequest(arrival_s, conv.length + message, answer, content=tuple(conv.runs))
        conv.runs.append((SIM_TOKEN, answer))
        conv.length += message + answer
        conv.turns_left -= 1
        return req


def conversation_requests(rows: Sequence[WorkloadRequest], spec: ConversationSpec,
                          max_model_len: int) -> list[WorkloadRequest]:
    """The rows as conversations laid end to end (each conversation's turns in a row, all arriving at 0):
    the prompts the workload sends, for estimates that read lengths (memory, the SLO's budget)."""
    build = _Builder(spec, max_model_len)
    out: list[WorkloadRequest] = []
    conv: _Conversation | None = None
    for row in rows:
        first = conv is None or conv.turns_left <= 0 or not build.fits(conv, row)
        if first:
            conv = build.start()
        assert conv is not None
        out.append(build.turn(conv, row, 0.0, first))
    return out


class ConversationArrivals:
    """`n` Poisson arrivals at `rate` whose request i has row i's lengths (the pool cycled) and is a turn
    of the conversation chosen when it arrives (the module's docstring says how). `request` must be
    called in order, each with the finish times the simulation knows by then."""

    def __init__(self, rows: Sequence[WorkloadRequest], n: int, rate: float, spec: ConversationSpec,
                 max_model_len: int, seed: int = 0) -> None:
        if not rows:
            raise ValueError("conversations need at least one row of lengths")
        self.times_ns = [round(t * 1e9) for t in poisson_arrivals(n, rate, seed)]
        self.rows = [rows[i % len(rows)] for i in range(n)]
        self.output_lens = [r.output_len for r in self.rows]  # the answers, known before any is routed
        self.spec = spec
        self._build = _Builder(spec, max_model_len)
        self._active: list[_Conversation] = []  # conversations with turns left, oldest first
        self._next = 0
        self.num_continued = 0  # arrivals that continued a conversation (the rest opened one)

    def __len__(self) -> int:
        return len(self.times_ns)

    def arrival_ns(self, i: int) -> int:
        return self.times_ns[i]

    def request(self, i: int, finished_ns: Callable[[str], int | None]) -> tuple[int, WorkloadRequest]:
        """Request i (its id is `r{i}`): the next turn of the conversation whose last answer finished
        longest ago, at least think_s before it arrives; else the first turn of a new one."""
        if i != self._next:
            raise ValueError(f"requests must be taken in order: {self._next} is next, got {i}")
        self._next += 1
        now, row = self.times_ns[i], self.rows[i]
        think = round(self.spec.think_s * 1e9)
        best: _Conversation | None = None
        best_ready = 0
        for conv in self._active:
            done = finished_ns(conv.last_rid)
            if done is None or done + think > now:
                continue
            if not self._build.fits(conv, row):
                conv.turns_left = 0  # its next turn would not fit the context: it ends here
                continue
            if best is None or done + think < best_ready:
                best, best_ready = conv, done + think
        self._active = [c for c in self._active if c.turns_left > 0]
        first = best is None
        conv = self._build.start() if best is None else best
        if first:
            self._active.append(conv)
        else:
            self.num_continued += 1
        req = self._build.turn(conv, row, now * 1e-9, first)
        conv.last_rid = f"r{i}"
        if conv.turns_left <= 0:
            self._active.remove(conv)
        return i, req
