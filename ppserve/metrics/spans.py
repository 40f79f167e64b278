"""Span records: what one stage (one tp rank) did and when, plus clock alignment and JSONL storage.

A span is the raw fact every other metric is derived from (ARCHITECTURE.md#measuring-bubbles). Workers
record them with a `SpanRecorder`; the engine shifts each worker's spans onto its own clock with
`estimate_offset` / `shift`, and keeps them as JSON lines. The engine also reports *work intervals*: half-open
`(start_ns, end_ns)` ranges during which some request was waiting or in flight. Spans plus work
intervals are the whole input of the bubble math in `ppserve.metrics.bubbles`.

Pure Python, stdlib only: no torch, ray or grpc here.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KINDS",
    "BUSY_KINDS",
    "ENGINE_STAGE",
    "Span",
    "SpanRecorder",
    "NULL_RECORDER",
    "WorkInterval",
    "WorkTracker",
    "shift",
    "estimate_offset",
    "write_jsonl",
    "read_jsonl",
    "read_work_intervals",
]

# What a span can say. `schedule` lives on the engine track (stage == ENGINE_STAGE).
# `prepare` is a stage building a microbatch's inputs (its diff applied, tensors made) before its
# hidden states arrive: work of the stage, kept out of `compute` so that compute stays the span from
# the stage's inputs being complete to its outputs (what per-request bubbles measure between stages).
# `grammar_mask` is the last stage filling its structured outputs' token masks, inside its `prepare`
# (busy through that span already, so not a busy kind of its own).
KINDS: frozenset[str] = frozenset({"recv_wait", "prepare", "compute", "send", "schedule", "grammar_mask"})
# Kinds that make a stage busy: waiting for input is idleness, which is exactly what a bubble is.
BUSY_KINDS: frozenset[str] = frozenset({"prepare", "compute", "send"})
# The stage number of the engine / scheduler track.
ENGINE_STAGE = -1

# Half-open [start_ns, end_ns) on the engine clock during which the engine had work.
WorkInterval = tuple[int, int]

_TAG_NAMES = ("num_prefill_tokens", "num_decode_tokens", "request_ids", "num_draft_tokens")


@dataclass(frozen=True)
class Span:
    """One timed activity of one (stage, tp rank) for one microbatch; times in engine-clock ns.

    A speculated microbatch's spans carry its draft tokens (compute and the engine's schedule span); the
    schedule span also the drafts accepted, once its result is back (None before, or without drafts).
    `to_dict` writes each only when set, so other spans' dicts stay as they were.
    """

    kind: str
    start_ns: int
    end_ns: int
    stage: int
    tp_rank: int
    step_id: int
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    request_ids: tuple[str, ...] = ()
    num_draft_tokens: int = 0
    num_accepted_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"span kind {self.kind!r} is not one of {sorted(KINDS)}")
        if self.end_ns < self.start_ns:
            raise ValueError(f"span end_ns={self.end_ns} is before start_ns={self.start_ns}")
        # Accept lists (e.g. from JSON) but store a tuple so the span stays hashable and immutable.
        if not isinstance(self.request_ids, tuple):
            object.__setattr__(self, "request_ids", tuple(self.request_ids))

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of builtins; `from_dict` inverts it exactly."""
        d: dict[str, Any] = {
            "kind": self.kind,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "stage": self.stage,
            "tp_rank": self.tp_rank,
            "step_id": self.step_id,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "request_ids": list(self.request_ids),
        }
        if self.num_draft_tokens:
            d["num_draft_tokens"] = self.num_draft_tokens
        if self.num_accepted_tokens is not None:
            d["num_accepted_tokens"] = self.num_accepted_tokens
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        return cls(
            kind=str(d["kind"]),
            start_ns=int(d["start_ns"]),
            end_ns=int(d["end_ns"]),
            stage=int(d["stage"]),
            tp_rank=int(d["tp_rank"]),
            step_id=int(d["step_id"]),
            num_prefill_tokens=int(d.get("num_prefill_tokens", 0)),
            num_decode_tokens=int(d.get("num_decode_tokens", 0)),
            request_ids=tuple(str(r) for r in d.get("request_ids", ())),
            num_draft_tokens=int(d.get("num_draft_tokens", 0)),
            num_accepted_tokens=None if d.get("num_accepted_tokens") is None
            else int(d["num_accepted_tokens"]),
        )


class SpanRecorder:
    """Collects the spans of one process (one stage, one tp rank).

    With `enabled=False`, `record` returns at once and `span` hands back a shared null context, so
    a disabled recorder can stay on the hot path. No global state: each worker owns its recorder.
    """

    def __init__(
        self,
        stage: int,
        tp_rank: int,
        enabled: bool = True,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.stage = stage
        self.tp_rank = tp_rank
        self.enabled = enabled
        self.clock = clock
        self._spans: list[Span] = []

    def span(self, kind: str, step_id: int, **tags: Any) -> AbstractContextManager[None]:
        """Time the body of a `with` block as one span; tags are Span's optional fields."""
        if not self.enabled:
            return _NULL_CONTEXT
        return self._timed(kind, step_id, tags)

    @contextmanager
    def _timed(self, kind: str, step_id: int, tags: dict[str, Any]) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            # Recorded even if the body raised: a failed step still occupied the stage.
            self.record(kind, start, self.clock(), step_id, **tags)

    def record(self, kind: str, start_ns: int, end_ns: int, step_id: int, **tags: Any) -> None:
        """Record a span whose times were taken elsewhere (e.g. CUDA events after a sync)."""
        if not self.enabled:
            return
        unknown = set(tags) - set(_TAG_NAMES)
        if unknown:
            raise ValueError(f"unknown span tags {sorted(unknown)}; allowed: {list(_TAG_NAMES)}")
        self._spans.append(Span(kind, int(start_ns), int(end_ns), self.stage, self.tp_rank, step_id, **tags))

    def drain(self) -> list[Span]:
        """Return the spans recorded so far and forget them (so each is shipped once)."""
        spans, self._spans = self._spans, []
        return spans

    def __len__(self) -> int:
        return len(self._spans)


_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()

# The default recorder: disabled, so code can always call it. Not a singleton store: it records nothing.
NULL_RECORDER = SpanRecorder(stage=ENGINE_STAGE, tp_rank=0, enabled=False)


class WorkTracker:
    """Turns the engine's "do I have work now?" observations into work intervals.

    The engine calls `update(has_work, now_ns)` whenever the answer may have changed (a request
    arrived, a microbatch returned, a request finished); intervals open on False->True and close on
    True->False.
    """

    def __init__(self) -> None:
        self._closed: list[WorkInterval] = []
        self._open_since: int | None = None

    def update(self, has_work: bool, now_ns: int) -> None:
        if has_work and self._open_since is None:
            self._open_since = now_ns
        elif not has_work and self._open_since is not None:
            if now_ns > self._open_since:
                self._closed.append((self._open_since, now_ns))
            self._open_since = None

    def intervals(self, now_ns: int | None = None, since_ns: int | None = None) -> list[WorkInterval]:
        """Closed intervals (only those ending after `since_ns` when given), plus the open one cut at
        `now_ns` when given. Closed intervals are appended in time order, so `since_ns` is a bisection:
        the stats window reads its last seconds without copying the whole history."""
        first = 0 if since_ns is None else bisect.bisect_right(self._closed, since_ns, key=lambda iv: iv[1])
        out = self._closed[first:]
        if self._open_since is not None and now_ns is not None and now_ns > self._open_since:
            out.append((self._open_since, now_ns))
        return out


def shift(spans: Iterable[Span], offset_ns: int) -> list[Span]:
    """Move spans onto another clock: add `offset_ns` to both ends of each."""
    return [
        Span(
            s.kind,
            s.start_ns + offset_ns,
            s.end_ns + offset_ns,
            s.stage,
            s.tp_rank,
            s.step_id,
            s.num_prefill_tokens,
            s.num_decode_tokens,
            s.request_ids,
        )
        for s in spans
    ]


def estimate_offset(samples: list[tuple[int, int, int]]) -> int:
    """Offset to add to a remote clock's readings to put them on the engine's clock.

    Each sample is one ping: (engine time when sent, remote clock reading, engine time when the
    answer came back). The fastest round trip bounds the error best (its one-way delays are
    smallest), so we assume the remote read its clock at that trip's midpoint.
    """
    if not samples:
        raise ValueError("estimate_offset needs at least one (send, remote, recv) sample")
    for send, _, recv in samples:
        if recv < send:
            raise ValueError(f"ping answered before it was sent: send={send} recv={recv}")
    send, remote, recv = min(samples, key=lambda s: s[2] - s[0])
    return (send + recv) // 2 - remote


def write_jsonl(
    path: str | os.PathLike[str],
    spans: Iterable[Span],
    work_intervals: Iterable[WorkInterval] = (),
) -> None:
    """Write spans (one JSON object per line), then work intervals as `{"work": [start, end]}` lines."""
    with open(path, "w", encoding="utf-8") as f:
        for s in spans:
            f.write(json.dumps(s.to_dict(), separators=(",", ":")) + "\n")
        for start, end in work_intervals:
            f.write(json.dumps({"work": [int(start), int(end)]}) + "\n")


def _read_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def read_jsonl(path: str | os.PathLike[str]) -> list[Span]:
    """The spans of a file written by `write_jsonl` (work-interval lines are skipped)."""
    return [Span.from_dict(r) for r in _read_records(path) if "work" not in r]


def read_work_intervals(path: str | os.PathLike[str]) -> list[WorkInterval]:
    """The work intervals of a file written by `write_jsonl`."""
    return [(int(r["work"][0]), int(r["work"][1])) for r in _read_records(path) if "work" in r]
