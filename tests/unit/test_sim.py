"""The simulator on hand-computed pipelines, the cost model's shape, workloads, profile fitting, imports."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from ppserve.config import POLICIES, SchedulerConfig
from ppserve.metrics import gpipe_bubble_fraction
from ppserve.metrics.spans import Span
from ppserve.sched.cost import StepCost
from ppserve.sim import (
    BatchShape,
    ConstantCostModel,
    Profile,
    ProfileCostModel,
    RooflineCostModel,
    SimConfig,
    WorkloadRequest,
    fit_profile,
    kv_cache_blocks,
    load_hardware,
    load_model_spec,
    poisson_arrivals,
    read_trace,
    simulate,
    with_poisson_arrivals,
)
from ppserve.sim.workload import clip_to_context, fixed_ratio, uniform_lengths, zipf_lengths
from tests.unit.imports import assert_imports_without

MS = 1_000_000


def equal_microbatches(m: int, budget: int = 64) -> list[WorkloadRequest]:
    """m requests whose whole prompt is exactly one budget and who want one token: with sarathi each
    microbatch holds exactly one prompt, so the scheduler emits m equal microbatches."""
    return [WorkloadRequest(0.0, budget, 1) for _ in range(m)]


def sim_cfg(budget: int = 64, ring: bool | None = None, **kw) -> SimConfig:
    return SimConfig(SchedulerConfig(token_budget=budget, token_ring=ring), check_invariants=True, **kw)


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 3), (4, 10), (8, 8), (3, 17)])
def test_gpipe_oracle(p, m):
    res = simulate(equal_microbatches(m), ConstantCostModel(p, 0.001), sim_cfg())
    assert res.num_microbatches == m
    rep = res.bubble_report("all")
    assert rep.mean_bubble_fraction == gpipe_bubble_fraction(p, m)
    assert rep.mean_starvation_fraction == 0.0
    assert res.end_s == pytest.approx((m + p - 1) * 0.001)


def test_two_stages_three_microbatches_exact_times():
    d, t, o = 10 * MS, 1 * MS, 2 * MS
    res = simulate(equal_microbatches(3), ConstantCostModel(2, d * 1e-9, t * 1e-9),
                   sim_cfg(ring=False, schedule_overhead_s=o * 1e-9))
    got = {(s.step_id, s.stage): (s.start_ns, s.end_ns) for s in res.spans if s.kind == "compute"}
    # mb 0, 1 enter at 0; mb 2 is scheduled when mb 0 returns (2d + t) plus the overhead o (no token ring:
    # with it mb 2, a prompt that waits for no token, would take the extra slot at once).
    assert got == {
        (0, 0): (0, d), (0, 1): (d + t, 2 * d + t),
        (1, 0): (d, 2 * d), (1, 1): (2 * d + t, 3 * d + t),
        (2, 0): (2 * d + t + o, 3 * d + t + o), (2, 1): (3 * d + 2 * t + o, 4 * d + 2 * t + o),
    }
    waits = {(s.step_id, s.stage): (s.start_ns, s.end_ns) for s in res.spans if s.kind == "recv_wait"}
    assert waits[(0, 1)] == (0, d + t)
    assert waits[(2, 1)] == (3 * d + t, 3 * d + 2 * t + o)
    assert {s.kind for s in res.spans} == {"compute", "recv_wait", "send", "schedule"}
    # Tokens arrive when the last stage finishes; the only token of each request is its first.
    assert res.timings["r2"].token_times_s == [pytest.approx((4 * d + 2 * t + o) * 1e-9)]
    assert res.timings["r0"].ttft_s == pytest.approx((2 * d + t) * 1e-9)
    # Per-request bubble = the transfer gaps (plus r2's wait for stage 1).
    assert res.bubble_report("all").per_request_bubble_ns == {"r0": t, "r1": t, "r2": t}


def test_dispatch_latency_delays_every_stage_start():
    d, t, o, q = 10 * MS, 1 * MS, 2 * MS, 3 * MS
    res = simulate(equal_microbatches(3), ConstantCostModel(2, d * 1e-9, t * 1e-9),
                   sim_cfg(ring=False, schedule_overhead_s=o * 1e-9, dispatch_latency_s=q * 1e-9))
    got = {(s.step_id, s.stage): (s.start_ns, s.end_ns) for s in res.spans if s.kind == "compute"}
    # mb 0 and 1 are scheduled at 0 and reach the stages at q; mb 2 is scheduled when mb 0 returns plus o.
    assert got[(0, 0)] == (q, q + d) and got[(1, 0)] == (q + d, q + 2 * d)
    assert got[(0, 1)] == (q + d + t, q + 2 * d + t)
    back = q + 2 * d + t + o
    assert got[(2, 0)] == (back + q, back + q + d)
    with pytest.raises(ValueError, match="dispatch_latency_s"):
        SimConfig(dispatch_latency_s=-1.0)


def test_arrivals_idle_gaps_are_starvation():
    wl = [WorkloadRequest(0.0, 64, 1), WorkloadRequest(1.0, 64, 1)]
    res = simulate(wl, ConstantCostModel(2, 0.01), sim_cfg())
    # Every microbatch costs the same whatever it holds, and the cost model says so to the scheduler
    # (its prior): cutting the lone 64-token prompt into chunks would only add steps, so it goes down
    # the two stages in one microbatch, two step times.
    assert res.work_intervals == [(0, 20 * MS), (1000 * MS, 1020 * MS)]
    rep = res.bubble_report("all")
    assert rep.mean_starvation_fraction > 0.9
    assert res.timings["r1"].first_scheduled_s == pytest.approx(1.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_run_with_invariants(policy):
    wl = with_poisson_arrivals(uniform_lengths(30, (5, 120), (1, 20), seed=1), rate=200.0, seed=2)
    cfg = SimConfig(SchedulerConfig(policy=policy, token_budget=64, max_num_seqs=8), num_blocks=64,
                    block_size=8, max_model_len=256, check_invariants=True)
    res = simulate(wl, ConstantCostModel(3, 0.002, 0.0001), cfg)
    assert res.num_finished == 30 and not res.rejected
    assert all(len(res.timings[f"r{k}"].token_times_s) == w.output_len for k, w in enumerate(wl))
    lat = res.latency()
    assert lat["num_output_tokens"] == sum(w.output_len for w in wl)
    assert res.throughput()["requests_per_s"] > 0
    # Every microbatch costs 2 ms on every stage: each stage is busy exactly 2 ms per microbatch, and
    # busy, bubble and starvation fill the window.
    rep = res.bubble_report("all")
    for st in rep.stages:
        assert st.busy_ns == res.num_microbatches * 2 * MS
        assert st.busy_fraction + st.bubble_fraction + st.starvation_fraction == pytest.approx(1.0)
    assert res.summary("all")["bubbles"]["mean_bubble_fraction"] == pytest.approx(rep.mean_bubble_fraction)


def test_sim_trace_round_trip(tmp_path):
    from ppserve.metrics import bubble_report, load_chrome_trace, validate_chrome_trace

    res = simulate(uniform_lengths(10, (10, 80), (2, 6)), ConstantCostModel(3, 0.001, 0.0002), sim_cfg())
    path = tmp_path / "sim.json"
    res.save_trace(path)
    spans, work = load_chrome_trace(path)
    assert bubble_report(spans, work, "active") == res.bubble_report("active")
    import json

    assert validate_chrome_trace(json.loads(path.read_text())) == []


# --- cost model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt3():
    return RooflineCostModel(load_model_spec("gpt3-175b"), load_hardware("a100"), num_stages=8, tp=8)


def test_cost_model_monotone(gpt3):
    prev = 0.0
    for n in (1, 8, 64, 256, 1024, 4096):
        t = gpt3.stage_time(0, BatchShape.uniform(num_prefill_tokens=n))
        assert t > prev
        prev = t
    for ctx in (0, 100, 1000, 4000):
        t = gpt3.stage_time(0, BatchShape.uniform(num_decode_tokens=32, context=ctx))
        assert t >= prev or ctx == 0
        prev = t
    assert (gpt3.stage_time(7, BatchShape.uniform(num_decode_tokens=32))
            > gpt3.stage_time(0, BatchShape.uniform(num_decode_tokens=32)))
    assert gpt3.transfer_time(BatchShape.uniform(512)) > gpt3.transfer_time(BatchShape.uniform(8))


def test_roofline_switch(gpt3):
    hw, m = gpt3.hw, gpt3.model
    weight_bound = m.layer_params * m.dtype_bytes / 8 / (hw.mem_bw * hw.bw_eff)
    # Few tokens: reading the weights dominates, time is flat in the token count.
    assert gpt3.linear_time(1) == pytest.approx(gpt3.linear_time(4), rel=1e-3)
    assert gpt3.linear_time(1) == pytest.approx(weight_bound, rel=1e-2)
    # Many tokens: FLOP-bound, time grows linearly.
    flop_bound = 2 * 4096 * m.layer_params / 8 / (hw.peak_flops * hw.mfu_eff)
    assert gpt3.linear_time(4096) == pytest.approx(flop_bound)
    assert gpt3.linear_time(8192) == pytest.approx(2 * gpt3.linear_time(4096))
    # The switch sits near peak_flops / mem_bw tokens (the ridge point).
    ridge = (hw.peak_flops * hw.mfu_eff) / (hw.mem_bw * hw.bw_eff) * m.dtype_bytes / 2
    assert gpt3.linear_time(int(ridge * 0.5)) == pytest.approx(gpt3.linear_time(1), rel=0.05)
    assert gpt3.linear_time(int(ridge * 2)) > 1.5 * gpt3.linear_time(1)


def test_tp_and_allreduce():
    m, hw = load_model_spec("llama2-70b"), load_hardware("h100")
    tp1, tp8 = RooflineCostModel(m, hw, 4, 1), RooflineCostModel(m, hw, 4, 8)
    assert tp1.allreduce_time(512) == 0 and tp8.allreduce_time(512) > 0
    assert tp8.linear_time(2048) == pytest.approx(tp1.linear_time(2048) / 8, rel=0.01)
    assert kv_cache_blocks(m, hw, 4, 8, 16) > kv_cache_blocks(m, hw, 4, 2, 16)
    with pytest.raises(ValueError, match="tp=5"):
        RooflineCostModel(m, hw, 4, 5)


def test_tables_load_and_errors(tmp_path):
    for name in ("gpt3-175b", "llama2-70b", "llama3-8b", "smollm2-135m"):
        assert load_model_spec(name).num_layers > 0
    assert load_model_spec("gpt3-175b").num_params == pytest.approx(175e9, rel=0.02)
    assert load_model_spec("llama2-70b").num_params == pytest.approx(69e9, rel=0.03)
    assert load_hardware("h100").peak_flops > load_hardware("a100").peak_flops
    with pytest.raises(ValueError, match="unknown hardware"):
        load_hardware("tpu9000")
    bad = tmp_path / "hw.yaml"
    bad.write_text("name: x\npeak_flops: fast\n")
    with pytest.raises(ValueError, match="peak_flops"):
        load_hardware(bad)


# --- profiles ---------------------------------------------------------------------------------


def synthetic_spans(coefs, transfer_ns: int = 50_000) -> list[Span]:
    spans, t = [], 0
    for step, (p, d) in enumerate([(0, 16), (128, 4), (512, 0), (256, 32), (64, 64), (0, 1), (1000, 8)]):
        start = t
        for stage, (a, b, c) in enumerate(coefs):
            dur = round((a + b * p + c * d) * 1e9)
            spans.append(Span("compute", start, start + dur, stage, 0, step, p, d, ("r",)))
            start += dur + transfer_ns
        t = start + 10 * MS
    return spans


def test_fit_profile_recovers_coefficients(tmp_path):
    coefs = [(1e-3, 20e-6, 50e-6), (2e-3, 10e-6, 80e-6)]
    prof = fit_profile(synthetic_spans(coefs))
    # In the step-cost vocabulary: every token pays b, a decode (a sampled token) c - b more.
    for fit, rms, (a, b, c) in zip(prof.cost.stages, prof.rms_residual_s, coefs, strict=True):
        assert fit.coefficients == pytest.approx(StepCost(a, b, 0.0, 0.0, c - b).coefficients, rel=1e-5,
                                                 abs=1e-9)
        assert rms < 1e-8
    assert prof.transfer_s == pytest.approx(50e-6)
    prof.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == prof
    cm = ProfileCostModel(loaded)
    assert cm.num_stages == 2
    assert cm.stage_time(1, BatchShape.uniform(100, 10)) == pytest.approx(2e-3 + 100 * 10e-6 + 10 * 80e-6)
    with pytest.raises(ValueError):
        fit_profile([])


def test_fit_profile_degenerate_columns():
    # Decode-only spans: the prefill column never varies and is left out.
    spans = [Span("compute", 0, round((1e-3 + 5e-5 * d) * 1e9), 0, 0, i, 0, d)
             for i, d in enumerate((1, 4, 9, 30))]
    fit = fit_profile(spans).cost.stages[0]
    assert fit.sample_s == 0 and fit.token_s == pytest.approx(5e-5) and fit.floor_s == pytest.approx(1e-3)
    assert StepCost.of([-1.0, 0.0, 0.0, 0.0, 0.0]).predict(BatchShape.uniform(0, 1)) == 0.0  # clamped at >= 0


# --- workloads --------------------------------------------------------------------------------


def test_read_trace_and_scale(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n5.0,100,10\n5.5,301,3\n7.0,40,1\n")
    reqs = read_trace(csv)
    assert reqs == [WorkloadRequest(0.0, 100, 10), WorkloadRequest(0.5, 301, 3), WorkloadRequest(2.0, 40, 1)]
    scaled = read_trace(csv, limit=2, prefill_scale=0.1, decode_scale=0.5)
    assert [(r.prompt_len, r.output_len) for r in scaled] == [(10, 5), (30, 2)]
    assert read_trace(csv, start=1, limit=1) == [WorkloadRequest(0.0, 301, 3)]
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        read_trace(bad)


def test_shared_trace_readable():
    from ppserve.sim.workload import default_trace_path

    try:
        path = default_trace_path()
    except FileNotFoundError:
        pytest.skip("../shared/traces is not present")
    reqs = read_trace(path, limit=100)
    assert len(reqs) == 100 and reqs[0].arrival_s == 0.0


def test_poisson_rate():
    times = poisson_arrivals(20_000, rate=4.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.03)
    assert poisson_arrivals(5, 1.0, seed=1) == poisson_arrivals(5, 1.0, seed=1)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_synthetic_lengths():
    z = zipf_lengths(2000, (1, 100), (1, 10), theta=1.0, seed=0)
    assert all(1 <= r.prompt_len <= 100 for r in z)
    assert sum(r.prompt_len <= 10 for r in z) > sum(r.prompt_len > 90 for r in z)
    f = fixed_ratio(3, 1200, pd_ratio=3.0)
    assert f[0] == WorkloadRequest(0.0, 900, 300)
    clipped = clip_to_context([WorkloadRequest(0.0, 5000, 10), WorkloadRequest(0.0, 100, 5000)], 4096)
    assert [(r.prompt_len, r.output_len) for r in clipped] == [(4095, 1), (100, 3996)]
    with pytest.raises(ValueError):
        WorkloadRequest(0.0, 0, 1)


# --- imports ----------------------------------------------------------------------------------


def test_sim_imports_no_torch():
    assert_imports_without("ppserve.sim, ppserve.sim.cli, ppserve.sim.reproduce_sarathi",
                           ("torch", "ray", "grpc", "matplotlib"))


def test_simulate_cli_and_profile_round_trip(tmp_path, capsys):
    from ppserve.cli import main

    csv = tmp_path / "w.csv"
    csv.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{i * 0.01},{50 + 7 * i},{1 + i % 5}\n" for i in range(20)))
    trace = tmp_path / "sim.json"
    rc = main(["simulate", "--model", "smollm2-135m", "--hardware", "a100", "--pp", "2", "--tp", "1",
               "--workload", str(csv), "--num-requests", "20", "--policy", "sarathi", "--token-budget", "64",
               "--trace", str(trace), "--json", str(tmp_path / "s.json"), "--check"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "finished 20 requests" in out and trace.exists()
    bub = json.loads((tmp_path / "s.json").read_text())["bubbles"]
    assert 0.0 <= bub["short_handed_bubble_fraction"] <= bub["mean_bubble_fraction"]
    prof = tmp_path / "p.json"
    assert main(["simulate", "--fit-from", str(trace), "--profile-out", str(prof)]) == 0
    assert Profile.load(prof).num_samples[0] > 0
    assert main(["simulate", "--hardware", str(prof), "--workload", str(csv), "--num-requests", "20",
                 "--token-budget", "64"]) == 0
    assert math.isfinite(Profile.load(prof).transfer_s)


# --- budget modes through the simulator (scheduler.observe_step wiring) -------------------------


def test_time_budget_mode_in_the_simulator_evens_out_long_context_microbatches():
    m, hw = load_model_spec("llama3-8b"), load_hardware("a100")
    cost = RooflineCostModel(m, hw, num_stages=2, tp=1)
    wl = uniform_lengths(30, (512, 7000), (4, 16), seed=3)
    cv = {}
    for mode in ("tokens", "time"):
        sc = SchedulerConfig(token_budget=512, budget_mode=mode, max_num_seqs=256)
        res = simulate(wl, cost, SimConfig(sc, num_blocks=50_000, max_model_len=8192, check_invariants=True))
        assert res.num_finished == 30
        times = [s.duration_ns for s in res.spans if s.kind == "compute" and s.stage == 1
                 and s.num_prefill_tokens]
        mean = sum(times) / len(times)
        cv[mode] = math.sqrt(sum((t - mean) ** 2 for t in times) / len(times)) / mean
    assert res.budget_mode is not None and res.budget_mode.cost.calibrated  # type: ignore[attr-defined]
    assert cv["time"] < cv["tokens"]


def test_reproduce_sarathi_paper_workload_runs_small():
    from ppserve.sim.reproduce_sarathi import reproduce

    out = reproduce(num_requests=32, batch_size=4, total_tokens=512, pd_ratio=10)
    assert out["settings"]["max_num_seqs"] == 32 and "P:D 10" in out["settings"]["workload"]
    assert out["ratios"]["median_bubble_orca_over_sarathi"] > 1


def test_a_trace_of_token_counts_only_takes_synthetic_arrivals(tmp_path):
    """Vidur's published traces (arxiv-summarization, BWB) have only token counts: fine with Poisson or
    at-once arrivals, refused where the trace's own arrivals are asked for."""
    from ppserve.bench.workloads import WorkloadSpec, build_workload

    path = tmp_path / "counts.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n100,10\n200,20\n300,30\n")
    reqs = read_trace(path, need_arrivals=False)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 100, 10), (0.0, 200, 20),
                                                                         (0.0, 300, 30)]
    with pytest.raises(ValueError, match="no arrived_at column"):
        read_trace(path)
    spec = WorkloadSpec(source=f"trace:{path}", num_requests=3, rate=2.0, prefill_scale=1.0, decode_scale=1.0)
    assert [r.prompt_len for r in build_workload(spec)] == [100, 200, 300]
    with pytest.raises(ValueError, match="no arrived_at column"):
        build_workload(WorkloadSpec(source=f"trace:{path}", num_requests=3, arrival="trace"))


def test_a_lone_decoding_request_leaves_only_short_handed_bubble():
    from ppserve.bench.harness import summarize_run

    res = simulate([WorkloadRequest(0.0, 16, 20)], ConstantCostModel(2, 0.01), sim_cfg())
    bub = summarize_run(res.timings, res.spans, res.work_intervals, num_stages=2)["bubbles"]
    # One request's decodes ride one microbatch at a time: each of the two stages idles half the run,
    # all of it while fewer than p requests were in the system.
    assert bub["mean_bubble_fraction"] > 0.4
    assert bub["short_handed_time_fraction"] == 1.0
    assert bub["short_handed_bubble_fraction"] == pytest.approx(bub["mean_bubble_fraction"])
    stageless = summarize_run(res.timings, res.spans, res.work_intervals)["bubbles"]
    assert stageless["short_handed_bubble_fraction"] is None
    # One shape for every bubble report: the simulator's summary has the same keys, the short-handed
    # part included.
    sim_bub = res.summary()["bubbles"]
    assert sim_bub.keys() == bub.keys()
    assert sim_bub["short_handed_bubble_fraction"] == pytest.approx(bub["short_handed_bubble_fraction"])
