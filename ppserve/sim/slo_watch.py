"""Stop a simulated run once it is certain to fail its SLO (`SimConfig.stop_on_slo_fail`).

A capacity search (`ppserve plan`, `metrics.capacity.find_capacity`) probes rates above the capacity
on purpose, and there a simulated run is at its most expensive: the queue grows for the whole arrival
window, then drains for as long again, every step carrying a full decode batch. Its verdict is often
certain long before: once more than half of all the run's requests have waited longer than the
scheduling-delay SLO, the median is over it whatever the rest do, and likewise for the TBT gaps
against the p99 SLO. This watch counts those certainties as the run goes; it never guesses, so a run it
stops would have failed had it gone on (and a run that passes is never stopped).
Why the counts are certain, with the percentile `metrics.latency.percentile` computes (linear between
closest ranks): of n sorted values the q-th percentile is at least v[floor(q/100 (n-1))], which is over
a threshold X as soon as n - floor(q/100 (n-1)) of the values are. That count never falls as n grows,
so the largest n the run could reach (every request of the workload admitted; every output token but
the first making a gap) gives a count that holds whatever n turns out to be.
- A request first scheduled `d` after it arrived has delay d for good; one still waiting at time t has
  a delay of at least t - arrival when it is scheduled.
- A TBT gap is fixed once the token after it exists. Simulated requests run to their output length
  (ignore_eos), and one step's tokens of a request come at one time, so gaps are between updates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ppserve.request import Request

__all__ = ["SloStop", "SloWatch", "over_count_for_certain_fail"]


def over_count_for_certain_fail(n: int, q: float) -> int:
    """How many of `n` values must exceed X for their q-th percentile to exceed X, whatever the rest are."""
    return n - math.floor(q / 100 * (n - 1))


@dataclass(frozen=True)
class SloStop:
    """The SLO a simulated run may stop on: TBT p99 and median scheduling delay (seconds; None: not
    watched)."""

    tbt_p99_s: float | None = None
    sched_delay_p50_s: float | None = None
    check_every: int = 64  # steps between checks of the waiting requests (the TBT count is kept per token)

    def __post_init__(self) -> None:
        for name in ("tbt_p99_s", "sched_delay_p50_s"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {self.check_every!r}")


class SloWatch:
    """Counts, as a simulated run goes, the gaps and delays that are over the SLO for good."""

    def __init__(self, stop: SloStop, output_lens: Sequence[int]) -> None:
        self.stop = stop
        n = len(output_lens)
        gaps = sum(max(0, k - 1) for k in output_lens)
        self.delays_needed = over_count_for_certain_fail(n, 50) if n else None
        self.gaps_needed = over_count_for_certain_fail(gaps, 99) if gaps else None
        self.gaps_over = 0
        self.delays_over = 0  # of requests already scheduled
        self._last_token_s: dict[str, float] = {}
        self._unscheduled: dict[str, Request] = {}  # admitted, not yet scheduled when last looked
        self._steps = 0

    def admitted(self, req: Request) -> None:
        self._unscheduled[req.request_id] = req

    def tokens(self, request_id: str, now_s: float) -> None:
        """A step gave `request_id` its next token(s) at `now_s`."""
        last = self._last_token_s.get(request_id)
        if last is not None and self.stop.tbt_p99_s is not None and now_s - last > self.stop.tbt_p99_s:
            self.gaps_over += 1
        self._last_token_s[request_id] = now_s

    def step(self, now_s: float) -> str | None:
        """After each step: why the run fails for certain, or None (checked every `check_every` steps)."""
        self._steps += 1
        if self._steps % self.stop.check_every:
            return None
        return self.verdict(now_s)

    def verdict(self, now_s: float) -> str | None:
        stop = self.stop
        if stop.tbt_p99_s is not None and self.gaps_needed is not None and self.gaps_over >= self.gaps_needed:
            return self.judge(self.gaps_over, 0, now_s)
        if stop.sched_delay_p50_s is None or self.delays_needed is None:
            return None
        return self.judge(self.gaps_over, self.delays_over_at(now_s), now_s)

    def delays_over_at(self, now_s: float) -> int:
        """Requests whose scheduling delay is over the SLO for good at `now_s` (this run's clock): those
        scheduled late, and those still waiting past it."""
        limit = self.stop.sched_delay_p50_s
        if limit is None:
            return 0
        waiting_over = 0
        for rid, req in list(self._unscheduled.items()):
            if req.first_scheduled_time is not None:
                del self._unscheduled[rid]
                if req.first_scheduled_time - req.arrival_time > limit:
                    self.delays_over += 1
            elif now_s - req.arrival_time > limit:
                waiting_over += 1
        return self.delays_over + waiting_over

    def judge(self, gaps_over: int, delays_over: int, now_s: float) -> str | None:
        """Why counts this large fail the SLO for certain, or None. Several replicas' watches judge their
        summed counts with one of them (sim/replicas.py): the thresholds are the whole workload's."""
        stop = self.stop
        if stop.tbt_p99_s is not None and self.gaps_needed is not None and gaps_over >= self.gaps_needed:
            return (f"p99 TBT over {stop.tbt_p99_s:.4g} s for certain: {gaps_over} gaps over it, "
                    f"{self.gaps_needed} settle it (stopped at {now_s:.4g} s simulated)")
        limit = stop.sched_delay_p50_s
        if limit is not None and self.delays_needed is not None and delays_over >= self.delays_needed:
            return (f"median scheduling delay over {limit:.4g} s for certain: "
                    f"{delays_over} requests waited longer, {self.delays_needed} settle "
                    f"it (stopped at {now_s:.4g} s simulated)")
        return None
