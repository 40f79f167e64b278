"""Reproduce Sarathi's pipeline-parallel result in simulation: GPT-3 175B, TP8 x PP8 on A100s, sarathi vs orca.

The Sarathi paper (arXiv 2308.16369) reports, for GPT-3 on 64 A100s with pipeline parallelism, 6.29x
lower median per-request pipeline bubble time and 1.91x higher end-to-end throughput than Orca-style
iteration-level batching. This module runs both policies on the same workload through the simulator
(roofline cost model, configs/hardware/a100.yaml and configs/models/gpt3-175b.yaml) and prints the
ratios we get, whatever they are, with every setting. Usage:

    python -m ppserve.sim.reproduce_sarathi [--out sarathi_repro.json] [--num-requests 512] [--token-budget 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.sim.cost_model import RooflineCostModel, kv_cache_blocks, load_hardware, load_model_spec
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.workload import at_once, clip_to_context, default_trace_path, read_trace

__all__ = ["reproduce"]


def reproduce(
    num_requests: int = 512,
    token_budget: int = 512,
    max_num_seqs: int = 128,
    overhead_ms: float = 0.2,
    trace: str | None = None,
    trace_dir: str | None = None,
    seq_cap: bool = True,
) -> dict[str, Any]:
    """Run sarathi and orca on the same offline workload; return settings, per-policy figures, ratios."""
    model, hw = load_model_spec("gpt3-175b"), load_hardware("a100")
    pp, tp, block_size = 8, 8, 16
    cost = RooflineCostModel(model, hw, pp, tp)
    path = Path(trace) if trace else default_trace_path()
    # Offline (everything queued at 0): throughput is then the pipeline's, not the arrival rate's.
    wl = clip_to_context(at_once(read_trace(path, num_requests)), model.max_model_len)
    num_blocks = kv_cache_blocks(model, hw, pp, tp, block_size)
    settings: dict[str, Any] = {
        "model": model.name, "hardware": hw.name, "pp": pp, "tp": tp, "token_budget_sarathi": token_budget,
        "max_num_seqs": max_num_seqs, "per_microbatch_seq_cap": seq_cap,
        "requests_per_microbatch_cap": max_num_seqs // pp, "workload": f"{path.name}, first {len(wl)} rows, all at t=0",
        "block_size": block_size, "num_blocks": num_blocks,
        "schedule_overhead_ms": overhead_ms,
    }
    runs: dict[str, Any] = {}
    for policy in ("sarathi", "orca"):
        # Both policies cap requests per microbatch (max_num_seqs / pp), as Orca's and Sarathi's pipeline
        # setups fix a per-microbatch batch size; without it one microbatch can swallow every request
        # and leave the other pp-1 slots of the pipeline empty.
        sched = SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs,
                                per_microbatch_seq_cap=seq_cap, max_waiting=max(4096, len(wl)))
        res = simulate(wl, cost, SimConfig(sched, num_blocks, block_size, model.max_model_len,
                                           overhead_ms * 1e-3))
        if trace_dir:
            res.save_trace(Path(trace_dir) / f"gpt3_{policy}.json")
        runs[policy] = res.summary("active")
    s, o = runs["sarathi"], runs["orca"]
    ratios = {
        "median_bubble_orca_over_sarathi": o["bubbles"]["per_request_bubble_p50_s"] / s["bubbles"]["per_request_bubble_p50_s"],
        "throughput_sarathi_over_orca": s["throughput"]["requests_per_s"] / o["throughput"]["requests_per_s"],
        "bubble_fraction_orca_over_sarathi": o["bubbles"]["mean_bubble_fraction"] / s["bubbles"]["mean_bubble_fraction"],
        "paper": {"median_bubble": 6.29, "throughput": 1.91},
    }
    return {"settings": settings, "runs": runs, "ratios": ratios}


def _fmt(out: dict[str, Any]) -> str:
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in out["settings"].items())]
    for policy, r in out["runs"].items():
        b, t = r["bubbles"], r["throughput"]
        lines.append(
            f"{policy:>8}: median per-request bubble {b['per_request_bubble_p50_s'] * 1e3:9.2f} ms, "
            f"bubble fraction ({b['window']}) {100 * b['mean_bubble_fraction']:5.1f}%, "
            f"throughput {t['requests_per_s']:.3f} req/s ({t['output_tokens_per_s']:.0f} tok/s), "
            f"{r['num_microbatches']} microbatches, token cv {b['microbatch_token_cv']:.2f}"
        )
    ra = out["ratios"]
    lines.append(
        f"orca/sarathi median bubble: {ra['median_bubble_orca_over_sarathi']:.2f}x (paper 6.29x); "
        f"sarathi/orca throughput: {ra['throughput_sarathi_over_orca']:.2f}x (paper 1.91x); "
        f"bubble fraction ratio {ra['bubble_fraction_orca_over_sarathi']:.2f}x"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sarathi_repro.json")
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--overhead-ms", type=float, default=0.2)
    p.add_argument("--trace", help="request trace CSV (default: ../shared/traces/splitwise_conv.csv)")
    p.add_argument("--trace-dir", help="also write each run's Chrome trace here")
    p.add_argument("--no-seq-cap", action="store_true", help="do not cap requests per microbatch at max_num_seqs / pp")
    args = p.parse_args(argv)
    out = reproduce(args.num_requests, args.token_budget, args.max_num_seqs, args.overhead_ms, args.trace,
                    args.trace_dir, not args.no_seq_cap)
    print(_fmt(out))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
