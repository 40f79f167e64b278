"""Layer partitions of the default model at PP=2, side by side: output rate, bubble and per-stage compute on a
decode-heavy and a prefill-heavy workload.

A partition is a `parallel.partition_mode` (even, cost, calibrated) or explicit layer counts (`17/13`).
The analytic `cost` split (ppserve.sched.partition.robust_partition) is the one whose worst slowdown
against the best split for a decode microbatch and for a full-budget prefill chunk is least; decode
alone wants the LM head's stage to hold fewer layers (19 / 11 by weights), prefill an even split.

Two workloads, greedy, eos ignored, one `LLM` per partition and round (partitions alternate within a
round: the machine is shared and noisy, compare same-round ratios):
- `decode`: --decode-requests prompts of 32 tokens, --decode-tokens new tokens each (the decode ring);
- `prefill`: --prefill-requests prompts of 256 tokens, 64 new tokens, all at once (a saturated pipeline,
  mostly full-budget chunks: the shape of bench_serving.py's saturation scenario).
Per cell: output tok/s (wall), mean bubble (active window, the stages' own spans) and each stage's mean
compute ms per microbatch.

    python benchmarks/bench_partition.py [--partitions cost,19/11,even] [--rounds 2]
        [--workloads decode,prefill]
        [--out results/bench_partition.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ppserve import LLM, SamplingParams
from ppserve.bench.report import write_json


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[list[int]], int]]:
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]

    every = {"decode": (prompts(args.decode_requests, 32), args.decode_tokens),
             "prefill": (prompts(args.prefill_requests, 256), 64)}
    return {name: every[name] for name in args.workloads.split(",")}


def overrides_for(partition: str) -> list[str]:
    if "/" in partition:
        counts = partition.split("/")
        if len(counts) != 2 or not all(c.isdigit() for c in counts):
            raise SystemExit(f"an explicit partition is two layer counts, e.g. 17/13, got {partition!r}")
        return [f"parallel.layer_partition=[{counts[0]},{counts[1]}]"]
    if partition not in ("even", "cost", "calibrated"):
        raise SystemExit(f"unknown partition {partition!r}: even, cost, calibrated or counts like 17/13")
    return [f"parallel.partition_mode={partition}"]


def run(partition: str, loads: dict[str, tuple[list[list[int]], int]]) -> dict[str, object]:
    out: dict[str, object] = {"partition": partition}
    with LLM(pipeline_parallel_size=2, overrides=overrides_for(partition)) as llm:
        out["layers"] = [[d.layer_start, d.layer_end] for d in llm.engine.executor.describe()]
        first = next(iter(loads.values()))[0]
        llm.generate([p[:32] for p in first[:2]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for name, (prompts, max_tokens) in loads.items():
            llm.spans()
            llm._spans.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            wall = time.perf_counter() - start
            spans = [s for s in llm.spans() if s.kind == "compute"]
            stages = {
                st: statistics.fmean(s.duration_ns / 1e6 for s in spans if s.stage == st) for st in (0, 1)
            }
            out[name] = {"output_tok_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall,
                         "mean_bubble": llm.bubble_stats(window="active").mean_bubble_fraction,
                         "compute_ms_mean": stages}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--partitions", default="cost,19/11,even", help="modes (even, cost, calibrated) or counts (17/13)"
    )
    ap.add_argument("--workloads", default="decode,prefill")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode-requests", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--prefill-requests", type=int, default=48)
    ap.add_argument("--out", default="results/bench_partition.json")
    args = ap.parse_args()
    parts = args.partitions.split(",")
    for p in parts:
        overrides_for(p)  # bad input fails before any model loads
    loads = workloads(args)
    rows = []
    for r in range(args.rounds):
        for p in parts:
            row = {"round": r, **run(p, loads)}
            rows.append(row)
            print(
                f"round {r} {p} {row['layers']}: "
                + ", ".join(
                    f"{w} {row[w]['output_tok_s']:.1f} tok/s, bubble {100 * row[w]['mean_bubble']:.1f}%"
                    for w in loads
                ),
                flush=True,
            )
    base = parts[0]
    print(
        f"\n| partition | layers | workload | output tok/s per round | / {base}, same round | bubble per "
        "round | "
        "stage 0 / 1 compute ms (mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    for p in parts:
        mine = [row for row in rows if row["partition"] == p]
        for w in loads:
            ref = {row["round"]: row[w]["output_tok_s"] for row in rows if row["partition"] == base}
            rates = " / ".join(f"{row[w]['output_tok_s']:.1f}" for row in mine)
            ratios = " / ".join(f"{row[w]['output_tok_s'] / ref[row['round']]:.2f}" for row in mine)
            bubbles = " / ".join(f"{100 * row[w]['mean_bubble']:.1f}%" for row in mine)
            comp = statistics.fmean(row[w]["compute_ms_mean"][0] for row in mine), \
                statistics.fmean(row[w]["compute_ms_mean"][1] for row in mine)
            print(
                f"| {p} | {mine[0]['layers']} | {w} | {rates} | {ratios} | {bubbles} | {comp[0]:.1f} / "
                f"{comp[1]:.1f} |"
            )
    write_json(args.out, {"args": vars(args), "runs": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
