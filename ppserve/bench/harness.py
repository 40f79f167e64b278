"""The benchmark harness: replay a workload against a real pipeline and measure it.

Offline mode (the main one) drives `ppserve.engine.llm_engine.LLMEngine` directly, as a server would but
single-threaded: add every request whose arrival time has passed (relative to the run start on
`time.perf_counter`, the engine clock), step the engine while it has work, sleep until the next
arrival when it has none. The engine core's intake adds arrivals mid-step too, just before it schedules,
as a server's engine thread does. Each request's arrival time is its *scheduled* arrival, so the time it
spent waiting for a step to finish before being added counts as queueing. Token times come from the
engine's TokenDelta, first-schedule times from the scheduler's Request objects.

gRPC mode (`replay_grpc`) starts `ppserve serve` in a subprocess and sends the same requests through
`AsyncPPServeClient` at their arrival times; bubbles come from the Chrome trace the server writes on
shutdown.

Both produce a `RunResult`; `summarize_run` turns spans + work intervals + per-request timings into
the figures every report uses (and works unchanged on a simulated run). An offline run carries its
grammar figures (`meta["grammar"]`, engine/stats.py GrammarStats) and its speculation figures
(`meta["spec_decode"]`, `spec_decode_since`), only when there were any.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ppserve.metrics.bubbles import bubble_report, bubble_summary, short_handed_fractions
from ppserve.metrics.latency import RequestTiming, lifetimes_ns, summarize
from ppserve.metrics.spans import Span, WorkInterval
from ppserve.sim.workload import WorkloadRequest

__all__ = [
    "EngineSpec",
    "RunResult",
    "summarize_run",
    "ensure_ray",
    "build_llm",
    "warm_up",
    "reset_observations",
    "replay",
    "replay_grpc",
    "measure_decode_step",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """The engine settings a benchmark varies; everything else comes from the config / defaults."""

    model: str | None = None  # None = the default SmolLM2-135M-Instruct
    pp: int = 2
    token_budget: int = 128
    max_num_seqs: int = 32
    seq_cap: bool = True  # scheduler.per_microbatch_seq_cap (max_num_seqs / pp requests per microbatch)
    block_size: int | None = None  # None: the attention kernel's page (256 with flash-attn, else 16)
    num_kv_blocks: int | None = None
    max_model_len: int | None = 2048
    dtype: str = "float32"
    overrides: tuple[str, ...] = ()  # extra section.key=value settings

    def settings(self, policy: str, token_budget: int | None = None) -> list[str]:
        """The engine settings as `section.key=value` overrides: the one encoding, for `LLM(overrides=...)`
        and for `ppserve serve --set` alike."""
        sets = [
            f"parallel.pipeline_parallel_size={self.pp}",
            f"scheduler.token_budget={token_budget or self.token_budget}",
            f"scheduler.policy={policy}",
            f"scheduler.max_num_seqs={self.max_num_seqs}",
            f"scheduler.per_microbatch_seq_cap={'true' if self.seq_cap else 'false'}",
            f"model.dtype={self.dtype}",
        ]
        if self.block_size is not None:
            sets.append(f"cache.block_size={self.block_size}")
        if self.model:
            sets.append(f"model.model={self.model}")
        if self.max_model_len:
            sets.append(f"model.max_model_len={self.max_model_len}")
        if self.num_kv_blocks is not None:
            sets.append(f"cache.num_blocks={self.num_kv_blocks}")
        return [*sets, *self.overrides]


@dataclass
class RunResult:
    """What one measured run produced (real or simulated)."""

    name: str
    timings: dict[str, RequestTiming]
    spans: list[Span]
    work_intervals: list[WorkInterval]
    num_stages: int
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    aborted: bool = False  # stopped at the time limit; unfinished requests left out
    meta: dict[str, Any] = field(default_factory=dict)
    # Whether the request timings read the spans' clock (offline replay, the simulator): the bubble can then
    # be cut by how many requests were in the system. Not through gRPC: the client stamps Unix time.
    timings_on_span_clock: bool = True

    def summary(self, window: str = "active") -> dict[str, Any]:
        s = summarize_run(self.timings, self.spans, self.work_intervals, window,
                          num_stages=self.num_stages if self.timings_on_span_clock else None)
        s.update(name=self.name, num_preemptions=self.num_preemptions, aborted=self.aborted,
                 num_prompt_tokens=self.num_prompt_tokens, **self.meta)
        return s


def summarize_run(
    timings: dict[str, RequestTiming],
    spans: Sequence[Span],
    work_intervals: Sequence[WorkInterval] | None,
    window: str = "active",
    num_stages: int | None = None,
) -> dict[str, Any]:
    """Latency, throughput and bubble figures of one run (seconds; fractions in [0, 1]). With `num_stages`
    (the timings on the spans' clock), the bubble's part that fell while fewer than that many requests
    were in the system too (`short_handed_bubble_fraction`, metrics/bubbles.py `short_handed`)."""
    out: dict[str, Any] = {"latency": summarize(timings.values())}
    done = [t for t in timings.values() if t.token_times_s]
    if done:
        t0 = min(t.arrival_s for t in timings.values())
        t1 = max(t.token_times_s[-1] for t in done)
        dur = max(t1 - t0, 1e-9)
        ntok = sum(len(t.token_times_s) for t in done)
        out["throughput"] = {"duration_s": dur, "requests_per_s": len(done) / dur,
                             "output_tokens_per_s": ntok / dur}
    else:
        out["throughput"] = {"duration_s": 0.0, "requests_per_s": 0.0, "output_tokens_per_s": 0.0}
    if any(s.kind == "compute" for s in spans):
        rep = bubble_report(list(spans), None if work_intervals is None else list(work_intervals), window)
        short = None if num_stages is None else short_handed_fractions(
            spans, work_intervals, window, lifetimes_ns(done), num_stages)
        out["bubbles"] = bubble_summary(rep, short)
    return out


# ---------------------------------------------------------------------------------------------
# Building and preparing engines


def ensure_ray(num_cpus: int = 8) -> None:
    """Start one local Ray for the whole benchmark, so each LLM attaches instead of owning (and
    tearing down) its own. Logical CPUs may exceed physical ones (stage actors each ask for one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)


def build_llm(spec: EngineSpec, policy: str, token_budget: int | None = None) -> Any:
    from ppserve.engine.llm import LLM

    if spec.pp > 1:
        ensure_ray()
    return LLM(spec.model, overrides=spec.settings(policy, token_budget))


def reset_observations(engine: Any) -> None:
    """Forget spans and work intervals recorded so far (warm-up), so a measured run starts clean."""
    engine.reset_observations()


def warm_up(engine: Any, num_requests: int = 4, prompt_len: int = 64, max_tokens: int = 4) -> None:
    """Run a few requests so lazy initialisation (allocator, kernels, Ray paths) is not measured."""
    from ppserve.request import SamplingParams

    vocab = engine.arch.vocab_size
    for i in range(num_requests):
        ids = [(17 * i + 31 * k) % (vocab - 3) + 3 for k in range(prompt_len)]
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    reset_observations(engine)


def measure_decode_step(engine: Any, num_requests: int = 8, max_tokens: int = 24) -> float:
    """Median time between tokens of a decode-only load (short prompts, all at once): the time one
    decode microbatch takes to go around the pipeline. Used to set CPU TBT targets."""
    from ppserve.metrics.latency import percentile

    reqs = [WorkloadRequest(0.0, 4, max_tokens) for _ in range(num_requests)]
    prompts = [[(13 * i + k) % 1000 + 3 for k in range(4)] for i in range(num_requests)]
    res = replay(engine, reqs, prompts, progress=False, name="decode-probe")
    gaps = [g for t in res.timings.values() for g in t.tbt_gaps_s]
    return percentile(gaps, 50)


# ---------------------------------------------------------------------------------------------
# Offline replay


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)


def replay(
    engine: Any,
    requests: Sequence[WorkloadRequest],
    prompts: Sequence[list[int]],
    *,
    name: str = "run",
    progress: bool = True,
    max_duration_s: float | None = None,
) -> RunResult:
    """Replay `requests` (arrival times relative to now) on an idle engine; see the module docstring.

    With `max_duration_s`, requests still unfinished at that time are cancelled and left out of the
    timings, and the result is marked `aborted` (an overloaded capacity probe fails fast that way).
    """
    from ppserve.engine.stats import GrammarTally, spec_decode_since
    from ppserve.request import SamplingParams

    if engine.has_unfinished:
        raise RuntimeError("replay needs an idle engine")
    if len(prompts) != len(requests):
        raise ValueError(f"{len(prompts)} prompts for {len(requests)} requests")
    reset_observations(engine)
    before = engine.stats()  # prefix cache and speculation totals at the start: the run's own are the gain
    grammar = GrammarTally()  # the run's mask time, from its microbatches' results
    grammar_before = grammar.stats()  # the grammar caches' totals at the start, likewise
    order = sorted(range(len(requests)), key=lambda k: requests[k].arrival_s)
    clock = engine.clock
    states: dict[str, Any] = {}
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    finished: set[str] = set()
    aborted = False
    nxt = 0
    bar = _progress(len(requests), name, progress)
    t0 = clock()

    def admit_arrivals() -> None:
        """Add every request whose arrival time has passed. Also the engine core's intake: called mid-step,
        just before it schedules, as a server's engine thread takes the requests queued meanwhile
        (AsyncEngine._intake), so a request that arrives while the engine waits for a result or for the
        token ring's formation time joins the next microbatch, not the one after."""
        nonlocal nxt
        now = clock()
        while nxt < len(order) and requests[order[nxt]].arrival_s <= now - t0:
            k = order[nxt]
            w = requests[k]
            rid = f"r{k}"
            arrivals[rid] = t0 + w.arrival_s
            engine.add_request(prompts[k], SamplingParams(max_tokens=w.output_len, ignore_eos=True),
                               request_id=rid, arrival_time=arrivals[rid])
            states[rid] = engine.request_state(rid).request
            token_times[rid] = []
            nxt += 1

    core = engine.core
    intake, core.intake = core.intake, admit_arrivals
    core.step_observers.append(grammar.on_step)
    try:
        while nxt < len(order) or engine.has_unfinished:
            now = clock()
            if max_duration_s is not None and now - t0 > max_duration_s:
                aborted = True
                break
            admit_arrivals()
            if engine.has_unfinished:
                for d in engine.step():
                    token_times[d.request_id].extend(d.token_times)
                    if d.finished:
                        finished.add(d.request_id)
                        bar.update(1)
            elif nxt < len(order):
                time.sleep(max(0.0, min(0.05, t0 + requests[order[nxt]].arrival_s - clock())))
    finally:
        core.intake = intake
        core.step_observers.remove(grammar.on_step)
        bar.close()
    if aborted:
        for rid in list(states):
            if rid not in finished:
                engine.cancel(rid)
        while engine.has_unfinished:
            engine.step()
    now_ns = time.perf_counter_ns()
    spans = engine.collect_spans()
    work = engine.work.intervals(now_ns)
    timings = {
        rid: RequestTiming(arrivals[rid], states[rid].first_scheduled_time, token_times[rid])
        for rid in states if rid in finished
    }
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    meta: dict[str, Any] = {
        "num_submitted": nxt, "num_finished": len(finished), "prefix_cache_hits": hits,
        "prefix_cache_queries": queries, "prefix_cache_hit_rate": hits / queries if queries else 0.0}
    run_grammar = grammar.stats().since(grammar_before)
    if run_grammar.nonzero:
        meta["grammar"] = run_grammar.to_dict()
    run_spec = spec_decode_since(before, after)
    if run_spec is not None:
        meta["spec_decode"] = run_spec
    return RunResult(
        name=name, timings=timings, spans=spans, work_intervals=work,
        num_stages=engine.config.parallel.pipeline_parallel_size,
        num_prompt_tokens=sum(r.prompt_len for r in requests),
        num_preemptions=after.num_preemptions, aborted=aborted, meta=meta,
    )


# ---------------------------------------------------------------------------------------------
# Online replay through the gRPC server


def replay_grpc(
    spec: EngineSpec,
    policy: str,
    requests: Sequence[WorkloadRequest],
    prompts: Sequence[list[int]],
    *,
    workdir: str,
    name: str = "run",
    progress: bool = True,
    token_budget: int | None = None,
    start_timeout_s: float = 300.0,
    request_timeout_s: float = 1800.0,
) -> RunResult:
    """Start `ppserve serve` (its own Ray) for one policy, stream every request at its arrival time
    through `AsyncPPServeClient`, stop the server and read its trace for bubble figures."""
    import asyncio
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from ppserve.metrics.trace import load_chrome_trace

    trace_path = Path(workdir) / f"{name}-server-trace.json"
    sets = [arg for s in spec.settings(policy, token_budget) for arg in ("--set", s)]
    cmd = [sys.executable, "-m", "ppserve.cli", "serve", "--port", "0", "--http-port", "-1", *sets,
           "--set", f"trace.path={trace_path}"]
    log_path = Path(workdir) / f"{name}-server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below, after the process ends
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
    address = None
    try:
        t_start = time.monotonic()
        assert proc.stdout is not None
        while address is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"ppserve serve exited before serving (rc={proc.poll()}); see {log_path}")
            if line.startswith("ppserve serving on "):
                address = line.split("ppserve serving on ", 1)[1].strip()
            if time.monotonic() - t_start > start_timeout_s:
                raise RuntimeError(f"ppserve serve did not start in {start_timeout_s} s; see {log_path}")
        timings = asyncio.run(_grpc_clients(address, requests, prompts, name, progress, request_timeout_s))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    spans: list[Span] = []
    work: list[WorkInterval] | None = None
    if trace_path.exists():
        spans, work = load_chrome_trace(trace_path)[:2]
    else:
        logger.warning("the server wrote no trace at %s: no bubble figures for %s", trace_path, name)
    return RunResult(name=name, timings=timings, spans=spans, work_intervals=work or [],
                     num_stages=spec.pp, num_prompt_tokens=sum(r.prompt_len for r in requests),
                     timings_on_span_clock=False,
                     meta={"mode": "grpc", "server": address, "trace": str(trace_path)})


async def _grpc_clients(
    address: str,
    requests: Sequence[WorkloadRequest],
    prompts: Sequence[list[int]],
    name: str,
    progress: bool,
    timeout_s: float,
) -> dict[str, RequestTiming]:
    import asyncio

    from ppserve.server.client import AsyncPPServeClient

    bar = _progress(len(requests), name, progress)
    out: dict[str, RequestTiming] = {}
    async with AsyncPPServeClient(address) as client:
        await client.wait_ready(60.0)
        loop_t0 = time.time()

        async def one(k: int) -> None:
            w = requests[k]
            await asyncio.sleep(max(0.0, loop_t0 + w.arrival_s - time.time()))
            arrival = time.time()
            c = await client.generate(prompts[k], max_tokens=w.output_len, ignore_eos=True,
                                      request_id=f"r{k}", timeout=timeout_s)
            queue = (c.metrics or {}).get("queue_time_s")
            # Token times are server Unix seconds; client and server share this machine's clock.
            out[f"r{k}"] = RequestTiming(arrival, None if queue is None else arrival + queue,
                                         list(c.token_times))
            bar.update(1)

        try:
            await asyncio.gather(*(one(k) for k in range(len(requests))))
        finally:
            bar.close()
    return out
