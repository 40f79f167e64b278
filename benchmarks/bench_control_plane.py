"""The Ray control planes side by side on one workload: connections, compiled graph, classic calls.

Each builds the default model's PP=2 pipeline (embedded Ray, `parallel.dispatch=<plane>`), warms up,
runs the same eight chat requests (48 tokens each) offline, and reports throughput, the mean bubble
(active window), the control-plane gaps from the stages' own spans (engine dispatch -> stage 0,
stage 0 -> stage 1, last stage -> next schedule, and on the token ring last stage -> stage 0; medians;
metrics/control_plane.py) and what the idle stage actors burn: their
processes' CPU seconds per second over two idle seconds (a compiled graph's channel readers poll).

    python benchmarks/bench_control_plane.py [--planes connections,compiled,classic] [--rounds 2]
        [--out results/bench_control_plane.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ppserve import LLM, SamplingParams
from ppserve.bench.report import write_json
from ppserve.metrics.control_plane import control_plane_latency
from ppserve.server.demo import DEMO_PROMPTS as QUESTIONS  # the demo's load


def process_cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def run(plane: str, partition: str, max_tokens: int) -> dict[str, Any]:
    with LLM(pipeline_parallel_size=2, partition_mode=partition, max_num_seqs=len(QUESTIONS),
             overrides=[f"parallel.dispatch={plane}"]) as llm:
        tok = llm.tokenizer
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in QUESTIONS
        ]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
        llm.engine.reset_observations()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
        wall = time.perf_counter() - t0
        spans = llm.spans()
        bubble = llm.bubble_stats().mean_bubble_fraction
        pids = [d.pid for d in llm.engine.executor.describe()]
        c0 = process_cpu_s(pids)
        time.sleep(2.0)
        idle_cpu = (process_cpu_s(pids) - c0) / 2.0
    cp = control_plane_latency(spans)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"plane": plane, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "bubble": bubble,
            "control_plane": cp, "idle_actor_cpu_per_s": idle_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--planes", default="connections,compiled,classic")
    ap.add_argument("--partition", default="cost", help="parallel.partition_mode for every run")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="every plane this many times, in alternating order")
    ap.add_argument("--out", default="results/bench_control_plane.json")
    args = ap.parse_args()
    planes = args.planes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in planes}
    for _ in range(args.rounds):
        for plane in planes:
            runs[plane].append(run(plane, args.partition, args.max_tokens))
    print(
        "| control plane | out tok/s | bubble (active) | dispatch ms | stage->stage ms | turnaround ms | "
        "ring ms "
        "| idle actor CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for plane, rs in runs.items():
        def med(key: str, rs: list[dict[str, Any]] = rs) -> str:
            # Under the token ring a figure may have no sample in a run (every formation ahead: no
            # turnaround).
            got = [
                r["control_plane"][key]["p50_s"] * 1e3
                for r in rs
                if r["control_plane"][key]["p50_s"] is not None
            ]
            return f"{statistics.median(got):.2f}" if got else "-"
        print(
            f"| {plane} | {statistics.median(r['tokens_per_s'] for r in rs):.1f} | "
            f"{100 * statistics.median(r['bubble'] for r in rs):.1f}% | {med('dispatch')} | {med('hop')} | "
            f"{med('turnaround')} | {med('ring')} | "
            f"{statistics.median(r['idle_actor_cpu_per_s'] for r in rs):.2f} cores |"
        )
    write_json(args.out, {"args": vars(args), "runs": runs})
    print(f"wrote {args.out} (medians over {args.rounds} round(s))")


if __name__ == "__main__":
    main()
