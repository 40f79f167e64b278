"""What sampling costs: the sampler alone on [rows, vocab] logits, and its share of the engine's steps.

    python benchmarks/bench_sampler.py                      # both parts, JSON at results/sampler.json
    python benchmarks/bench_sampler.py --skip-engine        # the sampler alone
    git show 303801f:ppserve/worker/sampler.py > /tmp/old_sampler.py
    python benchmarks/bench_sampler.py --skip-engine --threads 1 --compare-with /tmp/old_sampler.py

Part 1 times `sample()` on 64 rows of a 49,152-token vocabulary (the default model's) for each kind of
request (best of --repeats, every kind in one run; with --compare-with, another sampler.py interleaved
call by call). Part 2 runs the default model offline on 64
prompts of 256 tokens, 32 sampled outputs each, and measures the time inside `sample()` against the wall
time of every engine step (budget 512): the share of a step that sampling takes, top-k/top-p unset, top-p
alone (what an OpenAI client can send: its API has no top-k) and both set, side by side.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

KINDS: dict[str, dict[str, Any]] = {
    "greedy": {},
    "temperature 1": {"temperature": 1.0},
    "temperature 1, seeded": {"temperature": 1.0, "seed": 7},
    "top_k 50": {"temperature": 1.0, "top_k": 50},
    "top_p 0.9": {"temperature": 1.0, "top_p": 0.9},
    "top_k 50 + top_p 0.9": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
}


def load_sampler(path: str) -> Any:
    """Another version of worker/sampler.py (e.g. `git show REV:ppserve/worker/sampler.py > old.py`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("other_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sampler_alone(
    rows: int, vocab: int, repeats: int, other: str | None
) -> dict[str, dict[str, float | None]]:
    """Best-of-`repeats` ms per kind; with `other`, that sampler too, the two interleaved call by call."""
    from ppserve.request import SamplingParams
    from ppserve.worker import sampler

    versions = {"this": sampler.sample, **({"other": load_sampler(other).sample} if other else {})}
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    out: dict[str, dict[str, float | None]] = {name: {} for name in versions}
    for label, kw in KINDS.items():
        try:
            params = [SamplingParams(**kw)] * rows
        except (TypeError, ValueError):  # older code without this field
            continue
        best = dict.fromkeys(versions, float("inf"))
        for _ in range(repeats + 1):  # the first round warms up and counts too: best-of drops it
            for name, sample in versions.items():
                t0 = time.perf_counter()
                sample(logits, params, list(range(rows)))
                best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        for name in versions:
            out[name][label] = best[name]
        print(f"  {label:24s} " + "  ".join(f"{name} {best[name]:8.2f} ms" for name in versions), flush=True)
    return out


def share_of_step(
    kind: dict[str, Any], num_prompts: int, prompt_len: int, output_len: int
) -> dict[str, float]:
    from ppserve import LLM, SamplingParams
    from ppserve.worker import stage_worker

    spent = [0.0]
    original = stage_worker.sample

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0

    stage_worker.sample = timed
    try:
        with LLM(None, token_budget=512, trace=False) as llm:
            vocab = llm.engine.arch.vocab_size
            rng = random.Random(0)
            prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
            llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True, **kind))
            eng = llm.engine
            for p in prompts:
                eng.add_request(p, SamplingParams(max_tokens=output_len, ignore_eos=True, **kind))
            spent[0], steps, step_s = 0.0, 0, 0.0
            while eng.has_unfinished:
                t0 = time.perf_counter()
                eng.step()
                steps, step_s = steps + 1, step_s + time.perf_counter() - t0
    finally:
        stage_worker.sample = original
    return {
        "steps": steps,
        "mean_step_ms": step_s / steps * 1e3,
        "sampling_ms_per_step": spent[0] / steps * 1e3,
        "sampling_share": spent[0] / step_s,
        "output_tok_s": num_prompts * output_len / step_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49_152)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--compare-with", help="another sampler.py to time beside this one, interleaved")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "results" / "sampler.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler alone: {args.rows} rows x {args.vocab} tokens, best of {args.repeats} "
          f"({torch.get_num_threads()} threads)")
    report: dict[str, Any] = {
        "rows": args.rows,
        "vocab": args.vocab,
        "threads": torch.get_num_threads(),
        "alone_ms": sampler_alone(args.rows, args.vocab, args.repeats, args.compare_with),
    }
    if not args.skip_engine:
        report["engine"] = {}
        for label in ("temperature 1", "top_p 0.9", "top_k 50 + top_p 0.9"):
            r = share_of_step(KINDS[label], args.num_prompts, args.prompt_len, args.output_len)
            report["engine"][label] = r
            print(f"  engine, {label:22s}: {r['steps']} steps of {r['mean_step_ms']:.0f} ms, sampling "
                  f"{r['sampling_ms_per_step']:.1f} ms a step = {100 * r['sampling_share']:.1f} %, "
                  f"{r['output_tok_s']:.1f} output tok/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
