"""Phases `correctness_pp1` and `correctness_pp2`: the in-process executor against transformers, same device.

The SmolLM2-135M-shaped checkpoint (float32 on disk, as the default model's GGUF conversion) is served
twice, with `dtype: float32` and with `dtype: auto` (bf16 on a GPU: the check records what auto chose).
Each time:

- teacher-forced logits: random token sequences go through the executor's own stages and KV caches
  (a first prefill chunk, later chunks over cached context, then single-token decodes), and every
  position's logits are compared with transformers' over the whole sequence (verdicts.logits_verdict);
- greedy generation through `LLM.generate` (CUDA graphs as served) against transformers' `generate`
  (verdicts.greedy_verdict).
"""

from __future__ import annotations

import random
from typing import Any

from ppserve.gpu_check.models import checkpoint, shape_for
from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.verdicts import NEAR_TIE, greedy_verdict, logits_verdict


def sizes(cuda: bool) -> dict[str, int]:
    """Sequences x length for the teacher-forced part (8 x 128 = 1,024 positions on a GPU), greedy prompts
    and tokens, and the chunks the sequences are fed in."""
    if cuda:
        return dict(seqs=8, length=128, first_chunk=45, chunk=32, decodes=8, prompts=8, prompt_len=24,
                    tokens=24)
    return dict(seqs=2, length=40, first_chunk=13, chunk=8, decodes=4, prompts=2, prompt_len=8, tokens=6)


def chunks(length: int, first: int, chunk: int, decodes: int) -> list[tuple[int, int]]:
    """[start, end) pieces of a sequence: a first prefill chunk, chunks over cached context, decodes."""
    bounds = [0, min(first, length)]
    while bounds[-1] < length - decodes:
        bounds.append(min(bounds[-1] + chunk, length - decodes))
    bounds.extend(range(bounds[-1] + 1, length + 1))
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def teacher_forced(workers: list[Any], tokens: list[int], pieces: list[tuple[int, int]]) -> Any:
    """[len, vocab] float32 logits of one sequence through the stages (each with its own KV cache, the
    executor's), fed piece by piece; block ids from 0 (the engine is idle, its cache free)."""
    import torch

    from ppserve.model.attention import AttentionMetadata

    bs, device = workers[0].block_size, workers[0].device
    table = list(range(-(-len(tokens) // bs)))
    out = []
    with torch.inference_mode():
        for a, b in pieces:
            meta = AttentionMetadata.build([b - a], [b], [table], bs, device)
            positions = torch.arange(a, b, device=device)
            hidden = torch.tensor(tokens[a:b], device=device)
            for w in workers:
                first = w.model.is_first
                hidden = w.model(hidden if first else None, None if first else hidden, positions, w.kv_caches,
                                 meta)
            out.append(workers[-1].model.compute_logits(hidden).float())
    return torch.cat(out)


def decided(logits: Any) -> Any:
    """[positions] bool: where the top two of [positions, vocab] `logits` are more than NEAR_TIE apart."""
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]) > NEAR_TIE


def near_tie_fraction(logits: Any) -> float:
    """The share of positions whose top two logits are within NEAR_TIE: where top-1 tells nothing."""
    return 1.0 - float(decided(logits).float().mean())


def compare_logits(ours: list[Any], refs: list[Any]) -> dict[str, Any]:
    import torch

    got, want = torch.cat(ours), torch.cat(refs)
    clear = decided(want)
    agree = got.argmax(-1) == want.argmax(-1)
    return {"positions": int(want.shape[0]), "max_abs_err": float((got - want).abs().max()),
            "mean_abs_err": float((got - want).abs().mean()), "max_abs_ref": float(want.abs().max()),
            "top1_agreement": float(agree.float().mean()), "decided_positions": int(clear.sum()),
            "near_tie_fraction": round(near_tie_fraction(want), 4),
            "top1_agreement_decided": float(agree[clear].float().mean()) if clear.any() else 1.0}


def reference(model_dir: Any, dtype: Any, device: str, seqs: list[list[int]], prompts: list[list[int]],
              got: list[list[int]], num_tokens: int) -> tuple[list[Any], dict[str, Any]]:
    """transformers on the same device and dtype: logits over each whole sequence, and greedy generate
    with the margin at each early difference from `got`."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    firsts, margins = [], []
    with torch.inference_mode():
        logits = [model(torch.tensor([s], device=device)).logits[0].float() for s in seqs]
        for ids, g in zip(prompts, got, strict=True):
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=num_tokens,
                               min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            ref = y[0, len(ids):].tolist()
            j = next((i for i, (a, b) in enumerate(zip(g, ref, strict=False)) if a != b),
                     min(len(g), len(ref)))
            firsts.append(j)
            margin = None
            if j < min(len(g), len(ref)):
                last = model(torch.tensor([ids + ref[:j]], device=device)).logits[0, -1].float()
                margin = round(float(last[ref[j]] - last[g[j]]), 4)
            margins.append(margin)
    del model
    verdict = greedy_verdict(firsts, margins, num_tokens)
    return logits, {"ok": verdict.ok, "tokens_before_first_difference": firsts, "margins": margins,
                    "failures": verdict.failures}


def one_dtype(ctx: Context, model_dir: Any, pp: int, dtype_name: str, n: dict[str, int]) -> dict[str, Any]:
    import torch

    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams

    rng = random.Random(pp)
    vocab = shape_for("smollm2", ctx.cuda)["vocab_size"]
    seqs = [[rng.randrange(3, vocab) for _ in range(n["length"])] for _ in range(n["seqs"])]
    prompts = [[rng.randrange(3, vocab) for _ in range(n["prompt_len"])] for _ in range(n["prompts"])]
    pieces = chunks(n["length"], n["first_chunk"], n["chunk"], n["decodes"])
    with LLM(str(model_dir), dtype=dtype_name, executor="inproc", pipeline_parallel_size=pp,
             cuda_graphs="auto" if ctx.cuda else "eager", max_model_len=max(n["length"], 256),
             max_num_seqs=16) as llm:
        workers = llm.engine.executor.workers
        dtype = workers[0].dtype
        backend = workers[0].model.attn_backend.name
        ours = [teacher_forced(workers, s, pieces) for s in seqs]
        outs = llm.generate(prompts, SamplingParams(max_tokens=n["tokens"], ignore_eos=True))
        got = [o.token_ids for o in outs]
        del workers
    refs, greedy = reference(model_dir, dtype, ctx.device, seqs, prompts, got, n["tokens"])
    figures = compare_logits(ours, refs)
    name = str(dtype).removeprefix("torch.")
    ok, reasons = logits_verdict(name, figures["positions"], figures["max_abs_err"], figures["max_abs_ref"],
                                 figures["top1_agreement_decided"], need_positions=1000 if ctx.cuda else 1,
                                 near_tie_fraction=figures["near_tie_fraction"])
    if ctx.cuda:
        torch.cuda.empty_cache()
    return {"ok": ok and greedy["ok"], "dtype_setting": dtype_name, "dtype": name,
            "attention_backend": backend,
            "teacher_forced": {**figures, "ok": ok, "reasons": reasons}, "greedy": greedy}


def run(ctx: Context) -> dict[str, Any]:
    pp = int(ctx.name.removeprefix("correctness_pp"))
    shape = shape_for("smollm2", ctx.cuda)
    model_dir = checkpoint(ctx.models_dir, "smollm2", shape, "float32", ctx.device)
    n = sizes(ctx.cuda)
    runs = {d: one_dtype(ctx, model_dir, pp, d, n) for d in ("float32", "auto")}
    auto_dtype = runs["auto"]["dtype"]
    if ctx.cuda and auto_dtype != "bfloat16":
        runs["auto"]["ok"] = False
        runs["auto"]["reasons"] = [f"dtype auto served the float32 checkpoint in {auto_dtype}, not bfloat16"]
    return {"ok": all(r["ok"] for r in runs.values()), "pp": pp, "model": {**shape, "weights": "random"},
            "runs": runs}


def headline(r: dict[str, Any]) -> str:
    parts = []
    for run in r["runs"].values():
        tf = run["teacher_forced"]
        parts.append(f"{run['dtype']}: top-1 {tf['top1_agreement_decided']:.4f} over {tf['positions']} pos "
                     f"({tf['near_tie_fraction']:.0%} near ties), max err {tf['max_abs_err']:.2g}, "
                     f"greedy {run['greedy']['tokens_before_first_difference']}")
    return f"pp {r['pp']}: " + "; ".join(parts)
