"""The four benchmarks, each a function from settings to a results folder:

- `compare`:  one workload, one seed, several policies side by side in one run
              (ARCHITECTURE.md#how-a-microbatch-is-formed, #serving-metrics);
- `capacity`: the Sarathi-Serve capacity search per policy, on the real pipeline and/or the simulator;
- `sweep`:    token budget vs p99 TBT and throughput (sarathi);
- `validate`: the simulator, fitted to a profile of the real pipeline on workload A, predicts per-stage
              busy time and p50 TBT of a held-out workload B.

Each writes results.json, a markdown file and plots into its folder and returns the JSON data.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ppserve.bench import report
from ppserve.bench.harness import (
    EngineSpec,
    RunResult,
    build_llm,
    measure_decode_step,
    replay,
    replay_grpc,
    summarize_run,
    warm_up,
)
from ppserve.bench.prompts import PromptBuilder
from ppserve.bench.workloads import WorkloadSpec, build_workload, workload_stats
from ppserve.metrics.capacity import SLO, Probe, ProbeSize, find_capacity, probe_from_summary
from ppserve.metrics.spans import Span
from ppserve.sim.workload import WorkloadRequest

__all__ = ["BenchContext", "CapacityCheck", "compare", "capacity", "sweep", "validate", "estimate_overhead_s",
           "load_prompt_builder"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchContext:
    engine: EngineSpec
    workload: WorkloadSpec
    outdir: Path
    mode: str = "offline"  # offline (drive the engine) | grpc (through `ppserve serve`)
    progress: bool = True
    save_traces: bool = True

    def settings(self) -> dict[str, Any]:
        return {"engine": dataclasses.asdict(self.engine), "workload": self.workload.to_dict(),
                "mode": self.mode}

    def scale_note(self) -> str:
        w = self.workload
        scale = (f", prefill x{w.prefill_scale:g}, decode x{w.decode_scale:g}"
                 if w.source.startswith("trace:") else "")
        arr = f"Poisson {w.rate:g} req/s" if w.arrival == "poisson" else w.arrival
        return (f"{w.source}{scale}, {w.num_requests} requests, {arr}, seed {w.seed}; pp={self.engine.pp}, "
                f"budget {self.engine.token_budget}, max_num_seqs {self.engine.max_num_seqs}, "
                f"seq cap {'on' if self.engine.seq_cap else 'off'}, {self.mode}")


def _bar(it: Any, desc: str, enabled: bool, total: int | None = None) -> Any:
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, total=total, disable=not enabled, dynamic_ncols=True)


def load_prompt_builder(spec: EngineSpec, seed: int) -> PromptBuilder:
    """The served model's tokenizer (None for a checkpoint without one) and vocabulary, no engine needed."""
    from ppserve.model.loader import read_hf_config, resolve_model

    model_dir = resolve_model(spec.model)
    vocab = int(read_hf_config(model_dir)["vocab_size"])
    tok = None
    if any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
    return PromptBuilder(tok, vocab, seed)


def _inputs(ctx: BenchContext, workload: WorkloadSpec | None = None, builder: PromptBuilder | None = None
            ) -> tuple[list[WorkloadRequest], list[list[int]], PromptBuilder]:
    w = workload or ctx.workload
    reqs = build_workload(w)
    builder = builder or load_prompt_builder(ctx.engine, w.seed)
    return reqs, builder.build_for(reqs), builder


def _samples(run: RunResult) -> dict[str, list[float]]:
    ts = run.timings.values()
    return {
        "ttft_s": [t.ttft_s for t in ts if t.ttft_s is not None],
        "tbt_s": [g for t in ts for g in t.tbt_gaps_s],
        "scheduling_delay_s": [t.scheduling_delay_s for t in ts if t.scheduling_delay_s is not None],
    }


def _save_trace(ctx: BenchContext, run: RunResult, name: str) -> None:
    if ctx.save_traces and run.spans:
        from ppserve.metrics.trace import save_chrome_trace

        (ctx.outdir / "traces").mkdir(exist_ok=True)
        save_chrome_trace(ctx.outdir / "traces" / f"{name}.json", run.spans,
                          work_intervals=run.work_intervals)


def _renumbered(runs: Sequence[RunResult]) -> list[Span]:
    """Spans of several runs in one list, step ids made distinct (fit_profile keys on them)."""
    out: list[Span] = []
    for k, r in enumerate(runs):
        out.extend(replace(s, step_id=s.step_id + k * 10_000_000) for s in r.spans)
    return out


def run_policy(ctx: BenchContext, policy: str, reqs: Sequence[WorkloadRequest], prompts: Sequence[list[int]],
               name: str | None = None, token_budget: int | None = None) -> RunResult:
    """One policy on one workload: build, warm up, replay, tear down."""
    name = name or policy
    if ctx.mode == "grpc":
        run = replay_grpc(ctx.engine, policy, reqs, prompts, workdir=str(ctx.outdir), name=name,
                          progress=ctx.progress, token_budget=token_budget)
    else:
        llm = build_llm(ctx.engine, policy, token_budget)
        try:
            warm_up(llm.engine)
            run = replay(llm.engine, reqs, prompts, name=name, progress=ctx.progress)
            run.meta["num_kv_blocks"] = llm.engine.executor.num_kv_blocks
        finally:
            llm.shutdown()
    run.meta.update(policy=policy, token_budget=token_budget or ctx.engine.token_budget)
    _save_trace(ctx, run, name)
    return run


# ---------------------------------------------------------------------------------------------
# compare


def _goals(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The pipeline issue's goals, measured (None when a policy is missing)."""
    s, v = summaries.get("sarathi"), summaries.get("vllm")
    if s is None:
        return {}
    bs = s.get("bubbles", {}).get("mean_bubble_fraction")
    out: dict[str, Any] = {"sarathi_mean_bubble_fraction": bs,
                           "sarathi_bubble_le_10pct": None if bs is None else bs <= 0.10}
    if v is not None:
        bv = v.get("bubbles", {}).get("mean_bubble_fraction")
        tv, ts = v["latency"]["tbt_s"]["p99"], s["latency"]["tbt_s"]["p99"]
        out["vllm_over_sarathi_bubble"] = bv / bs if bv is not None and bs else None
        out["vllm_over_sarathi_p99_tbt"] = tv / ts if tv is not None and ts else None
        out["bubble_3x_lower_than_vllm"] = None if out["vllm_over_sarathi_bubble"] is None else (
            out["vllm_over_sarathi_bubble"] >= 3)
        out["p99_tbt_3x_lower_than_vllm"] = None if out["vllm_over_sarathi_p99_tbt"] is None else (
            out["vllm_over_sarathi_p99_tbt"] >= 3)
    return out


def compare(ctx: BenchContext, policies: Sequence[str] = ("sarathi", "vllm", "orca", "static"),
            command: str = "") -> dict[str, Any]:
    """Every policy on the same workload (same prompts, same arrivals), one after another in one process."""
    from ppserve.sim.cost_model import fit_profile

    reqs, prompts, builder = _inputs(ctx)
    runs: dict[str, RunResult] = {}
    for policy in _bar(policies, "policies", ctx.progress):
        runs[policy] = run_policy(ctx, policy, reqs, prompts)
    summaries = {name: r.summary() for name, r in runs.items()}
    note = ctx.scale_note()
    data: dict[str, Any] = {
        "suite": "compare", "command": command, "settings": ctx.settings(), "note": note,
        "prompt_source": builder.source, "workload": workload_stats(reqs), "summaries": summaries,
        "ratios": report.ratio_lines(summaries), "goals": _goals(summaries),
    }
    try:
        prof = fit_profile(_renumbered(list(runs.values())), note=f"fitted from compare runs: {note}")
        prof.save(ctx.outdir / "profile.json")
        data["profile"] = str(ctx.outdir / "profile.json")
    except ValueError as e:
        logger.warning("no profile: %s", e)
    table = report.policy_table(list(summaries.values()))
    md = [f"# Policy comparison\n\n{note}\n", f"`{command}`\n" if command else "", table, "",
          *[f"- {line}" for line in data["ratios"]], "", "Goals: " + str(data["goals"])]
    (ctx.outdir / "table.md").write_text("\n".join(md) + "\n")
    report.write_json(ctx.outdir / "results.json", data)
    report.plot_latency_cdfs({n: _samples(r) for n, r in runs.items()}, ctx.outdir / "latency_cdf.png", note)
    report.plot_bubble_bars(summaries, ctx.outdir / "bubbles.png", note)
    print(table)
    for line in data["ratios"]:
        print(line)
    print(f"goals: {data['goals']}\nresults in {ctx.outdir}")
    return data


# ---------------------------------------------------------------------------------------------
# capacity


def estimate_overhead_s(spans: Sequence[Span]) -> float:
    """The engine's time per returned microbatch that a cost model does not see: from the last
    stage's end of a microbatch to the next schedule() (collect + update + Ray return), plus from
    schedule() to stage 0 starting it when stage 0 was idle (Ray dispatch). Medians, seconds."""
    compute = [s for s in spans if s.kind == "compute" and s.stage >= 0]
    if not compute:
        return 0.0
    last = max(s.stage for s in compute)
    ends = sorted(s.end_ns for s in compute if s.stage == last)
    scheds = [s for s in spans if s.kind == "schedule"]
    sched_starts = sorted(s.start_ns for s in scheds)
    import bisect

    back = []
    for e in ends:
        i = bisect.bisect_left(sched_starts, e)
        if i < len(sched_starts):
            back.append(sched_starts[i] - e)
    first0 = {s.step_id: s.start_ns for s in compute if s.stage == 0}
    free0 = sorted((s.end_ns, s.step_id) for s in compute if s.stage == 0)
    prev_end = {step: (free0[k - 1][0] if k else 0) for k, (_, step) in enumerate(free0)}
    dispatch = [first0[s.step_id] - s.end_ns for s in scheds
                if s.step_id in first0 and prev_end.get(s.step_id, 0) <= s.end_ns]
    med = (lambda xs: statistics.median(xs) if xs else 0)  # noqa: E731
    # Gaps beyond a second are idle time (no work), not overhead.
    return (med([b for b in back if b < 1e9]) + med([d for d in dispatch if 0 <= d < 1e9])) * 1e-9


def sim_config(ctx: BenchContext, policy: str, overhead_s: float, num_blocks: int | None,
               token_budget: int | None = None) -> Any:
    from ppserve.config import SchedulerConfig
    from ppserve.sim.simulator import SimConfig

    e = ctx.engine
    sched = SchedulerConfig(policy=policy, token_budget=token_budget or e.token_budget,
                            max_num_seqs=e.max_num_seqs,
                            per_microbatch_seq_cap=e.seq_cap)
    return SimConfig(scheduler=sched, num_blocks=num_blocks or 100_000, block_size=e.block_size or 16,
                     max_model_len=e.max_model_len or 2048, schedule_overhead_s=overhead_s)


def simulate_summary(ctx: BenchContext, policy: str, reqs: Sequence[WorkloadRequest], profile: Any,
                     overhead_s: float, num_blocks: int | None) -> tuple[dict[str, Any], Any]:
    from ppserve.sim.cost_model import ProfileCostModel
    from ppserve.sim.simulator import simulate

    res = simulate(reqs, ProfileCostModel(profile), sim_config(ctx, policy, overhead_s, num_blocks))
    s = summarize_run(res.timings, res.spans, res.work_intervals, num_stages=res.num_stages)
    s.update(name=f"sim/{policy}", num_preemptions=res.num_preemptions, aborted=False)
    return s, res


def capacity(ctx: BenchContext, policies: Sequence[str] = ("sarathi", "vllm"), *, on: str = "both",
             tbt_slo_s: float | None = None, tbt_factor: float = 5.0, sched_delay_slo_s: float = 2.0,
             start_rate: float = 1.0, max_evals: int = 5, rel_tol: float = 0.1, sim_num_requests: int = 200,
             sim_max_evals: int = 14, profile_path: str | None = None, run_slack_s: float = 60.0,
             probe_duration_s: float = 60.0, command: str = "") -> dict[str, Any]:
    """Capacity per policy: `on` = real | sim | both. The TBT SLO defaults to `tbt_factor` x the
    measured decode-only step (median TBT of a decode-only load on the first policy's pipeline).

    A probe at rate r replays `probe_duration_s` seconds of arrivals (r x duration requests: the workload's
    first rows, at least its `num_requests` on the real pipeline and `sim_num_requests` in the simulator),
    as `ppserve plan` does (metrics.capacity.ProbeSize: a fixed count would hide a queue at high rates)."""
    if on not in ("real", "sim", "both"):
        raise ValueError(f"capacity on must be real, sim or both, got {on!r}")
    reqs0, _, builder = _inputs(ctx)
    real = _RealCapacity(ctx, builder, tbt_slo_s, tbt_factor, sched_delay_slo_s, run_slack_s,
                         ProbeSize(probe_duration_s, ctx.workload.num_requests,
                                   max(ctx.workload.num_requests, 20_000)))
    results: dict[str, dict[str, Any]] = {}
    if on in ("real", "both") or profile_path is None or tbt_slo_s is None:
        # The real pipeline: the probes themselves, or (simulator only) one run for the profile and the SLO.
        for policy in _bar(policies if on != "sim" else policies[:1], "capacity (real)", ctx.progress):
            res = real.search(policy, start_rate, max_evals, rel_tol, calibrate_only=on == "sim")
            if res is not None:
                results[f"real/{policy}"] = res.to_dict()
    slo = real.slo()
    data: dict[str, Any] = {
        "suite": "capacity", "command": command, "settings": ctx.settings(),
        "slo": {"tbt_p99_s": slo.tbt_p99_s, "sched_delay_p50_s": slo.sched_delay_p50_s,
                "decode_step_s": real.decode_step, "tbt_factor": tbt_factor if real.decode_step else None},
        "probe": dataclasses.asdict(real.size),
        "prompt_source": builder.source, "workload": workload_stats(reqs0),
    }
    if on in ("sim", "both"):
        sim_size = ProbeSize(probe_duration_s, sim_num_requests, max(sim_num_requests, 20_000))
        data["sim"] = _simulated_capacity(ctx, policies, real, profile_path, sim_size, start_rate,
                                          sim_max_evals, slo, results)
    data["results"] = results
    data["ratios"] = _capacity_ratios(results)
    _report_capacity(ctx, data, slo, real.decode_step, tbt_factor, command)
    return data


class _RealCapacity:
    """Capacity probes on the real pipeline, one pipeline per policy; the SLO is measured on the first."""

    def __init__(self, ctx: BenchContext, builder: PromptBuilder, tbt_slo_s: float | None, tbt_factor: float,
                 sched_delay_slo_s: float, run_slack_s: float, size: ProbeSize) -> None:
        self.ctx, self.builder, self.size = ctx, builder, size
        self.tbt_slo_s, self.tbt_factor, self.sched_delay_slo_s = tbt_slo_s, tbt_factor, sched_delay_slo_s
        self.run_slack_s = run_slack_s
        self.decode_step: float | None = None
        self.runs: list[RunResult] = []
        self.num_blocks: int | None = None

    def slo(self) -> SLO:
        assert self.tbt_slo_s is not None, "no SLO: give one or measure it on a real pipeline"
        return SLO(self.tbt_slo_s, self.sched_delay_slo_s)

    def search(self, policy: str, start_rate: float, max_evals: int, rel_tol: float,
               calibrate_only: bool = False) -> Any:
        """The capacity of `policy` (None with `calibrate_only`: one probe at the start rate)."""
        llm = build_llm(self.ctx.engine, policy)
        try:
            eng = llm.engine
            warm_up(eng)
            self.num_blocks = eng.executor.num_kv_blocks
            if self.tbt_slo_s is None:
                self.decode_step = measure_decode_step(eng)
                self.tbt_slo_s = self.tbt_factor * self.decode_step
                logger.info("decode step %.4f s -> TBT SLO %.4f s", self.decode_step, self.tbt_slo_s)
            slo = self.slo()

            def evaluate(rate: float) -> Probe:
                # Poisson only moves arrivals (monotone in the row index): the k-th request keeps its
                # length and its prompt at every rate; a higher rate replays more of the rows.
                reqs = probe_workload(self.ctx.workload, rate, self.size)
                span = max(r.arrival_s for r in reqs)
                # Every probe replays the same first rows' prompts: cached by the probes before, they would
                # cost a later probe almost no prefill and pass a rate it fails cold. Each probe starts
                # cold, as a simulated one does (docs/decisions.md#capacity-probes-start-cold).
                eng.reset_prefix_cache()
                run = replay(eng, reqs, self.builder.build_for(reqs), name=f"{policy}@{rate:.3g}",
                             progress=self.ctx.progress,
                             max_duration_s=span + self.run_slack_s)
                self.runs.append(run)
                return probe_from_summary(rate, run.summary(), slo)

            if calibrate_only:
                evaluate(start_rate)
                return None
            res = find_capacity(evaluate, start_rate, max_evals=max_evals, rel_tol=rel_tol,
                                on_probe=lambda p: logger.info("probe %s", p))
            print(f"real/{policy}: capacity {res.capacity} req/s; probes "
                  + ", ".join(f"{p.rate:.3g}:{'ok' if p.ok else 'FAIL'}" for p in res.probes))
            return res
        finally:
            llm.shutdown()


def probe_workload(workload: WorkloadSpec, rate: float, size: ProbeSize) -> list[WorkloadRequest]:
    """The requests one capacity probe at `rate` replays: the workload's first `size.requests_at(rate)` rows
    (a fixed duration of arrivals) at Poisson `rate`."""
    return build_workload(replace(workload.with_rate(rate), num_requests=size.requests_at(rate)))


def simulated_probe(ctx: BenchContext, policy: str, rate: float, profile: Any, overhead_s: float,
                    num_blocks: int | None, size: ProbeSize, slo: SLO) -> Probe:
    """One capacity probe in the simulator: `probe_workload` over the profile, judged against the SLO."""
    s, _ = simulate_summary(ctx, policy, probe_workload(ctx.workload, rate, size), profile, overhead_s,
                            num_blocks)
    return probe_from_summary(rate, s, slo)


def _simulated_capacity(ctx: BenchContext, policies: Sequence[str], real: _RealCapacity,
                        profile_path: str | None,
                        size: ProbeSize, start_rate: float, sim_max_evals: int, slo: SLO,
                        results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Capacity in the simulator, over a profile fitted from the real probes (or a saved one)."""
    from ppserve.sim.cost_model import Profile, fit_profile

    if profile_path:
        profile = Profile.load(profile_path)
        overhead = estimate_overhead_s(real.runs[0].spans) if real.runs else 0.0
    else:
        profile = fit_profile(_renumbered(real.runs), note="fitted from the capacity probes' spans")
        overhead = statistics.median(estimate_overhead_s(r.spans) for r in real.runs)
        profile.save(ctx.outdir / "profile.json")
    for policy in _bar(policies, "capacity (sim)", ctx.progress):

        def sim_eval(rate: float, policy: str = policy) -> Probe:
            return simulated_probe(ctx, policy, rate, profile, overhead, real.num_blocks, size, slo)

        res = find_capacity(sim_eval, start_rate, max_evals=sim_max_evals, rel_tol=0.02)
        results[f"sim/{policy}"] = res.to_dict()
        print(f"sim/{policy}: capacity {res.capacity} req/s ({len(res.probes)} probes)")
    return {"overhead_s": overhead, "probe": dataclasses.asdict(size), "profile": dataclasses.asdict(profile)}


def _capacity_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    for where in ("real", "sim"):
        base = results.get(f"{where}/sarathi", {}).get("capacity")
        for label, r in results.items():
            if (label.startswith(where + "/") and not label.endswith("/sarathi") and base
                    and r.get("capacity")):
                ratios[f"{where}: sarathi / {label.split('/', 1)[1]}"] = base / r["capacity"]
    return ratios


def _report_capacity(ctx: BenchContext, data: dict[str, Any], slo: SLO, decode_step: float | None,
                     tbt_factor: float, command: str) -> None:
    results, ratios = data["results"], data["ratios"]
    note = (f"{ctx.scale_note()}; SLO p99 TBT <= {slo.tbt_p99_s * 1e3:.0f} ms"
            + (f" ({tbt_factor:g}x decode step {decode_step * 1e3:.0f} ms)" if decode_step else "")
            + f", median scheduling delay <= {slo.sched_delay_p50_s:g} s")
    table = report.capacity_table(results)
    md = [f"# Capacity\n\n{note}\n", f"`{command}`\n" if command else "", table, "",
          *[f"- {k}: {v:.2f}x" for k, v in ratios.items()]]
    (ctx.outdir / "capacity.md").write_text("\n".join(md) + "\n")
    report.write_json(ctx.outdir / "results.json", data)
    report.plot_capacity(results, ctx.outdir / "capacity.png", slo.tbt_p99_s, note)
    print(table)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    print(f"results in {ctx.outdir}")


# ---------------------------------------------------------------------------------------------
# sweep


def sweep(ctx: BenchContext, budgets: Sequence[int] = (32, 64, 128, 256, 512), policy: str = "sarathi",
          command: str = "") -> dict[str, Any]:
    """Token budget vs p99 TBT and throughput on one workload."""
    reqs, prompts, builder = _inputs(ctx)
    rows = []
    for b in _bar(budgets, "budgets", ctx.progress):
        run = run_policy(ctx, policy, reqs, prompts, name=f"{policy}-b{b}", token_budget=b)
        rows.append({"token_budget": b, "summary": run.summary()})
    note = ctx.scale_note().replace(f"budget {ctx.engine.token_budget}", f"{policy}, budgets {list(budgets)}")
    data = {"suite": "sweep", "command": command, "settings": ctx.settings(), "note": note,
            "prompt_source": builder.source, "workload": workload_stats(reqs), "rows": rows}
    table = report.sweep_table(rows)
    (ctx.outdir / "sweep.md").write_text(f"# Token-budget sweep\n\n{note}\n\n"
                                         + (f"`{command}`\n\n" if command else "")
                                         + table + "\n")
    report.write_json(ctx.outdir / "results.json", data)
    report.plot_sweep(rows, ctx.outdir / "sweep.png", note)
    print(table)
    print(f"results in {ctx.outdir}")
    return data


# ---------------------------------------------------------------------------------------------
# validate


def _rel(pred: float | None, real: float | None) -> float | None:
    return None if pred is None or not real else (pred - real) / real


@dataclass(frozen=True)
class CapacityCheck:
    """`validate`'s capacity comparison: the held-out workload's capacity under `bench capacity`'s SLO (p99
    TBT <= `tbt_factor` decode steps, measured on the pipeline; median scheduling delay <= 2 s), searched in
    the simulator over the profile fitted on A (and over the stages' start-up step costs, the profile
    `plan_then_run.py` plans with), then on the real pipeline from the first simulated capacity, bracketed
    to `rel_tol`. Both replay B's rows from its first, `probe_duration_s` seconds of arrivals a
    probe (`probe_workload`), every real probe from an empty prefix cache."""

    probe_duration_s: float = 30.0
    max_evals: int = 6  # real probes
    rel_tol: float = 0.05
    tbt_factor: float = 5.0
    sched_delay_slo_s: float = 2.0


def validate(ctx: BenchContext, held_out: WorkloadSpec | None = None, policy: str = "sarathi",
             tolerance: float = 0.15, command: str = "",
             capacity: CapacityCheck | None = None) -> dict[str, Any]:
    """Real run on A -> fit profile -> simulate B; real run on B; compare per-stage busy time, TBT and TTFT
    percentiles, bubble and throughput (and with `capacity`, B's capacity: `CapacityCheck`)."""
    from ppserve.sim.cost_model import Profile, fit_profile

    wa = ctx.workload
    wb = held_out or replace(wa, start=wa.start + wa.num_requests, seed=wa.seed + 1)
    reqs_a, prompts_a, builder = _inputs(ctx, wa)
    reqs_b, prompts_b, _ = _inputs(ctx, wb, builder)
    llm = build_llm(ctx.engine, policy)
    try:
        warm_up(llm.engine)
        num_blocks = llm.engine.executor.num_kv_blocks
        runs = {}
        for label, reqs, prompts in _bar([("A", reqs_a, prompts_a), ("B", reqs_b, prompts_b)], "workloads",
                                         ctx.progress):
            runs[label] = replay(llm.engine, reqs, prompts, name=f"real-{label}", progress=ctx.progress)
            _save_trace(ctx, runs[label], f"real-{label}")
        # The capacity check's SLO, measured after A and B so that their runs are those of a plain validate.
        decode_step = measure_decode_step(llm.engine) if capacity is not None else None
        startup = llm.engine.executor.startup_cost  # the stages' start-up step costs (worker/startup_cost.py)
    finally:
        llm.shutdown()
    profile = fit_profile(runs["A"].spans, note=f"fitted from workload A ({wa.label()})")
    profile.save(ctx.outdir / "profile.json")
    overhead = estimate_overhead_s(runs["A"].spans)
    out: dict[str, Any] = {"suite": "validate", "command": command, "settings": ctx.settings(),
                           "workload_a": wa.to_dict(), "workload_b": wb.to_dict(), "overhead_s": overhead,
                           "profile": dataclasses.asdict(profile), "prompt_source": builder.source}
    rows = []
    for label, reqs in (("A (in-sample)", reqs_a), ("B (held out)", reqs_b)):
        real = runs[label[0]].summary()
        sim, res = simulate_summary(ctx, policy, reqs, profile, overhead, num_blocks)
        report.write_json(ctx.outdir / f"sim-{label[0]}.json", sim)
        row: dict[str, Any] = {"workload": label}
        for st_real, st_sim in zip(real["bubbles"]["stages"], sim["bubbles"]["stages"], strict=True):
            k = st_real["stage"]
            row[f"stage{k}_busy_real_s"] = st_real["busy_s"]
            row[f"stage{k}_busy_sim_s"] = st_sim["busy_s"]
            row[f"stage{k}_busy_err"] = _rel(st_sim["busy_s"], st_real["busy_s"])
        for key, path in (("tbt_p50", "latency.tbt_s.p50"), ("tbt_p90", "latency.tbt_s.p90"),
                          ("tbt_p99", "latency.tbt_s.p99"), ("ttft_p50", "latency.ttft_s.p50"),
                          ("ttft_p90", "latency.ttft_s.p90"), ("ttft_p99", "latency.ttft_s.p99"),
                          ("bubble_mean", "bubbles.mean_bubble_fraction"),
                          ("throughput", "throughput.requests_per_s"), ("duration", "throughput.duration_s")):
            r, s = report._get(real, path), report._get(sim, path)
            row[f"{key}_real"], row[f"{key}_sim"], row[f"{key}_err"] = r, s, _rel(s, r)
        rows.append(row)
    out["rows"] = rows
    held = rows[1]
    errs = [abs(v) for k, v in held.items() if k.endswith("_busy_err") and v is not None]
    errs.append(abs(held["tbt_p50_err"]) if held["tbt_p50_err"] is not None else float("inf"))
    out["max_abs_error_held_out"] = max(errs)
    out["within_tolerance"] = max(errs) <= tolerance
    cap_line = ""
    if capacity is not None:
        assert decode_step is not None
        profiles = {"fitted on A": profile}
        if startup is not None:
            profiles["start-up"] = Profile(startup, profile.transfer_s, "the stages' start-up step costs")
        out["capacity"] = _validate_capacity(ctx, wb, builder, policy, profiles, overhead, num_blocks,
                                             decode_step,
                                             capacity)
        c = out["capacity"]
        sims = "; ".join(f"simulated over the {name} profile {v['capacity']} req/s, error "
                         + ("-" if v["error"] is None else f"{100 * v['error']:+.1f}%")
                         for name, v in c["sim"].items())
        cap_line = (f"\n\ncapacity of B (p99 TBT <= {1e3 * c['slo']['tbt_p99_s']:.0f} ms, median scheduling "
                    f"delay <= {c['slo']['sched_delay_p50_s']:g} s): real {c['real']['capacity']} req/s "
                    f"(bracket {c['real']['bracket']}); {sims}")
    lines = ["| workload | " + " | ".join(k for k in rows[0] if k != "workload") + " |",
             "|---|" + "---|" * (len(rows[0]) - 1)]
    for r in rows:
        lines.append(f"| {r['workload']} | " + " | ".join(
            "-" if v is None else (f"{100 * v:+.1f}%" if k.endswith("_err") else f"{v:.4g}")
            for k, v in r.items() if k != "workload") + " |")
    table = "\n".join(lines)
    note = (f"{ctx.scale_note()}; A = rows {wa.start}..{wa.start + wa.num_requests - 1}, B = rows "
            f"{wb.start}..{wb.start + wb.num_requests - 1} (seed {wb.seed}); overhead "
            f"{overhead * 1e3:.2f} ms")
    (ctx.outdir / "validate.md").write_text(
        f"# Simulator validation\n\n{note}\n\n" + (f"`{command}`\n\n" if command else "") + table
        + "\n\nmax |error| on held-out B (per-stage busy, p50 TBT): "
        f"{100 * out['max_abs_error_held_out']:.1f}% (tolerance {100 * tolerance:.0f}%)" + cap_line + "\n")
    report.write_json(ctx.outdir / "results.json", out)
    print(table + cap_line)
    print(f"held-out max |error| {100 * out['max_abs_error_held_out']:.1f}% "
          f"({'within' if out['within_tolerance'] else 'outside'} {100 * tolerance:.0f}%); results in "
          f"{ctx.outdir}")
    return out


def _validate_capacity(ctx: BenchContext, wb: WorkloadSpec, builder: PromptBuilder, policy: str,
                       profiles: dict[str, Any], overhead: float, num_blocks: int | None, decode_step: float,
                       check: CapacityCheck) -> dict[str, Any]:
    """B's capacity in the simulator over each profile (the first: fitted on A) and on the real pipeline,
    the same SLO and probes; each error is simulated over real."""
    ctx_b = replace(ctx, workload=wb)
    size = ProbeSize(check.probe_duration_s, wb.num_requests, max(wb.num_requests, ProbeSize.max_requests))
    slo = SLO(check.tbt_factor * decode_step, check.sched_delay_slo_s)
    sims = {name: find_capacity(
                lambda rate, p=p: simulated_probe(ctx_b, policy, rate, p, overhead, num_blocks, size, slo),
                max(wb.rate, 0.1), max_evals=14, rel_tol=check.rel_tol)
            for name, p in profiles.items()}
    first = next(iter(sims.values()))
    real_search = _RealCapacity(ctx_b, builder, slo.tbt_p99_s, check.tbt_factor, check.sched_delay_slo_s,
                                60.0, size)
    real = real_search.search(policy, first.capacity or max(wb.rate, 0.1), check.max_evals, check.rel_tol)
    return {"slo": {"tbt_p99_s": slo.tbt_p99_s, "sched_delay_p50_s": slo.sched_delay_p50_s,
                    "decode_step_s": decode_step, "tbt_factor": check.tbt_factor},
            "probe": dataclasses.asdict(size), "real": real.to_dict(),
            "sim": {name: {**sim.to_dict(), "error": (sim.capacity / real.capacity - 1.0)
                           if sim.capacity and real.capacity else None} for name, sim in sims.items()}}


SUITES: dict[str, Callable[..., dict[str, Any]]] = {
    "compare": compare, "capacity": capacity, "sweep": sweep, "validate": validate,
}
