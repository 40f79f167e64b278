"""What `ppserve plan` writes: the ranked table, the Pareto front as a picture, the winner as a config.

The winner's config is an engine YAML (`ppserve serve --config`): the pipeline shape with the layer split
the simulator priced, the policy, token budget, `max_num_seqs` and KV block size. Replicas are separate
servers (ppserve has no data-parallel setting): the file says how many to run behind a load balancer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ppserve.config import load_config
from ppserve.plan.search import Candidate
from ppserve.plan.space import Rejection

__all__ = ["table_rows", "format_table", "pareto_front", "save_pareto_plot", "winner_config", "write_report"]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def table_rows(cands: Sequence[Candidate]) -> list[dict[str, Any]]:
    """One row per deployment, best capacity per GPU first (the order `search` returns)."""
    rows = []
    for rank, c in enumerate(cands, 1):
        d, at = c.deployment, c.at_capacity
        lo, hi = c.result.bracket
        rows.append({
            "rank": rank, "deployment": d.label, "pp": d.pp, "tp": d.tp, "replicas": d.replicas,
            "gpus": d.gpus,
            "policy": d.policy, "token_budget": d.token_budget, "budget_from_slo": d.budget_from_slo,
            "max_num_seqs": d.max_num_seqs,
            "layer_counts": list(d.layer_counts), "kv_blocks_per_replica": d.num_blocks,
            "capacity_req_s": c.capacity, "capacity_per_gpu": c.capacity_per_gpu,
            "bracket_req_s": [lo, hi], "refined": c.refined, "saturated": c.result.saturated,
            "tbt_p99_ms": _ms(at.tbt_p99_s) if at else None,
            "ttft_p90_ms": _ms(at.extra.get("ttft_p90_s")) if at else None,
            "sched_delay_p50_ms": _ms(at.sched_delay_p50_s) if at else None,
            "probes": len(c.result.probes),
            "prefix_hit_rate": at.extra.get("prefix_hit_rate") if at else None,
            "why_not_higher": next((p.reason for p in c.result.probes if hi is not None and p.rate == hi),
                                   None),
        })
    return rows


def format_table(rows: Sequence[dict[str, Any]], rejected: Sequence[Rejection],
                 limit: int | None = None) -> str:
    """The ranked table as text, then the rejected shapes with their reasons."""
    head = (f"{'#':>3}  {'deployment':<44} {'GPUs':>4} {'req/s':>9} {'req/s/GPU':>10} {'bracket':>17} "
            f"{'TBT p99':>9} {'TTFT p90':>9}")
    lines = [head, "-" * len(head)]
    for r in rows[:limit]:
        lo, hi = r["bracket_req_s"]
        bracket = f"{_num(lo)}-{_num(hi)}" + ("" if r["refined"] else "*")
        lines.append(f"{r['rank']:>3}  {r['deployment']:<44} {r['gpus']:>4} {_num(r['capacity_req_s']):>9} "
                     f"{_num(r['capacity_per_gpu']):>10} {bracket:>17} {_num(r['tbt_p99_ms'], 'ms'):>9} "
                     f"{_num(r['ttft_p90_ms'], 'ms'):>9}")
    if limit is not None and len(rows) > limit:
        lines.append(f"     ... {len(rows) - limit} more in plan.md")
    lines.append("* coarse bracket only (not among the refined leaders)")
    for rej in rejected:
        lines.append(f"rejected {rej.label}: {rej.reason}")
    return "\n".join(lines)


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3g}{unit}"


def pareto_front(cands: Sequence[Candidate]) -> list[Candidate]:
    """The deployments no other beats on both capacity per GPU (higher) and TBT p99 at capacity (lower)."""
    points = [c for c in cands if c.at_capacity is not None and c.at_capacity.tbt_p99_s is not None]
    front = []
    for c in points:
        tbt, cap = _tbt(c), c.capacity_per_gpu
        if not any(_tbt(o) <= tbt and o.capacity_per_gpu >= cap
                   and (_tbt(o) < tbt or o.capacity_per_gpu > cap)
                   for o in points):
            front.append(c)
    return sorted(front, key=_tbt)


def _tbt(c: Candidate) -> float:
    at = c.at_capacity
    return float("inf") if at is None or at.tbt_p99_s is None else at.tbt_p99_s


def save_pareto_plot(cands: Sequence[Candidate], path: Path, title: str, tbt_slo_s: float) -> bool:
    """Capacity per GPU against TBT p99 at capacity, the front joined; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    front = pareto_front(cands)
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = (("sarathi", "o"), ("vllm", "s"), ("orca", "^"), ("vllm-v1", "D"), ("vllm-v1-async", "d"),
               ("sglang-pp", "v"))
    for policy, marker in markers:
        pts = [c for c in cands if c.deployment.policy == policy and _tbt(c) != float("inf")]
        if pts:
            ax.scatter([_tbt(c) * 1e3 for c in pts], [c.capacity_per_gpu for c in pts], marker=marker,
                       alpha=0.45, label=policy)
    ax.plot([_tbt(c) * 1e3 for c in front], [c.capacity_per_gpu for c in front], "k-", lw=1.2,
            label="Pareto front")
    for c in front:
        ax.annotate(c.deployment.label, (_tbt(c) * 1e3, c.capacity_per_gpu), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ax.axvline(tbt_slo_s * 1e3, color="grey", ls="--", lw=0.8, label="TBT p99 SLO")
    ax.set_xlabel("TBT p99 at capacity (ms)")
    ax.set_ylabel("capacity per GPU (requests/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def winner_config(c: Candidate, serve_model: str | None) -> dict[str, Any]:
    """The engine config (`ppserve serve --config`) of one replica of the deployment; validated here."""
    d = c.deployment
    data: dict[str, Any] = {
        "model": {"model": serve_model},
        "parallel": {"pipeline_parallel_size": d.pp, "tensor_parallel_size": d.tp,
                     "layer_partition": list(d.layer_counts)},
        "scheduler": {"policy": d.policy, "token_budget": d.token_budget, "max_num_seqs": d.max_num_seqs},
        "cache": {"block_size": d.block_size},
    }
    load_config(extra=data)  # raises ValueError on anything `ppserve serve` would refuse
    return data


def write_report(out: Path, cands: Sequence[Candidate], rejected: Sequence[Rejection],
                 settings: dict[str, Any],
                 serve_model: str | None) -> dict[str, Path]:
    """plan.json, plan.md, pareto.png (when matplotlib is there) and winner.yaml under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(cands)
    front = {id(c) for c in pareto_front(cands)}
    for r, c in zip(rows, cands, strict=True):
        r["pareto"] = id(c) in front
    paths = {"json": out / "plan.json", "md": out / "plan.md"}
    data = {"settings": settings, "ranked": rows,
            "rejected": [{"pp": r.pp, "tp": r.tp, "reason": r.reason} for r in rejected],
            "probes": {c.deployment.label: c.result.to_dict() for c in cands}}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    paths["md"].write_text(_markdown(rows, rejected, settings))
    if save_pareto_plot(cands, out / "pareto.png", f"{settings['model']} on {settings['cluster']}: "
                        f"{settings['workload']}", settings["slo"]["tbt_p99_s"]):
        paths["png"] = out / "pareto.png"
    winner = next((c for c in cands if c.capacity > 0), None)
    if winner is not None:
        cfg = winner_config(winner, serve_model)
        d = winner.deployment
        header = (f"# ppserve plan's winner: {d.label}, {winner.capacity:.4g} req/s in all "
                  f"({winner.capacity_per_gpu:.4g} per GPU) under the SLO, simulated.\n"
                  f"# One replica of {d.pp * d.tp} GPUs; run {d.replicas} of these behind a load balancer.\n")
        if serve_model is None and settings["model"] != "smollm2-135m":
            header += (f"# model.model is null (the built-in SmolLM2): set it to {settings['model']}'s "
                       "HF directory.\n")
        paths["winner"] = out / "winner.yaml"
        paths["winner"].write_text(header + yaml.safe_dump(cfg, sort_keys=False))
    return paths


def _markdown(rows: Sequence[dict[str, Any]], rejected: Sequence[Rejection], settings: dict[str, Any]) -> str:
    lines = [f"# ppserve plan: {settings['model']} on {settings['cluster']}", "",
             f"Workload: {settings['workload']}. SLO: {settings['slo']}.", "",
             *([f"Routing: {settings['routing']}.", ""] if settings.get("routing") else []),
             "| # | deployment | GPUs | capacity (req/s) | per GPU | bracket | refined | TBT p99 (ms) | "
             "TTFT p90 (ms) | Pareto |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["bracket_req_s"]
        lines.append(f"| {r['rank']} | {r['deployment']} | {r['gpus']} | {_num(r['capacity_req_s'])} | "
                     f"{_num(r['capacity_per_gpu'])} | {_num(lo)}-{_num(hi)} | "
                     f"{'yes' if r['refined'] else 'coarse'} | {_num(r['tbt_p99_ms'])} | "
                     f"{_num(r['ttft_p90_ms'])} | {'*' if r.get('pareto') else ''} |")
    if rejected:
        lines += ["", "Rejected before simulation:", ""]
        lines += [f"- {r.label}: {r.reason}" for r in rejected]
    return "\n".join(lines) + "\n"
