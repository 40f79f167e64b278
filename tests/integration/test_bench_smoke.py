"""Every benchmark runs end to end on a tiny input: a tiny random Llama (no tokenizer, so prompts are
random token ids), pp=2 on the session's Ray, a handful of requests. Figures are not checked, only
that each suite produces its files and sane shapes (benchmarks are not tests,
ARCHITECTURE.md#tests-and-benchmarks)."""

from __future__ import annotations

import json

import pytest

from ppserve.bench import suites
from ppserve.bench.harness import EngineSpec, build_llm, replay, warm_up
from ppserve.bench.prompts import PromptBuilder
from ppserve.bench.workloads import WorkloadSpec, build_workload


@pytest.fixture()
def ctx(tiny_llama_dir, tmp_path, ray_session):
    engine = EngineSpec(model=str(tiny_llama_dir), pp=2, token_budget=16, max_num_seqs=4, block_size=4,
                        max_model_len=128)
    workload = WorkloadSpec(source="uniform", num_requests=6, prompt_min=4, prompt_max=40, output_min=2,
                            output_max=6, arrival="poisson", rate=50.0, max_model_len=128)
    return suites.BenchContext(engine, workload, tmp_path, progress=False)


def test_random_id_prompts_without_tokenizer():
    b = PromptBuilder(None, vocab_size=256, seed=3)
    prompts = b.build([1, 5, 40])
    assert [len(p) for p in prompts] == [1, 5, 40]
    assert all(3 <= t < 256 for p in prompts for t in p)
    assert prompts == PromptBuilder(None, 256, seed=3).build([1, 5, 40])


def test_workload_specs():
    trace = build_workload(WorkloadSpec(num_requests=10, prefill_scale=0.1, decode_scale=0.1, rate=2.0))
    assert len(trace) == 10 and trace[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:], strict=False))
    fixed = build_workload(WorkloadSpec(source="fixed", num_requests=3, total_tokens=50, pd_ratio=4.0,
                                        arrival="at-once"))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(40, 10)}
    zipf = build_workload(WorkloadSpec(source="zipf", num_requests=5, prompt_min=4, prompt_max=9))
    assert all(4 <= r.prompt_len <= 9 for r in zipf)
    with pytest.raises(ValueError):
        WorkloadSpec(source="nope")


def test_replay_records_every_token(ctx):
    reqs = build_workload(ctx.workload)
    prompts = PromptBuilder(None, 256, 0).build([r.prompt_len for r in reqs])
    llm = build_llm(ctx.engine, "sarathi")
    try:
        warm_up(llm.engine, num_requests=2, prompt_len=8, max_tokens=2)
        run = replay(llm.engine, reqs, prompts, progress=False)
    finally:
        llm.shutdown()
    assert len(run.timings) == len(reqs)
    assert sorted(len(t.token_times_s) for t in run.timings.values()) == sorted(r.output_len for r in reqs)
    for t in run.timings.values():
        assert t.first_scheduled_s is not None and t.first_scheduled_s >= t.arrival_s
        assert t.token_times_s[0] >= t.first_scheduled_s
    s = run.summary()
    # Recomputed from the run's own spans: a stage's busy time is the union of its prepare, compute and send
    # spans in the window, and busy + bubble + starvation fill it; the second stage idles while the first
    # computes the first microbatch, so there is a bubble.
    from ppserve.metrics.bubbles import bubble_report, intersect, resolve_window, total, union

    rep = bubble_report(run.spans, run.work_intervals, "active")
    _, window = resolve_window(run.spans, run.work_intervals, "active")
    for st in rep.stages:  # tp = 1: one rank per stage
        spans = [(x.start_ns, x.end_ns) for x in run.spans if x.stage == st.stage
                 and x.kind in ("prepare", "compute", "send")]
        assert st.busy_ns == total(intersect(union(spans), window))
        assert st.busy_ns + st.bubble_ns + st.starvation_ns == total(window)
    # The last stage's sends are busy like every other stage's: each sampling step's tokens down the ring to
    # stage 0, then its result to the engine, both after its compute.
    last = max(x.stage for x in run.spans)
    computed = {x.step_id: x for x in run.spans if x.stage == last and x.kind == "compute"
                and x.num_decode_tokens}
    sends: dict[int, list] = {}
    for x in run.spans:
        if x.stage == last and x.kind == "send":
            sends.setdefault(x.step_id, []).append(x)
    assert computed and set(computed) <= set(sends)
    assert all(len(sends[i]) == 2 and min(x.start_ns for x in sends[i]) >= c.end_ns
               for i, c in computed.items())
    assert s["bubbles"]["mean_bubble_fraction"] == pytest.approx(rep.mean_bubble_fraction)
    assert 0.0 < rep.mean_bubble_fraction < 1.0
    assert len(s["bubbles"]["stages"]) == 2
    assert s["latency"]["num_requests"] == len(reqs)


def test_compare_via_cli(tiny_llama_dir, tmp_path, ray_session):
    from ppserve.bench.cli import main

    out = tmp_path / "cmp"
    rc = main(["--model", str(tiny_llama_dir), "--pp", "2", "--token-budget", "16", "--max-num-seqs", "4",
               "--block-size", "4", "--max-model-len", "128", "--workload", "uniform", "--num-requests", "5",
               "--prompt-range", "4,30", "--output-range", "2,5", "--rate", "50", "--out", str(out),
               "--no-progress", "--policies", "sarathi,vllm"], "compare")
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["summaries"]) == {"sarathi", "vllm"}
    assert "random token ids" in data["prompt_source"]
    for name in ("table.md", "latency_cdf.png", "bubbles.png", "profile.json", "traces/sarathi.json"):
        assert (out / name).exists(), name
    assert "| sarathi |" in (out / "table.md").read_text()


def test_capacity_real_and_sim(ctx):
    # Real probes for one policy (each policy costs a pipeline build), the simulator for both.
    # A probe covers 0.3 s of arrivals: 6 requests (the workload's) at the start rate, more above it.
    data = suites.capacity(ctx, ["sarathi"], on="both", start_rate=20.0, max_evals=2, sim_num_requests=20,
                           sim_max_evals=6, run_slack_s=30.0, probe_duration_s=0.3)
    assert set(data["results"]) == {"real/sarathi", "sim/sarathi"}
    assert data["probe"] == {"duration_s": 0.3, "min_requests": 6, "max_requests": 20_000}
    sim_only = suites.capacity(ctx, ["sarathi", "vllm"], on="sim", start_rate=20.0, sim_num_requests=20,
                               sim_max_evals=6, tbt_slo_s=data["slo"]["tbt_p99_s"], probe_duration_s=0.3,
                               profile_path=str(ctx.outdir / "profile.json"))
    assert set(sim_only["results"]) == {"sim/sarathi", "sim/vllm"}
    assert all(len(r["probes"]) >= 1 for r in data["results"].values())
    assert data["slo"]["tbt_p99_s"] > 0 and data["slo"]["decode_step_s"] > 0
    assert (ctx.outdir / "capacity.png").exists() and (ctx.outdir / "capacity.md").exists()


def test_sweep(ctx):
    data = suites.sweep(ctx, [8])  # one pipeline build per budget: one budget keeps the smoke test short
    assert [r["token_budget"] for r in data["rows"]] == [8]
    assert (ctx.outdir / "sweep.png").exists() and (ctx.outdir / "sweep.md").exists()


def test_validate(ctx):
    from dataclasses import replace

    check = suites.CapacityCheck(probe_duration_s=0.3, max_evals=2, rel_tol=0.25)
    data = suites.validate(ctx, replace(ctx.workload, seed=9), capacity=check)
    assert len(data["rows"]) == 2
    assert data["rows"][1]["stage0_busy_real_s"] > 0 and data["rows"][1]["stage0_busy_sim_s"] > 0
    assert all(data["rows"][1][f"{k}_real"] > 0 for k in ("tbt_p90", "ttft_p90", "ttft_p99", "throughput"))
    assert isinstance(data["within_tolerance"], bool)
    # B's capacity, simulated over A's fitted profile and over the start-up one, and real, under one SLO of
    # five measured decode steps; the real search starts where the first simulated one ended and stops after
    # its two probes.
    cap = data["capacity"]
    assert (cap["slo"]["tbt_p99_s"] == pytest.approx(5 * cap["slo"]["decode_step_s"])
            and cap["slo"]["decode_step_s"] > 0)
    assert list(cap["sim"]) == ["fitted on A", "start-up"] and 1 <= len(cap["real"]["probes"]) <= 2
    fitted = cap["sim"]["fitted on A"]
    if fitted["capacity"]:
        assert cap["real"]["probes"][0]["rate"] == pytest.approx(fitted["capacity"])
    for sim in cap["sim"].values():
        assert sim["probes"]
        if sim["capacity"] and cap["real"]["capacity"]:
            assert sim["error"] == pytest.approx(sim["capacity"] / cap["real"]["capacity"] - 1)
    assert "capacity of B" in (ctx.outdir / "validate.md").read_text()


def test_compare_through_grpc(ctx):
    from dataclasses import replace

    c = replace(ctx, mode="grpc", workload=replace(ctx.workload, num_requests=3))
    data = suites.compare(c, ["sarathi"])
    s = data["summaries"]["sarathi"]
    assert s["latency"]["num_requests"] == 3
    assert s["latency"]["scheduling_delay_s"]["count"] == 3
    assert "bubbles" in s
