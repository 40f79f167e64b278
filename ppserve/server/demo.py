"""`ppserve demo`: the whole system in one command, on one machine.

Starts an embedded Ray instance and a PP=2 pipeline on the default model, serves the gRPC API on a
free loopback port in this process, streams a set of concurrent chat requests through the gRPC
client, then prints latency, throughput and per-stage bubble figures and writes the trace (Chrome
JSON), a JSON summary and, when ppserve.timeline is installed, the timeline picture.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppserve.config import add_config_arguments

if TYPE_CHECKING:  # `ppserve --help` stays instant
    from ppserve.engine.stats import EngineStats
    from ppserve.metrics.host_cpu import CpuUsage

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about pipelines.",
    "Explain in one sentence what a GPU does.",
    "List three prime numbers.",
    "What is the boiling point of water in Celsius?",
    "Give me a short tip for writing clean Python code.",
    "Name three planets of the solar system.",
    "Why is the sky blue? Answer briefly.",
]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="run a PP=2 pipeline, serve it over gRPC, stream concurrent requests, report"
    )
    add_config_arguments(
        p, set_help="override a config value (demo defaults: pp=2, max_num_seqs=--num-requests)"
    )
    p.add_argument("--num-requests", type=int, default=8, help="concurrent chat requests (prompts repeat)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", default="results/demo", help="output folder for trace, summary and picture")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ppserve.config import load_config
    from ppserve.engine.async_engine import AsyncEngine

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The scheduler spreads the decodes over the two in-flight microbatches itself (balanced
    # formation), and the default cost-aware split gives the LM head's stage fewer layers.
    defaults = [
        "parallel.pipeline_parallel_size=2",
        f"scheduler.max_num_seqs={max(2, args.num_requests)}",
    ]
    config = load_config(args.config, [*defaults, *args.overrides])
    print(
        f"building the pipeline: pp={config.parallel.pipeline_parallel_size} "
        f"tp={config.parallel.tensor_parallel_size}, "
        f"model {config.model.model or 'SmolLM2-135M-Instruct'} ...",
        flush=True,
    )
    t0 = time.perf_counter()
    engine = AsyncEngine.build(config, keep_all_spans=True)
    print(f"pipeline ready in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        results, stats, wall, usage = asyncio.run(_serve_and_stream(engine, args))
        engine.stop()  # from here on this thread may touch the engine directly
        _report(engine, results, stats, wall, usage, out_dir)
    finally:
        engine.stop()
        engine.shutdown()
    print("shut down cleanly")
    return 0


async def _serve_and_stream(
    engine: Any, args: argparse.Namespace
) -> tuple[list[Any], EngineStats, float, CpuUsage | None]:
    from ppserve.metrics.host_cpu import cpu_usage, snapshot
    from ppserve.server.client import AsyncPPServeClient, Completion
    from ppserve.server.server import start_server

    running = await start_server(engine, "127.0.0.1", 0, engine.config.server.max_message_bytes)
    print(f"ppserve serving on {running.address}", flush=True)
    try:
        async with AsyncPPServeClient(running.address) as client:
            await client.wait_ready()
            prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_requests)]
            done = 0

            async def one(i: int, prompt: str) -> Completion:
                nonlocal done
                out = Completion()
                async for chunk in client.stream(
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.max_tokens,
                    request_id=f"demo-{i}",
                ):
                    out.add(chunk)
                done += 1
                print(
                    f"  [{done}/{len(prompts)}] demo-{i}: {len(out.token_ids)} tokens ({out.finish_reason})",
                    flush=True,
                )
                return out

            print(
                f"streaming {len(prompts)} concurrent chat requests (max_tokens={args.max_tokens}) ...",
                flush=True,
            )
            # The stage processes' pids, for where the machine's CPU went while the requests ran.
            stage_pids = {w.pid for w in engine.engine.executor.describe()} - {os.getpid()}
            cpu_before = snapshot(stage_pids)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            wall = time.perf_counter() - t0
            cpu_after = snapshot(stage_pids)
            usage = cpu_usage(cpu_before, cpu_after) if cpu_before and cpu_after else None
            for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
                print(f"--- demo-{i}: {p}\n    {r.text.strip()!s}")
            stats = await client.stats()
            from ppserve.server.cli import format_stats

            print("\nGetStats:\n" + format_stats(stats))
    finally:
        await running.stop(grace_s=5.0)
    return list(results), stats, wall, usage


def _report(engine: Any, results: list[Any], stats: EngineStats, wall: float, usage: CpuUsage | None,
            out_dir: Path) -> None:
    from ppserve.metrics.bubbles import bubble_report, short_handed_fractions
    from ppserve.metrics.control_plane import FIGURES, control_plane_latency
    from ppserve.metrics.latency import RequestTiming, lifetimes_ns, summarize
    from ppserve.metrics.trace import save_chrome_trace

    timings = []
    for r in results:
        m = r.metrics or {}
        arrival = r.token_times[0] - m.get("ttft_s", 0.0) if r.token_times else 0.0
        timings.append(RequestTiming(arrival, arrival + m.get("queue_time_s", 0.0), list(r.token_times)))
    lat = summarize(timings)
    ntok = lat["num_output_tokens"]

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1e3:.1f} ms"

    print(
        f"\n{len(results)} requests, {ntok} output tokens in {wall:.2f} s: "
        f"{ntok / wall:.1f} output tok/s, {len(results) / wall:.2f} req/s"
    )
    print(f"TTFT  p50 {ms(lat['ttft_s']['p50'])}  p99 {ms(lat['ttft_s']['p99'])}")
    print(f"TBT   p50 {ms(lat['tbt_s']['p50'])}  p99 {ms(lat['tbt_s']['p99'])}")
    print(
        f"TPOT  mean {ms(lat['tpot_s']['mean'])}   "
        f"scheduling delay p50 {ms(lat['scheduling_delay_s']['p50'])}"
    )

    spans = engine.all_spans()
    work = engine.engine.work.intervals(time.perf_counter_ns())
    report = bubble_report(spans, work, window="active")
    print("\n" + report.format_text())
    # Token times are Unix seconds, spans read perf_counter: one offset, read now, puts them on one clock.
    p = engine.engine.config.parallel.pipeline_parallel_size
    lifetimes = lifetimes_ns(timings, offset_s=time.time() - time.perf_counter())
    short, _ = short_handed_fractions(spans, work, "active", lifetimes, p)
    print(f"of the mean bubble, {100 * short:.1f} points fell while fewer than {p} requests were in the "
          "system (their decodes cannot fill every stage, whatever the formation)")
    control = control_plane_latency(spans)
    print("control plane per microbatch (medians): " + ", ".join(
        f"{name} {ms(control[name]['p50_s'])}" for name in FIGURES
    ) + "  (engine -> stage 0; stage s -> s+1; last stage -> next schedule; on the token ring, last stage ->"
        " stage 0)")
    if usage is not None:
        # A stage's bubble is either a core left idle (the stage waited on a token, a hop, an arrival) or a
        # core busy with something else (the engine, the server and these clients share the machine).
        print(usage.format_text("this process (engine, gRPC server, clients)"))

    trace_path = out_dir / "trace.json"
    save_chrome_trace(trace_path, spans, work_intervals=work, counters=engine.engine.cache_counters)
    print(f"\ntrace: {trace_path} (open in https://ui.perfetto.dev or chrome://tracing)")
    summary = {
        "wall_s": wall,
        "output_tokens_per_s": ntok / wall,
        "latency": lat,
        "bubbles_active": report.to_dict(),
        "short_handed_bubble_fraction": short,
        "control_plane": control,
        "host_cpu": usage.to_dict() if usage is not None else None,
        "stats": stats.to_dict(),
        "outputs": [
            {
                "request_id": r.request_id,
                "text": r.text,
                "token_ids": r.token_ids,
                "finish_reason": r.finish_reason,
                "metrics": r.metrics,
            }
            for r in results
        ],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {out_dir / 'summary.json'}")
    try:
        from ppserve.timeline.render import render_png
    except ImportError:
        print("timeline picture: skipped (ppserve.timeline is not installed)")
        return
    png = out_dir / "timeline.png"
    try:
        render_png(str(trace_path), str(png))
        print(f"timeline picture: {png}")
    except Exception as e:  # the picture is a bonus; the figures above already stand
        print(f"timeline picture failed: {e}", file=sys.stderr)
