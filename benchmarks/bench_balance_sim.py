"""The balanced pipeline at GPU scale, in the simulator (the same scheduler code over a roofline cost model).

Three tables, one run:
1. Llama-2-70B on A100s, PP4 x TP4, the Azure conversation trace (400 requests, Poisson at each rate),
   sarathi at token budget 512 and 128 running requests (seq cap on): the unbalanced formation with
   the old control-plane figures (0.2 ms turnaround, no dispatch latency, no token ring: what the issue
   measured); then, with ppserve's measured control plane (--dispatch-ms / --overhead-ms), the
   unbalanced and the balanced formation each without and with the token ring
   (`scheduler.token_ring`, its extra microbatch formed just in time;
   ARCHITECTURE.md#how-a-microbatch-is-formed). The default is the balanced formation with the ring.
   Beside them the baselines vllm (v0) and orca and today's peers vllm-v1(-async) and sglang-pp. Mean
   bubble (active window), microbatch token CV, throughput, TTFT and TBT.
2. One 4096-token prompt at PP4, budget 512: TTFT with the chunks pipelined (balanced) and one at a time
   (unbalanced), against the pipelined ideal (every chunk enters a stage the moment both the stage and
   the chunk are free, no control plane).
3. The capacity of sarathi and the peers on the trace's lengths under a p99-TBT SLO, as the
   planner finds it.

    python benchmarks/bench_balance_sim.py [--rates 2,4,8] [--out results/bench_balance_sim.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.metrics.capacity import SLO
from ppserve.plan.search import PlanContext, capacities
from ppserve.plan.space import Cluster, Deployment
from ppserve.sched.partition import even_partition
from ppserve.sim import (
    BatchShape,
    RooflineCostModel,
    SimConfig,
    WorkloadRequest,
    kv_cache_blocks,
    load_hardware,
    load_model_spec,
    read_trace,
    simulate,
    with_poisson_arrivals,
)
from ppserve.sim.workload import clip_to_context, default_trace_path


def run(cost: RooflineCostModel, workload: list[WorkloadRequest], sched: SchedulerConfig, num_blocks: int,
        max_len: int, overhead_ms: float, dispatch_ms: float) -> dict[str, Any]:
    cfg = SimConfig(sched, num_blocks, 16, max_len, overhead_ms * 1e-3, dispatch_ms * 1e-3)
    res = simulate(workload, cost, cfg)
    s = res.summary("active")
    lat = s["latency"]
    return {
        "bubble": s["bubbles"]["mean_bubble_fraction"], "token_cv": s["bubbles"]["microbatch_token_cv"],
        "microbatches": s["num_microbatches"], "requests_per_s": s["throughput"]["requests_per_s"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": lat["ttft_s"]["p50"], "ttft_p99_s": lat["ttft_s"]["p99"],
        "tbt_p50_s": lat["tbt_s"]["p50"], "tbt_p99_s": lat["tbt_s"]["p99"],
    }


def pipelined_ideal_ttft(cost: RooflineCostModel, prompt: int, budget: int) -> float:
    """Chunks of `budget` tokens through the stages with no waiting but for the stage and the chunk."""
    free = [0.0] * cost.num_stages
    done = 0.0
    for start in range(0, prompt, budget):
        n = min(budget, prompt - start)
        shape = BatchShape(((n, start),), int(start + n == prompt), n, 0)
        ready = 0.0
        for s in range(cost.num_stages):
            begin = max(free[s], ready)
            free[s] = begin + cost.stage_time(s, shape)
            ready = free[s] + cost.transfer_time(shape)
        done = free[-1]
    return done


def capacity_table(model: Any, hw: Any, pp: int, tp: int, blocks: int, trace: list[WorkloadRequest],
                   args: argparse.Namespace) -> dict[str, float]:
    """Each policy's capacity on the conversation trace's lengths under the p99-TBT SLO (and the median
    scheduling delay under 2 s), as `ppserve plan` finds it (`ppserve.plan.search.capacities`)."""
    layers = tuple(b - a for a, b in even_partition(model.num_layers, pp))
    slo = SLO(args.capacity_tbt_p99_ms * 1e-3)
    ctx = PlanContext(model, Cluster(hw, pp * tp), tuple(trace), slo,
                      overhead_s=args.overhead_ms * 1e-3, dispatch_s=args.dispatch_ms * 1e-3)
    policies = ("sarathi", "vllm-v1", "vllm-v1-async", "sglang-pp")
    deps = [Deployment(pp, tp, 1, policy, 512, 128, layers, blocks, 16) for policy in policies]
    out = {d.policy: c.capacity for d, c in zip(deps, capacities(ctx, deps, rel_tol=0.05), strict=True)}
    print(f"\ncapacity under p99 TBT <= {args.capacity_tbt_p99_ms:g} ms (req/s, to 5 %): "
          + ", ".join(f"{p} {v:.2f}" for p, v in out.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="2,4,8")
    ap.add_argument("--num-requests", type=int, default=400)
    ap.add_argument("--dispatch-ms", type=float, default=0.5, help="measured control plane (connections)")
    ap.add_argument("--overhead-ms", type=float, default=0.5, help="measured engine turnaround")
    ap.add_argument("--capacity-tbt-p99-ms", type=float, default=100.0,
                    help="also each policy's capacity under this p99-TBT SLO (0: skip)")
    ap.add_argument("--out", default="results/bench_balance_sim.json")
    args = ap.parse_args()
    model, hw = load_model_spec("llama2-70b"), load_hardware("a100")
    pp, tp = 4, 4
    cost = RooflineCostModel(model, hw, pp, tp)
    blocks = kv_cache_blocks(model, hw, pp, tp, 16)
    base = SchedulerConfig(policy="sarathi", token_budget=512, max_num_seqs=128, per_microbatch_seq_cap=True,
                           max_waiting=max(4096, args.num_requests))
    no_ring = dataclasses.replace(base, token_ring=False)
    trace = clip_to_context(
        read_trace(default_trace_path("splitwise_conv.csv"), args.num_requests), model.max_model_len
    )
    variants = [
        ("unbalanced, old control plane", dataclasses.replace(no_ring, balance=False), 0.2, 0.0),
        ("unbalanced", dataclasses.replace(no_ring, balance=False), args.overhead_ms, args.dispatch_ms),
        (
            "unbalanced + token ring",
            dataclasses.replace(base, balance=False),
            args.overhead_ms,
            args.dispatch_ms,
        ),
        ("balanced", no_ring, args.overhead_ms, args.dispatch_ms),
        ("balanced + token ring (default)", base, args.overhead_ms, args.dispatch_ms),
        # The published baselines and today's peers, each by its own rules (ppserve/sched/policies.py).
        *((policy, dataclasses.replace(base, policy=policy, token_ring=None), args.overhead_ms,
           args.dispatch_ms) for policy in ("vllm", "orca", "vllm-v1", "vllm-v1-async", "sglang-pp")),
    ]
    rows = []
    print(
        "| rate (req/s) | formation | bubble | token CV | req/s | out tok/s | TTFT p50 ms | TBT p50 ms | TBT "
        "p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for rate in [float(r) for r in args.rates.split(",")]:
        wl = with_poisson_arrivals(trace, rate, seed=0)
        for name, sched, overhead, dispatch in variants:
            r = run(cost, wl, sched, blocks, model.max_model_len, overhead, dispatch)
            rows.append(
                {"rate": rate, "formation": name, "overhead_ms": overhead, "dispatch_ms": dispatch, **r}
            )
            print(
                f"| {rate:g} | {name} | {100 * r['bubble']:.1f}% | {r['token_cv']:.2f} | "
                f"{r['requests_per_s']:.2f} | "
                f"{r['output_tokens_per_s']:.0f} | {1e3 * r['ttft_p50_s']:.0f} | {1e3 * r['tbt_p50_s']:.1f} "
                "| "
                f"{1e3 * r['tbt_p99_s']:.1f} |"
            )
    prompt = [WorkloadRequest(0.0, 4096, 1)]
    ideal = pipelined_ideal_ttft(cost, 4096, 512)
    long_rows = {"ideal_ttft_s": ideal}
    print(f"\none 4096-token prompt, PP{pp}, budget 512: pipelined ideal TTFT {1e3 * ideal:.1f} ms")
    for name, sched, overhead, dispatch in variants[1:]:
        r = run(cost, prompt, sched, blocks, 8192, overhead, dispatch)
        long_rows[name] = r["ttft_p50_s"]
        print(f"  {name}: TTFT {1e3 * r['ttft_p50_s']:.1f} ms = {r['ttft_p50_s'] / ideal:.2f}x the ideal")
    caps = capacity_table(model, hw, pp, tp, blocks, trace, args) if args.capacity_tbt_p99_ms > 0 else {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(
        {"args": vars(args), "trace_rows": rows, "long_prompt": long_rows, "capacity_req_s": caps}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
