"""N replicas behind a router: each replica is simulated exactly as one is (`SimRun`: its own pipeline,
scheduler and prefix-caching block manager), and a routing policy from ppserve.route places every
request when it arrives, from the replicas' loads at that simulated time and the request's prefix keys.

Why the replicas run in lockstep threads: a replica's engine takes in arrivals inside its step loop
(`EngineCore.fill`), at times only the loop knows, and the request arriving there must already be
routed, which needs every other replica's state at its arrival. So each replica's loop runs in a thread
that pauses at an intake that is due an unrouted arrival (or when idle); the router routes the next
arrival once every replica has paused at or past it, and resumes them. One thread runs at a time, in a
fixed order, so a run is deterministic, and a replica sees the requests routed to it exactly as
`simulate` would show them to it alone: one replica is `simulate`, bit for bit.

A replica's load is what the router can count: requests routed to it and not finished by the arrival's
time. An early stop on the SLO (`SimConfig.stop_on_slo_fail`) judges the replicas' counts summed, against
the whole workload's thresholds: the merged percentiles are what the SLO is on.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppserve.request import Request
from ppserve.route import RoutingPolicy, make_policy, prefix_keys
from ppserve.sim.cost_model import CostModel
from ppserve.sim.simulator import SimConfig, SimResult, SimRun, sim_prompt
from ppserve.sim.slo_watch import SloStop, SloWatch
from ppserve.sim.workload import WorkloadRequest

__all__ = ["Arrivals", "FixedArrivals", "RoutedResult", "has_prefix_content", "simulate_replicas"]


class Arrivals(Protocol):
    """Requests in arrival order; request i may be decided only when it arrives (conversations)."""

    @property
    def output_lens(self) -> Sequence[int]:
        """Every request's output length, known up front (the SLO watch's counts)."""
        ...

    def __len__(self) -> int: ...

    def arrival_ns(self, i: int) -> int: ...

    def request(self, i: int, finished_ns: Callable[[str], int | None]) -> tuple[int, WorkloadRequest]:
        """(k, request i): the simulator names it `r{k}` and builds its prompt with `sim_prompt(k, ...)`."""
        ...


class FixedArrivals:
    """A fixed workload, in the order `simulate` takes it in (arrival, then index)."""

    def __init__(self, workload: Sequence[WorkloadRequest]) -> None:
        self._order = sorted(((round(w.arrival_s * 1e9), k, w) for k, w in enumerate(workload)),
                             key=lambda x: (x[0], x[1]))
        self.output_lens = [w.output_len for w in workload]

    def __len__(self) -> int:
        return len(self._order)

    def arrival_ns(self, i: int) -> int:
        return self._order[i][0]

    def request(self, i: int, finished_ns: Callable[[str], int | None]) -> tuple[int, WorkloadRequest]:
        return self._order[i][1], self._order[i][2]


def has_prefix_content(workload: Sequence[WorkloadRequest]) -> bool:
    """Whether any request shares a prefix with another: where routing can matter beyond load."""
    return any(w.content is not None or (w.prefix_id is not None and w.prefix_len) for w in workload)


@dataclass
class RoutedResult:
    """Each replica's run and where every request went; `merged()` is the deployment as one SimResult."""

    replicas: dict[str, SimResult]
    routed: dict[str, str]  # request id -> replica
    policy: str
    stopped_early: str | None = None
    # policy counters where it keeps them (PrefixAffinity: choices that followed a prefix, overloads)
    policy_stats: dict[str, int] = field(default_factory=dict)

    def merged(self) -> SimResult:
        """Every replica's requests as one run: latency, throughput, rejections and the prefix cache are
        the deployment's. Spans stay per replica (a bubble is one pipeline's), so the merged run has none."""
        runs = list(self.replicas.values())
        cache = {key: sum((r.prefix_cache or {}).get(key, 0) for r in runs)
                 for key in ("query_tokens", "hit_tokens", "evictions")}
        return SimResult(
            spans=[], work_intervals=[],
            timings={rid: t for r in runs for rid, t in r.timings.items()},
            num_stages=runs[0].num_stages if runs else 0,
            num_microbatches=sum(r.num_microbatches for r in runs),
            num_preemptions=sum(r.num_preemptions for r in runs),
            end_s=max((r.end_s for r in runs), default=0.0),
            rejected={rid: why for r in runs for rid, why in r.rejected.items()},
            stopped_early=self.stopped_early,
            prefix_cache=cache,
        )

    def latency(self) -> dict[str, Any]:
        return self.merged().latency()

    def throughput(self) -> dict[str, float]:
        return self.merged().throughput()

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.merged().prefix_hit_rate

    def requests_per_replica(self) -> dict[str, int]:
        counts = dict.fromkeys(self.replicas, 0)
        for name in self.routed.values():
            counts[name] += 1
        return counts

    def summary(self) -> dict[str, Any]:
        merged = self.merged()
        return {
            "policy": self.policy,
            "num_requests": merged.num_finished,
            "num_rejected": len(merged.rejected),
            "num_preemptions": merged.num_preemptions,
            "throughput": merged.throughput(),
            "latency": merged.latency(),
            "prefix_cache_hit_rate": merged.prefix_hit_rate,
            "requests_per_replica": self.requests_per_replica(),
            "policy_stats": self.policy_stats,
            "stopped_early": self.stopped_early,
            "replicas": {name: r.summary() for name, r in self.replicas.items()},
        }


class _Abort(Exception):
    """Unwinds a replica's thread when the run is abandoned (another replica failed)."""


class _SharedWatch:
    """One SLO watch over every replica: each replica's own counts (SloWatch, thresholds of the whole
    workload), judged summed every `check_every` steps of any replica."""

    def __init__(self, stop: SloStop, output_lens: Sequence[int], replicas: int) -> None:
        self.stop = stop
        self.watches = [SloWatch(stop, output_lens) for _ in range(replicas)]
        self.now_s = [0.0] * replicas  # each replica's clock at its last step
        self.steps = 0
        self.stopped: str | None = None

    def view(self, i: int) -> _WatchView:
        return _WatchView(self, i)

    def step(self, i: int, now_s: float) -> str | None:
        self.now_s[i] = now_s
        if self.stopped is not None:
            return self.stopped
        self.steps += 1
        if self.steps % self.stop.check_every:
            return None
        gaps = sum(w.gaps_over for w in self.watches)
        # A replica's waiting requests are judged at its own clock: another's may be behind.
        delays = sum(w.delays_over_at(t) for w, t in zip(self.watches, self.now_s, strict=True))
        self.stopped = self.watches[i].judge(gaps, delays, now_s)
        return self.stopped


class _WatchView:
    def __init__(self, shared: _SharedWatch, i: int) -> None:
        self.shared, self.i, self.watch = shared, i, shared.watches[i]

    def admitted(self, req: Request) -> None:
        self.watch.admitted(req)

    def tokens(self, request_id: str, now_s: float) -> None:
        self.watch.tokens(request_id, now_s)

    def step(self, now_s: float) -> str | None:
        return self.shared.step(self.i, now_s)


class _Hub:
    """What the router thread and the replica threads share; one of them runs at a time."""

    def __init__(self) -> None:
        self.back = threading.Semaphore(0)  # a replica hands control back to the router
        self.next_ns: int | None = None  # the next arrival not routed yet (None: every one is)
        self.abort = False


class _Replica:
    def __init__(self, name: str, cost: CostModel, cfg: SimConfig, hub: _Hub,
                 watch: _WatchView | None) -> None:
        self.name = name
        self.hub = hub
        self.run = SimRun(cost, cfg, watch, feed=self)
        self.go = threading.Semaphore(0)
        self.state = "running"  # "blocked" (at an intake at `at_ns`), "idle", "done"
        self.at_ns = 0
        self.num_routed = 0
        self.result: SimResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)

    # ---- in the replica's thread -----------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.result = self.run.run()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the router thread, which raises it
            self.error = e
        self.state = "done"
        self.hub.back.release()

    def _pause(self, state: str, at_ns: int) -> None:
        self.run.settle()
        self.state, self.at_ns = state, at_ns
        self.hub.back.release()
        self.go.acquire()
        if self.hub.abort:
            raise _Abort
        self.state = "running"

    def before_intake(self, now_ns: int) -> None:
        while self.hub.next_ns is not None and self.hub.next_ns <= now_ns:
            self._pause("blocked", now_ns)

    def wait_for_work(self, now_ns: int) -> bool:
        while not self.run.pending:
            if self.hub.next_ns is None:
                return False
            self._pause("idle", now_ns)
        return True

    # ---- in the router's thread ------------------------------------------------------------------
    def resume(self) -> None:
        self.go.release()
        self.hub.back.acquire()

    def start(self) -> None:
        self.thread.start()
        self.hub.back.acquire()

    def runnable_before(self, t_ns: int | None) -> bool:
        """Whether it can go on without the arrival at `t_ns` (None: every arrival is routed)."""
        if self.state == "done":
            return False
        if self.state == "idle":
            return bool(self.run.pending) or t_ns is None
        return t_ns is None or self.at_ns < t_ns

    def load_at(self, t_ns: int) -> int:
        """Requests routed here and not finished by `t_ns`."""
        return self.num_routed - bisect.bisect_right(self.run.finish_times_ns, t_ns)

    def finished_ns(self, rid: str) -> int | None:
        return self.run.finished_ns.get(rid)


def simulate_replicas(workload: Sequence[WorkloadRequest] | Arrivals, cost: CostModel | Sequence[CostModel],
                      config: SimConfig | None = None, replicas: int = 1,
                      policy: str | RoutingPolicy = "prefix", seed: int = 0) -> RoutedResult:
    """Simulate `replicas` replicas (`cost` for each, or one cost model per replica) behind `policy` (a
    name for `route.make_policy`, or a policy object) until every routed request finishes or the SLO
    watch stops the run."""
    cfg = config or SimConfig()
    costs = list(cost) if isinstance(cost, Sequence) else [cost] * replicas
    if not costs:
        raise ValueError("need at least one replica")
    arrivals: Arrivals = FixedArrivals(workload) if isinstance(workload, Sequence) else workload
    router = make_policy(policy, seed) if isinstance(policy, str) else policy
    shared = (_SharedWatch(cfg.stop_on_slo_fail, arrivals.output_lens, len(costs))
              if cfg.stop_on_slo_fail else None)
    hub = _Hub()
    width = len(str(len(costs) - 1))
    reps = [_Replica(f"replica-{i:0{width}d}", c, cfg, hub, shared.view(i) if shared else None)
            for i, c in enumerate(costs)]
    by_name = {r.name: r for r in reps}
    routed: dict[str, str] = {}

    def finished_ns(rid: str) -> int | None:
        name = routed.get(rid)
        return None if name is None else by_name[name].finished_ns(rid)

    def advance(t_ns: int | None) -> None:
        """Run every replica until it needs the arrival at `t_ns` routed (None: to its end)."""
        for r in reps:
            while r.runnable_before(t_ns):
                r.resume()
                if r.error is not None:
                    raise r.error

    try:
        if len(arrivals):
            hub.next_ns = arrivals.arrival_ns(0)
        for r in reps:
            r.start()
            if r.error is not None:
                raise r.error
        for i in range(len(arrivals)):
            t = arrivals.arrival_ns(i)
            hub.next_ns = t
            advance(t)
            if shared is not None and shared.stopped is not None:
                break
            k, w = arrivals.request(i, finished_ns)
            tokens, salt = sim_prompt(k, w)
            keys = prefix_keys(tokens, cfg.block_size, salt)
            name = router.choose(keys, {r.name: float(r.load_at(t)) for r in reps})
            router.record(keys, name)
            rep = by_name[name]
            rep.run.add(t, k, w)
            rep.num_routed += 1
            routed[f"r{k}"] = name
        hub.next_ns = None
        advance(None)
    except BaseException:
        hub.abort = True
        for r in reps:
            if r.thread.is_alive() and r.state != "done":
                r.resume()
        raise
    stats = {key: getattr(router, key) for key in ("num_affine", "num_overloaded") if hasattr(router, key)}
    results = {}
    for r in reps:
        assert r.result is not None
        results[r.name] = r.result
    return RoutedResult(results, routed, router.name, shared.stopped if shared else None, stats)
