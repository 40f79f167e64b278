"""One step's seconds on every stage, gathered down the pipeline with the hidden states.

A row is a step id and that step's seconds on each stage so far. Stage 0 starts a row for every step
its timer has read (worker/step_timer.py); each later stage adds its own time for the same step once
its timer has read it, and the last stage hands the full row to the engine in its StepResult
(`timed_step_id`, `stage_seconds`), which pairs it with that step's composition (engine/core.py).
Timers read their events late, and not at the same step on every stage, so a row waits on a stage
until that stage's time for its step is there. One row at most travels with each microbatch, the
oldest first. Rows start one per step and leave one per step, so a lag, once the device fell behind
by it, stays; it is bounded by how far the device can fall behind: the engine holds at most p
microbatches in flight and a later stage waits for its input, so a stage's steps older than p are done
(in one process, the staging buffers' reuse bounds it the same way, worker/staging.py).

Only TP rank 0 of a stage holds the links, so only it relays. Its time is the stage's: a TP stage
ends in a collective (the last layer's all-reduce, the last stage's logits gather) that completes on
rank 0 only when the slowest rank reaches it, and starts on input that rank 0 broadcast, so rank 0's
span already covers its slowest rank's; no extra all-reduce of the times per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.worker.step_timer import StepTimer

NO_ROW = -1.0  # the step-id slot of a link message that carries no row
MAX_WAITING = 64  # rows held on a stage (or own times held for rows to come): a bug long before this


@dataclass(frozen=True)
class TimeRow:
    step_id: int
    seconds: tuple[float, ...]  # one per stage so far, in stage order


def wire(row: TimeRow | None, num_stages_before: int) -> tuple[float, ...]:
    """A row as the float64 values that cross a link: the step id, then one time per stage before the
    receiver; (NO_ROW, 0, ...) when none travels. Its length is fixed by the receiver's stage index."""
    if row is None:
        return (NO_ROW,) + (0.0,) * num_stages_before
    if len(row.seconds) != num_stages_before:
        raise ValueError(f"a row of {len(row.seconds)} stage times for a link after {num_stages_before} "
                         "stages")
    return (float(row.step_id), *row.seconds)


def wire_length(num_stages_before: int) -> int:
    return 1 + num_stages_before


def unwire(values: tuple[float, ...]) -> TimeRow | None:
    if not values:
        raise ValueError("a link message without its step-id slot")
    if values[0] == NO_ROW:
        return None
    return TimeRow(int(values[0]), tuple(values[1:]))


class StageTimes:
    """This stage's relay: its timer's readings joined to the rows from upstream, one row out per step."""

    def __init__(self, timer: StepTimer, first: bool, relays: bool = True) -> None:
        self.timer = timer
        self.first = first
        self.relays = relays  # False on TP ranks other than 0: they read their timer (spans) and pass nothing
        self.dropped = 0  # rows given up because this stage's time for their step never came
        self._waiting: deque[TimeRow] = deque()  # rows (from upstream, or started here) not yet sent on
        self._own: dict[int, float] = {}  # this stage's read times that no row has asked for yet

    def relay(self, upstream: Sequence[TimeRow] = ()) -> TimeRow | None:
        """After this stage's step: the row to send on (or to report, on the last stage), if one is complete.
        `upstream`: the rows that reached this stage since its last step (none, one, or a few at once
        where the link hands them over late)."""
        for t in self.timer.take():
            if not self.relays:
                continue
            if self.first:
                self._waiting.append(TimeRow(t.step_id, (t.seconds,)))
            else:
                self._own[t.step_id] = t.seconds
        if not self.relays:
            return None
        if upstream:
            if self.first:
                raise ValueError("the first stage has no upstream rows")
            self._waiting.extend(upstream)
        self._bound()
        return self._waiting.popleft() if self.first and self._waiting else self._complete()

    def _complete(self) -> TimeRow | None:
        while self._waiting:
            head = self._waiting[0]
            own = self._own.pop(head.step_id, None)
            if own is not None:
                self._waiting.popleft()
                for sid in [s for s in self._own if s < head.step_id]:
                    del self._own[sid]  # steps upstream never timed: no row will ask for them
                return TimeRow(head.step_id, head.seconds + (own,))
            if not any(s > head.step_id for s in self._own):
                return None  # not read yet: a later step sends it on
            # This stage read a later step but never this one (its step failed here): the row cannot complete.
            self._waiting.popleft()
            self.dropped += 1
        return None

    def _bound(self) -> None:
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popleft()
            self.dropped += 1
        while len(self._own) > MAX_WAITING:
            del self._own[min(self._own)]
