"""Serving latency metrics from per-request timelines: TTFT, TBT, TPOT, scheduling delay
(ARCHITECTURE.md#serving-metrics).

Definitions follow Sarathi-Serve and Vidur:
- TTFT: arrival to first output token.
- TBT: each gap between consecutive output tokens of a request; percentiles pool the gaps of all
  requests (so long outputs weigh more, as a user streaming tokens experiences it).
- TPOT: (last token time - first token time) / (output tokens - 1), one value per request.
- Scheduling delay: arrival to first time the scheduler put the request into a microbatch.

Pure Python; times are seconds on one clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestTiming", "percentile", "stats", "summarize"]


@dataclass(frozen=True)
class RequestTiming:
    """When one request arrived, was first scheduled, and produced each output token (seconds)."""

    arrival_s: float
    first_scheduled_s: float | None
    token_times_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    @property
    def tbt_gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) >= 2 else None

    @property
    def scheduling_delay_s(self) -> float | None:
        if self.first_scheduled_s is None:
            return None
        return self.first_scheduled_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return self.token_times_s[-1] - self.arrival_s if self.token_times_s else None


def lifetimes_ns(timings: Iterable[RequestTiming], offset_s: float = 0.0) -> list[tuple[int, int]]:
    """Each request's time in the system, arrival to last token, in integer ns on a span clock that reads
    the timings' clock minus `offset_s`; requests with no token are left out."""
    return [(round((t.arrival_s - offset_s) * 1e9), round((t.token_times_s[-1] - offset_s) * 1e9))
            for t in timings if t.token_times_s]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between closest ranks.

    With the n values sorted as v[0..n-1], the percentile sits at fractional rank
    r = q/100 * (n-1) and is v[floor(r)] + (r - floor(r)) * (v[ceil(r)] - v[floor(r)]) — numpy's
    default ("linear") method, so figures agree with numpy-based tools.
    """
    v = sorted(values)
    if not v:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is outside [0, 100]")
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(v) - 1)
    frac = rank - lo
    if frac == 0:
        return float(v[lo])
    return v[lo] + frac * (v[hi] - v[lo])


def stats(values: Sequence[float]) -> dict[str, Any]:
    """count / mean / p50 / p90 / p99 / max of `values`; figures are None when there are none."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(values),
        "mean": math.fsum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": float(max(values)),
    }


def summarize(timings: Iterable[RequestTiming]) -> dict[str, Any]:
    """Percentiles and means of each metric over a set of requests (seconds).

    Requests without output tokens contribute only a scheduling delay; requests with a single token
    have no TBT gap and no TPOT.
    """
    ts = list(timings)

    def present(xs: Iterable[float | None]) -> list[float]:
        return [x for x in xs if x is not None]

    return {
        "num_requests": len(ts),
        "num_output_tokens": sum(len(t.token_times_s) for t in ts),
        "ttft_s": stats(present(t.ttft_s for t in ts)),
        "tbt_s": stats([g for t in ts for g in t.tbt_gaps_s]),
        "tpot_s": stats(present(t.tpot_s for t in ts)),
        "scheduling_delay_s": stats(present(t.scheduling_delay_s for t in ts)),
        "e2e_s": stats(present(t.e2e_s for t in ts)),
    }
