"""The TBT target (`scheduler.tbt_slo_ms`) on a real Ray pipeline: does the p99 time between tokens
stay under it?

    python benchmarks/bench_tbt_target.py --model /path/to/model --pp 2 --target-ms 250 --out tbt.json

Builds one pipeline with the adaptive token budget, generates a fixed workload (prompts of growing length,
a fixed number of new tokens each, eos ignored), then prints the time between tokens (p50, p99, max)
against the target, the controller's final token budget and its cost model's state, and writes them as
JSON. Prompts are token ids, so any model works, including a tiny random one without a tokenizer.

Nothing is asserted here: tests/integration/test_pipeline.py runs `run_tbt` on a tiny model and checks
only what does not depend on the clock (the controller's cost model calibrates from the stages' own
times); whether the p99 meets the target is this script's figure, on the machine it runs on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def workload(num_requests: int = 16, vocab: int = 256) -> list[list[int]]:
    """num_requests prompts of 40, 49, 58, ... tokens (deterministic ids in [3, vocab))."""
    return [[(7 * i + 3 * j) % (vocab - 6) + 3 for j in range(40 + 9 * i)] for i in range(num_requests)]


def _quantile(xs: list[float], q: float) -> float:
    return xs[int(q * (len(xs) - 1))] if xs else 0.0


def run_tbt(
    model: str,
    pp: int = 2,
    target_ms: float = 250.0,
    token_budget: int = 64,
    max_token_budget: int = 256,
    num_requests: int = 16,
    max_tokens: int = 40,
    block_size: int = 4,
    max_num_seqs: int = 16,
    dtype: str = "float32",
) -> dict[str, Any]:
    """One run of the workload under the TBT target; its figures (times in seconds)."""
    from ppserve import LLM, SamplingParams

    with LLM(
        str(model),
        dtype=dtype,
        pipeline_parallel_size=pp,
        token_budget=token_budget,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        overrides=[f"scheduler.tbt_slo_ms={target_ms}", f"scheduler.max_token_budget={max_token_budget}"],
    ) as llm:
        outs = llm.generate(workload(num_requests), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        mode = llm.engine.scheduler.budget_mode
    gaps = sorted(b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:], strict=False))
    cost = mode.cost
    return {
        "model": str(model),
        "pp": pp,
        "target_s": target_ms * 1e-3,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "start_token_budget": token_budget,
        "max_token_budget": max_token_budget,
        "tbt_p50_s": _quantile(gaps, 0.5),
        "tbt_p99_s": _quantile(gaps, 0.99),
        "tbt_max_s": gaps[-1] if gaps else 0.0,
        "num_gaps": len(gaps),
        "final_token_budget": mode.token_budget,
        "cost_calibrated": bool(cost.calibrated),
        "cost_num_samples": cost.fits[-1].num_samples,
        "cost_per_stage": cost.current.to_json(),
        "cost_prior": [f.prior.to_json() for f in cost.fits],
        "tokens": [list(o.token_ids) for o in outs],
    }


def report(fig: dict[str, Any]) -> str:
    met = "met" if fig["tbt_p99_s"] <= fig["target_s"] else "MISSED"
    return (
        f"TBT target {fig['target_s'] * 1e3:.0f} ms at pp={fig['pp']}: p50 {fig['tbt_p50_s'] * 1e3:.1f} ms, "
        f"p99 {fig['tbt_p99_s'] * 1e3:.1f} ms ({met}), max {fig['tbt_max_s'] * 1e3:.1f} ms over "
        f"{fig['num_gaps']} gaps; token budget {fig['start_token_budget']} -> {fig['final_token_budget']}; "
        f"cost model {'calibrated' if fig['cost_calibrated'] else 'not calibrated'} from "
        f"{fig['cost_num_samples']} microbatches"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--target-ms", type=float, default=250.0)
    p.add_argument("--token-budget", type=int, default=64, help="the controller's starting budget")
    p.add_argument("--max-token-budget", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default="tbt_target.json")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from ppserve.model.loader import resolve_model

        model = str(resolve_model(None))
    fig = run_tbt(model, args.pp, args.target_ms, args.token_budget, args.max_token_budget, args.num_requests,
                  args.max_tokens, dtype=args.dtype)
    print(report(fig))
    Path(args.out).write_text(json.dumps({**fig, "args": vars(args)}, indent=2))
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
