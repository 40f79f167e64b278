"""Where the balanced pipeline's bubble goes at GPU scale: stage 0's idle time in a simulated run,
cut by cause.

Every later stage only waits for the stage before it, so the pipeline's bubble starts at stage 0: it idles
between two microbatches while the engine has work. Each such gap, from the end of microbatch j-1 on
stage 0 to the start of microbatch j there, is cut into the parts the simulated engine's own events
delimit (ppserve/sim/simulator.py: the engine collects the oldest microbatch when it leaves the last
stage, turns around for `schedule_overhead_s`, schedules, and the stages hold the microbatch
`dispatch_latency_s` later):

- `ring`: the pipeline held its p microbatches, so j could only be formed once the oldest came back
  from the last stage. A decoding request's next token needs its last one, so each decode group goes
  round the ring; when one microbatch costs more than the others (a prefill chunk beside its decodes, or
  longer contexts) the others finish and wait for it. Split by whether the microbatch waited for
  carried a prefill chunk.
- `few`: fewer than p microbatches were in flight and nothing more could be formed (every decode was
  in flight and no prompt waited): the work in reach did not fill the pipeline.
- `turnaround`: from the oldest microbatch's return to the schedule of j (the engine's result
  handling, `--overhead-ms`).
- `dispatch`: from the schedule of j to the stages holding it (`--dispatch-ms`).
- `ring_tokens`: with the token ring (`scheduler.token_ring`) stage 0 held j already and waited for
  the tokens its decodes take from an earlier microbatch, still on its way round.

The parts add up to stage 0's bubble (the bubble report's, active window; checked). Across them, the
table also gives how much of stage 0's bubble fell while fewer than p requests were in the system (arrived,
last token not yet out): there each request's decodes ride in one microbatch at a time, so once only
decodes are left p stages cannot all be busy whatever the formation (a prompt's chunks can still follow
each other down the pipeline). It is a cut across the parts, not one beside them: the share of the bubble
that a rule of formation can hardly take off. The runs are regimes
of `ppserve bench regimes` (ppserve/bench/regimes.py; default the conversation trace on Llama-2-70B at
A100 PP4 x TP4 at 2 / 4 / 8 req/s, bench_balance_sim.py's setup), each with the regime's control plane
and with none (the bound on what taking the control plane off the decode ring can give), under the
balanced formation, the balanced formation with the token ring (`scheduler.token_ring`, which
takes it off) and the unbalanced one.

A second table cuts every stage's idle time, not only stage 0's, three ways (`every_stage_idle`): fewer than p
requests in the system; short full-handed gaps between two decode-only microbatches, where with the token
ring the p decode groups go round at the slowest stage's pace (the last stage's LM head makes it slower);
and the rest, what a rule of formation can act on.

    python benchmarks/analysis_sim_bubble.py [--regimes conv-2,conv-4,conv-8] [--reduced] [--out FILE]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

from ppserve.bench.regimes import Formation, Regime, regimes, sim_setup
from ppserve.metrics.bubbles import intersect, short_handed, subtract, total, union
from ppserve.metrics.latency import lifetimes_ns
from ppserve.metrics.spans import ENGINE_STAGE, Span
from ppserve.sim import SimResult, simulate

PARTS = ("ring_prefill", "ring_decode", "ring_tokens", "few", "turnaround", "dispatch")


def first_stage_idle(res: SimResult, dispatch_s: float) -> dict[str, int]:
    """Stage 0's idle time while the engine had work, in nanoseconds, cut into PARTS (see the module doc)."""
    p = res.num_stages
    compute: dict[int, dict[int, Span]] = {s: {} for s in range(p)}
    scheduled: dict[int, int] = {}
    for sp in res.spans:
        if sp.kind == "compute" and sp.tp_rank == 0:
            compute[sp.stage][sp.step_id] = sp
        elif sp.kind == "schedule" and sp.stage == ENGINE_STAGE:
            scheduled[sp.step_id] = sp.start_ns
    work = union(res.work_intervals)
    steps = sorted(compute[0])
    # When each microbatch came back to the engine: it left the last stage (the engine was waiting for it:
    # it collects the oldest as soon as the pipeline is full or nothing more can be formed).
    back = [compute[p - 1][k].end_ns for k in steps]
    dispatch_ns = round(dispatch_s * 1e9)
    parts = dict.fromkeys(PARTS, 0)

    def add(part: str, start: int, end: int) -> None:
        if end > start:
            parts[part] += total(intersect([(start, end)], work))

    for i, j in enumerate(steps):
        idle_from, start = compute[0][steps[i - 1]].end_ns if i else 0, compute[0][j].start_ns
        if start <= idle_from:
            continue
        formed = scheduled[j]
        if formed >= idle_from:
            # The engine formed j only after stage 0 went idle; it last heard back from the pipeline at
            # `came`.
            k = bisect.bisect_right(back, formed, 0, i) - 1  # the last microbatch back before the schedule
            came = back[k] if k >= 0 else idle_from
            in_flight = sum(1 for m in range(max(0, i - p), i) if scheduled[steps[m]] <= idle_from < back[m])
            waited = "few"
            if in_flight >= p and k >= 0:
                waited = "ring_prefill" if compute[0][steps[k]].num_prefill_tokens else "ring_decode"
            add(waited, idle_from, min(came, start))
            add("turnaround", max(idle_from, came), min(formed, start))
        add("dispatch", max(idle_from, formed), min(formed + dispatch_ns, start))
        add("ring_tokens", max(idle_from, formed + dispatch_ns), start)
    if steps:  # the drain: the last microbatches go through the later stages with nothing left to form
        add("few", compute[0][steps[-1]].end_ns, work[-1][1] if work else 0)
    return parts


def under_p_requests(res: SimResult) -> int:
    """Stage 0's bubble, in ns, while fewer than p requests were in the system (see the module doc)."""
    work = union(res.work_intervals)
    busy = union(
        (sp.start_ns, sp.end_ns)
        for sp in res.spans
        if sp.kind == "compute" and sp.stage == 0 and sp.tp_rank == 0
    )
    return total(
        intersect(
            subtract(work, busy), short_handed(lifetimes_ns(res.timings.values()), res.num_stages, work)
        )
    )


# A gap between two decode-only microbatches shorter than this is a stage waiting on a slower one's pace.
PACE_GAP_S = 0.0005


def every_stage_idle(res: SimResult) -> dict[str, float]:
    """Every stage's idle time while the engine had work, as a fraction of the active window averaged over
    the stages, cut three ways: `under_p` (fewer than p requests in the system), `pace` (full-handed gaps
    under PACE_GAP_S between two decode-only microbatches: with the token ring, the p decode groups go
    round at the slowest stage's pace, and a faster stage waits for its tokens each step) and `rest`."""
    p = res.num_stages
    work = union(res.work_intervals)
    window = total(work)
    short = short_handed(lifetimes_ns(res.timings.values()), p, work)
    parts = {"under_p": 0, "pace": 0, "rest": 0}
    pace_ns = round(PACE_GAP_S * 1e9)
    for stage in range(p):
        spans = sorted(
            (sp for sp in res.spans if sp.kind == "compute" and sp.stage == stage and sp.tp_rank == 0),
            key=lambda sp: sp.start_ns,
        )
        idle = subtract(work, union((sp.start_ns, sp.end_ns) for sp in spans))
        under = total(intersect(idle, short))
        pace = 0
        for a, b in itertools.pairwise(spans):
            gap = subtract(intersect([(a.end_ns, b.start_ns)], work), short) if b.start_ns > a.end_ns else []
            if 0 < total(gap) < pace_ns and not a.num_prefill_tokens and not b.num_prefill_tokens:
                pace += total(gap)
        parts["under_p"] += under
        parts["pace"] += pace
        parts["rest"] += total(idle) - under - pace
    return {name: ns / p / window for name, ns in parts.items()} if window else dict.fromkeys(parts, 0.0)


FORMATIONS = (
    Formation("balanced", "sarathi", True, False),
    Formation("balanced + ring", "sarathi", True, True),
    Formation("balance=False", "sarathi", False, False),
)


def run(regime: Regime, formation: Formation, control_plane: bool) -> dict[str, Any]:
    """One regime under one formation, with the regime's control plane or none; stage 0's idle parts."""
    wl, cost, cfg = sim_setup(regime, formation)
    if not control_plane:
        cfg = dataclasses.replace(cfg, schedule_overhead_s=0.0, dispatch_latency_s=0.0)
    res = simulate(wl, cost, cfg)
    rep = res.bubble_report("active")
    parts = first_stage_idle(res, cfg.dispatch_latency_s)
    stage0 = rep.stages[0]
    if abs(sum(parts.values()) - stage0.bubble_ns) > 1:  # the report's ns are a mean over tp ranks (one here)
        raise AssertionError(
            f"stage 0's idle parts add up to {sum(parts.values())} ns, its bubble is {stage0.bubble_ns} ns"
        )
    lat = res.latency()
    return {
        "mean_bubble": float(rep.mean_bubble_fraction),
        "stage_bubbles": [float(s.bubble_fraction) for s in rep.stages],
        "stage0_parts": {name: ns / rep.window_ns for name, ns in parts.items()},
        "stage0_under_p_requests": under_p_requests(res) / rep.window_ns,
        "every_stage": every_stage_idle(res),
        "output_tokens_per_s": res.throughput()["output_tokens_per_s"],
        "tbt_p50_s": lat["tbt_s"]["p50"], "ttft_p50_s": lat["ttft_s"]["p50"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regimes", default="conv-2,conv-4,conv-8", help="regimes of `ppserve bench regimes`")
    ap.add_argument("--reduced", action="store_true", help="the regimes' reduced request counts")
    ap.add_argument("--out", default="results/analysis_sim_bubble.json")
    args = ap.parse_args()
    known = {r.name: r for r in regimes(args.reduced)}
    names = args.regimes.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown regime(s) {unknown}; known: {sorted(known)}")
    rows = []
    print(
        "| regime | formation | control plane | mean bubble | stage 0 | ring: awaited prefill | ring: "
        "awaited decodes "
        "| ring tokens | few microbatches | turnaround | dispatch | stage 0, under p requests | out tok/s | "
        "TBT p50 ms "
        "| TTFT p50 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for formation in FORMATIONS:
            for plane in (True, False):
                r = run(known[name], formation, plane)
                rows.append({"regime": name, "formation": formation.name, "control_plane": plane, **r})
                pct = {k: f"{100 * v:.1f}%" for k, v in r["stage0_parts"].items()}
                print(
                    f"| {name} | {formation.name} | {'measured' if plane else 'none'} | "
                    f"{100 * r['mean_bubble']:.1f}% | {100 * r['stage_bubbles'][0]:.1f}% | "
                    f"{pct['ring_prefill']} | "
                    f"{pct['ring_decode']} | {pct['ring_tokens']} | {pct['few']} | {pct['turnaround']} | "
                    f"{pct['dispatch']} | {100 * r['stage0_under_p_requests']:.1f}% | "
                    f"{r['output_tokens_per_s']:.0f} | {1e3 * r['tbt_p50_s']:.1f} | "
                    f"{1e3 * r['ttft_p50_s']:.0f} |"
                )
    print(
        "\nEvery stage's idle time (mean over the stages): fewer than p requests in the system, full-handed "
        "gaps "
        f"under {1e3 * PACE_GAP_S:g} ms between decode-only microbatches (a slower stage's pace), the rest\n"
    )
    print(
        "| regime | formation | control plane | mean bubble | under p requests | slower stage's pace | rest |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        e = r["every_stage"]
        print(
            f"| {r['regime']} | {r['formation']} | {'measured' if r['control_plane'] else 'none'} | "
            f"{100 * r['mean_bubble']:.2f}% | {100 * e['under_p']:.2f}% | {100 * e['pace']:.2f}% | "
            f"{100 * e['rest']:.2f}% |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
