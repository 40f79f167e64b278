"""`ppserve bench compare | capacity | sweep | validate | regimes`: the benchmark suites from the
command line.

Heavy packages are imported inside `run`, so `ppserve --help` stays instant. The scripts in
benchmarks/ call `main()` here with their suite name.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from ppserve.config import add_config_arguments

SUITE_NAMES = ("compare", "capacity", "sweep", "validate", "regimes")


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M-Instruct)")
    g.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    g.add_argument("--token-budget", type=int, default=128)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--no-seq-cap", action="store_true",
                   help="do not cap requests per microbatch at max_num_seqs / pp (on by default)")
    g.add_argument("--block-size", type=int, default=None,
                   help="KV block size (default: the attention kernel's page, 256 with flash-attn, else 16)")
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--dtype", default="float32")
    add_config_arguments(g, with_config=False)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="trace:splitwise_conv.csv",
                   help="trace:<name in ../shared/traces or path> | uniform | zipf | fixed | shared-prefix "
                        "| multi-turn")
    w.add_argument("--num-requests", type=int, default=48)
    w.add_argument("--start", type=int, default=0, help="first trace row")
    w.add_argument("--prefill-scale", type=float, default=0.15)
    w.add_argument("--decode-scale", type=float, default=0.15)
    w.add_argument("--arrival", default="poisson", choices=["poisson", "trace", "at-once"])
    w.add_argument("--rate", type=float, default=1.0, help="Poisson requests/s")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace arrivals sped up by this factor")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-range", default="16,256", help="uniform/zipf prompt lengths MIN,MAX")
    w.add_argument("--output-range", default="8,64", help="uniform/zipf output lengths MIN,MAX")
    w.add_argument("--total-tokens", type=int, default=256, help="fixed: tokens per request")
    w.add_argument("--pd-ratio", type=float, default=4.0, help="fixed: prompt:decode ratio")
    w.add_argument("--prefix-groups", type=int, default=8, help="shared-prefix: how many system prompts")
    w.add_argument("--prefix-len", type=int, default=1024,
                   help="shared-prefix / multi-turn: system prompt tokens")
    w.add_argument("--question-len", type=int, default=64,
                   help="shared-prefix / multi-turn: tokens per question")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    o = p.add_argument_group("output")
    o.add_argument("--mode", default="offline", choices=["offline", "grpc"],
                   help="offline: drive the engine in-process; grpc: through a `ppserve serve` subprocess")
    o.add_argument("--results", default="results", help="results root (a dated folder is made inside)")
    o.add_argument("--out", help="exact output folder (instead of a dated one under --results)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-traces", action="store_true", help="do not save a Chrome trace per run")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench",
                       help="benchmarks: policy comparison, capacity search, budget sweep, sim validation")
    bsub = p.add_subparsers(dest="suite", required=True)
    c = bsub.add_parser("compare", help="policies side by side on one workload")
    c.add_argument("--policies", default="sarathi,vllm,orca,static")
    k = bsub.add_parser("capacity",
                        help="highest request rate meeting the TBT / scheduling-delay SLO, per policy")
    k.add_argument("--policies", default="sarathi,vllm")
    k.add_argument("--on", default="both", choices=["real", "sim", "both"])
    k.add_argument("--tbt-slo-ms", type=float,
                   help="p99 TBT target (default: --tbt-factor x measured decode step)")
    k.add_argument("--tbt-factor", type=float, default=5.0)
    k.add_argument("--sched-delay-slo", type=float, default=2.0, help="median scheduling delay limit (s)")
    k.add_argument("--start-rate", type=float, default=1.0)
    k.add_argument("--max-evals", type=int, default=5, help="real-pipeline probes per policy")
    k.add_argument("--rel-tol", type=float, default=0.1)
    k.add_argument("--sim-num-requests", type=int, default=200,
                   help="the fewest requests a simulated probe replays")
    k.add_argument("--probe-duration", type=float, default=60.0,
                   help="seconds of arrivals one probe replays (rate x this many requests, at least "
                        "--num-requests on the real pipeline, --sim-num-requests in the simulator), as "
                        "ppserve plan does")
    k.add_argument("--sim-max-evals", type=int, default=14)
    k.add_argument("--profile", help="simulator profile JSON (default: fitted from the real probes)")
    k.add_argument("--run-slack", type=float, default=60.0,
                   help="a real probe is cut (and fails) this many seconds after its last arrival")
    s = bsub.add_parser("sweep", help="token budget vs p99 TBT and throughput")
    s.add_argument("--budgets", default="32,64,128,256,512")
    s.add_argument("--policy", default="sarathi")
    v = bsub.add_parser("validate", help="simulator fitted on workload A predicts held-out workload B")
    v.add_argument("--policy", default="sarathi")
    v.add_argument("--tolerance", type=float, default=0.15)
    v.add_argument("--held-out-start", type=int, help="first trace row of B (default: right after A)")
    v.add_argument("--held-out-rate", type=float, help="Poisson rate of B (default: A's)")
    v.add_argument("--capacity", action="store_true",
                   help="also B's capacity under bench capacity's SLO, simulated (profile fitted on A) and "
                        "real")
    v.add_argument("--tbt-factor", type=float, default=5.0,
                   help="with --capacity: the p99 TBT SLO in decode steps")
    v.add_argument("--probe-duration", type=float, default=30.0,
                   help="with --capacity: seconds of arrivals a probe")
    v.add_argument("--max-evals", type=int, default=6, help="with --capacity: real probes")
    v.add_argument("--rel-tol", type=float, default=0.05, help="with --capacity: the real bracket's width")
    for sp in (c, k, s, v):
        _common(sp)
        sp.set_defaults(func=run)
    r = bsub.add_parser("regimes", help="five microbatch formations on eleven load regimes, in the simulator")
    r.add_argument("--reduced", action="store_true", help="fewer requests per regime, same regimes (CI)")
    r.add_argument("--only", help="comma-separated regime names (default: all eleven)")
    r.add_argument("--results", default="results", help="results root (a dated folder is made inside)")
    r.add_argument("--out", help="exact output folder (instead of a dated one under --results)")
    r.add_argument("--no-plot", action="store_true", help="do not draw regimes.png")
    r.add_argument("--spans", metavar="DIR",
                   help="also write each cell's spans to DIR/<regime>--<formation>.jsonl (ppserve timeline "
                        "draws them)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1),
                   help="processes that run the cells (default: this machine's cores, at most 8; seeded, so "
                        "the figures do not depend on it)")
    r.set_defaults(func=run_regimes)


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ppserve.bench import report, suites
    from ppserve.bench.harness import EngineSpec
    from ppserve.bench.workloads import WorkloadSpec

    engine = EngineSpec(model=args.model, pp=args.pp, token_budget=args.token_budget,
                        max_num_seqs=args.max_num_seqs,
                        seq_cap=not args.no_seq_cap, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks,
                        max_model_len=args.max_model_len, dtype=args.dtype, overrides=tuple(args.overrides))
    pmin, pmax = _pair(args.prompt_range)
    omin, omax = _pair(args.output_range)
    workload = WorkloadSpec(source=args.workload, num_requests=args.num_requests, start=args.start,
                            prefill_scale=args.prefill_scale, decode_scale=args.decode_scale,
                            arrival=args.arrival,
                            rate=args.rate, time_scale=args.time_scale, seed=args.seed, prompt_min=pmin,
                            prompt_max=pmax, output_min=omin, output_max=omax, total_tokens=args.total_tokens,
                            pd_ratio=args.pd_ratio, max_model_len=args.max_model_len,
                            prefix_groups=args.prefix_groups, prefix_len=args.prefix_len,
                            question_len=args.question_len, turns=args.turns)
    tag = f"{workload.label()}-pp{engine.pp}-b{engine.token_budget}"
    outdir = Path(args.out) if args.out else report.results_dir(args.results, args.suite, tag)
    outdir.mkdir(parents=True, exist_ok=True)
    ctx = suites.BenchContext(engine, workload, outdir, mode=args.mode, progress=not args.no_progress,
                              save_traces=not args.no_traces)
    prog = ("ppserve" if Path(sys.argv[0]).name in ("ppserve", "cli.py", "__main__.py")
            else f"python {sys.argv[0]}")
    command = " ".join([prog, *(shlex.quote(a) for a in sys.argv[1:])])
    if args.suite == "compare":
        suites.compare(ctx, _names(args.policies), command=command)
    elif args.suite == "capacity":
        suites.capacity(ctx, _names(args.policies), on=args.on,
                        tbt_slo_s=None if args.tbt_slo_ms is None else args.tbt_slo_ms * 1e-3,
                        tbt_factor=args.tbt_factor, sched_delay_slo_s=args.sched_delay_slo,
                        start_rate=args.start_rate, max_evals=args.max_evals, rel_tol=args.rel_tol,
                        sim_num_requests=args.sim_num_requests, sim_max_evals=args.sim_max_evals,
                        profile_path=args.profile, run_slack_s=args.run_slack,
                        probe_duration_s=args.probe_duration, command=command)
    elif args.suite == "sweep":
        suites.sweep(ctx, [int(b) for b in _names(args.budgets)], policy=args.policy, command=command)
    else:
        held = replace(workload, start=args.held_out_start if args.held_out_start is not None
                       else workload.start + workload.num_requests, seed=workload.seed + 1,
                       rate=args.held_out_rate or workload.rate)
        check = (suites.CapacityCheck(args.probe_duration, args.max_evals, args.rel_tol, args.tbt_factor)
                 if args.capacity else None)
        suites.validate(ctx, held, policy=args.policy, tolerance=args.tolerance, command=command,
                        capacity=check)
    return 0


def run_regimes(args: argparse.Namespace) -> int:
    """`ppserve bench regimes`: run the suite, print its tables, write regimes.json / .md / .png."""
    from ppserve.bench import regimes, report

    outdir = Path(args.out) if args.out else report.results_dir(args.results, "regimes",
                                                                "reduced" if args.reduced else "full")
    prog = ("ppserve" if Path(sys.argv[0]).name in ("ppserve", "cli.py", "__main__.py")
            else f"python {sys.argv[0]}")
    command = " ".join([prog, *(shlex.quote(a) for a in sys.argv[1:])])
    progress = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    suite = regimes.run_suite(args.reduced, _names(args.only) if args.only else None, progress=progress,
                              workers=args.workers, spans_dir=args.spans)
    paths = regimes.write_suite(suite, outdir, command=command, plot=not args.no_plot)
    print(regimes.cells_table(suite))
    print()
    print(regimes.criteria_table(suite))
    if suite.get("speculation"):
        print()
        print(regimes.speculation_table(suite))
    print(f"\nsuite: {suite['suite_wall_s']:.1f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None, suite: str | None = None) -> int:
    """Entry point of the benchmarks/ scripts: `main(sys.argv[1:], "compare")`."""
    import logging

    parser = argparse.ArgumentParser(prog="ppserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(["bench", *([suite] if suite else []), *argv])
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rc: int = args.func(args)
    return rc
