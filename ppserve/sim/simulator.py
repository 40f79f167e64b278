"""Discrete-event simulation of the pipeline engine: ppserve's own scheduler over a step-time cost model.

The step loop is the engine's own (`ppserve.engine.core.EngineCore`), driven with a simulated
executor and clock, with time taken from a cost model instead of a GPU: at each decision time the engine adds
the requests that have arrived, schedules microbatches until `num_stages` are in flight (or nothing can run),
then waits for the *oldest* one to leave the last stage, hands its result to the scheduler after a fixed
overhead (`schedule_overhead_s`: the result's way back and the engine's turnaround), and decides again. The
control plane takes `dispatch_latency_s` to hand a microbatch to the stages; stage s starts microbatch j at
max(stage s free, j done on stage s-1 + transfer time), stage 0 when the dispatch arrives and, with the token
ring (`scheduler.token_ring`), once the tokens its decodes take have come back from the last stage (the step
that samples them done there, plus the slowest link's latency). The scheduler classes are used unchanged; only
its clock is the simulated one.

Output is the same data the real pipeline records — spans (compute / recv_wait / send on tp rank 0,
schedule on the engine track), work intervals, per-request token times — so `bubble_report`, the
Chrome trace and the timeline tool work on a simulated run unchanged. Times are integer nanoseconds
internally so hand-computed timelines (and the GPipe oracle) come out exactly. Speculative decoding
(`SimConfig.spec_acceptance`) is the scheduler's own, drafts accepted at that rate (sim/speculation.py).
"""

from __future__ import annotations

import bisect
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppserve.config import SchedulerConfig, SpeculativeConfig
from ppserve.engine.core import EngineCore
from ppserve.metrics.bubbles import (
    BubbleReport,
    Window,
    bubble_report,
    bubble_summary,
    short_handed_fractions,
)
from ppserve.metrics.latency import RequestTiming, lifetimes_ns, summarize
from ppserve.metrics.spans import Span, WorkInterval
from ppserve.metrics.trace import save_chrome_trace
from ppserve.request import Request, SamplingParams
from ppserve.sched import Scheduler, SchedulerOutput, StepResult
from ppserve.sched.budget import BudgetMode
from ppserve.sched.cost import BatchShape
from ppserve.sim.cost_model import CostModel, PlacedCostModel, PricedCostModel
from ppserve.sim.slo_watch import SloStop, SloWatch
from ppserve.sim.speculation import AcceptanceModel, SimProposer
from ppserve.sim.workload import WorkloadRequest, expand_runs

__all__ = ["SimConfig", "SimResult", "SimRun", "simulate"]

logger = logging.getLogger(__name__)

# The token every simulated step "samples": any id that is not an eos works, requests stop at max_tokens.
SIM_TOKEN = 7
_UNIQUE_TOKEN_BASE = 1_000_000  # request k's own prompt tokens are this + k: no two requests share them


def sim_prompt(k: int, w: WorkloadRequest) -> tuple[list[int], str | None]:
    """Request k's prompt tokens and cache salt. Its prefix identity is a salt namespace over SIM_TOKEN
    (what the simulated steps sample), so a multi-turn replay's next turn hits the previous turn's
    answer blocks too; the rest of the prompt is request k's own. A request that spells its prompt out
    (`WorkloadRequest.content`) gets those tokens, unsalted."""
    if w.content is not None:  # the workload spelled the prompt out: it shares what its tokens share
        return expand_runs(w.content), None
    own = [_UNIQUE_TOKEN_BASE + k] * (w.prompt_len - w.prefix_len)
    if w.prefix_id is None or not w.prefix_len:
        return own, None
    return [SIM_TOKEN] * w.prefix_len + own, f"sim-prefix-{w.prefix_id}"


@dataclass(frozen=True)
class SimConfig:
    """How the simulated engine is set up (the cost model says how fast it runs)."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 100_000  # KV blocks the scheduler may hand out
    block_size: int = 16
    max_model_len: int = 4096
    schedule_overhead_s: float = 0.0  # from the last stage's result to the next schedule() (engine + RPC)
    # from schedule() to the stages holding the SchedulerOutput (control plane)
    dispatch_latency_s: float = 0.0
    record_send: bool = True  # zero-length send spans after each non-last stage, like the real workers
    check_invariants: bool = False  # debug: scheduler.check_invariants() after every schedule and update
    max_microbatches: int = 10_000_000  # guard against a run that never ends
    # the engine's default: shared prefixes (WorkloadRequest.prefix_id) hit
    enable_prefix_caching: bool = True
    # Stop as soon as the run is certain to fail this SLO (capacity searches: sim/slo_watch.py); the
    # result then holds the requests admitted so far and says why in `stopped_early`.
    stop_on_slo_fail: SloStop | None = None
    # Speculative decoding: None is off; else each draft is accepted with this probability (independent
    # per position, the first rejection ends the run; drawn with `spec_seed`), at most
    # `num_speculative_tokens` drafts a decode, the scheduler choosing how many (sched/speculation.py).
    spec_acceptance: float | None = None
    num_speculative_tokens: int = 4
    spec_seed: int = 0

    def __post_init__(self) -> None:
        if self.spec_acceptance is not None and not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError(f"spec_acceptance must be in [0, 1] or None, got {self.spec_acceptance!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens!r}")
        if self.schedule_overhead_s < 0:
            raise ValueError(f"schedule_overhead_s must be >= 0, got {self.schedule_overhead_s!r}")
        if self.dispatch_latency_s < 0:
            raise ValueError(f"dispatch_latency_s must be >= 0, got {self.dispatch_latency_s!r}")


@dataclass
class SimResult:
    """Everything one simulated run produced."""

    spans: list[Span]
    work_intervals: list[WorkInterval]
    timings: dict[str, RequestTiming]
    num_stages: int
    num_microbatches: int
    num_preemptions: int
    end_s: float
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> why add_request refused it
    budget_mode: BudgetMode | None = None  # the scheduler's budget mode after the run (what it learned)
    # why the run stopped before every request finished (SimConfig.stop_on_slo_fail)
    stopped_early: str | None = None
    # speculative decoding's counters (SpecCounters.as_dict) when the run speculated, else None
    speculation: dict[str, Any] | None = None
    # the block manager's prefix-cache counters, in tokens (query_tokens, hit_tokens) and evictions
    prefix_cache: dict[str, int] | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hit tokens over query tokens (vLLM's definition), None where nothing was queried."""
        pc = self.prefix_cache
        return pc["hit_tokens"] / pc["query_tokens"] if pc and pc["query_tokens"] else None

    def bubble_report(self, window: Window = "active") -> BubbleReport:
        return bubble_report(self.spans, self.work_intervals, window)

    def latency(self) -> dict[str, Any]:
        return summarize(self.timings.values())

    @property
    def num_finished(self) -> int:
        return len(self.timings)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t.token_times_s) for t in self.timings.values())

    def throughput(self) -> dict[str, float]:
        """Requests and output tokens per second from the first arrival to the last token."""
        if not self.timings:
            return {"requests_per_s": 0.0, "output_tokens_per_s": 0.0, "duration_s": 0.0}
        t0 = min(t.arrival_s for t in self.timings.values())
        t1 = max(t.token_times_s[-1] for t in self.timings.values() if t.token_times_s)
        dur = max(t1 - t0, 1e-12)
        return {"requests_per_s": self.num_finished / dur,
                "output_tokens_per_s": self.num_output_tokens / dur,
                "duration_s": dur}

    def save_trace(self, path: str | os.PathLike[str]) -> str:
        save_chrome_trace(path, self.spans, self.work_intervals)
        return str(path)

    def summary(self, window: Window = "active") -> dict[str, Any]:
        rep = self.bubble_report(window)
        short = short_handed_fractions(self.spans, self.work_intervals, window,
                                       lifetimes_ns(self.timings.values()), self.num_stages)
        return {
            "num_requests": self.num_finished,
            "num_rejected": len(self.rejected),
            "num_microbatches": self.num_microbatches,
            "num_preemptions": self.num_preemptions,
            "throughput": self.throughput(),
            "latency": self.latency(),
            "bubbles": bubble_summary(rep, short),
        }


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


class _Pipeline:
    """The stages' timelines: when each is free, and the spans it has recorded."""

    def __init__(self, cost: CostModel, record_send: bool, dispatch_ns: int = 0) -> None:
        self.cost = cost
        self.free_ns = [0] * cost.num_stages
        self.record_send = record_send
        self.dispatch_ns = dispatch_ns
        self.spans: list[Span] = []
        # Checked once: a runtime Protocol check costs microseconds, a run has many microbatches.
        self.placed = cost if isinstance(cost, PlacedCostModel) else None
        # The token ring (scheduler.token_ring): when each microbatch left the last stage, and how
        # long its sampled tokens take back to stage 0 (a few ids: the slowest link's latency).
        self.left_ns: dict[int, int] = {}
        self.ring_ns = max(self._transfers(BatchShape(())), default=0)

    def run(self, out: SchedulerOutput, scheduled_ns: int) -> tuple[int, list[float]]:
        """Push one microbatch through every stage; returns when the last stage finishes it and its
        compute seconds per stage (what `Scheduler.observe_step` learns from)."""
        shape = BatchShape.of(out)
        pf, dc, rids = out.num_prefill_tokens, out.num_decode_tokens, tuple(out.order)
        transfers = self._transfers(shape)
        submit_ns = scheduled_ns + self.dispatch_ns  # when the stages hold the scheduler output
        ready = submit_ns  # stage 0's input is the scheduler output itself
        if out.ring_step_id is not None:  # and the tokens the ring brings from the last stage
            ready = max(ready, self.left_ns[out.ring_step_id] + self.ring_ns)
        end = submit_ns
        last = self.cost.num_stages - 1
        stage_s: list[float] = []
        for s in range(self.cost.num_stages):
            if ready > max(self.free_ns[s], submit_ns):
                # The worker got the scheduler output at submit time, then blocks on the hidden states
                # (stage 0: on the ring's tokens).
                self.spans.append(Span("recv_wait", max(self.free_ns[s], submit_ns), ready, s, 0,
                                       out.step_id))
            start = max(self.free_ns[s], ready)
            dur = _ns(self.cost.stage_time(s, shape))
            stage_s.append(dur * 1e-9)
            end = start + dur
            self.spans.append(Span("compute", start, end, s, 0, out.step_id, pf, dc, rids))
            if s < last and self.record_send:
                # Sends are asynchronous (isend): the stage is free at once, the link carries the data.
                self.spans.append(Span("send", end, end, s, 0, out.step_id))
            self.free_ns[s] = end
            ready = end + (transfers[s] if s < last else 0)
        if out.sample_request_ids:
            self.left_ns[out.step_id] = end
            # a ring source is at most p + 1 back
            self.left_ns.pop(out.step_id - 4 * self.cost.num_stages, None)
        return end, stage_s

    def _transfers(self, shape: BatchShape) -> list[int]:
        """Nanoseconds over each stage boundary: its own link where the cost model knows the placement."""
        n = self.cost.num_stages - 1
        if self.placed is not None:
            return [_ns(self.placed.boundary_transfer_time(s, shape)) for s in range(n)]
        return [_ns(self.cost.transfer_time(shape))] * n


class SimClock:
    """Simulated time in integer nanoseconds, moved by the simulated executor and the idle loop."""

    def __init__(self) -> None:
        self.now_ns = 0

    def seconds(self) -> float:
        return self.now_ns * 1e-9

    def ns(self) -> int:
        return self.now_ns


class SimExecutor:
    """The cost model's pipeline behind the engine's executor interface: `submit` works out when every
    stage runs the microbatch, `collect` moves the clock to when the last stage finishes the oldest; with
    an `acceptance` model it verifies each speculating decode's drafts too (`StepResult.num_accepted`)."""

    def __init__(self, pipe: _Pipeline, clock: SimClock, max_microbatches: int,
                 on_submit: Callable[[], None] | None = None,
                 acceptance: AcceptanceModel | None = None) -> None:
        self.pipe = pipe
        self.acceptance = acceptance
        self.clock = clock
        self.max_microbatches = max_microbatches
        self.on_submit = on_submit
        self.num_microbatches = 0
        self.just_collected = False  # a result came back and the engine has not turned around yet
        self.collected_ns = 0  # when the last result came back
        # (microbatch, last stage end ns, compute seconds per stage)
        self.in_flight: deque[tuple[SchedulerOutput, int, list[float]]] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        self.num_microbatches += 1
        if self.num_microbatches > self.max_microbatches:
            raise RuntimeError(f"simulation exceeded {self.max_microbatches} microbatches")
        if self.on_submit is not None:
            self.on_submit()
        self.in_flight.append((out, *self.pipe.run(out, self.clock.now_ns)))

    def collect(self) -> StepResult:
        out, done_ns, stage_s = self.in_flight.popleft()
        self.clock.now_ns = max(self.clock.now_ns, done_ns)
        self.collected_ns = self.clock.now_ns
        self.just_collected = True
        accepted: dict[str, int] = {}
        if out.draft_token_ids:
            if self.acceptance is None:
                raise RuntimeError(f"step {out.step_id} carries drafts but the executor has no acceptance "
                                   "model")
            accepted = {rid: self.acceptance.accepted(len(d)) for rid, d in out.draft_token_ids.items()}
        return StepResult(out.step_id, {rid: SIM_TOKEN for rid in out.sample_request_ids}, tuple(stage_s),
                          timed_step_id=out.step_id if stage_s else None,  # a simulated step times itself
                          num_accepted=accepted)


def simulate(workload: Sequence[WorkloadRequest], cost: CostModel,
             config: SimConfig | None = None) -> SimResult:
    """Run the workload through the simulated engine until every admitted request finishes.

    The step loop is the engine's own (`ppserve.engine.core.EngineCore`) over a `SimExecutor`
    and a simulated clock; its intake models the engine's turnaround (`schedule_overhead_s` after each
    result) and queues the requests that arrived before the engine looks."""
    cfg = config or SimConfig()
    watch = SloWatch(cfg.stop_on_slo_fail, [w.output_len for w in workload]) if cfg.stop_on_slo_fail else None
    run = SimRun(cost, cfg, watch)
    for arr_ns, k, w in sorted(((_ns(w.arrival_s), k, w) for k, w in enumerate(workload)),
                               key=lambda x: (x[0], x[1])):
        run.add(arr_ns, k, w)
    return run.run()


class Feed(Protocol):
    """Where a `SimRun` learns of arrivals that are not in its queue yet (sim/replicas.py's router)."""

    def before_intake(self, now_ns: int) -> None:
        """Return once every request arriving by `now_ns` that this run will get is in its queue."""

    def wait_for_work(self, now_ns: int) -> bool:
        """The run is idle with an empty queue: return True once a request is queued, False if none
        will come."""


class RunWatch(Protocol):
    """What a run tells its SLO watch (sim/slo_watch.py's SloWatch, or a router's shared one)."""

    def admitted(self, req: Request) -> None: ...

    def tokens(self, request_id: str, now_s: float) -> None: ...

    def step(self, now_s: float) -> str | None: ...


class SimRun:
    """One simulated engine: requests queued by `add` (in arrival order), `run` steps it to the end.

    `simulate` queues the whole workload first. Given a `feed`, the run asks it before each intake for
    what has arrived meanwhile and, idle, for more, so a router can decide at each arrival from the
    replicas' state at that time (sim/replicas.py); the step loop is the same either way."""

    def __init__(self, cost: CostModel, cfg: SimConfig, watch: RunWatch | None = None,
                 feed: Feed | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.watch = watch
        self.feed = feed
        self.clock = clock = SimClock()
        # The scheduler learns each stage's cost from the stage times, as in the engine, starting from
        # what the cost model says it charges where it can say so (the roofline's linearization).
        prior = cost.pipeline_cost() if isinstance(cost, PricedCostModel) else None
        speculating = cfg.spec_acceptance is not None
        self.sched = sched = Scheduler(
            cfg.scheduler, cfg.num_blocks, cfg.block_size, cfg.max_model_len,
            num_stages=cost.num_stages, clock=clock.seconds, cost_prior=prior,
            enable_prefix_caching=cfg.enable_prefix_caching,
            speculative=SpeculativeConfig(num_speculative_tokens=cfg.num_speculative_tokens)
            if speculating else None,
            proposer=SimProposer(SIM_TOKEN) if speculating else None)
        self.pipe = _Pipeline(cost, cfg.record_send, _ns(cfg.dispatch_latency_s))
        self.check = sched.check_invariants if cfg.check_invariants else None
        acceptance = (AcceptanceModel(cfg.spec_acceptance, cfg.spec_seed) if cfg.spec_acceptance is not None
                      else None)
        self.executor = SimExecutor(self.pipe, clock, cfg.max_microbatches, on_submit=self.check,
                                    acceptance=acceptance)
        self.pending: deque[tuple[int, int, WorkloadRequest]] = deque()  # queued, not yet arrived
        self.requests: dict[str, Request] = {}
        self.token_times: dict[str, list[float]] = {}
        self.rejected: dict[str, str] = {}
        # When each request finished or was refused (ns), and those times sorted: what a router's load
        # reads (sim/replicas.py).
        self.finished_ns: dict[str, int] = {}
        self.finish_times_ns: list[int] = []
        self.open: set[str] = set()  # admitted, not finished
        self.core = EngineCore(sched, self.executor, clock=clock.seconds, clock_ns=clock.ns,
                               intake=self._intake, wait_until=self._wait_until,
                               dispatch_s=cfg.dispatch_latency_s)

    def add(self, arrival_ns: int, k: int, w: WorkloadRequest) -> None:
        """Queue request k (its id is `r{k}`, its prompt `sim_prompt(k, w)`), arriving at `arrival_ns`."""
        self.pending.append((arrival_ns, k, w))

    def _turn_around(self) -> None:
        """The engine's turnaround after a result (`schedule_overhead_s`), once, before it looks again."""
        if self.executor.just_collected:
            self.clock.now_ns += _ns(self.cfg.schedule_overhead_s)
            self.executor.just_collected = False

    def _intake(self) -> None:
        self._turn_around()
        clock, pending = self.clock, self.pending
        if self.feed is not None:
            self.feed.before_intake(clock.now_ns)
        while pending and pending[0][0] <= clock.now_ns:
            arr_ns, k, w = pending.popleft()
            rid = f"r{k}"
            tokens, salt = sim_prompt(k, w)
            req = Request(rid, tokens, SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                          arrival_time=arr_ns * 1e-9, cache_salt=salt)
            try:
                self.sched.add_request(req)
            except (ValueError, OverflowError) as e:
                self.rejected[rid] = str(e)
                self._finished(rid, clock.now_ns)
                continue
            self.requests[rid] = req
            self.token_times[rid] = []
            self.open.add(rid)
            if self.watch is not None:
                self.watch.admitted(req)
            self.core.work.update(True, arr_ns)

    def _wait_until(self, due_s: float) -> None:
        """The engine waits to form the token ring's extra microbatch (EngineCore.fill_due): its turnaround
        after the last result first, then until `due_s` or the oldest microbatch's return, whichever comes
        first."""
        self._turn_around()
        due_ns = _ns(due_s)
        if self.executor.in_flight:
            due_ns = min(due_ns, self.executor.in_flight[0][1])  # woken by the result that comes back first
        self.clock.now_ns = max(self.clock.now_ns, due_ns)

    def settle(self) -> None:
        """Note the requests the last collect finished whose updates the loop has not seen yet (a run
        paused inside a step, at its intake)."""
        for rid in [r for r in self.open if self.requests[r].is_finished]:
            self._finished(rid, self.executor.collected_ns)

    def _finished(self, rid: str, at_ns: int) -> None:
        self.open.discard(rid)
        self.finished_ns[rid] = at_ns
        bisect.insort(self.finish_times_ns, at_ns)

    def run(self) -> SimResult:
        clock, sched, core, watch, check = self.clock, self.sched, self.core, self.watch, self.check
        token_times = self.token_times
        stopped_early: str | None = None
        while True:
            stepped = core.step()
            if stepped is not None:
                now, updates = stepped
                for u in updates:
                    token_times[u.request_id].extend([now] * len(u.new_token_ids))
                    if watch is not None and u.new_token_ids:
                        watch.tokens(u.request_id, now)
                    if u.finished and u.request_id in self.open:
                        self._finished(u.request_id, self.executor.collected_ns)
                if check is not None:
                    check()
                if watch is not None and (stopped_early := watch.step(now)) is not None:
                    break
            elif sched.has_unfinished:
                raise RuntimeError(
                    f"simulation stuck at {clock.seconds():.6f} s: {len(sched.waiting)} waiting, "
                    f"{len(sched.running)} running, nothing schedulable (KV cache too small?)"
                )
            elif self.pending:
                clock.now_ns = max(clock.now_ns, self.pending[0][0])  # idle until the next request arrives
            elif self.feed is not None and self.feed.wait_for_work(clock.now_ns):
                clock.now_ns = max(clock.now_ns, self.pending[0][0])
            else:
                break
        return self.result(stopped_early)

    def result(self, stopped_early: str | None = None) -> SimResult:
        sched, clock = self.sched, self.clock
        timings = {
            rid: RequestTiming(req.arrival_time, req.first_scheduled_time, self.token_times[rid])
            for rid, req in self.requests.items()
        }
        blocks = sched.blocks
        return SimResult(
            spans=self.pipe.spans + self.core.engine_spans,
            work_intervals=self.core.work.intervals(clock.now_ns),
            timings=timings,
            num_stages=self.cost.num_stages,
            num_microbatches=self.executor.num_microbatches,
            num_preemptions=sched.num_preemptions,
            end_s=clock.seconds(),
            rejected=self.rejected,
            budget_mode=sched.budget_mode,
            stopped_early=stopped_early,
            speculation=sched.spec.counters.as_dict() if sched.spec is not None else None,
            prefix_cache={"query_tokens": blocks.num_query_tokens, "hit_tokens": blocks.num_hit_tokens,
                          "evictions": blocks.num_evictions},
        )
