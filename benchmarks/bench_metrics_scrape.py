"""What a Prometheus scrape costs the engine: output tok/s and engine-thread statistics time, scraped
at 0 Hz and at --hz, for this tree and (with --before-src) another one, side by side in one run.

    git worktree add /tmp/wt22 <commit before the change>
    # JSON: results/metrics_scrape.json
    python benchmarks/bench_metrics_scrape.py --before-src /tmp/wt22
    python benchmarks/bench_metrics_scrape.py --pp 2 --before-src /tmp/wt22   # through Ray

Each source tree runs in its own process (PYTHONPATH), which builds one AsyncEngine with the server's
metrics exporter as its observer (the default model, float32) and serves --rounds rounds of the same
load, after one unmeasured warm-up round of it: --requests sampled requests (temperature 1,
ignore_eos) of --prompt-len random tokens and --output-len outputs, all at once. Rounds alternate the
scrape rate (0, hz, hz, 0, ...) so drift in the machine's load falls on both. A scrape is exactly the
HTTP `/metrics` handler (OpenAIFrontDoor.metrics_text) on the engine's event loop. The engine-thread
figure is the time the "ppserve-engine" thread spends
inside the statistics code (the stats window's methods and the AsyncEngine's stats helpers, whichever
the tree has; nested calls counted once), so it includes the periodic span drains as well as whatever a
scrape asks of that thread; per scrape is its growth from 0 Hz to hz, divided by the scrapes.

The trees run one after the other: their tok/s compare only on a quiet machine. The ratio of the 0 Hz and
hz rounds within one tree (interleaved) is the fair throughput figure under changing load. With
PYTHONPATH=DIR set for this command, the "after" tree is DIR instead of this checkout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ENGINE_THREAD = "ppserve-engine"
# Names in either tree (before: a stats call ran snapshot() on the engine thread; after: publish/drain).
WINDOW_METHODS = ("snapshot", "drain_spans", "drain", "publish")
ENGINE_METHODS = ("_stats", "_publish_stats")


class EngineThreadTimer:
    """Sums the engine thread's time inside the wrapped methods (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0  # only the engine thread changes it

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if callable(fn):
                setattr(obj, name, self._timed(fn))

    def _timed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name != ENGINE_THREAD:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

        return timed


async def _scrape_loop(door: Any, hz: float, stop: asyncio.Event, latencies: list[float]) -> None:
    if hz <= 0:
        return
    period = 1.0 / hz
    next_t = time.perf_counter()
    while not stop.is_set():
        t0 = time.perf_counter()
        resp = await door.metrics_text()
        latencies.append(time.perf_counter() - t0)
        assert resp.status_code == 200 and b"ppserve:generation_tokens_total" in resp.body
        next_t += period
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, next_t - time.perf_counter()))
        except TimeoutError:
            pass


async def _one_round(engine: Any, door: Any, prompts: list[list[int]], args: argparse.Namespace, hz: float,
                     timer: EngineThreadTimer) -> dict[str, Any]:
    from ppserve.engine.messages import PromptInput
    from ppserve.request import SamplingParams

    sp = SamplingParams(max_tokens=args.output_len, temperature=1.0, ignore_eos=True)
    stop, latencies = asyncio.Event(), []
    seconds0, calls0 = timer.seconds, timer.calls
    scraper = asyncio.create_task(_scrape_loop(door, hz, stop, latencies))

    async def one(p: list[int]) -> int:
        stream = await engine.add_request(PromptInput(token_ids=tuple(p)), sp)
        return sum([len(c.token_ids) async for c in stream])

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    wall = time.perf_counter() - t0
    stop.set()
    await scraper
    return {
        "hz": hz,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "scrapes": len(latencies),
        "scrape_latency_ms_mean": 1e3 * sum(latencies) / max(1, len(latencies)),
        "engine_stats_s": timer.seconds - seconds0,
        "engine_stats_calls": timer.calls - calls0,
    }


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One source tree: build the engine, run the alternating rounds, return the figures."""
    import ppserve
    from ppserve.config import load_config
    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.server.metrics import ServerMetrics
    from ppserve.server.openai_api import OpenAIFrontDoor

    config = load_config(overrides=[f"parallel.pipeline_parallel_size={args.pp}", "model.dtype=float32"])
    engine = AsyncEngine.build(config)
    metrics = ServerMetrics("bench")
    engine.add_observer(metrics)
    timer = EngineThreadTimer()
    timer.wrap(engine, ENGINE_METHODS)
    timer.wrap(engine.window, WINDOW_METHODS)
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    rates = [0.0, args.hz, args.hz, 0.0] * ((args.rounds + 3) // 4)

    async def main() -> list[dict[str, Any]]:
        engine.start()
        door = OpenAIFrontDoor(engine, "bench", metrics)
        try:
            # A whole unmeasured round first: the first one at this batch size runs ~2x slower (cold paths).
            await _one_round(engine, door, prompts, args, 0.0, timer)
            return [await _one_round(engine, door, prompts, args, hz, timer) for hz in rates[:args.rounds]]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    try:
        rounds = asyncio.run(main())
    finally:
        engine.shutdown()
    return {"ppserve": str(Path(ppserve.__file__).resolve().parents[1]), "rounds": rounds}


def summarize(rounds: list[dict[str, Any]], hz: float) -> dict[str, float]:
    def mean(key: str, rate: float) -> float:
        vals = [r[key] for r in rounds if r["hz"] == rate]
        return sum(vals) / len(vals)

    scrapes = sum(r["scrapes"] for r in rounds if r["hz"] == hz) / max(1, sum(r["hz"] == hz for r in rounds))
    per_s = {rate: mean("engine_stats_s", rate) / mean("wall_s", rate) for rate in (0.0, hz)}
    return {
        "tok_s_0hz": mean("output_tok_s", 0.0),
        "tok_s_hz": mean("output_tok_s", hz),
        "tok_s_ratio": mean("output_tok_s", hz) / mean("output_tok_s", 0.0),
        "engine_stats_ms_per_s_0hz": 1e3 * per_s[0.0],
        "engine_stats_ms_per_s_hz": 1e3 * per_s[hz],
        # The growth of engine-thread stats time from 0 Hz to hz, per scrape.
        "engine_ms_per_scrape": 1e3 * (mean("engine_stats_s", hz) - mean("engine_stats_s", 0.0)
                                       * mean("wall_s", hz) / mean("wall_s", 0.0)) / max(1.0, scrapes),
        "scrape_latency_ms": mean("scrape_latency_ms_mean", hz),
    }


def run_tree(src: str | None, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = str(Path(src).resolve())
    cmd = [sys.executable, __file__, "--worker", "--pp", str(args.pp), "--hz", str(args.hz), "--rounds",
           str(args.rounds), "--requests", str(args.requests), "--prompt-len", str(args.prompt_len),
           "--output-len", str(args.output_len)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--before-src", help="also run this source tree (e.g. a git worktree of the commit before)"
    )
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hz", type=float, default=10.0, help="scrape rate of the scraped rounds")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per tree, alternating 0 Hz and --hz")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--out", default=str(REPO / "results" / "metrics_scrape.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (one at 0 Hz, one at --hz)")
    if args.hz <= 0:
        ap.error("--hz must be > 0")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    trees = {"after": None} if not args.before_src else {"before": args.before_src, "after": None}
    load = os.getloadavg()
    results = {name: run_tree(src, args) for name, src in trees.items()}
    load_end = os.getloadavg()
    print(f"load average {load[0]:.2f} at the start, {load_end[0]:.2f} at the end; pp={args.pp}, "
          f"{args.requests} requests x {args.prompt_len} prompt + {args.output_len} output tokens, sampled")
    print(f"| tree | tok/s 0 Hz | tok/s {args.hz:g} Hz | ratio | engine stats ms/s 0 Hz | at {args.hz:g} Hz "
          f"| engine ms per scrape | scrape latency ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, res in results.items():
        res["summary"] = s = summarize(res["rounds"], args.hz)
        print(f"| {name} | {s['tok_s_0hz']:.1f} | {s['tok_s_hz']:.1f} | {s['tok_s_ratio']:.3f} | "
              f"{s['engine_stats_ms_per_s_0hz']:.2f} | {s['engine_stats_ms_per_s_hz']:.2f} | "
              f"{s['engine_ms_per_scrape']:.3f} | {s['scrape_latency_ms']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "loadavg_start": load, "loadavg_end": load_end,
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
