"""Even vs cost-aware vs calibrated layer partition on the default model at PP=2: per-stage compute time.

The same workload runs through each partition in one process; the figures come from the stages' own
`compute` spans. Cost-aware partitioning (ppserve.sched.partition) prices the LM head as if every token
got logits (about eight decoder layers each for SmolLM2); the calibrated one measures the per-layer and
head costs from the stages' compute times on a short run at the configured budget (engine/calibration.py).

    python benchmarks/bench_partition.py [--requests 16] [--max-tokens 48] [--modes even,cost,calibrated]
        [--out results/bench_partition.json]
"""

from __future__ import annotations

import argparse
import statistics

from ppserve import LLM, SamplingParams
from ppserve.bench.report import write_json


def run(mode: str, prompts: list[list[int]], max_tokens: int, budget: int) -> dict[str, object]:
    with LLM(pipeline_parallel_size=2, partition_mode=mode, token_budget=budget, max_num_seqs=len(prompts),
             overrides=["scheduler.per_microbatch_seq_cap=true"]) as llm:
        layout = [[d.layer_start, d.layer_end] for d in llm.engine.executor.describe()]
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        llm.spans()
        llm._spans.clear()
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        spans = [s for s in llm.spans() if s.kind == "compute"]
        report = llm.bubble_stats(window="active")
        wall_s = (max(s.end_ns for s in spans) - min(s.start_ns for s in spans)) * 1e-9
    per_stage = {}
    for stage in (0, 1):
        ms = [s.duration_ns / 1e6 for s in spans if s.stage == stage]
        per_stage[stage] = {"microbatches": len(ms), "compute_ms_mean": statistics.fmean(ms),
                            "compute_ms_median": statistics.median(ms), "busy_ms_total": sum(ms)}
    slow, fast = max(v["busy_ms_total"] for v in per_stage.values()), min(v["busy_ms_total"] for v in per_stage.values())
    return {"mode": mode, "layers": layout, "stages": per_stage, "imbalance": slow / fast,
            "mean_bubble_fraction_active": report.mean_bubble_fraction, "wall_s": wall_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--token-budget", type=int, default=128)
    ap.add_argument("--modes", default="even,cost,calibrated")
    ap.add_argument("--out", default="results/bench_partition.json")
    args = ap.parse_args()
    prompts = [[(i * 31 + j * 7) % 40000 + 100 for j in range(args.prompt_len)] for i in range(args.requests)]
    rows = [run(mode, prompts, args.max_tokens, args.token_budget) for mode in args.modes.split(",")]
    print("| partition | layers | stage 0 compute ms (mean) | stage 1 compute ms (mean) | busy imbalance | bubble (active) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        st = r["stages"]
        print(f"| {r['mode']} | {r['layers']} | {st[0]['compute_ms_mean']:.1f} | {st[1]['compute_ms_mean']:.1f} | "
              f"{r['imbalance']:.2f}x | {100 * r['mean_bubble_fraction_active']:.1f}% | {r['wall_s']:.2f} |")
    write_json(args.out, {"args": vars(args), "runs": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
