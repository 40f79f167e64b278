"""What sharing the work in reach over k rounds buys and costs (`scheduler.balance_rounds`, issue 21),
in the simulator.

The balanced formation shares the work in reach among the p microbatches of one round by default. With
k > 1, while requests keep arriving (`ppserve.sched.balance.ArrivalWatch`), it shares it among k rounds:
thinner chunks beside the decodes, a more level microbatch time, fewer bubbles and a shorter TBT tail,
and more microbatches per prompt (TTFT). This runs the same seeded workloads at each k, side by side:

- the regime suite's conversation regimes (Llama-2-70B, A100 PP4xTP4, 2 / 4 / 8 req/s) and Sarathi's
  saturated GPT-3 case (512 requests at t=0: the arrivals stop at once, so k must change nothing);
- the conversation trace on Llama-3-70B H100 deployments (PP4xTP2, PP8xTP1, PP2xTP4) and on other rows
  and rates of the trace on A100, where the trade comes out differently.

Per cell: mean bubble (active window), TTFT p50 / p99, TBT p99, output tok/s.

    python benchmarks/bench_balance_rounds.py [--rounds 1,2,4] [--jobs 2]
        [--out results/bench_balance_rounds.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from ppserve.bench.regimes import BALANCED, Formation, Regime, regimes, sim_setup
from ppserve.bench.report import write_json
from ppserve.sim import simulate
from ppserve.sim.workload import (
    WorkloadRequest,
    clip_to_context,
    default_trace_path,
    read_trace,
    with_poisson_arrivals,
)


def _trace(start: int, rate: float, seed: int, n: int = 400) -> list[WorkloadRequest]:
    return with_poisson_arrivals(
        clip_to_context(read_trace(default_trace_path(), n, start=start), 4096), rate, seed=seed
    )


def setups() -> list[Regime]:
    suite = {r.name: r for r in regimes()}
    extra = [
        Regime("conv-3, rows 400-799, seed 1", "", functools.partial(_trace, 400, 3.0, 1)),
        Regime("conv-6, rows 800-1199, seed 2", "", functools.partial(_trace, 800, 6.0, 2)),
        Regime("llama3-70b h100 pp4xtp2, 4 req/s", "", functools.partial(_trace, 0, 4.0, 3),
               model="llama3-70b", hardware="h100", pp=4, tp=2),
        Regime("llama3-70b h100 pp8xtp1, 4 req/s", "", functools.partial(_trace, 0, 4.0, 3),
               model="llama3-70b", hardware="h100", pp=8, tp=1),
        Regime("llama3-70b h100 pp2xtp4, 8 req/s", "", functools.partial(_trace, 0, 8.0, 4),
               model="llama3-70b", hardware="h100", pp=2, tp=4),
    ]
    return [suite[name] for name in ("sarathi-gpt3", "conv-2", "conv-4", "conv-8")] + extra


def cell(name: str, rounds: int) -> dict[str, Any]:
    """One setup (by name: the suite's regimes hold lambdas, which do not cross to a process) at `rounds`."""
    regime = {r.name: r for r in setups()}[name]
    wl, cost, cfg = sim_setup(regime, Formation(BALANCED, "sarathi", True))
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, balance_rounds=rounds))
    s = simulate(wl, cost, cfg).summary("active")
    lat = s["latency"]
    return {
        "setup": regime.name,
        "rounds": rounds,
        "mean_bubble": s["bubbles"]["mean_bubble_fraction"],
        "ttft_p50_s": lat["ttft_s"]["p50"],
        "ttft_p99_s": lat["ttft_s"]["p99"],
        "tbt_p99_s": lat["tbt_s"]["p99"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
    }


def _cell(args: tuple[str, int]) -> dict[str, Any]:
    return cell(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds", default="1,2,4", help="values of scheduler.balance_rounds, the first the baseline"
    )
    ap.add_argument("--jobs", type=int, default=2, help="simulations in parallel processes")
    ap.add_argument("--out", default="results/bench_balance_rounds.json")
    args = ap.parse_args()
    ks = [int(k) for k in args.rounds.split(",")]
    if not ks or min(ks) < 1:
        raise SystemExit(f"--rounds needs values >= 1, got {args.rounds!r}")
    todo = [(r.name, k) for r in setups() for k in ks]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(_cell, todo))
    base = {row["setup"]: row for row in rows if row["rounds"] == ks[0]}
    print(
        "| setup | rounds | mean bubble | TTFT p50 ms | TTFT p99 ms | TBT p99 ms | out tok/s | vs "
        f"rounds={ks[0]}: "
        "TTFT p50 / TBT p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        b = base[row["setup"]]
        tbt = row["tbt_p99_s"] / b["tbt_p99_s"] if b["tbt_p99_s"] else float("nan")
        print(
            f"| {row['setup']} | {row['rounds']} | {100 * row['mean_bubble']:.1f}% | "
            f"{1e3 * row['ttft_p50_s']:.1f} | "
            f"{1e3 * row['ttft_p99_s']:.1f} | {1e3 * row['tbt_p99_s']:.1f} | "
            f"{row['output_tokens_per_s']:.0f} | "
            f"{row['ttft_p50_s'] / b['ttft_p50_s']:.2f}x / {tbt:.2f}x |"
        )
    write_json(args.out, {"args": vars(args), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
