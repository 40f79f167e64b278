"""`ppserve simulate`: run a workload through the simulated pipeline and print bubbles, latency, throughput.

Also `--fit-from TRACE --profile-out P.json` fits a per-stage profile from spans measured on the real
pipeline (a Chrome trace or spans JSONL), to pass back as `--hardware P.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppserve.config import add_config_arguments

if TYPE_CHECKING:  # the run path imports these lazily, so `ppserve --help` stays instant
    from ppserve.config import EngineConfig, SchedulerConfig
    from ppserve.metrics.bubbles import Window
    from ppserve.sim.cost_model import CostModel, ModelSpec
    from ppserve.sim.simulator import SimResult
    from ppserve.sim.workload import WorkloadRequest


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of the pipeline with ppserve's scheduler")
    add_config_arguments(p, config_help="engine YAML config (scheduler / cache / parallel sections are used)")
    p.add_argument("--hardware", default="a100",
                   help="a100 | h100 | a hardware YAML | a fitted profile .json")
    p.add_argument("--model", default="gpt3-175b",
                   help="gpt3-175b | llama2-70b | llama3-8b | smollm2-135m | YAML")
    p.add_argument("--pp", type=int, help="pipeline stages (default: config, or the profile's stage count)")
    p.add_argument("--tp", type=int, help="tensor-parallel ranks per stage (default: config)")
    p.add_argument("--workload", default="splitwise_conv.csv",
                   help="trace CSV path or a name in ../shared/traces (arrived_at, num_prefill_tokens, "
                        "num_decode_tokens)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--rate", type=float,
                   help="Poisson arrivals at this many requests/s (default: the trace's own)")
    p.add_argument("--at-once", action="store_true", help="all requests arrive at 0 (offline throughput)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefill-scale", type=float, default=1.0)
    p.add_argument("--decode-scale", type=float, default=1.0)
    p.add_argument("--policy", help="sarathi | vllm | orca | static (default: config)")
    p.add_argument("--token-budget", type=int, help="tokens per microbatch (default: config)")
    p.add_argument("--max-num-seqs", type=int, help="requests running at once (default: config)")
    p.add_argument("--seq-cap", action="store_true", help="cap requests per microbatch at max_num_seqs / pp")
    # Defaults: ppserve's own control plane, connections (docs/decisions.md#control-plane-dispatch).
    p.add_argument("--overhead-ms", type=float, default=0.5,
                   help="engine turnaround per returned microbatch: result back, update, next schedule")
    p.add_argument("--dispatch-ms", type=float, default=0.5,
                   help="control-plane latency from schedule() to the stages holding the microbatch")
    p.add_argument("--window", default="active", help="bubble window: active | all | steady")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace here (open with `ppserve timeline`)")
    p.add_argument("--json", dest="json_out", help="write the summary as JSON here")
    p.add_argument("--check", action="store_true", help="check scheduler invariants after every step (slow)")
    p.add_argument("--fit-from", help="fit a profile from this trace / spans JSONL instead of simulating")
    p.add_argument("--profile-out", default="profile.json", help="where --fit-from writes the profile")
    p.set_defaults(func=run)


def _load_spans(path: str) -> list[Any]:
    """Spans from a spans JSONL or a Chrome trace written by ppserve."""
    from ppserve.metrics.spans import read_jsonl
    from ppserve.metrics.trace import load_chrome_trace

    if not Path(path).exists():
        raise FileNotFoundError(f"no such file: {path}")
    if path.endswith(".jsonl"):
        return read_jsonl(path)
    return load_chrome_trace(path)[0]


def run(args: argparse.Namespace) -> int:
    """Fit a profile (`--fit-from`), or simulate the workload and print (and write) what it measured."""
    if args.fit_from:
        return _fit_profile(args.fit_from, args.profile_out)
    from ppserve.config import load_config
    from ppserve.sim.cost_model import load_model_spec
    from ppserve.sim.simulator import SimConfig, simulate

    cfg = load_config(args.config, args.overrides)
    sched = _scheduler_config(cfg.scheduler, args)
    model = load_model_spec(args.model)
    tp = args.tp or cfg.parallel.tensor_parallel_size
    block_size = cfg.cache.block_size or 16  # unset: 16-token blocks, as on most GPU deployments
    max_len = cfg.model.max_model_len or model.max_model_len
    cost, num_blocks = _cost_model(args, cfg, sched, model, tp, block_size, max_len)
    path, wl = _workload(args, max_len)

    res = simulate(wl, cost, SimConfig(sched, num_blocks, block_size, max_len, args.overhead_ms * 1e-3,
                                       args.dispatch_ms * 1e-3, check_invariants=args.check))
    summary = res.summary(args.window)
    # Every setting that shaped the run, printed and saved beside the figures so a run can be repeated.
    settings = {"model": model.name, "hardware": args.hardware, "pp": cost.num_stages, "tp": tp,
                "layers_per_stage": list(getattr(cost, "layer_counts", ())) or None,
                "policy": sched.policy, "token_budget": sched.token_budget,
                "max_num_seqs": sched.max_num_seqs,
                "per_microbatch_seq_cap": sched.per_microbatch_seq_cap, "num_blocks": num_blocks,
                "workload": str(path), "num_requests": len(wl), "rate": args.rate, "at_once": args.at_once,
                "prefill_scale": args.prefill_scale, "decode_scale": args.decode_scale,
                "overhead_ms": args.overhead_ms, "dispatch_ms": args.dispatch_ms}
    _print_report(res, summary, settings, args.window)
    _write_outputs(res, summary, settings, args.trace, args.json_out)
    return 0


def _fit_profile(spans_path: str, profile_out: str) -> int:
    """Fit a per-stage profile from measured spans, save it and print each stage's fit."""
    from ppserve.sim.cost_model import fit_profile

    prof = fit_profile(_load_spans(spans_path), note=f"fitted from {spans_path}")
    prof.save(profile_out)
    for i, (s, n, rms) in enumerate(zip(prof.cost.stages, prof.num_samples, prof.rms_residual_s,
                                        strict=True)):
        print(f"stage {i}: {s.floor_s * 1e3:.4f} ms + {s.token_s * 1e6:.4f} us/token + "
              f"{s.sample_s * 1e6:.4f} us/decode ({n} microbatches, rms residual {rms * 1e3:.4f} ms)")
    print(f"transfer {prof.transfer_s * 1e3:.4f} ms -> {profile_out}")
    return 0


def _scheduler_config(sc: SchedulerConfig, args: argparse.Namespace) -> SchedulerConfig:
    """The config's scheduler section (every --set scheduler.* applies), with the flags on top."""
    return dataclasses.replace(
        sc,
        policy=args.policy or sc.policy,
        token_budget=args.token_budget or sc.token_budget,
        max_num_seqs=args.max_num_seqs or sc.max_num_seqs,
        per_microbatch_seq_cap=args.seq_cap or sc.per_microbatch_seq_cap,
        # The whole workload may queue at once (--at-once): never reject it for the queue's length.
        max_waiting=max(sc.max_waiting, args.num_requests),
    )


def _cost_model(
    args: argparse.Namespace, cfg: EngineConfig, sched: SchedulerConfig, model: ModelSpec, tp: int,
    block_size: int,
    max_len: int,
) -> tuple[CostModel, int]:
    """The cost model (a fitted profile, or the roofline of model on hardware, its layers split as the
    engine splits them: parallel.partition_mode) and the KV blocks it allows."""
    from ppserve.sim.cost_model import (
        Profile,
        ProfileCostModel,
        RooflineCostModel,
        kv_cache_blocks,
        load_hardware,
    )
    from ppserve.sim.partition import simulated_ranges

    if args.hardware.endswith(".json"):
        profiled = ProfileCostModel(Profile.load(args.hardware))
        if args.pp and args.pp != profiled.num_stages:
            raise ValueError(f"--pp {args.pp} but the profile {args.hardware} has {profiled.num_stages} "
                             "stages")
        # A profile says nothing about memory: unless the config caps it, the KV cache never runs out.
        return profiled, cfg.cache.num_blocks or 1_000_000
    pp = args.pp or cfg.parallel.pipeline_parallel_size
    hw = load_hardware(args.hardware)
    num_blocks = cfg.cache.num_blocks or kv_cache_blocks(model, hw, pp, tp, block_size)
    ranges = simulated_ranges(cfg.parallel, model, hw, pp, tp, sched, max_len, num_blocks, block_size)
    roofline = RooflineCostModel(model, hw, pp, tp, tuple(end - start for start, end in ranges))
    return roofline, num_blocks


def _workload(args: argparse.Namespace, max_len: int) -> tuple[Path, list[WorkloadRequest]]:
    """The trace's requests (a path, or a name in the shared traces), re-timed as asked, clipped to the
    context."""
    from ppserve.sim.workload import (
        at_once,
        clip_to_context,
        default_trace_path,
        read_trace,
        with_poisson_arrivals,
    )

    path = Path(args.workload)
    if not path.exists():
        path = default_trace_path(args.workload)
    wl = read_trace(path, args.num_requests, args.prefill_scale, args.decode_scale,
                    need_arrivals=not (args.rate or args.at_once))
    if args.rate:
        wl = with_poisson_arrivals(wl, args.rate, args.seed)
    if args.at_once:
        wl = at_once(wl)
    return path, clip_to_context(wl, max_len)


def _print_report(res: SimResult, summary: dict[str, Any], settings: dict[str, Any], window: Window) -> None:
    """Settings, the bubble report, throughput and the latency percentiles, as text."""
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(res.bubble_report(window).format_text())
    thr, lat = summary["throughput"], summary["latency"]
    print(f"finished {res.num_finished} requests ({len(res.rejected)} rejected), {res.num_microbatches} "
          f"microbatches, {res.num_preemptions} preemptions in {thr['duration_s']:.3f} s simulated: "
          f"{thr['requests_per_s']:.3f} req/s, {thr['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft_s", "tbt_s", "scheduling_delay_s"):
        st = lat[name]
        if st["count"]:
            print(f"{name[:-2]:>16}: p50 {st['p50'] * 1e3:.2f} ms  p99 {st['p99'] * 1e3:.2f} ms")


def _write_outputs(
    res: SimResult, summary: dict[str, Any], settings: dict[str, Any], trace: str | None, json_out: str | None
) -> None:
    """The Chrome trace (--trace) and the settings plus summary as JSON (--json), where asked for."""
    if trace:
        print(f"trace: {res.save_trace(trace)}")
    if json_out:
        Path(json_out).write_text(json.dumps({"settings": settings, **summary}, indent=2) + "\n")
        print(f"json: {json_out}")
