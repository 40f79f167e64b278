"""Phase `multi_gpu`: a pipeline over NCCL between GPUs, started and served without Ray.

Runs where the machine has two or more GPUs (else "not run"): pp 2 on the multi-process executor
(engine/mp_executor.py; rank r on GPU r), tp 2 inside each stage where there are four, the token ring
on, the SmolLM2-135M-shaped checkpoint in float32. Its start-up is the NCCL check itself: the links'
first contacts (the ring's included) must complete in the pipeline's order (worker/stage_actor.py
warm_up_links). Then:

- greedy generation (prompts chunked under a small token budget, so later chunks read KV over the
  link's earlier steps) against transformers' `generate` (verdicts.greedy_verdict);
- teacher-forced log-probabilities on the pipeline's own path: each generated position's top-k
  log-probabilities against transformers' over the same prompt and tokens, in one forward, so no
  difference in a greedy path can hide or excuse an error (verdicts.logits_verdict: a log-softmax moves
  every logit by one constant);
- the bubble figures of a short burst, from the stages' own spans, reported (not a verdict: one
  machine's two GPUs are not a cluster's).
The dry run (`--device cpu`) runs the same code on CPU processes over the rendezvous link (NCCL's
strictest rules, comm/rendezvous.py), so it passes only if the links' order is right.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ppserve.gpu_check.correctness import reference
from ppserve.gpu_check.models import checkpoint, shape_for
from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.prompts import PromptSource
from ppserve.gpu_check.verdicts import NEAR_TIE, logits_verdict

TOP_K = 20  # log-probabilities per position compared (SamplingParams.logprobs' limit)


def sizes(cuda: bool) -> dict[str, int]:
    """Prompts x generated tokens (16 x 64 = 1,024 teacher-forced positions on GPUs), the token budget that
    chunks them, and the burst timed for bubbles."""
    if cuda:
        return dict(prompts=16, prompt_min=40, prompt_max=200, tokens=64, budget=128, burst=48,
                    burst_tokens=32)
    return dict(prompts=3, prompt_min=6, prompt_max=30, tokens=6, budget=16, burst=6, burst_tokens=4)


def layout(cuda: bool, gpus: int) -> tuple[int, int] | None:
    """(pp, tp) for this machine: pp 2, with tp 2 inside each stage where four GPUs exist; None: too few."""
    if not cuda:
        return 2, 1
    if gpus >= 4:
        return 2, 2
    return (2, 1) if gpus >= 2 else None


def compare_logprobs(outs: list[Any], ref_logits: list[Any]) -> dict[str, Any]:
    """Our top-k log-probabilities at every generated position against the reference's at the same ids;
    top-1: our (greedy) token against the reference's argmax where its top two are more than NEAR_TIE
    apart."""
    import torch

    errs, scale, agree, clear = [], 0.0, [], []
    for out, logits in zip(outs, ref_logits, strict=True):
        ref = torch.log_softmax(logits, dim=-1)
        top2 = logits.topk(2, dim=-1).values
        for pos, (token, (_, top)) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            ids = torch.tensor([t for t, _ in top], device=ref.device)
            ours = torch.tensor([v for _, v in top], device=ref.device)
            theirs = ref[pos, ids]
            errs.append(float((ours - theirs).abs().max()))
            scale = max(scale, float(theirs.abs().max()))
            agree.append(token == int(logits[pos].argmax()))
            clear.append(float(top2[pos, 0] - top2[pos, 1]) > NEAR_TIE)
    decided = [a for a, c in zip(agree, clear, strict=True) if c]
    return {"positions": len(errs), "top_k": TOP_K, "max_abs_err": max(errs), "max_abs_ref": scale,
            "mean_abs_err": sum(errs) / len(errs), "decided_positions": len(decided),
            "near_tie_fraction": round(1 - len(decided) / len(agree), 4),
            "top1_agreement": sum(agree) / len(agree),
            "top1_agreement_decided": sum(decided) / len(decided) if decided else 1.0}


def run(ctx: Context) -> dict[str, Any]:
    import torch

    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams

    gpus = torch.cuda.device_count() if ctx.cuda else 0
    shape_pp_tp = layout(ctx.cuda, gpus)
    if shape_pp_tp is None:
        return {"not_run": f"needs two or more GPUs, this machine has {gpus}"}
    pp, tp = shape_pp_tp
    shape = shape_for("smollm2", ctx.cuda)
    model_dir = checkpoint(ctx.models_dir, "smollm2", shape, "float32", ctx.device)
    n = sizes(ctx.cuda)
    rng = random.Random(2)
    source = PromptSource(shape["vocab_size"], seed=2)
    prompts = source.draw([rng.randint(n["prompt_min"], n["prompt_max"]) for _ in range(n["prompts"])])
    burst = source.draw([rng.randint(n["prompt_min"], n["prompt_max"]) for _ in range(n["burst"])])
    overrides = ["scheduler.token_ring=true"] + ([] if ctx.cuda else ["parallel.stage_link=rendezvous"])
    with LLM(str(model_dir), dtype="float32", executor="mp", pipeline_parallel_size=pp,
             tensor_parallel_size=tp,
             token_budget=n["budget"], max_model_len=512, max_num_seqs=64, trace=True,
             cuda_graphs="auto" if ctx.cuda else "eager", overrides=overrides) as llm:
        links = "NCCL" if ctx.cuda else "rendezvous (CPU)"
        outs = llm.generate(prompts, SamplingParams(max_tokens=n["tokens"], ignore_eos=True, logprobs=TOP_K))
        t0 = time.perf_counter_ns()  # the engine's clock, the spans' and the work intervals'
        llm.generate(burst, SamplingParams(max_tokens=n["burst_tokens"], ignore_eos=True))
        report = llm.bubble_stats(window=(t0, time.perf_counter_ns()))
        stages = {s.stage: round(s.bubble_fraction, 4) for s in report.stages}
        workers = [{"stage": w.stage, "tp_rank": w.tp_rank, "pid": w.pid}
                   for w in llm.engine.executor.describe()]
    got = [o.token_ids for o in outs]
    seqs = [p + g[:-1] for p, g in zip(prompts, got, strict=True)]  # the pipeline's own path
    logits, greedy = reference(model_dir, torch.float32, ctx.device, seqs, prompts, got, n["tokens"])
    ref_logits = [lg[len(p) - 1:] for lg, p in zip(logits, prompts, strict=True)]
    figures = compare_logprobs(outs, ref_logits)
    ok, reasons = logits_verdict("float32", figures["positions"], figures["max_abs_err"],
                                 figures["max_abs_ref"],
                                 figures["top1_agreement_decided"], need_positions=1000 if ctx.cuda else 1,
                                 near_tie_fraction=figures["near_tie_fraction"])
    spans_ok = sorted(stages) == list(range(pp))
    if not spans_ok:
        reasons.append(f"bubble figures from stages {sorted(stages)}, not all {pp}")
    return {"ok": ok and greedy["ok"] and spans_ok, "pp": pp, "tp": tp, "gpus": gpus, "links": links,
            "executor": "mp", "workers": workers, "model": {**shape, "weights": "random", "dtype": "float32"},
            "teacher_forced": {**figures, "ok": ok, "reasons": reasons}, "greedy": greedy,
            "bubble": {"stages": stages, "mean": round(sum(stages.values()) / max(len(stages), 1), 4),
                       "burst_requests": n["burst"]}}


def headline(r: dict[str, Any]) -> str:
    tf, g = r["teacher_forced"], r["greedy"]
    return (f"pp {r['pp']} tp {r['tp']} over {r['links']}: top-1 {tf['top1_agreement_decided']:.4f} over "
            f"{tf['positions']} pos, max logprob err {tf['max_abs_err']:.2g}, greedy "
            f"{g['tokens_before_first_difference']}, bubble {r['bubble']['mean']:.1%}")
