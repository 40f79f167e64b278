"""A stage built on one thread and stepped on another, with and without freeing the builder's OpenMP pool.

`ppserve serve` builds its in-process stage on the event loop's thread and steps it on the engine thread;
a Ray stage is set up on Ray's task thread and computes on its loop thread. libgomp keeps one worker pool
per thread that has run a parallel region and, once all pools together hold more threads than the process
may use CPUs, stops spinning at barriers (worker/openmp_pool.py). This times the default model's decode
step at --rows rows (pp=1, in process, `dtype: auto`, sampled) in three ways, each in a fresh process,
interleaved round by round:

- `same thread`: built and stepped on the main thread (the offline API);
- `second thread`: built on the main thread, stepped on another (the server before the fix);
- `second thread, pool freed`: the same, after `release_thread_pool()` on the main thread (the server now).

Prints the median decode step and the stepping thread's voluntary context switches per second.

    python benchmarks/analysis_openmp_pool.py [--rounds 2] [--rows 7] [--cores 0-1]

Writes results/analysis_openmp_pool.json (or --out). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("same thread", "second thread", "second thread, pool freed")

INNER = """
import json, random, statistics, sys, threading, time
from ppserve import LLM, SamplingParams
from ppserve.model.loader import resolve_model
from ppserve.worker.openmp_pool import release_thread_pool
mode, rows = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
llm = LLM(str(resolve_model(None)), dtype="auto", token_budget=512, enable_prefix_caching=False)
result = {}

def switches():
    path = f"/proc/self/task/{threading.get_native_id()}/status"
    return int(next(ln for ln in open(path) if ln.startswith("voluntary_ctxt_switches")).split()[1])

def run():
    eng, steps = llm.engine, []
    for _ in range(3):
        for i in range(rows):
            eng.add_request([rng.randrange(100, 40000) for _ in range(256)],
                            SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0),
                            request_id=f"r{time.monotonic_ns()}-{i}")
        times = []
        while eng.has_unfinished:
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        steps += times[3:-2]  # decode-only steps at `rows` rows
    s0, t0 = switches(), time.perf_counter()
    for i in range(rows):
        eng.add_request([rng.randrange(100, 40000) for _ in range(256)],
                        SamplingParams(max_tokens=40, ignore_eos=True, temperature=1.0), request_id=f"c{i}")
    while eng.has_unfinished:
        eng.step()
    result.update(
        step_ms=1e3 * statistics.median(steps), switches_per_s=(switches() - s0) / (time.perf_counter() - t0)
    )

if mode == "same thread":
    run()
else:
    if mode == "second thread, pool freed":
        release_thread_pool()
    t = threading.Thread(target=run)
    t.start()
    t.join()
llm.shutdown()
print("RESULT " + json.dumps(result))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", type=int, default=7)
    ap.add_argument("--cores", default="0-1")
    ap.add_argument("--out", default=str(REPO / "results" / "analysis_openmp_pool.json"))
    args = ap.parse_args()
    runs: list[dict[str, object]] = []
    for rnd in range(args.rounds):
        for mode in MODES:
            load = os.getloadavg()[0]
            proc = subprocess.run(
                ["taskset", "-c", args.cores, sys.executable, "-c", INNER, mode, str(args.rows)],
                capture_output=True,
                text=True,
                cwd=REPO,
                timeout=900,
                env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
            )
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"{mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            res = json.loads(lines[-1][len("RESULT "):])
            runs.append({"round": rnd, "mode": mode, "load_average": round(load, 2), **res})
            print(f"round {rnd} {mode:28s} decode step {res['step_ms']:6.1f} ms, "
                  f"{res['switches_per_s']:7.0f} voluntary switches/s (load {load:.2f})", flush=True)
    print(f"\n| how the stage is stepped | decode step at {args.rows} rows, ms (median of rounds) "
          "| stepping thread's voluntary switches / s |\n|---|---|---|")
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        print(f"| {mode} | {statistics.median(float(r['step_ms']) for r in mine):.1f} | "  # type: ignore[arg-type]
              f"{statistics.median(float(r['switches_per_s']) for r in mine):.0f} |")  # type: ignore[arg-type]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": args.rows, "cores": args.cores, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
