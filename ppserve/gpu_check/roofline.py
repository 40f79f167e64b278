"""Phase `roofline`: decode and prefill sweeps on the Llama-3-8B-shaped model, against the device's peaks.

Decode: B requests decode together (B = 1 ... 256); each full decode-only microbatch reads every weight
once and each sequence's KV cache, so achieved HBM bandwidth = (weight bytes + KV bytes read) / the
stage's seconds, against the device's peak (4.8 TB/s on an H200). Prefill: one prompt of N tokens in one
microbatch; achieved TFLOP/s = (2 x parameters x N + the causal attention's 2 x layers x heads x
head_dim x N^2) / seconds, against the dense bf16 peak. The stage's seconds are what it reports to the
scheduler (StepResult.stage_seconds: its prepare span on the host plus its compute on CUDA events), so
these figures are lower bounds on the kernels' own. Host overhead per decode step: the engine's wall time
from one collected microbatch to the next, minus the stage's seconds (pp 1: nothing overlaps them).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from ppserve.gpu_check.environment import device_peaks
from ppserve.gpu_check.models import checkpoint, param_count, shape_for
from ppserve.gpu_check.phase import Context


def plan(cuda: bool) -> dict[str, Any]:
    if cuda:
        return dict(batches=[1, 8, 32, 128, 256], prompt=512, tokens=24, prefill=[512, 2048], layers=16)
    return dict(batches=[1, 4], prompt=16, tokens=4, prefill=[32], layers=2)


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


def decode_point(llm: Any, log: StepLog, batch: int, p: dict[str, Any], vocab: int, bytes_w: int,
                 kv_bytes_per_token: int, peak_bw: float | None) -> dict[str, Any]:
    from ppserve.request import SamplingParams

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, vocab) for _ in range(p["prompt"])] for _ in range(batch)]
    log.rows.clear()
    llm.generate(prompts, SamplingParams(max_tokens=p["tokens"], ignore_eos=True))
    rows = log.rows
    full = [i for i, r in enumerate(rows) if r["prefill"] == 0 and r["decode"] == batch and r["seconds"] is not None]
    if not full:
        raise RuntimeError(f"no decode-only microbatch of {batch} sequences (token budget or max_num_seqs too small?)")
    seconds = statistics.median(rows[i]["seconds"] for i in full)
    ctx = statistics.median(rows[i]["context"] for i in full)
    # Step i's wall: from the previous microbatch's collection to its own (pp 1: it ran in between).
    pairs = [(rows[i]["t"] - rows[i - 1]["t"], rows[i]["seconds"]) for i in full if i > 0 and rows[i - 1]["prefill"] == 0]
    bw = (bytes_w + ctx * kv_bytes_per_token) / seconds
    return {"batch": batch, "steps": len(full), "median_step_ms": round(seconds * 1e3, 3),
            "median_context_tokens": ctx, "achieved_GBps": round(bw / 1e9, 3),
            "fraction_of_peak_bw": None if peak_bw is None else round(bw / peak_bw, 3),
            "engine_wall_ms": round(statistics.median(w for w, _ in pairs) * 1e3, 3) if pairs else None,
            "host_overhead_ms": round(statistics.median(w - s for w, s in pairs) * 1e3, 3) if pairs else None}


def prefill_point(llm: Any, log: StepLog, n: int, vocab: int, shape: dict[str, Any], layers: int,
                  peak_flops: float | None) -> dict[str, Any]:
    from ppserve.request import SamplingParams

    rng = random.Random(n)
    prompt = [rng.randrange(3, vocab) for _ in range(n)]
    times = []
    for _ in range(3):  # the first may still compile or grow the allocator
        log.rows.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
        times += [r["seconds"] for r in log.timed() if r["prefill"] == n]
    if not times:
        raise RuntimeError(f"the {n}-token prompt did not run as one microbatch (token budget too small?)")
    seconds = min(times[1:] or times)
    params = param_count(shape, layers)
    heads, d = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    flops = 2 * params["layers"] * n + 2 * params["head"] + 2 * layers * heads * d * n * n
    return {"tokens": n, "seconds": round(seconds, 5), "achieved_TFLOPs": round(flops / seconds / 1e12, 2),
            "fraction_of_peak_flops": None if peak_flops is None else round(flops / seconds / peak_flops, 3)}


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
    max_len = max(max(p["prefill"]), p["prompt"] + p["tokens"]) + 16
    t0 = time.perf_counter()
    # bf16 on the device; a CPU dry run computes in float32 (bf16 GEMMs crawl on CPUs without it).
    with LLM(str(model_dir), dtype="bfloat16" if ctx.cuda else "float32", executor="inproc", max_num_seqs=max(p["batches"]),
             token_budget=max(max(p["prefill"]), max(p["batches"])), max_model_len=max_len,
             cuda_graphs="auto" if ctx.cuda else "eager") as llm:
        start_s = time.perf_counter() - t0
        worker = llm.engine.executor.workers[0]
        log = StepLog()
        llm.engine.core.step_observers.append(log)
        decode = [decode_point(llm, log, b, p, shape["vocab_size"], bytes_w, kv_bytes_per_token, peak_bw)
                  for b in p["batches"]]
        prefill = [prefill_point(llm, log, n, shape["vocab_size"], shape, layers, peak_flops) for n in p["prefill"]]
        memory, backend = worker.memory_log, worker.model.attn_backend.name
        graphs = worker.graphs is not None
        del worker
    return {"model": {**shape, "dtype": "bfloat16", "weights": "random"}, "attention_backend": backend,
            "decode_graphs": graphs, "peaks": {"bf16_flops": peak_flops, "hbm_bytes_per_s": peak_bw},
            "weight_bytes_streamed": bytes_w, "build_s": round(build_s, 1), "start_s": round(start_s, 1),
            "decode": decode, "prefill": prefill, "memory": memory}


def headline(r: dict[str, Any]) -> str:
    best_bw = max(r["decode"], key=lambda x: x["achieved_GBps"])
    best_pf = max(r["prefill"], key=lambda x: x["achieved_TFLOPs"])
    over = [x["host_overhead_ms"] for x in r["decode"] if x["host_overhead_ms"] is not None]
    return (f"decode {best_bw['achieved_GBps']:.0f} GB/s at batch {best_bw['batch']} "
            f"({best_bw['fraction_of_peak_bw']} of peak), prefill {best_pf['achieved_TFLOPs']:.1f} TFLOP/s "
            f"({best_pf['fraction_of_peak_flops']} of peak), host overhead {min(over, default=float('nan')):.2f}-"
            f"{max(over, default=float('nan')):.2f} ms/step")
