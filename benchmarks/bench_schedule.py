"""How long `schedule()` takes next to the step it schedules, at 512 running requests.

Two measurements in one run:
1. Pure Python: schedule() + update_from_output() on a scheduler holding 512 decoding requests
   (no model), averaged over many steps.
2. Real engine: 512 requests decoding through the default model (pp=1, all prompts in one prefill); the
   engine's own `schedule` spans are compared with the stage's `compute` spans of the same microbatches.
Goal (issue 2 / issue 7): schedule() <= 1 % of a step. The pure measurement runs with prefix caching off
and on side by side (issue 23: on <= 1.1x off); every request's prompt is its own, so both do the same work.

    python benchmarks/bench_schedule.py [--requests 512] [--out results/bench_schedule.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from ppserve.config import SchedulerConfig
from ppserve.request import Request, SamplingParams
from ppserve.sched import Scheduler, StepResult


def settled_scheduler(num_requests: int, pp: int, prefix_caching: bool) -> Scheduler:
    """A scheduler holding `num_requests` decoding requests on a pipeline of `pp` slots, every slot full
    (pp microbatches in flight, pp + 1 with the token ring that pp > 1 runs by default; the decodes in
    pp groups of about num_requests / pp)."""
    cfg = SchedulerConfig(policy="sarathi", token_budget=num_requests, max_num_seqs=num_requests)
    s = Scheduler(cfg, num_blocks=num_requests * 64, block_size=16, max_model_len=8192, num_stages=pp,
                  enable_prefix_caching=prefix_caching)
    for i in range(num_requests):  # distinct prompts: caching on computes what caching off does
        prompt = list(range(1 + 32 * i, 33 + 32 * i))
        s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=10_000, ignore_eos=True)))
    # Prefill everything, then let the decodes settle into pp groups.
    warm = 0
    while warm < 4 * pp:
        while s.schedule() is not None:
            pass
        complete_oldest(s)
        settled = not s.waiting and not any(r.is_prefill for r in s.running.values())
        warm = warm + 1 if settled else 0
    while s.schedule() is not None:
        pass
    return s


def complete_oldest(s: Scheduler) -> None:
    out = s.in_flight[0]
    s.update_from_output(out, StepResult(out.step_id, {rid: 7 for rid in out.sample_request_ids}))


def pure_schedule_us(num_requests: int, steps: int = 200, pp: int = 1) -> dict[str, dict[str, float]]:
    """Median schedule() and update_from_output() per microbatch, prefix caching on and off: two
    schedulers stepped in turn (the order alternating every step), so that a burst of noise on this shared
    machine slows both sides alike instead of whichever ran in it."""
    scheds = {
        "on": settled_scheduler(num_requests, pp, True),
        "off": settled_scheduler(num_requests, pp, False),
    }
    times: dict[str, tuple[list[int], list[int]]] = {mode: ([], []) for mode in scheds}
    for step in range(steps):
        for mode in (("on", "off") if step % 2 == 0 else ("off", "on")):
            s = scheds[mode]
            t0 = time.perf_counter_ns()
            complete_oldest(s)
            t1 = time.perf_counter_ns()
            out = s.schedule()
            t2 = time.perf_counter_ns()
            # One slot freed, one microbatch formed: the pipeline is full again (p slots, p + 1 with the
            # token ring).
            assert out is not None and len(s.in_flight) == s.max_in_flight and s.schedule() is None
            times[mode][0].append(t2 - t1)
            times[mode][1].append(t1 - t0)
    return {mode: {"schedule_us_median": statistics.median(sched_ns) / 1e3,
                   "update_us_median": statistics.median(update_ns) / 1e3}
            for mode, (sched_ns, update_ns) in times.items()}


def engine_ratio(num_requests: int, max_tokens: int) -> dict[str, float]:
    from ppserve import LLM

    blocks = num_requests * -(-(16 + max_tokens) // 16)  # room for every request: no preemption
    # A budget that holds every prompt at once: one prefill step, then every microbatch decodes all requests.
    with LLM(
        token_budget=num_requests * 16, max_num_seqs=num_requests, dtype="float32", num_kv_blocks=blocks
    ) as llm:
        prompts = [[1 + (i * 7 + j) % 4000 for j in range(16)] for i in range(num_requests)]
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        spans = llm.spans()
    sched = {s.step_id: s.duration_ns for s in spans if s.kind == "schedule"}
    compute = {s.step_id: (s.duration_ns, s.num_decode_tokens) for s in spans if s.kind == "compute"}
    # Steady decode microbatches: every request decodes once.
    steps = [sid for sid, (_, dec) in compute.items() if dec == num_requests]
    if not steps:
        raise RuntimeError(f"no microbatch held {num_requests} decodes; raise --max-tokens")
    ratios = [sched[sid] / compute[sid][0] for sid in steps]
    return {
        "decode_steps": len(steps),
        "schedule_ms_median": statistics.median(sched[s] for s in steps) / 1e6,
        "compute_ms_median": statistics.median(compute[s][0] for s in steps) / 1e6,
        "schedule_fraction_median": statistics.median(ratios),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument(
        "--pp", type=int, nargs="+", default=[1, 4], help="pipeline depths for the pure measurement"
    )
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--skip-engine", action="store_true", help="only the pure-Python measurement")
    ap.add_argument("--out", default="results/bench_schedule.json")
    args = ap.parse_args()
    result: dict[str, Any] = {"requests": args.requests, "pure": {}}
    for pp in args.pp:
        for n in sorted({args.requests // 4, args.requests // 2, args.requests, 2 * args.requests}):
            both = pure_schedule_us(n, pp=pp)
            r, off = both["on"], both["off"]
            total = r["schedule_us_median"] + r["update_us_median"]
            total_off = off["schedule_us_median"] + off["update_us_median"]
            result["pure"][f"pp{pp}-{n}"] = {**r, "caching_off": off, "on_over_off": total / total_off}
            print(
                f"pure scheduler, pp={pp}, {n} decoding requests: schedule() {r['schedule_us_median']:.0f} "
                "us + "
                f"update_from_output() {r['update_us_median']:.0f} us = {total:.0f} us per microbatch of "
                f"{n // pp} "
                f"decodes ({1e3 * total / n:.0f} ns per running request; medians); prefix caching off "
                f"{total_off:.0f} us: on/off {total / total_off:.2f}x (goal <= 1.1x)"
            )
    if not args.skip_engine:
        eng = engine_ratio(args.requests, args.max_tokens)
        result["engine"] = eng
        print(
            f"engine, default model pp=1, {eng['decode_steps']} decode microbatches of {args.requests} "
            "tokens: "
            f"schedule {eng['schedule_ms_median']:.2f} ms vs compute {eng['compute_ms_median']:.1f} ms "
            f"-> {100 * eng['schedule_fraction_median']:.2f} % of a step (goal <= 1 %)"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
