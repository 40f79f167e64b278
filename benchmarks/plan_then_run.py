"""`ppserve plan` on this CPU, then its winner run for real: predicted capacity against measured (issue 26).

Three steps, each a ppserve command (printed as it runs), under --out:

1. Two profiles of this machine's stages, both at pp=2 with 15 + 15 layers: `profile/profile.json`, fitted
   from one real run of the workload (`ppserve bench capacity --on sim` runs the real pipeline once for its
   spans), and `profile/startup.json`, the stages' own start-up step costs (worker/startup_cost.py) with the
   transfer time the run measured. That run also measures this machine's decode step, and the SLO is
   `bench capacity`'s default, 5 of them (--tbt-factor), unless --tbt-p99-ms gives one: a fixed SLO means
   another thing on every machine, and one that a single decode nearly fills leaves only budgets whose every
   step sits at its edge, where the p99 follows noise.
2. `plan-probes/` and `plan-startup/`: `ppserve plan --model smollm2-135m --hardware cpu --gpus <cores>
   --profile P --profile-layers 15,15` with each: every deployment of the cores (replicas x pp x tp), each
   one's capacity under the SLO on the simulator; a winner is its `plan.json`'s first row.
3. `run/`: `ppserve bench capacity --on real` with the winner's pp, tp, policy, token budget, sequence cap,
   layer split and KV blocks (of the plan --profile-source names), on the same workload, seed, probe
   length and SLO, its search starting at the predicted rate and bracketing to the planner's 5 %. A winner
   of several replicas runs one replica, pinned to its share of the cores (the others would hold the rest),
   and its capacity is multiplied by the replica count.

Prints predicted / measured per profile (the issue's goal: 0.85-1.15) and writes `plan_then_run.json`.

    python benchmarks/plan_then_run.py [--out results/plan_then_run] [--tbt-p99-ms MS | --tbt-factor 5]
        [--scale 0.05] [--probe-duration 30] [--num-requests 48] [--max-evals 8] [--cores 2] [--reuse]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ppserve.plan.search import MIN_PROBE_REQUESTS

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M's 30 decoder layers, split evenly where the profile is measured: the planner re-splits a
# profile by telling one layer's cost from the last stage's head, which takes two stages or more.
PROFILE_LAYERS = (15, 15)
# The real search brackets the winner's capacity as finely as the planner brackets a simulated one,
# starting at the predicted rate: a search from 1 req/s doubling to a fail left a 20 % bracket (5 passed,
# 6 failed) after its six probes, wider than the 0.85-1.15 the check asks of predicted / measured.
REL_TOL = 0.05


def run(cmd: list[str], cores: str | None = None) -> None:
    full = (["taskset", "-c", cores] if cores else []) + cmd
    print("$ " + shlex.join(full), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(full, cwd=REPO, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {shlex.join(full)}")
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


STARTUP_PROFILE = """
import json, sys
from ppserve import LLM
from ppserve.sim.cost_model import Profile
out, transfer_s, layers, dtype = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
with LLM(None, pipeline_parallel_size=len(layers), layer_partition=layers, dtype=dtype) as llm:
    cost = llm.engine.executor.startup_cost
note = "the stages' start-up step costs (worker/startup_cost.py)"
Profile(cost, transfer_s=transfer_s, note=note).save(out)
"""


def startup_profile(probes_profile: Path, out: Path, dtype: str) -> Path:
    """The profile of the stages' own start-up timing (a few shapes each on its KV cache, after warm-up),
    in the dtype the real runs serve, with the stage-to-stage transfer the probes measured: an
    alternative to the probes' least-squares fit."""
    transfer = json.loads(probes_profile.read_text())["transfer_s"]
    print(f"$ (start-up step costs of a pp={len(PROFILE_LAYERS)} pipeline) -> {out}", flush=True)
    proc = subprocess.run([sys.executable, "-c", STARTUP_PROFILE, str(out), str(transfer),
                           json.dumps(list(PROFILE_LAYERS)), dtype], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"start-up profile failed:\n{proc.stderr[-3000:]}")
    return out


def plan(cli: list[str], args: argparse.Namespace, profile: Path, out: Path) -> dict[str, Any]:
    """`ppserve plan` over the cores priced by `profile`; its winner (plan.json's first row)."""
    run([*cli, "plan", "--model", "smollm2-135m", "--hardware", "cpu", "--gpus", str(args.cores),
         "--profile", str(profile), "--profile-layers", ",".join(map(str, PROFILE_LAYERS)),
         "--policies", args.policies, *workload_args(args, bench=False), "--tbt-p99-ms", str(args.tbt_p99_ms),
         "--no-progress", "--out", str(out)])
    winner: dict[str, Any] = json.loads((out / "plan.json").read_text())["ranked"][0]
    print(f"winner: {winner['deployment']}, predicted {winner['capacity_req_s']:.3g} req/s", flush=True)
    return winner


def workload_args(args: argparse.Namespace, bench: bool) -> list[str]:
    """The same requests, arrivals and probe size for the planner and the real run. Both replay the trace
    from its first row, as many rows as a probe's duration needs, Poisson arrivals from one seed; a probe
    replays at least the planner's own minimum, whatever --num-requests says (for the planner, the rows its
    memory and SLO-budget estimates read)."""
    trace = f"trace:{args.trace}.csv" if bench else args.trace
    out = ["--dtype", args.dtype] if bench else []
    fewest = max(args.num_requests, MIN_PROBE_REQUESTS) if bench else args.num_requests
    out += ["--workload", trace, "--prefill-scale", str(args.scale), "--decode-scale", str(args.scale),
           "--num-requests", str(fewest), "--seed", str(args.seed)]
    return out + (
        ["--probe-duration", str(args.probe_duration)]
        if bench
        else ["--duration-s", str(args.probe_duration)]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "results" / "plan_then_run"))
    ap.add_argument(
        "--cores", type=int, default=len(os.sched_getaffinity(0)), help="the cluster: this many cores"
    )
    ap.add_argument(
        "--trace", default="splitwise_conv", help="a trace in ../shared/traces (its name, without .csv)"
    )
    ap.add_argument("--scale", type=float, default=0.05, help="prompt and output lengths scaled by this")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--probe-duration", type=float, default=30.0, help="seconds of arrivals per probe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="what the probes, the start-up profile and the real run serve in (one for all three: "
        "a bf16 start-up profile planned a float32 run at 0.43x its capacity on a Xeon with AMX)",
    )
    ap.add_argument(
        "--tbt-p99-ms",
        type=float,
        default=None,
        help="the p99 TBT SLO (default: `bench capacity`'s own, --tbt-factor x the decode step that "
        "step 1 measures on this machine)",
    )
    ap.add_argument(
        "--tbt-factor",
        type=float,
        default=5.0,
        help="the default SLO in decode steps. The fixed 400 ms this check used to hold was 1.8 decode "
        "steps (222 ms) on a slow Xeon VM: the budget it allowed (16) put every step at the SLO's "
        "edge, and predicted / measured read 2.0 there",
    )
    ap.add_argument(
        "--max-evals",
        type=int,
        default=8,
        help="real probes of the winner: its search starts at the "
        "predicted rate and brackets the capacity to the planner's own 5 %%, as far as these allow",
    )
    ap.add_argument("--policies", default="sarathi,vllm")
    ap.add_argument(
        "--profile-source",
        choices=("probes", "startup"),
        default="startup",
        help="whose plan's winner runs for real: the profile fitted from the probes' spans, or the "
        "stages' start-up step costs (both plans are written and reported)",
    )
    ap.add_argument("--reuse", action="store_true", help="keep what an earlier run under --out measured: its "
                    "probes' profile, and its real run when it was of this winner")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "ppserve.cli"]
    # The SLO: given, or `bench capacity`'s own default, measured by step 1 on this machine.
    step1_slo = (
        ["--tbt-slo-ms", str(args.tbt_p99_ms)] if args.tbt_p99_ms else ["--tbt-factor", str(args.tbt_factor)]
    )

    # 1. This machine's profile, from one real run at pp = 2 (the stage link's cost is in it too).
    profile = out / "profile" / "profile.json"
    if not (args.reuse and profile.exists()):
        run(
            [
                *cli,
                "bench",
                "capacity",
                "--on",
                "sim",
                "--pp",
                str(len(PROFILE_LAYERS)),
                "--policies",
                "sarathi",
                *step1_slo,
                "--set",
                f"parallel.layer_partition={json.dumps(list(PROFILE_LAYERS))}",
                *workload_args(args, bench=True),
                "--sim-max-evals",
                "1",
                "--no-progress",
                "--no-traces",
                "--out",
                str(out / "profile"),
            ]
        )
    slo_s = json.loads((out / "profile" / "results.json").read_text())["slo"]
    if args.tbt_p99_ms is None:
        args.tbt_p99_ms = round(slo_s["tbt_p99_s"] * 1e3, 1)  # the plan and the real run hold the same SLO
        step, factor = slo_s["decode_step_s"], slo_s["tbt_factor"]
        how = f"{factor:g} x the decode step {step * 1e3:.1f} ms measured in step 1" if step else "step 1's"
        print(f"SLO: p99 TBT {args.tbt_p99_ms:g} ms ({how})", flush=True)
    slo = ["--tbt-slo-ms", str(args.tbt_p99_ms)]

    # 2. The plan over the cores, priced by each profile: the probes' fit and the stages' start-up timing.
    winners = {"probes": plan(cli, args, profile, out / "plan-probes")}
    winners["startup"] = plan(
        cli,
        args,
        startup_profile(profile, out / "profile" / "startup.json", args.dtype),
        out / "plan-startup",
    )
    winner = winners[args.profile_source]

    # 3. The winner for real: one replica on its share of the cores.
    per_replica = winner["pp"] * winner["tp"]
    cores = f"0-{per_replica - 1}" if per_replica > 1 else "0"
    settings = ["--set", f"parallel.tensor_parallel_size={winner['tp']}",
                "--set", f"parallel.layer_partition={json.dumps(winner['layer_counts'])}"]
    marker = out / "run" / "deployment.txt"  # which deployment run/ measured (for --reuse)
    if not (args.reuse and marker.exists() and marker.read_text() == winner["deployment"]):
        run(
            [
                *cli,
                "bench",
                "capacity",
                "--on",
                "real",
                "--pp",
                str(winner["pp"]),
                "--policies",
                winner["policy"],
                "--token-budget",
                str(winner["token_budget"]),
                "--max-num-seqs",
                str(winner["max_num_seqs"]),
                "--num-kv-blocks",
                str(winner["kv_blocks_per_replica"]),
                *settings,
                *slo,
                *workload_args(args, bench=True),
                "--start-rate",
                f"{winner['capacity_req_s'] / winner['replicas']:.4g}",
                "--rel-tol",
                str(REL_TOL),
                "--max-evals",
                str(args.max_evals),
                "--no-progress",
                "--no-traces",
                "--out",
                str(out / "run"),
            ],
            cores=cores if winner["replicas"] > 1 else None,
        )
        marker.write_text(winner["deployment"])
    real = json.loads((out / "run" / "results.json").read_text())["results"][f"real/{winner['policy']}"]
    measured = (
        float(real["capacity"] or 0.0) * winner["replicas"]
    )  # no capacity: even the lowest probe failed
    # The highest rate that failed, above the capacity (none where every probe passed): the true capacity
    # lies between, so predicted / measured lies between predicted over each.
    failed = real["bracket"][1]
    above = float(failed) * winner["replicas"] if failed is not None else None
    rows = {}
    for source, w in winners.items():
        same = w["deployment"] == winner["deployment"]  # the run measures the run winner's deployment only
        rows[source] = {
            "winner": w,
            "predicted_req_s": w["capacity_req_s"],
            "predicted_over_measured": w["capacity_req_s"] / measured if same and measured else None,
            "predicted_over_lowest_fail": w["capacity_req_s"] / above if same and above else None,
        }
    report = {"run": winner["deployment"], "profile_source": args.profile_source, "measured_req_s": measured,
              "measured_per_replica": real, "plans": rows, "settings": vars(args)}
    (out / "plan_then_run.json").write_text(json.dumps(report, indent=2) + "\n")
    fails = f"{above:.3g} failed" if above else "no probe failed"
    print(
        f"\nran {winner['deployment']}: measured {measured:.3g} req/s (one replica "
        f"{measured / winner['replicas']:.3g} "
        f"x {winner['replicas']}; {fails})"
    )
    for source, r in rows.items():
        ratio, top = r["predicted_over_measured"], r["predicted_over_lowest_fail"]
        shown = (f"{ratio:.2f}" + (f" (over the lowest fail: {top:.2f})" if top is not None else "")
                 if ratio is not None else "n/a (a different winner, not run)")
        print(f"  profile from {source}: winner {r['winner']['deployment']}, predicted "
              f"{r['predicted_req_s']:.3g} req/s, predicted / measured {shown}")


if __name__ == "__main__":
    main()
