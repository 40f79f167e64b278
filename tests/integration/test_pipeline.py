"""The Ray pipeline on CPU (real actors, gloo): equality with transformers, invariants, traces."""

from __future__ import annotations

import json
import random
import time

import pytest

from ppserve import LLM, SamplingParams
from ppserve.metrics.bubbles import bubble_report
from ppserve.metrics.trace import load_chrome_trace, validate_chrome_trace
from ppserve.sched.cost import BatchShape
from tests.bench_scripts import load_benchmark
from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 16


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(0, (1, 5, 17, 33, 64, 90))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


def generate(model_dir, prompts, **kwargs):
    return ppserve_greedy(model_dir, prompts, MAX_NEW, **kwargs)


@pytest.mark.parametrize("pp", [1, 2, 3])
def test_in_process_pipeline_equals_transformers(tiny_llama_dir, prompts, expected, pp):
    """Every stage in this process, hidden states handed over in memory: no Ray at all."""
    got, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=pp, token_budget=24,
                      block_size=4)
    assert got == expected


def test_calibrated_partition_is_measured_once_and_cached(tiny_llama_dir, prompts, expected, tmp_path,
                                                          monkeypatch):
    """partition_mode: calibrated measures the stage costs on a short run, caches the profile under
    $PPSERVE_CACHE_DIR (keyed: tests/unit/test_partition.py), reads it back the next time (no second
    run) and starts the scheduler's cost model from it; the tokens are unchanged."""
    from ppserve.engine import calibration

    monkeypatch.setenv("PPSERVE_CACHE_DIR", str(tmp_path))
    runs = []
    measure = calibration.measure_cost_profile
    monkeypatch.setattr(calibration, "measure_cost_profile", lambda e: runs.append(1) or measure(e))
    monkeypatch.setattr(calibration, "CALIBRATION_OUTPUT", 8)  # a shorter run: the mechanism, not the figure
    for _ in range(2):
        got, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=2,
                          token_budget=24, block_size=4, max_num_seqs=4,
                          overrides=["parallel.partition_mode=calibrated"])
        assert got == expected
    assert len(runs) == 1
    (cached,) = (tmp_path / "partition").glob("*.json")
    profile = calibration.CostProfile.from_json(json.loads(cached.read_text()))
    assert profile.num_microbatches > 0 and "calibration run" in profile.source


@pytest.mark.parametrize("dispatch,pp,tp", [("compiled", 2, 2), ("classic", 3, 1)])
def test_other_control_planes_equal_transformers(ray_session, tiny_llama_dir, prompts, expected, dispatch, pp,
                                                 tp):
    got, _ = generate(tiny_llama_dir, prompts, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                      token_budget=16, block_size=4, overrides=[f"parallel.dispatch={dispatch}"])
    assert got == expected


def test_stage_times_reach_the_scheduler_under_ray(ray_session, tiny_llama_dir, prompts, expected):
    """Every microbatch comes back with both stages' compute seconds (TP rank 0's each), and the
    time budget's cost model learns from them on a Ray pipeline."""
    with LLM(str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=2, tensor_parallel_size=2,
             token_budget=16, block_size=4, overrides=["scheduler.budget_mode=time"]) as llm:
        seen = []
        collect = llm.engine.executor.collect

        def recording_collect(*a, **kw):
            result = collect(*a, **kw)
            seen.append(result.stage_seconds)
            return result

        llm.engine.executor.collect = recording_collect
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        cost = llm.engine.scheduler.budget_mode.cost
    assert [o.token_ids for o in outs] == expected  # time-budgeted batches change nothing in the tokens
    assert seen and all(len(t) == 2 and all(x > 0 for x in t) for t in seen)
    assert cost.fits[0].num_samples == len(seen) and cost.calibrated
    assert cost.current.stages[1] != cost.fits[1].prior and cost.current.pace(BatchShape(((16, 0),), 1)) > 0


def test_tbt_target_learns_under_ray(ray_session, tiny_llama_dir):
    """scheduler.tbt_slo_ms on a Ray pipeline: the controller's cost model calibrates from the stages' own
    times, and the adaptive budget changes nothing in the tokens. This runs the workload of
    benchmarks/bench_tbt_target.py, whose figure is whether the p99 time between tokens meets the target
    (a property of the machine); the controller's steering on a deterministic clock is tested in
    tests/unit/test_sched_cost.py."""
    bench = load_benchmark("bench_tbt_target")
    fig = bench.run_tbt(str(tiny_llama_dir), pp=2, target_ms=250.0, num_requests=16, max_tokens=40)
    print("\n" + bench.report(fig))
    assert fig["cost_calibrated"] and fig["cost_num_samples"] > 20
    assert fig["cost_per_stage"] != fig["cost_prior"]
    assert fig["num_gaps"] == 16 * 39  # every token came with its time
    assert fig["tokens"] == reference_greedy(tiny_llama_dir, bench.workload(16), 40)


@pytest.mark.parametrize(
    "pp,tp,budget",
    [(2, 2, 16), (1, 2, 7), (2, 1, 1), (4, 1, 64)],
    ids=["pp2-tp2", "tp2", "pp2-budget1", "pp4"],
)
def test_pipeline_equals_transformers(ray_session, tiny_llama_dir, prompts, expected, pp, tp, budget):
    got, _ = generate(tiny_llama_dir, prompts, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                      token_budget=budget, block_size=4)
    assert got == expected


def test_pipeline_with_preemption(ray_session, tiny_llama_dir, prompts, expected):
    # 40 blocks of 4 tokens: fewer than the six requests need together at the end.
    got, preemptions = generate(tiny_llama_dir, prompts, pipeline_parallel_size=2, tensor_parallel_size=2,
                                token_budget=32, block_size=4, num_kv_blocks=40)
    assert preemptions > 0
    assert got == expected


@pytest.mark.parametrize("policy", ["sarathi", "vllm", "orca", "static", "vllm-v1", "vllm-v1-async",
                                    "sglang-pp"])
def test_policies_through_pipeline(ray_session, tiny_llama_dir, prompts, expected, policy):
    got, _ = generate(tiny_llama_dir, prompts, pipeline_parallel_size=2, token_budget=24, policy=policy,
                      block_size=4, max_num_seqs=4)
    assert got == expected


def test_invariants_and_trace_from_real_run(ray_session, tiny_llama_dir, tmp_path):
    """Count in-flight microbatches and per-request membership from the stages' own spans."""
    rng = random.Random(1)
    pp = 3
    with LLM(str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=pp, token_budget=20,
             block_size=4) as llm:
        formed = {}  # step id -> SchedulerOutput, to tell which microbatch samples a request
        schedule = llm.engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            if out is not None:
                formed[out.step_id] = out
            return out

        llm.engine.scheduler.schedule = recording_schedule
        depth_at_collect = []  # (microbatches in flight, requests running) when the oldest is collected
        collect = llm.engine.executor.collect

        def recording_collect(*a, **kw):
            sched = llm.engine.scheduler
            depth_at_collect.append((len(sched.in_flight), len(sched.running)))
            return collect(*a, **kw)

        llm.engine.executor.collect = recording_collect
        prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(1, 80))] for _ in range(12)]
        params = [SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True) for _ in prompts]
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
        # The last steps' stage spans may still be on their way (a loaded machine): let them land, so the
        # trace and the live figures below read the same spans.
        deadline, seen = time.monotonic() + 5.0, -1
        while seen != len(llm.spans()) and time.monotonic() < deadline:
            seen = len(llm.spans())
            time.sleep(0.3)
        trace_path = llm.save_trace(tmp_path / "trace.json")
        stats = llm.bubble_stats(window="all")
        spans = llm.spans()
        assert llm.engine.scheduler.blocks.num_free == llm.engine.scheduler.blocks.num_blocks
        depth = llm.engine.scheduler.max_in_flight

    compute = [s for s in spans if s.kind == "compute"]
    sched = {s.step_id: s for s in spans if s.kind == "schedule"}
    assert {s.stage for s in compute} == set(range(pp))
    # A microbatch is in flight from its schedule span until the last stage finishes computing it.
    last_end = {s.step_id: s.end_ns for s in compute if s.stage == pp - 1}
    intervals = {sid: (sched[sid].start_ns, last_end[sid]) for sid in last_end}
    assert set(intervals) == set(sched)
    events = sorted([(a, 1) for a, _ in intervals.values()] + [(b, -1) for _, b in intervals.values()],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    # Never more than the scheduler's depth in flight, per the stages' own spans: pp, and one more with the
    # token ring (the default).
    assert depth == pp + 1
    assert peak == depth
    # Steady state: once 2p requests or more run, the pipeline is that deep at >= 90 % of collects.
    busy = [d for d, running in depth_at_collect if running >= 2 * pp]
    assert len(busy) >= 20, depth_at_collect
    assert sum(d == depth for d in busy) >= 0.9 * len(busy), busy
    members = {s.step_id: set(s.request_ids) for s in compute if s.stage == 0}
    ids = sorted(intervals)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            (a0, a1), (b0, b1) = intervals[a], intervals[b]
            if a0 < b1 and b0 < a1:  # overlapping in time: only a prompt's chunks may ride in both,
                shared = members[a] & members[b]  # and never after the chunk that samples it,
                sampled = shared & set(formed[a].sample_request_ids)
                if formed[b].ring_step_id == a:  # but for a decode on the token ring: its input is a's token
                    sampled -= set(formed[b].ring_request_ids)
                assert not sampled, (a, b, shared)
    # Every stage computes every microbatch in the same order.
    for s in range(pp):
        order = [c.step_id for c in sorted((c for c in compute if c.stage == s), key=lambda c: c.start_ns)]
        assert order == sorted(order)

    trace = json.loads(trace_path.read_text())
    assert validate_chrome_trace(trace) == []
    for ev in trace["traceEvents"]:
        assert {"ph", "ts", "pid", "tid"} <= ev.keys()
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
    flows = [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert flows and len([e for e in flows if e["ph"] == "s"]) == len([e for e in flows if e["ph"] == "f"])
    loaded_spans, work = load_chrome_trace(trace_path)
    again = bubble_report(loaded_spans, work, window="all")
    assert again.mean_bubble_fraction == pytest.approx(stats.mean_bubble_fraction, abs=1e-12)
    for a, b in zip(again.stages, stats.stages, strict=True):
        assert (a.busy_ns, a.bubble_ns, a.starvation_ns) == (b.busy_ns, b.bubble_ns, b.starvation_ns)


def test_tracing_off_records_nothing(ray_session, tiny_llama_dir):
    with LLM(str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=2, trace=False,
             block_size=4) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
        assert [s for s in llm.spans() if s.kind != "schedule"] == []
