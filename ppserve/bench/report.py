"""Benchmark output: a results folder per run, JSON, markdown tables and plots (matplotlib, Agg).

Tables and plots are derived from run summaries (`harness.RunResult.summary()`); the JSON holds the
summaries, the settings and the workload, so every figure can be recomputed. Runs that used structured
outputs carry a `grammar` record (harness.py); the policy table is then followed by a grammar table, and
only then: a run without grammars has nothing to show there. Likewise runs whose microbatches carried
drafts carry a `spec_decode` record, shown in a speculative decoding table after it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "results_dir",
    "write_json",
    "policy_table",
    "grammar_table",
    "spec_decode_table",
    "ratio_lines",
    "sweep_table",
    "capacity_table",
    "plot_latency_cdfs",
    "plot_bubble_bars",
    "plot_sweep",
    "plot_capacity",
]


def results_dir(root: str | Path, suite: str, tag: str) -> Path:
    """results/<date-time>-<suite>-<tag>/ (created)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{stamp}-{suite}-{tag}")
    path = Path(root) / safe
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (set, frozenset, tuple)):
        return list(x)
    return str(x)


def write_json(path: str | Path, data: Any) -> Path:
    """`data` as indented JSON at `path` (its folder made if missing); what JSON cannot hold becomes a
    string."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def _f(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def policy_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per run: latency percentiles, throughput, bubbles (window named in the header)."""
    window = next((s["bubbles"]["window"] for s in summaries if "bubbles" in s), "-")
    head = (
        "| run | reqs | TTFT p50 (s) | TTFT p99 (s) | TBT p50 (ms) | TBT p99 (ms) | TPOT mean (ms) "
        "| sched delay p50 (s) | out tok/s | req/s "
        f"| bubble frac mean ({window}) | of it, < p requests in system | bubble frac per stage "
        "| per-req bubble p50 (ms) | microbatches | preempt "
        "| prefix hit |"
    )
    ncols = head.count("|") - 1
    lines = [head, "|" + "---|" * ncols]
    for s in summaries:
        lat, thr, bub = s["latency"], s["throughput"], s.get("bubbles", {})
        stages = " / ".join(_pct(st["bubble_fraction"]) for st in bub.get("stages", [])) or "-"
        lines.append(
            f"| {s['name']}{' (aborted)' if s.get('aborted') else ''} | {lat['num_requests']} "
            f"| {_f(lat['ttft_s']['p50'], 1, 2)} | {_f(lat['ttft_s']['p99'], 1, 2)} "
            f"| {_f(lat['tbt_s']['p50'], 1e3)} | {_f(lat['tbt_s']['p99'], 1e3)} | "
            f"{_f(lat['tpot_s']['mean'], 1e3)} | {_f(lat['scheduling_delay_s']['p50'], 1, 2)} | "
            f"{_f(thr['output_tokens_per_s'], 1, 2)} | {_f(thr['requests_per_s'], 1, 3)} | "
            f"{_pct(bub.get('mean_bubble_fraction'))} | {_pct(bub.get('short_handed_bubble_fraction'))} | "
            f"{stages} | {_f(bub.get('per_request_bubble_s', {}).get('p50'), 1e3)} | "
            f"{bub.get('num_microbatches', '-')} | {s.get('num_preemptions', '-')} | "
            f"{_pct(s.get('prefix_cache_hit_rate'))} |"
        )
    extra = [t for t in (grammar_table(summaries), spec_decode_table(summaries)) if t]
    return "\n\n".join(["\n".join(lines), *extra])


def grammar_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per run that used structured outputs: its grammar compiles, cache hits, failures, compile
    seconds, and the last stage's mask time in all and per masked microbatch; "" when no run did."""
    rows = [s for s in summaries if s.get("grammar")]
    if not rows:
        return ""
    head = ("| run | grammar compiles | cache hits | compile failures | compile total (s) "
            "| masked microbatches | mask total (ms) | mask per masked microbatch (ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        g = s["grammar"]
        lines.append(
            f"| {s['name']} | {g.get('compiles', 0)} | {g.get('cache_hits', 0)} | "
            f"{g.get('compile_failures', 0)} | {_f(g.get('compile_s'), 1, 3)} | {g.get('masked_steps', 0)} | "
            f"{_f(g.get('mask_s'), 1e3, 2)} | {_f(g.get('mask_mean_s'), 1e3, 3)} |"
        )
    return "\n".join(lines)


def spec_decode_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """One row per run whose microbatches carried drafts: verifications with drafts, draft and accepted
    tokens, acceptance rate, mean acceptance length and the accepted count per position; "" when none did."""
    rows = [s for s in summaries if s.get("spec_decode")]
    if not rows:
        return ""
    head = ("| run | drafts | draft tokens | accepted | acceptance rate | mean acceptance length "
            "| accepted per position |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in rows:
        d = s["spec_decode"]
        per_pos = " / ".join(str(n) for n in d.get("num_accepted_tokens_per_pos", [])) or "-"
        lines.append(
            f"| {s['name']} | {d.get('num_drafts', 0)} | {d.get('num_draft_tokens', 0)} | "
            f"{d.get('num_accepted_tokens', 0)} | {_pct(d.get('acceptance_rate'))} | "
            f"{_f(d.get('mean_acceptance_length'), 1, 2)} | {per_pos} |"
        )
    return "\n".join(lines)


def _get(s: Mapping[str, Any], path: str) -> float | None:
    cur: Any = s
    for part in path.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur if isinstance(cur, (int, float)) else None


def ratio_lines(summaries: Mapping[str, Mapping[str, Any]], base: str = "sarathi") -> list[str]:
    """How each other run compares with `base` on the headline figures (other / base)."""
    if base not in summaries:
        return []
    b = summaries[base]
    figures = [
        ("mean bubble fraction", "bubbles.mean_bubble_fraction"),
        ("p99 TBT", "latency.tbt_s.p99"),
        ("p50 TBT", "latency.tbt_s.p50"),
        ("p50 TTFT", "latency.ttft_s.p50"),
        ("per-request bubble p50", "bubbles.per_request_bubble_s.p50"),
        ("output tokens/s", "throughput.output_tokens_per_s"),
    ]
    out = []
    for name, s in summaries.items():
        if name == base:
            continue
        parts = []
        for label, path in figures:
            x, y = _get(s, path), _get(b, path)
            parts.append(f"{label} {x / y:.2f}x" if x is not None and y else f"{label} -")
        out.append(f"{name} / {base}: " + ", ".join(parts))
    return out


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = ("| token budget | TBT p50 (ms) | TBT p99 (ms) | TTFT p50 (s) | out tok/s | req/s "
            "| bubble frac mean | microbatches |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s = r["summary"]
        lines.append(
            f"| {r['token_budget']} | {_f(_get(s, 'latency.tbt_s.p50'), 1e3)} | "
            f"{_f(_get(s, 'latency.tbt_s.p99'), 1e3)} | {_f(_get(s, 'latency.ttft_s.p50'), 1, 2)} | "
            f"{_f(_get(s, 'throughput.output_tokens_per_s'), 1, 2)} | "
            f"{_f(_get(s, 'throughput.requests_per_s'), 1, 3)} | "
            f"{_pct(_get(s, 'bubbles.mean_bubble_fraction'))} | "
            f"{s.get('bubbles', {}).get('num_microbatches', '-')} |"
        )
    return "\n".join(lines)


def capacity_table(results: Mapping[str, Mapping[str, Any]], base: str = "sarathi") -> str:
    """results: label (e.g. 'real/sarathi') -> CapacityResult.to_dict()."""
    head = "| run | capacity (req/s) | bracket (pass, fail) | probes | vs " + base + " |"
    lines = [head, "|---|---|---|---|---|"]
    for label, r in results.items():
        where = label.rsplit("/", 1)[0] + "/" if "/" in label else ""
        ref = results.get(f"{where}{base}", {}).get("capacity")
        cap = r.get("capacity")
        ratio = f"{ref / cap:.2f}x lower" if cap and ref and label != f"{where}{base}" else "-"
        lo, hi = r.get("bracket", [None, None])
        sat = " (saturated)" if r.get("saturated") else ""
        lines.append(f"| {label} | {_f(cap, 1, 3)}{sat} | ({_f(lo, 1, 3)}, {_f(hi, 1, 3)}) "
                     f"| {len(r.get('probes', []))} | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str | Path, note: str) -> Path:
    """Title the figure with `note` (if any), write it to `path` and free it: every plot ends so."""
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    v = sorted(values)
    n = len(v)
    return v, [(i + 1) / n for i in range(n)]


def plot_latency_cdfs(samples: Mapping[str, Mapping[str, Sequence[float]]], path: str | Path,
                      note: str = "") -> Path:
    """samples: run -> {"ttft_s": [...], "tbt_s": [...], "scheduling_delay_s": [...]}; one CDF panel each."""
    plt = _plt()
    keys = [("ttft_s", "TTFT (s)"), ("tbt_s", "TBT (ms)"), ("scheduling_delay_s", "scheduling delay (s)")]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    for ax, (key, label) in zip(axes, keys, strict=True):
        scale = 1e3 if key == "tbt_s" else 1.0
        for name, s in samples.items():
            vals = [x * scale for x in s.get(key, [])]
            if vals:
                xs, ys = _cdf(vals)
                ax.step(xs, ys, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        if key == "tbt_s":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(plt, fig, path, note)


def plot_bubble_bars(summaries: Mapping[str, Mapping[str, Any]], path: str | Path, note: str = "") -> Path:
    """Per-stage bubble fraction per run (grouped bars) and per-request bubble p50 per run."""
    plt = _plt()
    names = [n for n, s in summaries.items() if "bubbles" in s]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    num_stages = max((len(summaries[n]["bubbles"]["stages"]) for n in names), default=0)
    width = 0.8 / max(num_stages + 1, 1)
    for st in range(num_stages):
        vals = [100 * summaries[n]["bubbles"]["stages"][st]["bubble_fraction"] for n in names]
        ax.bar([i + st * width for i in range(len(names))], vals, width, label=f"stage {st}")
    ax.bar([i + num_stages * width for i in range(len(names))],
           [100 * summaries[n]["bubbles"]["mean_bubble_fraction"] for n in names], width, label="mean",
           color="k",
           alpha=0.6)
    ax.set_xticks([i + num_stages * width / 2 for i in range(len(names))], names)
    window = summaries[names[0]]["bubbles"]["window"] if names else "-"
    ax.set_ylabel(f"bubble fraction (%), window {window}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    p50 = [1e3 * (summaries[n]["bubbles"]["per_request_bubble_s"]["p50"] or 0.0) for n in names]
    ax2.bar(names, p50, color="tab:red", alpha=0.7)
    ax2.set_ylabel("per-request bubble time p50 (ms)")
    ax2.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path, note)


def plot_sweep(rows: Sequence[Mapping[str, Any]], path: str | Path, note: str = "") -> Path:
    """Token budget vs p99 TBT and output throughput."""
    plt = _plt()
    budgets = [r["token_budget"] for r in rows]
    tbt = [1e3 * (_get(r["summary"], "latency.tbt_s.p99") or float("nan")) for r in rows]
    thr = [_get(r["summary"], "throughput.output_tokens_per_s") or float("nan") for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, tbt, "o-", color="tab:blue", label="p99 TBT (ms)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("token budget")
    ax.set_ylabel("p99 TBT (ms)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(budgets, thr, "s--", color="tab:green", label="output tokens/s")
    ax2.set_ylabel("output tokens/s", color="tab:green")
    ax.grid(alpha=0.3)
    return _save(plt, fig, path, note)


def plot_capacity(results: Mapping[str, Mapping[str, Any]], path: str | Path, slo_tbt_s: float,
                  note: str = "") -> Path:
    """p99 TBT of every probe against its rate, one series per run, the SLO as a line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        pts = sorted((p["rate"], p["tbt_p99_s"]) for p in r.get("probes", [])
                     if p.get("tbt_p99_s") is not None)
        if pts:
            ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "o-", label=label)
    ax.axhline(1e3 * slo_tbt_s, color="r", ls="--", label="TBT SLO")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("p99 TBT (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path, note)
