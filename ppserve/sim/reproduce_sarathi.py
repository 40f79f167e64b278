"""Reproduce Sarathi's pipeline-parallel result in simulation: GPT-3 175B, TP8 x PP8 A100s, sarathi vs orca.

The Sarathi paper (arXiv 2308.16369) reports, for GPT-3 on 64 A100s with pipeline parallelism, 6.29x
lower median per-request pipeline bubble time and 1.91x higher end-to-end throughput than Orca-style
iteration-level batching. This module runs both policies on the same workload through the simulator
(roofline cost model, configs/hardware/a100.yaml and configs/models/gpt3-175b.yaml) and prints the
ratios we get, whatever they are, with every setting (ours: docs/decisions.md#sarathi-reproduction).

The default workload follows the paper's pipeline setup (Sarathi, not Sarathi-Serve): every request has
the same length with a fixed prefill:decode (P:D) ratio, everything is queued at once, and each
microbatch holds `batch_size` requests (max_num_seqs = batch_size * pp with the per-microbatch cap) for
both policies; sarathi chunks prefills to the token budget, orca runs whole prompts. `--workload trace`
runs the Splitwise conversation trace instead (variable lengths), where the cap leaves sarathi's
microbatches mostly decodes and the gap to orca is much smaller. Usage:

    python -m ppserve.sim.reproduce_sarathi [--out sarathi_repro.json] [--workload paper|trace]
        [--total-tokens 1024] [--pd-ratio 10] [--batch-size 16] [--token-budget 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.sim.cost_model import RooflineCostModel, kv_cache_blocks, load_hardware, load_model_spec
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.workload import at_once, clip_to_context, default_trace_path, fixed_ratio, read_trace

__all__ = ["reproduce"]


def reproduce(
    num_requests: int | None = None,
    token_budget: int = 256,
    max_num_seqs: int | None = None,
    overhead_ms: float = 0.2,
    trace: str | None = None,
    trace_dir: str | None = None,
    seq_cap: bool = True,
    workload: str = "paper",
    total_tokens: int = 1024,
    pd_ratio: float = 10.0,
    batch_size: int = 16,
    policies: tuple[str, ...] = ("sarathi", "orca", "vllm", "vllm-v1", "vllm-v1-async", "sglang-pp"),
) -> dict[str, Any]:
    """Run sarathi and orca (the paper's pair) and the other `policies` (the vLLM-v0 baseline and
    today's peers, each by its own rules) on the same offline workload; return settings, per-policy
    figures, ratios.

    workload "paper": `num_requests` (default 4 * batch_size * pp) requests of `total_tokens` tokens at
    P:D `pd_ratio`, `batch_size` requests per microbatch. workload "trace": the first `num_requests`
    (default 512) rows of the trace, max_num_seqs default 128.
    """
    model, hw = load_model_spec("gpt3-175b"), load_hardware("a100")
    pp, tp, block_size = 8, 8, 16
    cost = RooflineCostModel(model, hw, pp, tp)
    # Offline (everything queued at 0): throughput is then the pipeline's, not the arrival rate's.
    if workload == "paper":
        max_num_seqs = max_num_seqs or batch_size * pp
        wl = fixed_ratio(num_requests or 4 * batch_size * pp, total_tokens, pd_ratio)
        desc = (f"{len(wl)} requests of {total_tokens} tokens (prompt {wl[0].prompt_len}, output "
                f"{wl[0].output_len}: P:D {pd_ratio}), all at t=0")
    elif workload == "trace":
        max_num_seqs = max_num_seqs or 128
        path = Path(trace) if trace else default_trace_path()
        wl = clip_to_context(at_once(read_trace(path, num_requests or 512)), model.max_model_len)
        desc = f"{path.name}, first {len(wl)} rows, all at t=0"
    else:
        raise ValueError(f"workload must be paper or trace, got {workload!r}")
    num_blocks = kv_cache_blocks(model, hw, pp, tp, block_size)
    settings: dict[str, Any] = {
        "model": model.name, "hardware": hw.name, "pp": pp, "tp": tp, "token_budget_sarathi": token_budget,
        "max_num_seqs": max_num_seqs, "per_microbatch_seq_cap": seq_cap,
        "requests_per_microbatch_cap": max_num_seqs // pp, "workload": desc,
        "block_size": block_size, "num_blocks": num_blocks,
        "schedule_overhead_ms": overhead_ms,
    }
    runs: dict[str, Any] = {}
    if not {"sarathi", "orca"} <= set(policies):
        raise ValueError(f"policies must include sarathi and orca (the paper's pair), got {list(policies)}")
    for policy in policies:
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
        "median_bubble_orca_over_sarathi": (o["bubbles"]["per_request_bubble_s"]["p50"]
                                            / s["bubbles"]["per_request_bubble_s"]["p50"]),
        "throughput_sarathi_over_orca": s["throughput"]["requests_per_s"] / o["throughput"]["requests_per_s"],
        "bubble_fraction_orca_over_sarathi": (o["bubbles"]["mean_bubble_fraction"]
                                              / s["bubbles"]["mean_bubble_fraction"]),
        "paper": {"median_bubble": 6.29, "throughput": 1.91},
        # every other policy against sarathi: its bubble fraction over sarathi's, sarathi's throughput
        # over its
        "versus_sarathi": {p: {"bubble_fraction": r["bubbles"]["mean_bubble_fraction"]
                                                  / s["bubbles"]["mean_bubble_fraction"],
                               "throughput_sarathi_over": s["throughput"]["requests_per_s"]
                                                          / r["throughput"]["requests_per_s"]}
                           for p, r in runs.items() if p != "sarathi"},
    }
    return {"settings": settings, "runs": runs, "ratios": ratios}


def _fmt(out: dict[str, Any]) -> str:
    lines = ["settings: " + ", ".join(f"{k}={v}" for k, v in out["settings"].items())]
    for policy, r in out["runs"].items():
        b, t = r["bubbles"], r["throughput"]
        lines.append(
            f"{policy:>9}: median per-request bubble {b['per_request_bubble_s']['p50'] * 1e3:9.2f} ms, "
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
    for policy, v in ra["versus_sarathi"].items():
        if policy != "orca":
            lines.append(f"{policy}/sarathi bubble fraction: {v['bubble_fraction']:.2f}x; sarathi/{policy} "
                         f"throughput: {v['throughput_sarathi_over']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="sarathi_repro.json")
    p.add_argument("--workload", choices=("paper", "trace"), default="paper",
                   help="paper: fixed-length requests at a P:D ratio (Sarathi's setup); trace: Splitwise "
                        "conv")
    p.add_argument("--num-requests", type=int, help="default: 4 * batch size * pp (paper), 512 (trace)")
    p.add_argument("--token-budget", type=int, default=256, help="sarathi's chunk size / token budget")
    p.add_argument("--max-num-seqs", type=int, help="default: batch size * pp (paper), 128 (trace)")
    p.add_argument("--total-tokens", type=int, default=1024, help="paper workload: prompt + output tokens")
    p.add_argument("--pd-ratio", type=float, default=10.0, help="paper workload: prompt:decode tokens")
    p.add_argument("--batch-size", type=int, default=16, help="paper workload: requests per microbatch")
    p.add_argument("--overhead-ms", type=float, default=0.2)
    p.add_argument("--trace", help="request trace CSV (default: ../shared/traces/splitwise_conv.csv)")
    p.add_argument("--trace-dir", help="also write each run's Chrome trace here")
    p.add_argument("--no-seq-cap", action="store_true",
                   help="do not cap requests per microbatch at max_num_seqs / pp")
    args = p.parse_args(argv)
    out = reproduce(args.num_requests, args.token_budget, args.max_num_seqs, args.overhead_ms, args.trace,
                    args.trace_dir, not args.no_seq_cap, args.workload, args.total_tokens, args.pd_ratio,
                    args.batch_size)
    print(_fmt(out))
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"json: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
