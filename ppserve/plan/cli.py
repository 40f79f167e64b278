"""`ppserve plan`: the best deployment for a model, a cluster and an SLO, found on the simulator.

    ppserve plan --model llama3-70b --hardware h100 --gpus 8 --workload splitwise_conv --tbt-p99-ms 100 \
        --out plan/

Enumerates the deployments that fit (and says why the others do not), finds each one's capacity under
the SLO on the simulator (the real scheduler over a roofline or fitted cost model), and writes the
ranked table, the Pareto front and the winner's engine config under --out.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_parser(sub: Any) -> None:
    from ppserve.route import POLICIES

    p = sub.add_parser("plan", help="search deployments (pp x tp, replicas, policy, budget) for capacity "
                                    "under an SLO")
    m = p.add_argument_group("model and cluster")
    m.add_argument("--model", required=True, help="a model table (llama3-70b, qwen3-32b, ...), its YAML, or "
                                                  "an HF config.json / directory")
    m.add_argument("--hardware", default="h100", help="a100 | h100 | a40 | cpu | a hardware YAML")
    m.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    m.add_argument("--nodes", type=int, default=1)
    m.add_argument("--inter-node-gbps", type=float, help="override the NIC's GB/s per GPU between nodes")
    m.add_argument("--nvlink-gbps", type=float, help="override the intra-node GB/s per GPU")
    m.add_argument("--profile",
                   help="price steps with this fitted profile (ppserve simulate --fit-from), re-split "
                                     "over each deployment's pp x tp, instead of the hardware's roofline")
    m.add_argument("--profile-layers", type=_ints,
                   help="layers per stage where --profile was measured, e.g. 15,15")
    m.add_argument("--profile-tp", type=int, default=1, help="tp where --profile was measured")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="splitwise_conv",
                   help="sharegpt4-like | arxiv-summarization-like | conversations (multi-turn chats over "
                        "the conversation trace's lengths) | a trace CSV or a name in ../shared/traces")
    w.add_argument("--num-requests", type=int, default=2000,
                   help="requests the memory and SLO-budget estimates read: a distribution's draws (a probe "
                        "replays rate x duration of them, cycled) or a trace's first rows (a probe replays "
                        "the trace from its first row, as ppserve bench capacity does)")
    w.add_argument("--duration-s", type=float, default=60.0,
                   help="seconds of arrivals per refined probe (coarse probes: a third of it)")
    w.add_argument("--prefill-scale", type=float, default=1.0)
    w.add_argument("--decode-scale", type=float, default=1.0)
    w.add_argument("--seed", type=int, default=0, help="seed of the lengths and of every probe's arrivals")
    s = p.add_argument_group("SLO")
    s.add_argument("--tbt-p99-ms", type=float, required=True, help="p99 time between tokens")
    s.add_argument("--ttft-p90-ms", type=float, help="p90 time to first token (default: not checked)")
    s.add_argument("--sched-delay-s", type=float, default=2.0,
                   help="median scheduling delay (Sarathi-Serve: 2 s)")
    k = p.add_argument_group("search")
    k.add_argument("--policies", default="sarathi,vllm",
                   help="comma-separated, among sarathi, vllm, orca and the peers vllm-v1(-async), sglang-pp")
    k.add_argument("--token-budgets", type=_ints, default=(256, 512, 1024, 2048),
                   help="sarathi's (and the peers'), comma-separated")
    k.add_argument("--max-num-seqs", type=_ints, default=(256,),
                   help="sarathi's (and the peers'), comma-separated")
    k.add_argument("--vllm-max-num-seqs", type=_ints, default=(32, 64, 128), help="vllm's max batch sizes")
    k.add_argument("--no-slo-budget", action="store_true",
                   help="search the budget grid only, not also each shape's budget for the TBT SLO "
                        "(plan/slo_budget.py)")
    k.add_argument("--full-probes", action="store_true",
                   help="run every probe to its end (by default one stops once it is certain to fail the "
                        "SLO: the same verdicts, and a failing probe's figures are then those of its "
                        "requests so far)")
    k.add_argument("--max-pp", type=int)
    k.add_argument("--refine", type=int, default=4,
                   help="leaders refined to --fine-tol after the coarse round")
    k.add_argument("--coarse-tol", type=float, default=0.25)
    k.add_argument("--fine-tol", type=float, default=0.05)
    k.add_argument("--jobs", type=int, help="parallel processes (default: every CPU)")
    k.add_argument("--routing", choices=POLICIES, default="prefix",
                   help="the router in front of the replicas, simulated with them where the workload shares "
                        "prefixes (--workload conversations); elsewhere each replica gets rate / replicas")
    k.add_argument("--overhead-ms", type=float, default=0.5, help="engine turnaround per returned microbatch")
    k.add_argument("--dispatch-ms", type=float, default=0.5, help="control-plane latency to the stages")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="plan", help="folder for plan.json, plan.md, pareto.png, winner.yaml")
    o.add_argument("--serve-model",
                   help="the HF directory winner.yaml names (default: --model's, if it is one)")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--emit", action="append", choices=["rayservice"], default=[],
                   help="also write rayservice.yaml beside winner.yaml: a KubeRay RayService serving the "
                        "winner (launch/kuberay/README.md)")
    o.add_argument("--image", help="the container image of --emit rayservice (default: ppserve:VERSION, "
                                   "ppserve:VERSION-cpu on cpu hardware)")
    p.set_defaults(func=run)


def _progress(enabled: bool) -> Callable[[str, int], Callable[[], None]]:
    def make(stage: str, total: int) -> Callable[[], None]:
        if not enabled or total == 0:
            return lambda: None
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"{stage:>6}", unit="deployment")

        def tick() -> None:
            bar.update(1)
            if bar.n >= total:
                bar.close()

        return tick

    return make


def run(args: argparse.Namespace) -> int:
    from ppserve.metrics.capacity import SLO
    from ppserve.plan import inputs
    from ppserve.plan.report import format_table, table_rows, write_report
    from ppserve.plan.search import PlanContext, routing_note, search
    from ppserve.plan.slo_budget import with_slo_budgets
    from ppserve.plan.space import SearchSpace, WorkloadShape, enumerate_deployments

    t0 = time.perf_counter()
    model, hf_dir = inputs.model_spec(args.model)
    clu = inputs.cluster(args.hardware, args.gpus, args.nodes, args.inter_node_gbps, args.nvlink_gbps)
    reqs, pool, desc = inputs.workload(args.workload, args.num_requests, model.max_model_len, args.seed,
                                       args.prefill_scale, args.decode_scale)
    slo = SLO(args.tbt_p99_ms * 1e-3, args.sched_delay_s,
              None if args.ttft_p90_ms is None else args.ttft_p90_ms * 1e-3)
    space = SearchSpace(tuple(x.strip() for x in args.policies.split(",") if x.strip()), args.token_budgets,
                        args.max_num_seqs, args.vllm_max_num_seqs, args.max_pp)
    feasible, rejected = enumerate_deployments(model, clu, space,
                                               WorkloadShape.of([(r.prompt_len, r.output_len) for r in reqs]))
    ctx = PlanContext(model, clu, tuple(pool), slo, args.duration_s, seed=args.seed,
                      overhead_s=args.overhead_ms * 1e-3, dispatch_s=args.dispatch_ms * 1e-3,
                      stop_early=not args.full_probes, routing=args.routing,
                      conversations=inputs.conversation_spec(args.workload))
    if args.profile:
        ctx = replace(ctx, cost_model=_profile_factory(args, model.num_layers))
    if not args.no_slo_budget:
        feasible = with_slo_budgets(feasible, lambda d: ctx.cost_model(ctx, d), slo.tbt_p99_s,
                                    sum(r.prompt_len for r in reqs) / len(reqs))
    cluster_desc = f"{clu.nodes} x {clu.gpus_per_node} {clu.hardware.name}"
    print(f"{model.name} on {cluster_desc}: {len(feasible)} deployments to search, {len(rejected)} shapes "
          "rejected")
    cands = search(ctx, feasible, jobs=args.jobs, coarse_tol=args.coarse_tol, fine_tol=args.fine_tol,
                   refine=args.refine, progress=_progress(not args.no_progress))
    wall = time.perf_counter() - t0
    settings = {"model": model.name, "cluster": cluster_desc, "workload": desc, "num_requests": len(reqs),
                "duration_s": args.duration_s,
                "seed": args.seed, "slo": {"tbt_p99_s": slo.tbt_p99_s, "ttft_p90_s": slo.ttft_p90_s,
                                            "sched_delay_p50_s": slo.sched_delay_p50_s},
                "coarse_tol": args.coarse_tol, "fine_tol": args.fine_tol, "refine": args.refine,
                "jobs": args.jobs, "wall_s": round(wall, 1), "hardware": clu.hardware.name,
                "full_probes": args.full_probes, "routing": routing_note(ctx)}
    settings["cost_model"] = (f"profile {args.profile} re-split" if args.profile
                              else f"roofline on {clu.hardware.name}")
    paths = write_report(Path(args.out), cands, rejected, settings, args.serve_model or hf_dir)
    if "rayservice" in (getattr(args, "emit", None) or []) and "winner" in paths:
        paths["rayservice"] = _emit_rayservice(args, cands, clu, args.serve_model or hf_dir)
    print(format_table(table_rows(cands), rejected, limit=15))
    if "png" not in paths:
        print("pareto.png not drawn: matplotlib is not installed (pip install matplotlib)")
    if "winner" not in paths:
        print("no deployment meets the SLO at any rate searched: no winner.yaml")
    print(f"searched in {wall:.1f} s; wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _profile_factory(args: argparse.Namespace, num_layers: int) -> Any:
    """The fitted profile as the planner's cost model, checked against the model's layer count."""
    from ppserve.plan.resplit import ProfileResplit
    from ppserve.sim.cost_model import Profile

    if not args.profile_layers:
        raise ValueError("--profile needs --profile-layers: the layers per stage it was measured with")
    if sum(args.profile_layers) != num_layers:
        raise ValueError(f"--profile-layers {list(args.profile_layers)} sum to {sum(args.profile_layers)}, "
                         f"the model has {num_layers} layers")
    return ProfileResplit(Profile.load(args.profile), tuple(args.profile_layers), args.profile_tp)


def _emit_rayservice(args: argparse.Namespace, cands: Any, clu: Any, serve_model: str | None) -> Path:
    """rayservice.yaml for the winner: its replicas, pp x tp and layer split on --gpus x --nodes."""
    from importlib.metadata import version

    from ppserve.deploy.kuberay import dump_manifest, rayservice_manifest
    from ppserve.plan.report import winner_config

    winner = next(c for c in cands if c.capacity > 0)  # the one winner.yaml holds
    d = winner.deployment
    cpu = args.hardware == "cpu" or clu.hardware.name.startswith("cpu")
    image = getattr(args, "image", None) or f"ppserve:{version('ppserve')}{'-cpu' if cpu else ''}"
    doc = rayservice_manifest("ppserve", image, winner_config(winner, serve_model), d.replicas, d.pp, d.tp,
                              clu.gpus_per_node, clu.nodes, accelerator=None if cpu else "nvidia.com/gpu")
    path = Path(args.out) / "rayservice.yaml"
    path.write_text(f"# ppserve plan's winner as a KubeRay RayService: {d.label}, image {image}.\n"
                    "# model.model must name a path inside the image or on a volume every pod mounts.\n"
                    + dump_manifest(doc))
    return path
