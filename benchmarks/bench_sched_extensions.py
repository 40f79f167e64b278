"""Beyond the anchors, measured in the simulator: time-budget microbatches and a TBT-target budget.

1. Plain token budget vs time budget (`budget_mode: time`, the step-cost model fitted online from
   the simulated stage times): per-microbatch compute-time CV (all microbatches, and those carrying a
   prefill chunk: decode-only microbatches are short because there is no work, which no budget can
   fix), mean bubble fraction (window `active`, from `bubble_report` on the simulated spans), median
   per-request bubble time, throughput.
2. Automatic token budget from `tbt_slo_ms`: measured p99 TBT against the target, the budget the
   controller settled on, and throughput, next to the fixed default budget.

Deterministic (seeded workloads, analytic roofline cost model). Usage:

    python benchmarks/bench_sched_extensions.py [--out bench_sched_extensions.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.sim import (
    RooflineCostModel,
    SimConfig,
    kv_cache_blocks,
    load_hardware,
    load_model_spec,
    simulate,
)
from ppserve.sim.workload import (
    WorkloadRequest,
    clip_to_context,
    default_trace_path,
    read_trace,
    uniform_lengths,
    with_poisson_arrivals,
)

BLOCK = 16
OVERHEAD_S = 2e-4


def _cv(xs: list[float]) -> float | None:
    if len(xs) < 2 or statistics.fmean(xs) == 0:
        return None
    return statistics.pstdev(xs) / statistics.fmean(xs)


def _setup(model: str, hw: str, pp: int, tp: int) -> tuple[Any, Any, int]:
    m, h = load_model_spec(model), load_hardware(hw)
    return m, RooflineCostModel(m, h, pp, tp), kv_cache_blocks(m, h, pp, tp, BLOCK)


def run_one(
    model: str, hw: str, pp: int, tp: int, wl: list[WorkloadRequest], sched: SchedulerConfig
) -> dict[str, Any]:
    m, cost, blocks = _setup(model, hw, pp, tp)
    t0 = time.perf_counter()
    res = simulate(wl, cost, SimConfig(sched, blocks, BLOCK, m.max_model_len, OVERHEAD_S))
    rep = res.bubble_report("active")
    slowest = pp - 1  # the last stage adds the LM head: it sets the pace
    comp = [s for s in res.spans if s.kind == "compute" and s.stage == slowest]
    all_ms = [s.duration_ns * 1e-6 for s in comp]
    pf_ms = [s.duration_ns * 1e-6 for s in comp if s.num_prefill_tokens > 0]
    lat = res.latency()
    mode = res.budget_mode
    return {
        "num_microbatches": res.num_microbatches,
        "compute_ms_mean": statistics.fmean(all_ms),
        "compute_cv_all": _cv(all_ms),
        "compute_cv_prefill_microbatches": _cv(pf_ms),
        "num_prefill_microbatches": len(pf_ms),
        "mean_bubble_fraction_active": rep.mean_bubble_fraction,
        "per_request_bubble_p50_ms": (rep.per_request_bubble_p50_ns or 0) * 1e-6,
        "output_tokens_per_s": res.throughput()["output_tokens_per_s"],
        "tbt_p50_ms": lat["tbt_s"]["p50"] * 1e3,
        "tbt_p99_ms": lat["tbt_s"]["p99"] * 1e3,
        "final_token_budget": mode.token_budget if mode is not None else sched.token_budget,
        "wall_s": time.perf_counter() - t0,
    }


def time_budget_cases(quick: bool) -> list[dict[str, Any]]:
    n = 120 if quick else 300
    cases = [
        (
            "llama3-8b",
            "a100",
            4,
            1,
            uniform_lengths(n, (512, 7800), (16, 128), seed=1),
            "uniform prompts 512-7800, out 16-128, at t=0",
        ),
        (
            "llama2-70b",
            "a100",
            4,
            4,
            uniform_lengths(n, (512, 3800), (16, 128), seed=1),
            "uniform prompts 512-3800, out 16-128, at t=0",
        ),
    ]
    rows = []
    for model, hw, pp, tp, wl, desc in cases:
        for mode in ("tokens", "time"):
            sched = SchedulerConfig(token_budget=512, budget_mode=mode, max_num_seqs=512, max_waiting=10_000)
            r = run_one(model, hw, pp, tp, wl, sched)
            rows.append(
                {
                    "model": model,
                    "hardware": hw,
                    "pp": pp,
                    "tp": tp,
                    "workload": desc,
                    "requests": len(wl),
                    "budget_mode": mode,
                    "token_budget": 512,
                    "time_budget": "predicted time of a 512-token chunk from an empty cache"
                    if mode == "time"
                    else None,
                    **r,
                }
            )
    return rows


def adaptive_cases(quick: bool) -> list[dict[str, Any]]:
    model, hw, pp, tp = "llama2-70b", "a100", 4, 4
    m = load_model_spec(model)
    n, rate = (400, 4.0) if quick else (1000, 4.0)
    wl = clip_to_context(
        with_poisson_arrivals(read_trace(default_trace_path(), n), rate=rate, seed=0), m.max_model_len
    )
    rows = []
    for slo in (None, 50.0, 100.0, 200.0, 400.0):
        sched = SchedulerConfig(token_budget=512, max_waiting=10_000, tbt_slo_ms=slo)
        r = run_one(model, hw, pp, tp, wl, sched)
        rows.append(
            {
                "model": model,
                "hardware": hw,
                "pp": pp,
                "tp": tp,
                "workload": f"splitwise_conv first {len(wl)} rows, Poisson {rate}/s seed 0",
                "tbt_slo_ms": slo,
                "meets_target": None if slo is None else r["tbt_p99_ms"] <= slo,
                **r,
            }
        )
    return rows


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_sched_extensions.json")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = p.parse_args(argv)

    tb = time_budget_cases(args.quick)
    print(
        "1) token budget vs time budget (token_budget 512; bubbles in window 'active'; slowest stage's "
        "compute times)"
    )
    print(
        f"{'model':<11} {'mode':<6} {'mbs':>5} {'cv all':>7} {'cv pf-mb':>8} {'bubble%':>8} "
        f"{'req bubble p50 ms':>17}"
        f" {'tok/s':>7} {'tbt p99 ms':>10}"
    )
    for r in tb:
        print(
            f"{r['model']:<11} {r['budget_mode']:<6} {r['num_microbatches']:>5} "
            f"{_f(r['compute_cv_all'], '.3f'):>7}"
            f" {_f(r['compute_cv_prefill_microbatches'], '.3f'):>8} "
            f"{100 * r['mean_bubble_fraction_active']:>7.2f}%"
            f" {r['per_request_bubble_p50_ms']:>17.1f} {r['output_tokens_per_s']:>7.0f} "
            f"{r['tbt_p99_ms']:>10.1f}"
        )
    ad = adaptive_cases(args.quick)
    print("\n2) automatic token budget from a TBT target (llama2-70b pp4 tp4 on A100, Poisson arrivals)")
    print(f"{'target ms':>9} {'p99 TBT ms':>10} {'p50 TBT ms':>10} {'meets':>6} {'budget':>7} {'tok/s':>7}")
    for r in ad:
        print(
            f"{_f(r['tbt_slo_ms'], '.0f'):>9} {r['tbt_p99_ms']:>10.1f} {r['tbt_p50_ms']:>10.1f}"
            f" {_f(r['meets_target'], ''):>6} {r['final_token_budget']:>7} {r['output_tokens_per_s']:>7.0f}"
        )
    Path(args.out).write_text(
        json.dumps(
            {
                "time_budget": tb,
                "adaptive_budget": ad,
                "schedule_overhead_s": OVERHEAD_S,
                "block_size": BLOCK,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
