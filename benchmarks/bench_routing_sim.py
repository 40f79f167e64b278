"""Routed capacity on the simulator: prefix-aware against round-robin and power-of-two routing, for a
deployment of several replicas serving multi-turn conversations (simulated, not measured).

Each policy's capacity is the planner's own search (`ppserve.plan.search.capacities`: the highest
Poisson rate with p99 TBT and the median scheduling delay under the SLO, bracketed to --tol) with every
replica simulated behind the router (ppserve/sim/replicas.py) on `ppserve plan --workload
conversations` (ppserve/sim/conversations.py: each turn re-sends its history; the Azure conversation
trace's rows are the turns' new messages and answers). The last row, "one replica x N", is one
replica's capacity times the replicas: what the planner would say if every turn found its history (no
router at all), the figure a routed capacity is measured against.

    python benchmarks/bench_routing_sim.py --tol 0.02           # Llama-3-70B, 2 x 8 H100, tp2·pp4 x2
    python benchmarks/bench_routing_sim.py --ttft-p90-ms 2000   # a TTFT limit too
    python benchmarks/bench_routing_sim.py --deployment tp4pp2 --duration-s 30

Prints a Markdown table and writes JSON (--out, default results/<date-time>-routing-sim.json). Not a test.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from ppserve.metrics.capacity import SLO
from ppserve.plan import inputs
from ppserve.plan.search import Candidate, PlanContext, capacities, roofline
from ppserve.plan.slo_budget import with_slo_budgets
from ppserve.plan.space import Deployment, SearchSpace, WorkloadShape, enumerate_deployments
from ppserve.route import POLICIES
from ppserve.sim.conversations import ConversationSpec, conversation_requests

SINGLE = "one replica x N"


def _deployment(args: argparse.Namespace, model: Any, clu: Any, reqs: list[Any]) -> Deployment:
    m = re.fullmatch(r"tp(\d+)pp(\d+)", args.deployment)
    if not m:
        raise SystemExit(f"--deployment must look like tp2pp4, got {args.deployment!r}")
    tp, pp = int(m[1]), int(m[2])
    grid = (512,) if args.token_budget == "slo" else (int(args.token_budget),)
    space = SearchSpace(("sarathi",), grid, (args.max_num_seqs,), (32,), None)
    feasible, rejected = enumerate_deployments(model, clu, space,
                                               WorkloadShape.of([(r.prompt_len, r.output_len) for r in reqs]))
    if args.token_budget == "slo":  # the budget `ppserve plan` adds for the TBT SLO (plan/slo_budget.py)
        ctx = PlanContext(model, clu, (), SLO(args.tbt_p99_ms * 1e-3))
        priced = with_slo_budgets(feasible, lambda d: roofline(ctx, d), args.tbt_p99_ms * 1e-3,
                                  sum(r.prompt_len for r in reqs) / len(reqs))
        feasible = [replace(d, token_budget=d.slo_budget, budget_from_slo=True) for d in priced
                    if d.slo_budget is not None]
    for d in feasible:
        if (d.tp, d.pp) == (tp, pp):
            return d
    why = next((r.reason for r in rejected if (r.tp, r.pp) == (tp, pp)), "not enumerated")
    raise SystemExit(f"tp{tp}·pp{pp} does not fit {clu.nodes} x {clu.gpus_per_node} GPUs: {why}")


def _search(job: tuple[str, PlanContext, Deployment, float]) -> tuple[str, Candidate, float]:
    name, ctx, d, tol = job
    t0 = time.perf_counter()
    cand = capacities(ctx, [d], rel_tol=tol, jobs=1)[0]
    return name, cand, time.perf_counter() - t0


def _row(name: str, cand: Candidate, replicas: int, wall_s: float) -> dict[str, Any]:
    at = cand.at_capacity
    extra = at.extra if at else {}
    scale = replicas if name == SINGLE else 1
    lo, hi = cand.result.bracket
    ttft = extra.get("ttft_p90_s")
    return {
        "routing": name,
        "capacity_req_s": cand.capacity * scale,
        "capacity_per_gpu": cand.capacity_per_gpu,
        "bracket_req_s": [None if x is None else x * scale for x in (lo, hi)],
        "prefix_hit_rate": extra.get("prefix_hit_rate"),
        "tbt_p99_ms": at.tbt_p99_s * 1e3 if at and at.tbt_p99_s is not None else None,
        "ttft_p90_ms": None if ttft is None else ttft * 1e3,
        "requests_per_replica": extra.get("requests_per_replica"),
        "why_not_higher": next((p.reason for p in cand.result.probes if p.rate == hi), None),
        "probes": len(cand.result.probes),
        "wall_s": round(wall_s, 1),
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--deployment", default="tp2pp4", help="one replica's shape; replicas fill the cluster")
    ap.add_argument("--token-budget", default="slo",
                    help="sarathi's token budget, or 'slo': the largest the TBT SLO allows "
                         "(plan/slo_budget.py)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--tbt-p99-ms", type=float, default=100.0)
    ap.add_argument("--sched-delay-s", type=float, default=2.0)
    ap.add_argument("--ttft-p90-ms", type=float,
                    help="a p90 TTFT limit too (default none, as in ppserve plan)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="seconds of arrivals per probe")
    ap.add_argument("--tol", type=float, default=0.05, help="capacity bracketed to this relative width")
    ap.add_argument("--mean-turns", type=float, default=ConversationSpec.mean_turns)
    ap.add_argument("--think-s", type=float, default=ConversationSpec.think_s)
    ap.add_argument("--system-prompts", type=int, default=0, help="shared system prompts (0: none)")
    ap.add_argument("--system-len", type=int, default=0, help="tokens of each system prompt")
    ap.add_argument("--num-requests", type=int, default=2000, help="rows the memory estimate reads")
    ap.add_argument("--jobs", type=int, default=2, help="searches run side by side")
    ap.add_argument("--out", help="JSON path (default results/<date-time>-routing-sim.json)")
    args = ap.parse_args()

    model, _ = inputs.model_spec(args.model)
    clu = inputs.cluster(args.hardware, args.gpus, args.nodes)
    spec = ConversationSpec(args.mean_turns, args.think_s, args.system_prompts, args.system_len)
    _, pool, desc = inputs.workload(inputs.CONVERSATIONS, args.num_requests, model.max_model_len)
    reqs = conversation_requests(pool[:args.num_requests], spec, model.max_model_len)
    d = _deployment(args, model, clu, reqs)
    slo = SLO(args.tbt_p99_ms * 1e-3, args.sched_delay_s,
              None if args.ttft_p90_ms is None else args.ttft_p90_ms * 1e-3)
    base = PlanContext(model, clu, tuple(pool), slo, args.duration_s, conversations=spec)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    jobs = [(p, replace(base, routing=p), d, args.tol) for p in policies]
    jobs.append((SINGLE, base, replace(d, replicas=1), args.tol))
    print(f"{model.name} on {clu.nodes} x {clu.gpus_per_node} {clu.hardware.name}, {d.label}; {desc}; "
          f"SLO p99 TBT <= {args.tbt_p99_ms:g} ms, median scheduling delay <= {args.sched_delay_s:g} s"
          + ("" if args.ttft_p90_ms is None else f", p90 TTFT <= {args.ttft_p90_ms:g} ms") + "; "
          f"{args.duration_s:g} s of arrivals per probe")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool_exec:
        done = {name: (cand, wall) for name, cand, wall in pool_exec.map(_search, jobs)}
    rows = [_row(name, done[name][0], d.replicas, done[name][1]) for name, *_ in jobs]
    print()
    print("| routing | capacity (req/s) | per GPU | prefix hit rate | TBT p99 (ms) | TTFT p90 (ms) | "
          "requests per replica | probes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        per = "-" if r["routing"] == SINGLE or not r["requests_per_replica"] else \
            " / ".join(str(x) for x in r["requests_per_replica"])
        print(f"| {r['routing']} | {_fmt(r['capacity_req_s'])} | {_fmt(r['capacity_per_gpu'])} | "
              f"{_fmt(r['prefix_hit_rate'])} | {_fmt(r['tbt_p99_ms'])} | {_fmt(r['ttft_p90_ms'])} | {per} | "
              f"{r['probes']} |")
    wall = time.perf_counter() - t0
    print(f"\n{len(rows)} searches in {wall:.0f} s")
    out = Path(args.out or f"results/{time.strftime('%Y%m%d-%H%M%S')}-routing-sim.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": {**vars(args), "model": model.name, "deployment": d.label,
                                            "workload": desc, "gpus": d.gpus}, "rows": rows,
                               "wall_s": round(wall, 1)}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
