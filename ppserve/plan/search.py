"""Capacity of each deployment under the SLO, on the simulator, pruned and in parallel processes.

A probe simulates `duration_s` seconds of arrivals: the first rate x duration requests of one fixed
pool of lengths (a trace's rows in order, as `ppserve bench capacity` replays them; cycled if it is
shorter), arrivals drawn from one seed. Where requests share prefixes (conversations, system prompts)
it simulates every replica behind the router's policy (`PlanContext.routing`, sim/replicas.py): the
policy decides how much each replica's prefix cache saves. Otherwise one replica at its share of the
rate (see `probe`). A probe's result depends on the deployment and the rate only: the same in any
process, on any run. The duration, not a request count, is what makes an overloaded rate fail
(`metrics.capacity.ProbeSize` says why; `ppserve bench capacity` sizes its probes the same way).

The search is `metrics.capacity.find_capacity`, pruned in rounds (see `search`): one deployment per
pipeline shape coarsely (bracketed to `coarse_tol` over a shorter duration), the other settings of the
shapes that are not far behind, then the leaders refined to `fine_tol` over the full duration. Each
deployment's search is one task in a process pool.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.metrics.capacity import SLO, CapacityResult, Probe, ProbeSize, find_capacity, probe_from_summary
from ppserve.plan.space import Cluster, Deployment
from ppserve.sched.cost import BatchShape
from ppserve.sim.conversations import ConversationArrivals, ConversationSpec
from ppserve.sim.cost_model import CostModel, ModelSpec, RooflineCostModel
from ppserve.sim.replicas import has_prefix_content, simulate_replicas
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.slo_watch import SloStop
from ppserve.sim.workload import WorkloadRequest, with_poisson_arrivals

__all__ = ["PlanContext", "Candidate", "probe", "probe_requests", "estimate_rate", "search", "capacities",
           "CostModelFactory", "MIN_PROBE_REQUESTS", "is_routed", "routing_note"]

# How a context prices a deployment's replica: the roofline of the model on the cluster's hardware by
# default; a fitted profile re-split over the deployment's shape where one was given.
CostModelFactory = Callable[["PlanContext", Deployment], CostModel]

MIN_PROBE_REQUESTS = 50  # the fewest requests a probe replays, however low its rate


def roofline(ctx: PlanContext, d: Deployment) -> CostModel:
    return RooflineCostModel(ctx.model, ctx.cluster.hardware, d.pp, d.tp, d.layer_counts,
                             gpus_per_node=ctx.cluster.gpus_per_node)


@dataclass(frozen=True)
class PlanContext:
    """Everything a probe needs besides the deployment and the rate; sent once to each worker process."""

    model: ModelSpec
    cluster: Cluster
    requests: tuple[WorkloadRequest, ...]  # the pool of lengths (plan/inputs.py), arrivals redrawn per rate
    slo: SLO
    duration_s: float = 60.0  # seconds of arrivals per probe
    min_requests: int = MIN_PROBE_REQUESTS  # a probe replays at least this many requests
    # and at most this many (a probe cut short says so: `truncated`)
    max_requests: int = ProbeSize.max_requests
    seed: int = 0
    overhead_s: float = 0.5e-3  # engine turnaround per returned microbatch
    dispatch_s: float = 0.5e-3  # control-plane latency to the stages
    cost_model: CostModelFactory = roofline
    stop_early: bool = True  # a probe stops once it is certain to fail (False: every probe runs to the end)
    # What one probe runs: `probe` (the simulator) unless a test stands in a system of known capacity.
    # A module-level function, so the context pickles into the worker processes.
    prober: Callable[[PlanContext, Deployment, float], Probe] | None = None
    # The router's policy in front of the replicas (route.make_policy's names), simulated where the
    # workload shares prefixes.
    routing: str = "prefix"
    # The pool's rows are the turns of multi-turn conversations (sim/conversations.py), None: requests.
    conversations: ConversationSpec | None = None

    @property
    def probe_size(self) -> ProbeSize:
        return ProbeSize(self.duration_s, self.min_requests, self.max_requests)


@dataclass
class Candidate:
    """A deployment and what the search found."""

    deployment: Deployment
    result: CapacityResult
    refined: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def capacity(self) -> float:
        """Requests/s the whole deployment sustains under the SLO (0 when even the lowest rate failed)."""
        return self.result.capacity or 0.0

    @property
    def capacity_per_gpu(self) -> float:
        return self.capacity / self.deployment.gpus

    @property
    def at_capacity(self) -> Probe | None:
        """The probe at the capacity: its TBT and TTFT are the deployment's at its highest passing rate."""
        passing = [p for p in self.result.probes if p.ok and p.rate == self.result.capacity]
        return passing[0] if passing else None


def probe_requests(ctx: PlanContext, per_replica: float) -> list[WorkloadRequest]:
    """What a probe of one replica at `per_replica` requests/s replays: the pool's lengths in order (cycled
    when the duration needs more requests than it holds), Poisson arrivals from the context's seed."""
    n = ctx.probe_size.requests_at(per_replica)
    return with_poisson_arrivals([ctx.requests[i % len(ctx.requests)] for i in range(n)], per_replica,
                                 ctx.seed)


def is_routed(ctx: PlanContext, d: Deployment) -> bool:
    """Whether a probe of `d` simulates its replicas behind the router: conversations always (their
    turns are chosen from the simulation's finish times), other workloads where they share prefixes and
    `d` has more than one replica."""
    return ctx.conversations is not None or (d.replicas > 1 and has_prefix_content(ctx.requests))


def routing_note(ctx: PlanContext) -> str:
    """What the plan's capacities assume of the router, for plan.json and plan.md."""
    if ctx.conversations is not None or has_prefix_content(ctx.requests):
        return (f"{ctx.routing}: every replica simulated behind the router (the workload shares "
                "prefixes)")
    return (f"{ctx.routing} not simulated: no request shares a prefix, so one replica at rate / replicas "
            "stands for each (random routing: see plan/search.py's probe)")


def probe(ctx: PlanContext, d: Deployment, rate: float) -> Probe:
    """Simulate `d` at `rate` (the whole deployment's requests/s) and judge it against the SLO.

    Without shared prefixes, one replica at rate / replicas: a Poisson stream split at random over the
    replicas is exactly a Poisson stream of rate / replicas at each, independent, and the merged
    percentiles of like replicas are one's, so this is random routing, simulated at 1 / replicas of the
    cost. With nothing shared the caches do not depend on the policy, and round-robin and power-of-two
    spread requests more evenly than a random split, so the figure is theirs or a little under. With
    shared prefixes the policy decides what each cache holds: every replica is simulated behind it."""
    if is_routed(ctx, d):
        return _routed_probe(ctx, d, rate)
    per_replica = rate / d.replicas
    want = ctx.probe_size.wanted(per_replica)
    reqs = probe_requests(ctx, per_replica)
    n = len(reqs)
    sched = SchedulerConfig(policy=d.policy, token_budget=d.token_budget, max_num_seqs=d.max_num_seqs,
                            max_waiting=max(4096, n))
    # A probe over the capacity stops once its fail is certain (sim/slo_watch.py): the same verdict, and
    # the rates above the capacity, which the search must try, no longer cost the most.
    stop = SloStop(ctx.slo.tbt_p99_s, ctx.slo.sched_delay_p50_s) if ctx.stop_early else None
    cfg = SimConfig(sched, d.num_blocks, d.block_size, ctx.model.max_model_len, ctx.overhead_s,
                    ctx.dispatch_s,
                    stop_on_slo_fail=stop)
    res = simulate(reqs, ctx.cost_model(ctx, d), cfg)
    lat = res.latency()
    p = probe_from_summary(rate, {"latency": lat, "throughput": res.throughput()}, ctx.slo)
    extra = {**p.extra, "tbt_p50_s": lat["tbt_s"]["p50"], "ttft_p50_s": lat["ttft_s"]["p50"],
             "num_preemptions": res.num_preemptions, "num_requests": n, "truncated": n < want}
    if res.stopped_early:  # the figures are those of the requests admitted when it stopped
        return Probe(rate, False, p.tbt_p99_s, p.sched_delay_p50_s, res.stopped_early,
                     {**extra, "stopped_early": True, "num_admitted": res.num_finished})
    if res.rejected:  # the scheduler refused requests (too long for the KV cache): not a pass
        why = f"{len(res.rejected)} requests refused: {next(iter(res.rejected.values()))}"
        return Probe(rate, False, p.tbt_p99_s, p.sched_delay_p50_s, f"{p.reason}; {why}", extra)
    return Probe(p.rate, p.ok, p.tbt_p99_s, p.sched_delay_p50_s, p.reason, extra)


def _routed_probe(ctx: PlanContext, d: Deployment, rate: float) -> Probe:
    """Every replica of `d` behind `ctx.routing` at `rate`, judged on the merged requests."""
    want = ctx.probe_size.wanted(rate)
    n = ctx.probe_size.requests_at(rate)
    if ctx.conversations is not None:
        arrivals: Any = ConversationArrivals(ctx.requests, n, rate, ctx.conversations,
                                             ctx.model.max_model_len, ctx.seed)
    else:
        arrivals = probe_requests(ctx, rate)
    sched = SchedulerConfig(policy=d.policy, token_budget=d.token_budget, max_num_seqs=d.max_num_seqs,
                            max_waiting=max(4096, n))
    stop = SloStop(ctx.slo.tbt_p99_s, ctx.slo.sched_delay_p50_s) if ctx.stop_early else None
    cfg = SimConfig(sched, d.num_blocks, d.block_size, ctx.model.max_model_len, ctx.overhead_s,
                    ctx.dispatch_s, stop_on_slo_fail=stop)
    res = simulate_replicas(arrivals, [ctx.cost_model(ctx, d) for _ in range(d.replicas)], cfg,
                            d.replicas, ctx.routing, seed=ctx.seed)
    merged = res.merged()
    lat = merged.latency()
    p = probe_from_summary(rate, {"latency": lat, "throughput": merged.throughput()}, ctx.slo)
    extra = {**p.extra, "tbt_p50_s": lat["tbt_s"]["p50"], "ttft_p50_s": lat["ttft_s"]["p50"],
             "num_preemptions": merged.num_preemptions, "num_requests": n, "truncated": n < want,
             "routing": res.policy, "prefix_hit_rate": merged.prefix_hit_rate,
             "requests_per_replica": list(res.requests_per_replica().values())}
    if res.stopped_early:
        return Probe(rate, False, p.tbt_p99_s, p.sched_delay_p50_s, res.stopped_early,
                     {**extra, "stopped_early": True, "num_admitted": merged.num_finished})
    if merged.rejected:
        why = f"{len(merged.rejected)} requests refused: {next(iter(merged.rejected.values()))}"
        return Probe(rate, False, p.tbt_p99_s, p.sched_delay_p50_s, f"{p.reason}; {why}", extra)
    return Probe(p.rate, p.ok, p.tbt_p99_s, p.sched_delay_p50_s, p.reason, extra)


def estimate_rate(ctx: PlanContext, d: Deployment) -> float:
    """An optimistic requests/s for `d` from its cost model: each request's prompt at the speed of full
    prefill chunks and its output at the speed of a full decode batch, on the slowest stage. The SLO
    lands below it; the search starts at half of it."""
    cost = ctx.cost_model(ctx, d)
    n = len(ctx.requests)
    prompt = sum(r.prompt_len for r in ctx.requests) / n
    output = sum(r.output_len for r in ctx.requests) / n
    chunk = max(1, min(d.token_budget, round(prompt)))
    decodes = max(1, min(d.max_num_seqs, d.token_budget,
                         d.num_blocks * d.block_size // max(1, round(prompt + output))))
    context = round(prompt + output / 2)

    def slowest(shape: BatchShape) -> float:
        return max(cost.stage_time(s, shape) for s in range(cost.num_stages))

    per_request = (prompt * slowest(BatchShape.uniform(chunk)) / chunk
                   + output * slowest(BatchShape.uniform(0, decodes, context)) / decodes)
    return d.replicas / max(per_request, 1e-9)


@dataclass(frozen=True)
class _Task:
    index: int
    deployment: Deployment
    start_rate: float
    rel_tol: float
    max_evals: int
    growth: float = 2.0


_CTX: PlanContext | None = None  # the worker process's context, set once by the pool's initializer


def _init(ctx: PlanContext) -> None:
    global _CTX
    _CTX = ctx


def _run(task: _Task) -> tuple[int, CapacityResult]:
    ctx = _CTX
    if ctx is None:
        raise RuntimeError("plan worker started without a context")
    d = task.deployment
    run_probe = ctx.prober or probe
    res = find_capacity(lambda rate: run_probe(ctx, d, rate), task.start_rate, max_evals=task.max_evals,
                        rel_tol=task.rel_tol, growth=task.growth, min_rate=1e-3 * task.start_rate)
    return task.index, res


def _run_all(ctx: PlanContext, tasks: Sequence[_Task], jobs: int,
             on_done: Callable[[], None]) -> dict[int, CapacityResult]:
    """Each task's search, in a pool of `jobs` processes (in this process when jobs is 1)."""
    out: dict[int, CapacityResult] = {}
    if jobs <= 1 or len(tasks) <= 1:
        _init(ctx)
        for t in tasks:
            i, res = _run(t)
            out[i] = res
            on_done()
        return out
    with ProcessPoolExecutor(max_workers=jobs, initializer=_init, initargs=(ctx,)) as pool:
        # Longest first (deepest pipelines simulate the most microbatches), so no straggler ends the round.
        order = sorted(tasks, key=lambda t: -t.deployment.pp)
        for fut in as_completed([pool.submit(_run, t) for t in order]):
            i, res = fut.result()
            out[i] = res
            on_done()
    return out


def capacities(ctx: PlanContext, deployments: Sequence[Deployment], *, rel_tol: float = 0.05,
               max_evals: int = 10,
               jobs: int | None = None, progress: Callable[[], None] | None = None) -> list[Candidate]:
    """Every deployment's capacity bracketed to `rel_tol` over the context's duration, unpruned, in the
    order given (for side-by-side tables such as the Sarathi-Serve reproduction)."""
    tasks = [_Task(i, d, 0.5 * estimate_rate(ctx, d), rel_tol, max_evals) for i, d in enumerate(deployments)]
    results = _run_all(ctx, tasks, jobs or os.cpu_count() or 1, progress or (lambda: None))
    return [Candidate(d, results[i], refined=True) for i, d in enumerate(deployments)]


def _representatives(deployments: Sequence[Deployment]) -> dict[tuple[int, int], int]:
    """Per (pp, tp) shape, the deployment that stands for it in the first round: sarathi with the budget
    nearest 512 that the shape's TBT SLO allows where the planner priced it (plan/slo_budget.py: a budget
    over it fails the SLO at every rate and would prune a shape that a smaller budget serves well), else
    with the budget nearest 512; else the shape's first deployment."""
    best: dict[tuple[int, int], int] = {}
    for i, d in enumerate(deployments):
        key = (d.pp, d.tp)
        j = best.get(key)
        if j is None or _rep_score(d) < _rep_score(deployments[j]):
            best[key] = i
    return best


def _rep_score(d: Deployment) -> tuple[int, int, float]:
    over_slo = d.slo_budget is not None and d.token_budget > d.slo_budget
    return (0 if d.policy == "sarathi" else 1, 1 if over_slo else 0, abs(math.log2(d.token_budget / 512)))


def search(ctx: PlanContext, deployments: Sequence[Deployment], *, jobs: int | None = None,
           coarse_tol: float = 0.25, fine_tol: float = 0.05, refine: int = 4, keep_shapes: float = 0.5,
           coarse_duration_s: float | None = None, coarse_evals: int = 6, fine_evals: int = 8,
           progress: Callable[[str, int], Callable[[], None]] | None = None) -> list[Candidate]:
    """The capacity of the deployments, pruned in three rounds:

    1. shapes: one deployment per (pp, tp) (`_representatives`), coarse; shapes below `keep_shapes` x the
       best capacity per GPU are dropped with their other settings (their representative stays in the table);
    2. settings: every other deployment of the kept shapes, coarse;
    3. refine: the `refine` best per GPU to `fine_tol` over the full duration, again until the first
       `refine` of the ranking are all refined (a coarse capacity overstates: the backlog has less time).

    Coarse rounds use `coarse_duration_s` (default a third of the context's). Returns every searched
    deployment, best capacity per GPU first. `progress(stage, total)` gives the callback called after
    each finished deployment (a progress bar)."""
    if not deployments:
        return []
    if not 0 < keep_shapes <= 1:
        raise ValueError(f"keep_shapes must be in (0, 1], got {keep_shapes}")
    jobs = jobs or os.cpu_count() or 1
    tick = progress or (lambda stage, total: lambda: None)
    short = replace(ctx, duration_s=coarse_duration_s or ctx.duration_s / 3)

    def coarse_round(stage: str, indices: Sequence[int]) -> dict[int, Candidate]:
        tasks = [_Task(i, deployments[i], 0.5 * estimate_rate(ctx, deployments[i]), coarse_tol, coarse_evals)
                 for i in indices]
        return {i: Candidate(deployments[i], r)
                for i, r in _run_all(short, tasks, jobs, tick(stage, len(tasks))).items()}

    reps = _representatives(deployments)
    cands = coarse_round("shapes", sorted(reps.values()))
    best = max(c.capacity_per_gpu for c in cands.values())
    kept = {shape for shape, i in reps.items() if cands[i].capacity_per_gpu >= keep_shapes * best
            and best > 0}
    rest = [i for i, d in enumerate(deployments) if (d.pp, d.tp) in kept and i not in cands]
    cands.update(coarse_round("settings", rest))
    for _ in range(3):
        ranked = sorted(cands, key=lambda i: _rank_key(cands, i))[:refine]
        todo = [i for i in ranked if not cands[i].refined and cands[i].capacity > 0]
        if not todo:
            break
        # Start at the coarse capacity and step by the coarse tolerance: one probe if the coarse figure
        # holds, more where the longer run lets a backlog show (a small KV cache can halve it).
        tasks = [_Task(i, deployments[i], cands[i].capacity, fine_tol, fine_evals, 1 + coarse_tol)
                 for i in todo]
        for i, res in _run_all(ctx, tasks, jobs, tick("refine", len(tasks))).items():
            cands[i] = Candidate(deployments[i], res, refined=True)
    return [cands[i] for i in sorted(cands, key=lambda i: _rank_key(cands, i))]


def _rank_key(cands: dict[int, Candidate], i: int) -> tuple[float, int]:
    """Best capacity per GPU first; equal capacities (settings that serve alike) in the deployments'
    order, so which of them is refined and how they are listed never depends on which probe finished first."""
    return -cands[i].capacity_per_gpu, i
