"""How true the scheduler's step-cost model is on the real CPU pipeline (issue 21): every microbatch's
predicted time on each stage, taken just before its measured stage times teach the model (so each
prediction is out of sample, one step ahead), against those measured times.

The run is the busy-load policy comparison's (`bench_policies.py --rate 3.0 --num-requests 48
--prefill-scale 0.15 --decode-scale 0.15 --token-budget 128 --max-num-seqs 32`, sarathi, the default
partition) unless told otherwise. Printed and written per stage and for the pace (the slowest stage):
median / p90 absolute relative error, over the microbatches after the model's first `--skip`
observations (before then it predicts from nothing, or its prior). Goal: <= 10 % / <= 25 %.

In hindsight: the same five-feature cost fitted on the scored microbatches themselves (in sample, every
one weighed alike, one fit per kind: with a prefill chunk, decode-only) and scored on them: the least error
this model's form can reach on this run's times, so what is left there is the machine's jitter or a
feature the form lacks, not the online fit's lag.

Beside it, the stages' start-up step costs alone (worker/startup_cost.py, the online model's prior, never
updated) against every microbatch from the first: how true the profile is that a pipeline starts from
and that `plan_then_run.py` plans with.

    python benchmarks/bench_cost_model.py [--rate 3.0] [--num-requests 48]
        [--out results/bench_cost_model.json]
        [--set parallel.partition_mode=calibrated]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ppserve.bench.harness import EngineSpec, build_llm, replay, warm_up
from ppserve.bench.report import write_json
from ppserve.bench.suites import load_prompt_builder
from ppserve.bench.workloads import WorkloadSpec, build_workload
from ppserve.metrics.latency import percentile
from ppserve.sched.cost import BatchShape, StepCostFit, features


def _errors(pred: Sequence[float], meas: Sequence[float]) -> dict[str, float] | None:
    signed = [(p - m) / m for p, m in zip(pred, meas, strict=True) if m > 0]
    errs = [abs(e) for e in signed]
    if not errs:
        # nothing scored: at pp = 1 the scheduler fits no online model (it has no stages to level)
        return None
    # `bias`: the median signed error, below 0 where the model prices steps faster than they run
    return {"median": percentile(errs, 50), "p90": percentile(errs, 90), "bias": percentile(signed, 50),
            "n": len(errs)}


def measure(spec: EngineSpec, workload: WorkloadSpec, skip: int) -> dict[str, Any]:
    reqs = build_workload(workload)
    prompts = load_prompt_builder(spec, workload.seed).build([r.prompt_len for r in reqs])
    llm = build_llm(spec, "sarathi")
    rows: list[tuple[list[float], tuple[float, ...]]] = []
    prior_rows: list[tuple[list[float], tuple[float, ...]]] = []
    with_chunk: list[bool] = []  # per scored row: whether its microbatch held a prefill chunk
    feats: list[tuple[float, ...]] = []  # per scored row: its microbatch's cost features (the hindsight fit)
    startup = llm.engine.executor.startup_cost
    try:
        warm_up(llm.engine)
        sched = llm.engine.scheduler
        observe = sched.observe_step

        def predicting_observe(out: Any, stage_seconds: Sequence[float] = (), timed: Any = None) -> None:
            # Predict before the model sees this microbatch's times: an out-of-sample, one-step-ahead figure,
            # for the microbatch the times measure (`timed`: an earlier one when the stages read them late).
            measured = out if timed is None else timed
            if stage_seconds and not measured.is_empty and startup is not None:
                prior_rows.append((startup.stage_times(BatchShape.of(measured)), tuple(stage_seconds)))
            if stage_seconds and not measured.is_empty and sched.cost.fits[0].num_samples >= skip:
                shape = BatchShape.of(measured)
                rows.append((sched.cost.current.stage_times(shape), tuple(stage_seconds)))
                with_chunk.append(measured.num_prefill_tokens > 0)
                feats.append(features(shape.chunks, shape.num_sampled))
            observe(out, stage_seconds, timed=timed)

        sched.observe_step = predicting_observe  # type: ignore[method-assign]
        run = replay(llm.engine, reqs, prompts, name="cost-model", progress=False)
    finally:
        llm.shutdown()
    summary = run.summary()
    # The online cost prices the two kinds with two pieces (sched/cost.py, DECODE_ONLY_WEIGHT): scored apart
    # too.
    by_kind = {kind: _errors([max(p) for (p, _), c in zip(rows, with_chunk, strict=True) if c == chunk],
                             [max(m) for (_, m), c in zip(rows, with_chunk, strict=True) if c == chunk])
               for kind, chunk in (("with_chunk", True), ("decode_only", False))}
    return {
        **_scored(rows),
        "pace_by_kind": by_kind,
        "hindsight_by_kind": _hindsight(rows, feats, with_chunk),
        "num_microbatches": len(rows),
        "skip": skip,
        "startup_prior": {
            **_scored(prior_rows),
            "num_microbatches": len(prior_rows),
            "cost": startup.to_json() if startup is not None else None,
        },
        "mean_bubble_fraction": summary.get("bubbles", {}).get("mean_bubble_fraction"),
        "final_cost": sched.cost.current.to_json(),
    }


def _hindsight(rows: Sequence[tuple[Sequence[float], tuple[float, ...]]], feats: Sequence[Sequence[float]],
               with_chunk: Sequence[bool]) -> dict[str, dict[str, float] | None]:
    """Per kind, the pace's errors of one fit per stage over that kind's own scored microbatches
    (in sample)."""
    out: dict[str, dict[str, float] | None] = {}
    for kind, chunk in (("with_chunk", True), ("decode_only", False)):
        idx = [i for i, c in enumerate(with_chunk) if c == chunk]
        if not idx:
            out[kind] = None
            continue
        stages = len(rows[idx[0]][1])
        fits = [StepCostFit(None, forgetting=1.0, min_samples=1) for _ in range(stages)]
        for i in idx:
            for s, fit in enumerate(fits):
                fit.observe(feats[i], rows[i][1][s])
        costs = [fit.cost for fit in fits]
        out[kind] = _errors(
            [max(c.of_features(feats[i]) for c in costs) for i in idx], [max(rows[i][1]) for i in idx]
        )
    return out


def _scored(rows: Sequence[tuple[Sequence[float], tuple[float, ...]]]) -> dict[str, Any]:
    """Per stage and for the pace (the slowest stage): the errors of predicted against measured."""
    stages = len(rows[0][1]) if rows else 0
    per_stage = [_errors([p[s] for p, _ in rows], [m[s] for _, m in rows]) for s in range(stages)]
    return {"per_stage": per_stage, "pace": _errors([max(p) for p, _ in rows], [max(m) for _, m in rows])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--workload", default="trace:splitwise_conv.csv")
    ap.add_argument("--prefill-scale", type=float, default=0.15)
    ap.add_argument("--decode-scale", type=float, default=0.15)
    ap.add_argument("--token-budget", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument(
        "--skip", type=int, default=32, help="microbatches the model learns from before it is scored"
    )
    ap.add_argument(
        "--set", dest="overrides", action="append", default=[], help="section.key=value (repeatable)"
    )
    ap.add_argument("--out", default="results/bench_cost_model.json")
    args = ap.parse_args()
    spec = EngineSpec(pp=args.pp, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                      overrides=tuple(args.overrides))
    workload = WorkloadSpec(
        source=args.workload,
        num_requests=args.num_requests,
        prefill_scale=args.prefill_scale,
        decode_scale=args.decode_scale,
        rate=args.rate,
    )
    fig = measure(spec, workload, args.skip)
    print(f"{fig['num_microbatches']} microbatches scored (after the model's first {args.skip})")
    prior = fig["startup_prior"]
    for title, f in [
        ("online model", fig),
        (f"start-up step costs alone, all {prior['num_microbatches']}", prior),
    ]:
        print(title)
        for name, e in [*((f"stage {s}", e) for s, e in enumerate(f["per_stage"])), ("pace", f["pace"])]:
            if e is None:
                print(f"{name:>8}: nothing scored")
                continue
            print(f"{name:>8}: |predicted - measured| / measured  median {100 * e['median']:.1f} %  "
                  f"p90 {100 * e['p90']:.1f} %  (goal <= 10 % / <= 25 %)  bias {100 * e['bias']:+.1f} %")
    for kind, e in fig["pace_by_kind"].items():
        if e is not None:
            print(
                f"online model, pace, {kind.replace('_', ' ')} ({e['n']} microbatches): median "
                f"{100 * e['median']:.1f} %  "
                f"p90 {100 * e['p90']:.1f} %  bias {100 * e['bias']:+.1f} %"
            )
    for kind, e in fig["hindsight_by_kind"].items():
        if e is not None:
            print(
                f"in hindsight (in sample), pace, {kind.replace('_', ' ')}: median {100 * e['median']:.1f} % "
                " "
                f"p90 {100 * e['p90']:.1f} %  bias {100 * e['bias']:+.1f} %"
            )
    write_json(args.out, {"args": vars(args), **fig})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
