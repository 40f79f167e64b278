"""Phase `roofline`: decode and prefill sweeps on the Llama-3-8B-shaped model, against the device's peaks.

Decode: B requests decode together (B = 1 ... 256); each full decode-only microbatch reads every weight
once and each sequence's KV cache, so achieved HBM bandwidth = (weight bytes + KV bytes read) / the
stage's seconds, against the device's peak (4.8 TB/s on an H200). Prefill: one prompt of N tokens in one
microbatch; achieved TFLOP/s = (2 x parameters x N + the causal attention's 2 x layers x heads x
head_dim x N^2) / seconds, against the dense bf16 peak. The stage's seconds are what it reports to the
scheduler (StepResult.stage_seconds: its prepare span on the host plus its compute on CUDA events), so
these figures are lower bounds on the kernels' own. Host overhead per decode step: the engine's wall time
from one collected microbatch to the next, minus the stage's seconds (pp 1: nothing overlaps them).

A decode point's requests run long enough that all B still decode after the last prompt is in
(`decode_max_tokens`: B prompts under the budget take up to B x prompt / budget microbatches to prefill).
Every run's prompts are its own (prompts.py): with the prefix cache on, as served, a repeated prompt
would prefill one block's remainder and the TFLOP/s figure would time nothing. A point that fails keeps
its error beside the other points' figures, and fails the phase.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ppserve.gpu_check.environment import device_peaks
from ppserve.gpu_check.models import checkpoint, param_count, shape_for
from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.prompts import PromptSource


def plan(cuda: bool) -> dict[str, Any]:
    """The sweeps: B requests of `prompt` tokens for each B in `batches`, timed over at least
    `decode_steps` decode-only microbatches of all B; `repeats` prompts of each length in `prefill`."""
    if cuda:
        return dict(batches=[1, 8, 32, 128, 256], prompt=512, decode_steps=16, prefill=[512, 2048], repeats=3,
                    layers=16)
    return dict(batches=[1, 4], prompt=16, decode_steps=3, prefill=[32], repeats=3, layers=2)


def token_budget(p: dict[str, Any]) -> int:
    """The microbatch token budget: the longest prefill runs as one microbatch, the largest batch decodes in
    one."""
    return int(max(max(p["prefill"]), max(p["batches"])))


def prefill_steps(batch: int, prompt: int, budget: int) -> int:
    """At most how many microbatches the engine (pp 1, decodes first, prompt chunks filling the rest of the
    budget) takes to prefill `batch` prompts of `prompt` tokens given at once: until the last prompt is
    in, fewer than `batch` requests decode beside the chunks, so each microbatch carries at least
    budget - (batch - 1) prompt tokens."""
    room = budget - (batch - 1)
    if room < 1:
        raise ValueError(f"a {budget}-token budget leaves no prompt tokens beside {batch - 1} decodes")
    return -(-batch * prompt // room)


def decode_max_tokens(batch: int, prompt: int, budget: int, decode_steps: int) -> int:
    """max_tokens of a decode point's requests. A request's first token comes with its last prompt chunk
    (the first requests' in the first microbatch), so all `batch` requests decode together from the
    microbatch after the last prompt is in until the first ones reach max_tokens: that many microbatches
    past the prefill, `decode_steps` of them timed and one more whose time would come back with a step
    that never runs (stage times are read a step late)."""
    return prefill_steps(batch, prompt, budget) + decode_steps + 1


class StepLog:
    """Every microbatch the engine collects (a step observer): its shape, wall time and seconds. The
    seconds come with a later result when the stages read them late (`timed_step_id`): they go to the
    row of the step they measure, and a row whose time has not come back has None."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, out: Any, result: Any) -> None:
        context = sum(c + n for c, n in zip(out.num_computed_tokens, out.num_scheduled_tokens, strict=True))
        self.rows.append({"step": out.step_id, "t": time.perf_counter(), "prefill": out.num_prefill_tokens,
                          "decode": out.num_decode_tokens, "context": context, "seconds": None})
        if result.timed_step_id is not None:
            for row in reversed(self.rows):
                if row["step"] == result.timed_step_id:
                    row["seconds"] = sum(result.stage_seconds)
                    break

    def timed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["seconds"] is not None]


def decode_point(llm: Any, log: StepLog, prompts: list[list[int]], max_tokens: int, bytes_w: int,
                 kv_bytes_per_token: int, peak_bw: float | None) -> dict[str, Any]:
    from ppserve.request import SamplingParams

    batch = len(prompts)
    log.rows.clear()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    rows = log.rows
    full = [i for i, r in enumerate(rows) if r["prefill"] == 0 and r["decode"] == batch
            and r["seconds"] is not None]
    if not full:
        raise RuntimeError(f"no decode-only microbatch of {batch} sequences (token budget or max_num_seqs "
                           "too small?)")
    seconds = statistics.median(rows[i]["seconds"] for i in full)
    ctx = statistics.median(rows[i]["context"] for i in full)
    # Step i's wall: from the previous microbatch's collection to its own (pp 1: it ran in between).
    pairs = [(rows[i]["t"] - rows[i - 1]["t"], rows[i]["seconds"]) for i in full if i > 0
             and rows[i - 1]["prefill"] == 0]
    bw = (bytes_w + ctx * kv_bytes_per_token) / seconds
    return {"steps": len(full), "max_tokens": max_tokens, "cached_prompt_tokens": cached_tokens(outs),
            "median_step_ms": round(seconds * 1e3, 3),
            "median_context_tokens": ctx, "achieved_GBps": round(bw / 1e9, 3),
            "fraction_of_peak_bw": None if peak_bw is None else round(bw / peak_bw, 3),
            "engine_wall_ms": round(statistics.median(w for w, _ in pairs) * 1e3, 3) if pairs else None,
            "host_overhead_ms": round(statistics.median(w - s for w, s in pairs) * 1e3, 3) if pairs else None}


def prefill_point(llm: Any, log: StepLog, prompts: list[list[int]], shape: dict[str, Any], layers: int,
                  peak_flops: float | None) -> dict[str, Any]:
    """Runs each of `prompts` (all one length) once and keeps the fastest after the first (which may still
    compile or grow the allocator); no prompt repeats another, so each run computes all of its own."""
    from ppserve.request import SamplingParams

    n = len(prompts[0])
    times, cached = [], 0
    for prompt in prompts:
        log.rows.clear()
        cached += cached_tokens(llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True)))
        times += [r["seconds"] for r in log.timed() if r["prefill"] == n]
    if not times:
        raise RuntimeError(f"the {n}-token prompt did not run as one microbatch (token budget too small?)")
    seconds = min(times[1:] or times)
    params = param_count(shape, layers)
    heads, d = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    flops = 2 * params["layers"] * n + 2 * params["head"] + 2 * layers * heads * d * n * n
    return {"runs": len(times), "cached_prompt_tokens": cached, "seconds": round(seconds, 5),
            "achieved_TFLOPs": round(flops / seconds / 1e12, 2),
            "fraction_of_peak_flops": None if peak_flops is None else round(flops / seconds / peak_flops, 3)}


def cached_tokens(outs: list[Any]) -> int:
    """Prompt tokens the prefix cache supplied to these outputs (0 when every run computed its prompt)."""
    return sum(o.num_cached_tokens for o in outs)


def measured(llm: Any, label: dict[str, Any], measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One sweep point: its label and figures, or its label and error. A point that fails (no microbatch
    of its shape, out of memory) loses its own figures only; the requests it left behind are cancelled,
    so the next point starts on an idle engine."""
    try:
        return {**label, **measure()}
    except Exception as e:
        error = {**label, "error": f"{type(e).__name__}: {e}"}
    try:
        for rid in llm.engine.unfinished_ids():
            llm.engine.cancel(rid)
    except Exception as e:  # the engine itself is gone: the later points will say so with their own errors
        error["cleanup_error"] = f"{type(e).__name__}: {e}"
    return error


def run(ctx: Context) -> dict[str, Any]:
    import torch

    from ppserve.engine.llm import LLM

    p = plan(ctx.cuda)
    layers = ctx.options.get("roofline_layers") or p["layers"]
    shape = {**shape_for("llama3_8b", ctx.cuda), "num_hidden_layers": layers}
    t0 = time.perf_counter()
    model_dir = checkpoint(ctx.models_dir, "llama3_8b", shape, "bfloat16", ctx.device)
    build_s = time.perf_counter() - t0
    peaks = device_peaks(torch.cuda.get_device_name(0)) if ctx.cuda else None
    peak_flops, peak_bw = peaks if peaks else (None, None)
    params = param_count(shape, layers)
    bytes_w = 2 * (params["layers"] + params["head"])  # bf16; the embedding is gathered, not streamed
    d = shape["hidden_size"] // shape["num_attention_heads"]
    kv_bytes_per_token = 2 * layers * shape["num_key_value_heads"] * d * 2
    budget = token_budget(p)
    max_tokens = {b: decode_max_tokens(b, p["prompt"], budget, p["decode_steps"]) for b in p["batches"]}
    max_len = max(max(p["prefill"]), p["prompt"] + max(max_tokens.values())) + 16
    source = PromptSource(shape["vocab_size"], seed=0)  # every run's prompts its own: none is cached
    t0 = time.perf_counter()
    # bf16 on the device; a CPU dry run computes in float32 (bf16 GEMMs crawl on CPUs without it).
    with LLM(str(model_dir), dtype="bfloat16" if ctx.cuda else "float32", executor="inproc",
             max_num_seqs=max(p["batches"]),
             token_budget=budget, max_model_len=max_len, cuda_graphs="auto" if ctx.cuda else "eager") as llm:
        start_s = time.perf_counter() - t0
        worker = llm.engine.executor.workers[0]
        log = StepLog()
        llm.engine.core.step_observers.append(log)
        decode = []
        for b in p["batches"]:
            prompts = source.draw([p["prompt"]] * b)
            decode.append(measured(llm, {"batch": b},
                                   partial(decode_point, llm, log, prompts, max_tokens[b], bytes_w,
                                                             kv_bytes_per_token, peak_bw)))
        prefill = []
        for n in p["prefill"]:
            prompts = source.draw([n] * p["repeats"])
            prefill.append(measured(llm, {"tokens": n},
                                    partial(prefill_point, llm, log, prompts, shape, layers,
                                                               peak_flops)))
        memory, backend = worker.memory_log, worker.model.attn_backend.name
        graphs = worker.graphs is not None
        del worker
    failed = [x for x in decode + prefill if "error" in x]
    return {"ok": not failed, "model": {**shape, "dtype": "bfloat16", "weights": "random"},
            "attention_backend": backend, "token_budget": budget,
            "decode_graphs": graphs, "peaks": {"bf16_flops": peak_flops, "hbm_bytes_per_s": peak_bw},
            "weight_bytes_streamed": bytes_w, "build_s": round(build_s, 1), "start_s": round(start_s, 1),
            "decode": decode, "prefill": prefill, "memory": memory}


def headline(r: dict[str, Any]) -> str:
    decode = [x for x in r["decode"] if "error" not in x]
    prefill = [x for x in r["prefill"] if "error" not in x]
    parts = []
    if decode:
        best_bw = max(decode, key=lambda x: x["achieved_GBps"])
        over = [x["host_overhead_ms"] for x in decode if x["host_overhead_ms"] is not None]
        parts.append(f"decode {best_bw['achieved_GBps']:.0f} GB/s at batch {best_bw['batch']} "
                     f"({best_bw['fraction_of_peak_bw']} of peak)")
    if prefill:
        best_pf = max(prefill, key=lambda x: x["achieved_TFLOPs"])
        parts.append(f"prefill {best_pf['achieved_TFLOPs']:.1f} TFLOP/s "
                     f"({best_pf['fraction_of_peak_flops']} of peak)")
    if decode:
        parts.append("host overhead "
                     f"{min(over, default=float('nan')):.2f}-{max(over, default=float('nan')):.2f} ms/step")
    failed = [f"batch {x['batch']}" for x in r["decode"] if "error" in x]
    failed += [f"prefill {x['tokens']}" for x in r["prefill"] if "error" in x]
    if failed:
        parts.append("FAILED: " + ", ".join(failed))
    return ", ".join(parts)
