"""The regime suite (issue 21): every microbatch formation on every load regime, in the simulator.

One table answers "are the microbatches uniform in every regime?": the simulator (ppserve/sim, the
engine's own step loop and scheduler over a roofline cost model; ARCHITECTURE.md#the-simulator) runs eight
formations on eleven regimes, deterministic (every workload seeded, no wall clock in any figure).

Formations (`FORMATIONS`): `sarathi`, the default (the balanced formation,
ARCHITECTURE.md#how-a-microbatch-is-formed, with the token ring); `sarathi-unbal` (balance=False);
`sarathi-no-ring` (token_ring=False); the baselines `vllm` and `orca` as published, and today's peers
`vllm-v1`, `vllm-v1-async` and `sglang-pp` (`ppserve/sched/policies.py`). Regimes (`regimes()`;
request counts full / `--reduced`): Sarathi's saturated GPT-3 case, the conversation trace at three
rates, long and sparse prompts, one long prompt, bursts, decode-heavy, shared prefixes, multi-turn; why
each: docs/decisions.md#regime-suite. Per cell: bubbles (active window), throughput, TTFT p50/p99, TBT p99,
per-request bubble p50. `criteria` checks, per regime, what the simulator can promise: balanced
sarathi's mean bubble <= the unbalanced one's and each peer's, its throughput >= THROUGHPUT_FLOOR x and
TTFT p50 <= TTFT_CEILING x the best formation's. `SPECULATION`: cells with speculative decoding on.

    ppserve bench regimes [--reduced] [--only sarathi-gpt3,conv-8] [--out DIR] [--spans DIR]
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.metrics.latency import RequestTiming, stats
from ppserve.metrics.spans import write_jsonl
from ppserve.sim.cost_model import RooflineCostModel, kv_cache_blocks, load_hardware, load_model_spec
from ppserve.sim.simulator import SimConfig, simulate
from ppserve.sim.workload import (
    WorkloadRequest,
    bursty_arrivals,
    clip_to_context,
    default_trace_path,
    evenly_spaced,
    fixed_ratio,
    log_uniform_prompts,
    multi_turn,
    read_trace,
    shared_prefix,
    uniform_lengths,
    with_poisson_arrivals,
)

__all__ = [
    "FORMATIONS",
    "BALANCED",
    "UNBALANCED",
    "NO_RING",
    "THROUGHPUT_FLOOR",
    "TTFT_CEILING",
    "Formation",
    "Regime",
    "SPECULATION",
    "SpecCell",
    "regimes",
    "run_cell",
    "sim_setup",
    "run_suite",
    "criteria",
    "cells_table",
    "criteria_table",
    "speculation_table",
    "markdown",
    "plot_regimes",
    "write_suite",
]

THROUGHPUT_FLOOR = 0.97  # balanced sarathi's throughput >= this x the best formation's
TTFT_CEILING = 1.1  # balanced sarathi's TTFT p50 <= this x the best (lowest) formation's


@dataclass(frozen=True)
class Formation:
    name: str
    policy: str
    balance: bool = True
    token_ring: bool | None = None  # the token ring; None: SchedulerConfig's default (on for sarathi only)


BALANCED = "sarathi"
UNBALANCED = "sarathi-unbal"
NO_RING = "sarathi-no-ring"
FORMATIONS: tuple[Formation, ...] = (
    Formation(BALANCED, "sarathi", True),
    Formation(UNBALANCED, "sarathi", False),
    Formation(NO_RING, "sarathi", True, token_ring=False),
    Formation("vllm", "vllm"),
    Formation("orca", "orca"),
    Formation("vllm-v1", "vllm-v1"),
    Formation("vllm-v1-async", "vllm-v1-async"),
    Formation("sglang-pp", "sglang-pp"),
)
# Today's peers (vLLM v1 with and without async scheduling, SGLang): the default's bubble must be no
# worse than each one's too.
PEERS = ("vllm-v1", "vllm-v1-async", "sglang-pp")


@dataclass(frozen=True)
class SpecCell:
    """A regime's cell rerun with speculative decoding on: at most `num_speculative_tokens` drafts a
    decode, each accepted with probability `acceptance` (independent per position)."""

    regime: str
    formation: str = BALANCED
    acceptance: float = 0.7
    num_speculative_tokens: int = 4

    @property
    def name(self) -> str:
        """The cell's formation name (also its spans file's: `<regime>--<name>.jsonl`)."""
        return f"{self.formation}-spec-a{self.acceptance:g}-k{self.num_speculative_tokens}"


# Idle stages (sparse), a lone prefill (one-long-prompt: one output token, nothing to draft) and a busy
# load (conv-8): where drafts fill the pipeline, where they cannot help, and where the budget is full.
SPECULATION: tuple[SpecCell, ...] = (SpecCell("sparse"), SpecCell("one-long-prompt"), SpecCell("conv-8"))


@dataclass(frozen=True)
class Regime:
    """One load regime: a workload on one model, pipeline and scheduler setting."""

    name: str
    description: str
    workload: Callable[[], list[WorkloadRequest]]  # built on demand (seeded: the same list every call)
    model: str = "llama2-70b"
    hardware: str = "a100"
    pp: int = 4
    tp: int = 4
    token_budget: int = 512
    max_num_seqs: int = 128
    seq_cap: bool = True
    overhead_ms: float = 0.5  # engine turnaround (SimConfig.schedule_overhead_s)
    dispatch_ms: float = 0.5  # control plane (SimConfig.dispatch_latency_s)
    max_model_len: int | None = None  # None: the model's own context
    block_size: int = 16

    def settings(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "workload"}


# Request counts: (full, reduced).
_COUNTS: dict[str, tuple[int, int]] = {
    "sarathi-gpt3": (512, 128),
    "conv": (400, 100),
    "long-prompts": (64, 16),
    "sparse": (8, 8),
    "one-long-prompt": (1, 1),
    "bursty": (160, 64),
    "decode-heavy": (160, 40),
    "shared-prefix": (128, 32),
    "multi-turn": (32, 8),
}
LONG_PROMPT = (2048, 16384)
LONG_OUTPUT = (100, 400)
LONG_CONTEXT = LONG_PROMPT[1] + 512


def _conv(n: int, start: int = 0) -> list[WorkloadRequest]:
    # The Llama-2-70B context (4096) is what every regime on the trace clips to.
    return clip_to_context(read_trace(default_trace_path(), n, start=start), 4096)


def _poisson_conv(n: int, rate: float) -> list[WorkloadRequest]:
    return with_poisson_arrivals(_conv(n), rate, seed=0)


def regimes(reduced: bool = False) -> list[Regime]:
    """The eleven regimes (docs/decisions.md#regime-suite); `reduced`: fewer requests, same regimes."""
    k = 1 if reduced else 0

    def n(key: str) -> int:
        return _COUNTS[key][k]

    out = [
        Regime("sarathi-gpt3",
               f"GPT-3 175B A100 TP8xPP8, {n('sarathi-gpt3')} x 1024 tokens at P:D 10 at t=0 "
               "(reproduce_sarathi)",
               lambda: fixed_ratio(n("sarathi-gpt3"), 1024, 10.0),
               model="gpt3-175b", pp=8, tp=8, token_budget=256, max_num_seqs=128, overhead_ms=0.2,
               dispatch_ms=0.0),
    ]
    for rate in (2.0, 4.0, 8.0):
        out.append(Regime(f"conv-{rate:g}",
                          f"Llama-2-70B A100 PP4xTP4, conversation trace {n('conv')} rows, Poisson {rate:g} "
                          "req/s",
                          functools.partial(_poisson_conv, n("conv"), rate)))
    out += [
        Regime("long-prompts",
               f"{n('long-prompts')} prompts log-uniform {LONG_PROMPT[0]}-{LONG_PROMPT[1]}, outputs "
               f"{LONG_OUTPUT[0]}-{LONG_OUTPUT[1]}, Poisson 0.5 req/s, context {LONG_CONTEXT}",
               lambda: with_poisson_arrivals(log_uniform_prompts(n("long-prompts"), LONG_PROMPT, LONG_OUTPUT,
                                                                 seed=0),
                                             0.5, seed=0),
               max_model_len=LONG_CONTEXT),
        Regime("sparse", f"{n('sparse')} requests (conversation lengths) 60 s apart",
               lambda: evenly_spaced(_conv(n("sparse")), 60.0)),
        Regime("one-long-prompt", "one 4096-token prompt, 1 output token, context 8192",
               lambda: [WorkloadRequest(0.0, 4096, 1)], max_model_len=8192),
        Regime("bursty",
               f"bursts of 16 requests every 10 s, {n('bursty') // 16} bursts, conversation lengths",
               lambda: bursty_arrivals(_conv(n("bursty")), 16, 10.0)),
        Regime("decode-heavy",
               f"{n('decode-heavy')} requests, prompts 64-256, 1000 output tokens, Poisson 2 req/s",
               lambda: with_poisson_arrivals(uniform_lengths(n("decode-heavy"), (64, 256), (1000, 1000),
                                                             seed=0),
                                             2.0, seed=0)),
        Regime("shared-prefix", f"{n('shared-prefix')} requests: 8 system prompts of 1024 tokens + 64-token "
               "questions, 64 out, Poisson 4 req/s (prefix caching)",
               lambda: with_poisson_arrivals(shared_prefix(8, n("shared-prefix") // 8, 1024, 64, 64), 4.0,
                                             seed=0)),
        Regime("multi-turn", f"{n('multi-turn')} conversations x 4 turns re-sending their history (512-token "
               "system prompt, 64-token questions, 128-token answers), a turn every 20 s (prefix caching)",
               lambda: multi_turn(n("multi-turn"), 4, 512, 64, 128, gap_s=20.0)),
    ]
    return out


def sim_setup(regime: Regime, formation: Formation, workload: Sequence[WorkloadRequest] | None = None,
              spec: SpecCell | None = None) -> tuple[list[WorkloadRequest], RooflineCostModel, SimConfig]:
    """What one cell simulates: the regime's workload (or `workload`), its roofline and the SimConfig of
    its settings under `formation` (also for analyses of a regime: benchmarks/analysis_sim_bubble.py),
    with `spec`'s speculative decoding when given."""
    model, hw = load_model_spec(regime.model), load_hardware(regime.hardware)
    cost = RooflineCostModel(model, hw, regime.pp, regime.tp)
    blocks = kv_cache_blocks(model, hw, regime.pp, regime.tp, regime.block_size)
    wl = list(regime.workload() if workload is None else workload)
    sched = SchedulerConfig(policy=formation.policy, token_budget=regime.token_budget,
                            max_num_seqs=regime.max_num_seqs, per_microbatch_seq_cap=regime.seq_cap,
                            max_waiting=max(4096, len(wl)), balance=formation.balance,
                            token_ring=formation.token_ring)
    cfg = SimConfig(sched, blocks, regime.block_size, regime.max_model_len or model.max_model_len,
                    regime.overhead_ms * 1e-3, regime.dispatch_ms * 1e-3,
                    spec_acceptance=spec.acceptance if spec else None,
                    num_speculative_tokens=spec.num_speculative_tokens if spec else 4)
    return wl, cost, cfg


def _step_gaps(timings: Mapping[str, RequestTiming]) -> list[float]:
    """Each request's gaps between the steps that delivered its tokens (tokens of one step share a time)."""
    gaps = []
    for t in timings.values():
        times = t.token_times_s
        gaps += [b - a for a, b in zip(times[:-1], times[1:], strict=True) if b != a]
    return gaps


def run_cell(regime: Regime, formation: Formation, workload: Sequence[WorkloadRequest] | None = None,
             spans_dir: str | Path | None = None, spec: SpecCell | None = None) -> dict[str, Any]:
    """Simulate one regime under one formation; the cell's figures (seconds, fractions). With `spans_dir`
    the cell's spans and work intervals are written there too, as `<regime>--<formation>.jsonl`
    (`ppserve timeline` draws them). With `spec`, speculative decoding on (its name is the formation's;
    the cell adds the speculation counters)."""
    wl, cost, cfg = sim_setup(regime, formation, workload, spec)
    name = spec.name if spec else formation.name
    t0 = time.perf_counter()
    res = simulate(wl, cost, cfg)
    if spans_dir is not None:
        write_jsonl(Path(spans_dir) / f"{regime.name}--{name}.jsonl", res.spans, res.work_intervals)
    s = res.summary("active")
    rep = res.bubble_report("active")
    lat, thr, bub = s["latency"], s["throughput"], s["bubbles"]
    cell: dict[str, Any] = {
        "regime": regime.name,
        "formation": name,
        "num_requests": s["num_requests"],
        "num_rejected": s["num_rejected"],
        "num_microbatches": s["num_microbatches"],
        "num_preemptions": s["num_preemptions"],
        "mean_bubble": bub["mean_bubble_fraction"],
        # The part of it that fell while fewer than p requests were in the system (metrics/bubbles.py).
        "short_handed_bubble": bub["short_handed_bubble_fraction"],
        "stage_bubble": [st.bubble_fraction for st in rep.stages],
        "requests_per_s": thr["requests_per_s"],
        "output_tokens_per_s": thr["output_tokens_per_s"],
        "duration_s": thr["duration_s"],
        "ttft_p50_s": lat["ttft_s"]["p50"],
        "ttft_p99_s": lat["ttft_s"]["p99"],
        "tbt_p99_s": lat["tbt_s"]["p99"],
        "tbt_p50_s": lat["tbt_s"]["p50"],
        "tpot_p50_s": lat["tpot_s"]["p50"],
        "step_gap_p50_s": stats(_step_gaps(res.timings))["p50"],
        "per_request_bubble_p50_s": bub["per_request_bubble_s"]["p50"],
        "microbatch_token_cv": bub["microbatch_token_cv"],
        "sim_wall_s": time.perf_counter() - t0,  # how long the simulation took here (not a figure)
    }
    if spec is not None:
        cell.update(acceptance=spec.acceptance, num_speculative_tokens=spec.num_speculative_tokens,
                    speculation=res.speculation)
    return cell


def criteria(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One regime's criteria from its cells (one per formation): each figure, the reference it is held to, the
    ratio, pass."""
    by = {c["formation"]: c for c in cells}
    bal, unbal = by[BALANCED], by[UNBALANCED]
    best_thr = max(c["requests_per_s"] for c in cells)
    ttfts = [c["ttft_p50_s"] for c in cells if c["ttft_p50_s"] is not None]
    best_ttft = min(ttfts) if ttfts else None

    def ratio(x: float | None, y: float | None) -> float | None:
        return None if x is None or not y else x / y

    rivals = [unbal, *(by[p] for p in PEERS if p in by)]
    worst_rival = min(rivals, key=lambda c: c["mean_bubble"])
    bubble_ok = bal["mean_bubble"] <= worst_rival["mean_bubble"] + 1e-12
    thr_ratio = ratio(bal["requests_per_s"], best_thr)
    ttft_ratio = ratio(bal["ttft_p50_s"], best_ttft)
    out: dict[str, Any] = {
        "bubble": {"balanced": bal["mean_bubble"], "unbalanced": unbal["mean_bubble"],
                   "by": {c["formation"]: c["mean_bubble"] for c in rivals},
                   "least_rival": worst_rival["formation"],
                   "ratio": ratio(bal["mean_bubble"], worst_rival["mean_bubble"]), "ok": bubble_ok},
        "throughput": {"balanced": bal["requests_per_s"], "best": best_thr,
                       "best_formation": max(cells, key=lambda c: c["requests_per_s"])["formation"],
                       "ratio": thr_ratio, "floor": THROUGHPUT_FLOOR,
                       "ok": thr_ratio is not None and thr_ratio >= THROUGHPUT_FLOOR},
        "ttft_p50": {"balanced": bal["ttft_p50_s"], "best": best_ttft,
                     "best_formation": next((c["formation"] for c in cells if c["ttft_p50_s"] == best_ttft),
                                            None),
                     "ratio": ttft_ratio, "ceiling": TTFT_CEILING,
                     "ok": ttft_ratio is not None and ttft_ratio <= TTFT_CEILING},
    }
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def run_suite(reduced: bool = False, only: Sequence[str] | None = None,
              progress: Callable[[str], None] | None = None, workers: int = 1,
              spans_dir: str | Path | None = None) -> dict[str, Any]:
    """Every formation on every regime (or the regimes named in `only`): settings, cells, criteria, and
    the `SPECULATION` cells of those regimes (`speculation`: each with speculation off and on).
    `workers` > 1 runs the cells in that many processes; every cell is seeded, so the figures are the
    same either way (only their `sim_wall_s` moves). `spans_dir`: each cell's spans written there
    (`run_cell`)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers!r}")
    if spans_dir is not None:
        Path(spans_dir).mkdir(parents=True, exist_ok=True)
    chosen = regimes(reduced)
    if only:
        unknown = set(only) - {r.name for r in chosen}
        if unknown:
            raise ValueError(f"unknown regime(s) {sorted(unknown)}; known: {[r.name for r in chosen]}")
        chosen = [r for r in chosen if r.name in only]
    names = {r.name for r in chosen}
    specs = [sc for sc in SPECULATION if sc.regime in names]
    t0 = time.perf_counter()
    out: dict[str, Any] = {"reduced": reduced, "formations": [dataclasses.asdict(f) for f in FORMATIONS],
                           "regimes": {}}
    pool = (ProcessPoolExecutor(min(workers, len(chosen) * len(FORMATIONS)),
                                mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None)
    by_name = {f.name: f for f in FORMATIONS}
    try:
        # Submitted all at once, read back in order: the progress lines and the cells keep the suite's order.
        pending = {(r.name, f.name): pool.submit(_cell_by_name, reduced, r.name, f.name, spans_dir)
                   for r in chosen for f in FORMATIONS} if pool else {}
        spec_pending = [pool.submit(_cell_by_name, reduced, sc.regime, sc.formation, spans_dir, sc)
                        for sc in specs] if pool else []
        for regime in chosen:
            wl = regime.workload()
            cells = []
            for f in FORMATIONS:
                cells.append(pending[regime.name, f.name].result() if pool
                             else run_cell(regime, f, wl, spans_dir))
                if progress:
                    c = cells[-1]
                    progress(f"{regime.name:>16} {f.name:>13}: bubble {100 * c['mean_bubble']:5.1f}% "
                             f"({c['sim_wall_s']:.1f} s)")
            out["regimes"][regime.name] = {
                "description": regime.description, "settings": regime.settings(), "num_requests": len(wl),
                "cells": cells, "criteria": criteria(cells),
            }
        out["speculation"] = []
        for i, sc in enumerate(specs):
            regime = next(r for r in chosen if r.name == sc.regime)
            on = (spec_pending[i].result() if pool
                  else run_cell(regime, by_name[sc.formation], spans_dir=spans_dir, spec=sc))
            off = next(c for c in out["regimes"][sc.regime]["cells"] if c["formation"] == sc.formation)
            out["speculation"].append({"regime": sc.regime, "formation": sc.formation, "off": off, "on": on})
            if progress:
                progress(f"{sc.regime:>16} {sc.name}: bubble {100 * on['mean_bubble']:5.1f}% "
                         f"({on['sim_wall_s']:.1f} s)")
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    out["suite_wall_s"] = time.perf_counter() - t0
    return out


def _cell_by_name(reduced: bool, regime_name: str, formation_name: str,
                  spans_dir: str | Path | None = None, spec: SpecCell | None = None) -> dict[str, Any]:
    """`run_cell` in a worker process: a regime's workload is a closure, so the names cross, not the
    objects."""
    regime = next(r for r in regimes(reduced) if r.name == regime_name)
    return run_cell(regime, next(f for f in FORMATIONS if f.name == formation_name), spans_dir=spans_dir,
                    spec=spec)


# ---------------------------------------------------------------------------------------------
# Output


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{1e3 * x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def cells_table(suite: Mapping[str, Any]) -> str:
    """One row per (regime, formation)."""
    head = ("| regime | formation | reqs | bubble mean | of it, < p requests | bubble per stage | req/s | "
            "out tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TBT p99 (ms) | per-req bubble p50 (ms) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in suite["regimes"].items():
        for c in r["cells"]:
            stages = " / ".join(f"{100 * b:.0f}" for b in c["stage_bubble"])
            lines.append(
                f"| {name} | {c['formation']} | {c['num_requests']} | {_pct(c['mean_bubble'])} "
                f"| {_pct(c.get('short_handed_bubble'))} | {stages} "
                f"| {c['requests_per_s']:.3f} | {c['output_tokens_per_s']:.0f} | {_ms(c['ttft_p50_s'])} "
                f"| {_ms(c['ttft_p99_s'])} | {_ms(c['tbt_p99_s'])} | {_ms(c['per_request_bubble_p50_s'])} |"
            )
    return "\n".join(lines)


def speculation_table(suite: Mapping[str, Any]) -> str:
    """Two rows per speculation cell: the formation with speculation off, then on. Several tokens of one
    step share a time, so TBT p50 counts the gaps inside a step (zero) too; TPOT p50 and the step gap
    p50 (between the steps that deliver a request's tokens) say what a token and a step cost."""
    head = ("| regime | formation | speculation | bubble mean | out tok/s | TBT p50 (ms) | TPOT p50 (ms) | "
            "step gap p50 (ms) | TBT p99 (ms) | mean acceptance length |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in suite.get("speculation", ()):
        for label, c in (("off", row["off"]), ("on", row["on"])):
            spec = c.get("speculation") or {}
            if label == "on":
                label = f"a={c['acceptance']:g}, k={c['num_speculative_tokens']}"
            mal = spec.get("mean_acceptance_length")
            accepted = "-" if mal is None else f"{mal:.2f}"
            lines.append(
                f"| {row['regime']} | {row['formation']} | {label} | {_pct(c['mean_bubble'])} "
                f"| {c['output_tokens_per_s']:.0f} | {_ms(c['tbt_p50_s'])} | {_ms(c['tpot_p50_s'])} "
                f"| {_ms(c['step_gap_p50_s'])} | {_ms(c['tbt_p99_s'])} | {accepted} |"
            )
    return "\n".join(lines)


def criteria_table(suite: Mapping[str, Any]) -> str:
    """One row per regime: balanced sarathi against its least-bubble rival (the unbalanced formation or
    a peer) and against the best formation."""
    head = ("| regime | bubble: balanced / least of unbalanced and peers | throughput: balanced / best (>= "
            f"{THROUGHPUT_FLOOR}) | TTFT p50: balanced / best (<= {TTFT_CEILING}) | all |")
    lines = [head, "|---|---|---|---|---|"]
    for name, r in suite["regimes"].items():
        k = r["criteria"]
        b, t, f = k["bubble"], k["throughput"], k["ttft_p50"]

        def mark(ok: bool) -> str:
            return "" if ok else " **FAIL**"

        lines.append(
            f"| {name} | {_pct(b['balanced'])} / {_pct(b['by'][b['least_rival']])} ({b['least_rival']})"
            f"{mark(b['ok'])} "
            f"| {_x(t['ratio'])} (best {t['best_formation']}){mark(t['ok'])} "
            f"| {_x(f['ratio'])} (best {f['best_formation']}){mark(f['ok'])} | "
            f"{'pass' if k['ok'] else 'FAIL'} |"
        )
    return "\n".join(lines)


def plot_regimes(suite: Mapping[str, Any], path: str | Path) -> Path:
    """Mean bubble per regime per formation (grouped bars) and throughput relative to each regime's best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(suite["regimes"])
    forms = [f.name for f in FORMATIONS]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(8.0, 1.3 * len(names)), 7), sharex=True)
    width = 0.8 / len(forms)
    for j, form in enumerate(forms):
        cells = [next(c for c in suite["regimes"][n]["cells"] if c["formation"] == form) for n in names]
        xs = [i + (j - (len(forms) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [100 * c["mean_bubble"] for c in cells], width, label=form)
        best = [suite["regimes"][n]["criteria"]["throughput"]["best"] for n in names]
        ax2.bar(xs, [c["requests_per_s"] / b if b else 0.0 for c, b in zip(cells, best, strict=True)], width,
                label=form)
    ax.set_ylabel("mean bubble fraction (%), active window")
    ax.set_ylim(0, 112)  # room for the legend above the tallest bars
    ax.legend(ncol=len(forms), fontsize=8, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    ax2.axhline(THROUGHPUT_FLOOR, color="k", ls="--", lw=0.8)
    ax2.set_ylabel("throughput / best formation's")
    ax2.set_ylim(0, 1.05)
    ax2.grid(axis="y", alpha=0.3)
    ax2.set_xticks(range(len(names)), names, rotation=20, ha="right")
    fig.suptitle(f"ppserve bench regimes{' --reduced' if suite.get('reduced') else ''} (simulator)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def markdown(suite: Mapping[str, Any], command: str = "") -> str:
    parts = ["# Regime suite (simulator)", ""]
    if command:
        parts += [f"`{command}`", ""]
    parts += ["Bubbles: active window. Per-stage bubble in %, stage 0 first.", "", cells_table(suite), "",
              criteria_table(suite), ""]
    if suite.get("speculation"):
        parts += ["Speculative decoding (simulated acceptance), off and on:", "", speculation_table(suite),
                  ""]
    return "\n".join(parts)


def write_suite(suite: Mapping[str, Any], outdir: str | Path, command: str = "",
                plot: bool = True) -> dict[str, Path]:
    """regimes.json, regimes.md and (with `plot`) regimes.png in `outdir`."""
    from ppserve.bench.report import write_json

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(outdir / "regimes.json", {"command": command, **suite})}
    md = outdir / "regimes.md"
    md.write_text(markdown(suite, command))
    paths["md"] = md
    if plot:
        paths["png"] = plot_regimes(suite, outdir / "regimes.png")
    return paths
