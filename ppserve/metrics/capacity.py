"""Capacity under an SLO (the Sarathi-Serve protocol, ARCHITECTURE.md#serving-metrics): the highest Poisson
request rate at which p99 TBT <= a target and median scheduling delay <= 2 s, found by search over the
rate on a fixed trace.

Pure Python: `find_capacity` only needs `evaluate(rate) -> Probe`, so the same search runs on the real
pipeline (`ppserve bench capacity`), on the simulator (`ppserve bench capacity --on sim`, `ppserve plan`),
and in unit tests on a fake latency function. The search brackets first (multiplying the rate by
`growth` while it passes, dividing while it fails), then bisects the bracket until it is narrower than
`rel_tol` or the evaluation budget is spent. Probes already made on the same evaluation (`prior`) seed
the bracket, so a coarse search can be refined later without repeating a rate. It assumes the SLO is
monotone in the rate (it is, up to measurement noise: more load never lowers latency on average).
Every caller sizes its probes by `ProbeSize` (a fixed duration of arrivals, not a fixed count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SLO", "Probe", "ProbeSize", "CapacityResult", "probe_from_summary", "find_capacity"]


@dataclass(frozen=True)
class SLO:
    tbt_p99_s: float  # p99 time between tokens must not exceed this
    sched_delay_p50_s: float = 2.0  # median scheduling delay (arrival to first schedule) must not exceed this
    ttft_p90_s: float | None = None  # p90 time to first token must not exceed this (None: not checked)

    def __post_init__(self) -> None:
        if (self.tbt_p99_s <= 0 or self.sched_delay_p50_s <= 0
                or (self.ttft_p90_s is not None and self.ttft_p90_s <= 0)):
            raise ValueError(f"SLO limits must be > 0, got {self}")


@dataclass(frozen=True)
class ProbeSize:
    """How many requests one probe at a rate replays: `duration_s` seconds of its arrivals (rate x
    duration), at least `min_requests`, at most `max_requests`.

    A fixed duration, not a fixed count, is what makes an overloaded rate fail. A fixed count of n
    requests arrives in n / rate seconds: at a high rate that is a short burst, which fits in the free
    seats (max_num_seqs) and is served without a queue, so every rate "passes". Over D seconds an overload
    of x % delays the median request by about x % of D / 2 once the seats are full, past the 2 s limit once
    x > 4 / D (7 % at 60 s)."""

    duration_s: float = 60.0
    min_requests: int = 50
    max_requests: int = 20_000

    def __post_init__(self) -> None:
        if not (self.duration_s > 0 and 1 <= self.min_requests <= self.max_requests):
            raise ValueError("a probe needs duration_s > 0 and 1 <= min_requests <= max_requests, "
                             f"got {self}")

    def wanted(self, rate: float) -> int:
        """Requests the duration asks for at `rate` (before the cap)."""
        return max(self.min_requests, math.ceil(rate * self.duration_s))

    def requests_at(self, rate: float) -> int:
        """Requests a probe at `rate` replays (fewer than `wanted` when the cap cuts it short)."""
        return min(self.wanted(rate), self.max_requests)


@dataclass(frozen=True)
class Probe:
    """One evaluated rate."""

    rate: float
    ok: bool
    tbt_p99_s: float | None = None
    sched_delay_p50_s: float | None = None
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe_from_summary(rate: float, summary: dict[str, Any], slo: SLO) -> Probe:
    """Judge a run summary (`harness.summarize_run` shape) against the SLO."""
    lat = summary["latency"]
    tbt = lat["tbt_s"]["p99"]
    delay = lat["scheduling_delay_s"]["p50"]
    reasons = []
    if summary.get("aborted"):
        reasons.append("run hit its time limit")
    if tbt is None:
        reasons.append("no TBT gaps")
    elif tbt > slo.tbt_p99_s:
        reasons.append(f"p99 TBT {tbt:.4g} s > {slo.tbt_p99_s:.4g} s")
    if delay is None:
        reasons.append("no scheduling delays")
    elif delay > slo.sched_delay_p50_s:
        reasons.append(f"median scheduling delay {delay:.4g} s > {slo.sched_delay_p50_s:.4g} s")
    ttft = lat.get("ttft_s", {}).get("p90")
    if slo.ttft_p90_s is not None and (ttft is None or ttft > slo.ttft_p90_s):
        reasons.append("no first tokens" if ttft is None
                       else f"p90 TTFT {ttft:.4g} s > {slo.ttft_p90_s:.4g} s")
    extra = {"output_tokens_per_s": summary.get("throughput", {}).get("output_tokens_per_s"),
             "ttft_p90_s": ttft}
    return Probe(rate, not reasons, tbt, delay, "; ".join(reasons) or "meets SLO", extra)


@dataclass
class CapacityResult:
    capacity: float | None  # highest passing rate found; None when even min_rate fails
    bracket: tuple[float | None, float | None]  # (highest pass, lowest fail)
    probes: list[Probe]
    saturated: bool = False  # every rate up to max_rate passed: capacity is at least max_rate

    def to_dict(self) -> dict[str, Any]:
        return {"capacity": self.capacity, "bracket": list(self.bracket), "saturated": self.saturated,
                "probes": [p.to_dict() for p in self.probes]}


def find_capacity(
    evaluate: Callable[[float], Probe],
    start_rate: float,
    *,
    max_evals: int = 8,
    rel_tol: float = 0.05,
    min_rate: float = 1e-3,
    max_rate: float = 1e6,
    on_probe: Callable[[Probe], None] | None = None,
    growth: float = 2.0,
    prior: Sequence[Probe] = (),
) -> CapacityResult:
    """Search for the highest rate that `evaluate` passes (see the module docstring).

    `max_evals` counts new evaluations only; the prior probes are free and come first in the result."""
    if not 0 < min_rate <= start_rate <= max_rate:
        raise ValueError("need 0 < min_rate <= start_rate <= max_rate, "
                         f"got {min_rate}, {start_rate}, {max_rate}")
    if max_evals < 1 or rel_tol <= 0 or growth <= 1:
        raise ValueError("need max_evals >= 1, rel_tol > 0 and growth > 1, "
                         f"got {max_evals}, {rel_tol}, {growth}")
    probes: list[Probe] = list(prior)
    cache: dict[float, Probe] = {p.rate: p for p in prior}
    budget = len(probes) + max_evals

    def run(rate: float) -> Probe:
        if rate not in cache:
            p = evaluate(rate)
            cache[rate] = p
            probes.append(p)
            if on_probe is not None:
                on_probe(p)
        return cache[rate]

    # The highest passing rate and the lowest failing one above it (a fail below a pass is noise).
    lo = max((p.rate for p in prior if p.ok), default=None)
    hi = min((p.rate for p in prior if not p.ok and (lo is None or p.rate > lo)), default=None)
    rate = start_rate
    if lo is not None and hi is None:
        rate = min(lo * growth, max_rate)
    elif lo is None and hi is not None:
        rate = max(hi / growth, min_rate)
    # Bracket.
    while (lo is None or hi is None) and len(probes) < budget:
        if run(rate).ok:
            lo = rate
            if hi is not None or rate >= max_rate:
                break
            rate = min(rate * growth, max_rate)
        else:
            hi = rate
            if lo is not None or rate <= min_rate:
                break
            rate = max(rate / growth, min_rate)
    # Bisect.
    while lo is not None and hi is not None and len(probes) < budget and (hi - lo) > rel_tol * lo:
        mid = (lo + hi) / 2
        if run(mid).ok:
            lo = mid
        else:
            hi = mid
    saturated = lo is not None and lo >= max_rate
    return CapacityResult(lo, (lo, hi), probes, saturated)
