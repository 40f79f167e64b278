"""When the token ring's extra microbatch is formed: just before stage 0 needs it, not when a slot frees.

With the token ring (`scheduler.token_ring`, sched/token_ring.py) the engine keeps p + 1 microbatches
in flight. The extra one's decodes take the tokens of the oldest in-flight microbatch from the last stage,
so it could be formed as soon as the oldest before that returns. But it would then wait at stage 0
behind the microbatch ahead of it for about one stage time, and a prompt arriving in that time would miss
it and join the one after: a step more of TTFT where prompts arrive among decodes
(docs/decisions.md#token-ring).

`RingClock` predicts when stage 0 will have finished the work in flight ahead of the next microbatch, so
the engine forms it ahead of then by the dispatch's latency (the caller's) plus `margin_s`, for the
prediction's error, and whatever arrived meanwhile rides in it. Stage 0 runs the in-flight microbatches in
order; one starts once the one before it is done, it was formed, and, if it takes ring decodes, their source
came back (the ring message reaches stage 0 about when the result reaches the engine). Each runs its predicted
stage-0 time (the scheduler's online step cost). Where a time is unknown (no prediction yet, or a source still
in flight) the answer is None: form now, as without the clock. Errors fall on the safe side as far as they
can: a microbatch's dispatch latency is left out of its start, which makes the answer early, not late. Pure
Python, like the rest of the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppserve.sched.output import SchedulerOutput

__all__ = ["RingClock"]


class RingClock:
    """Formation and return times of recent microbatches, and the predicted time stage 0 frees."""

    def __init__(self, margin_s: float, window: int) -> None:
        if not margin_s >= 0:
            raise ValueError(f"the ring's margin must be >= 0 seconds, got {margin_s!r}")
        self.margin_s = margin_s
        self.window = window  # returned steps kept: a ring source is at most this many steps back
        self._formed: dict[int, tuple[float, float | None]] = {}  # step id -> (formed at, stage-0 seconds)
        self._returned: dict[int, float] = {}  # step id -> when its result came back

    def formed(self, step_id: int, at_s: float, stage0_s: float | None) -> None:
        self._formed[step_id] = (at_s, stage0_s)

    def returned(self, step_id: int, at_s: float) -> None:
        self._formed.pop(step_id, None)
        self._returned[step_id] = at_s
        for old in [s for s in self._returned if s <= step_id - self.window]:
            del self._returned[old]

    def forget(self) -> None:
        """Drop every record (the in-flight microbatches were abandoned: a pipeline rebuild)."""
        self._formed.clear()
        self._returned.clear()

    def stage0_free_s(self, in_flight: Sequence[SchedulerOutput]) -> float | None:
        """When stage 0 is predicted to finish every microbatch in flight, or None where unknown."""
        free = float("-inf")
        for out in in_flight:
            ready, seconds = self._formed.get(out.step_id, (0.0, None))
            if seconds is None:
                return None
            if out.ring_step_id is not None:
                back = self._returned.get(out.ring_step_id)
                if back is None:  # its decodes' tokens are still on their way round
                    return None
                ready = max(ready, back)
            free = max(free, ready) + seconds
        return free if in_flight else None

    def due_s(self, in_flight: Sequence[SchedulerOutput]) -> float | None:
        """When the next microbatch must reach stage 0: `margin_s` before it frees; None: now."""
        free = self.stage0_free_s(in_flight)
        return None if free is None else free - self.margin_s
