"""Eight concurrent chat requests through `LLM(pipeline_parallel_size=2)` with the built-in defaults: the
pipeline's bubbles, from the stages' own spans, as a new user would first see them.

Each setting runs in its own `LLM`, one after another in this process, on the same prompts (the demo's
chat prompts), greedy: the defaults, then each `--variant` (a `section.key=value` list) beside them.

    python benchmarks/bench_default_chat.py [--requests 8] [--max-tokens 64]
        [--variant parallel.partition_mode=even] [--out results/bench_default_chat.json]
"""

from __future__ import annotations

import argparse
import re
import time

from ppserve import LLM, SamplingParams
from ppserve.bench.report import write_json
from ppserve.server.demo import DEMO_PROMPTS


def run(overrides: list[str], num_requests: int, max_tokens: int) -> dict[str, object]:
    convs = [[{"role": "user", "content": DEMO_PROMPTS[i % len(DEMO_PROMPTS)]}] for i in range(num_requests)]
    t0 = time.perf_counter()
    with LLM(pipeline_parallel_size=2, overrides=overrides) as llm:
        startup_s = time.perf_counter() - t0
        layout = [[d.layer_start, d.layer_end] for d in llm.engine.executor.describe()]
        t1 = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        wall_s = time.perf_counter() - t1
        rep = llm.bubble_stats(window="active")
    ntok = sum(len(o.token_ids) for o in outs)
    return {"overrides": overrides, "layers": layout, "startup_s": startup_s, "wall_s": wall_s,
            "output_tokens": ntok, "output_tokens_per_s": ntok / wall_s,
            "mean_bubble_fraction": rep.mean_bubble_fraction,
            "stage_bubble_fractions": [s.bubble_fraction for s in rep.stages]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="comma-separated section.key=value overrides run beside the defaults (repeatable; a list "
        "value in brackets: parallel.layer_partition=[18,12])",
    )
    ap.add_argument("--out", default="results/bench_default_chat.json")
    args = ap.parse_args()
    rows = [run([], args.requests, args.max_tokens)]
    # commas inside [...] belong to a list value (parallel.layer_partition=[18,12])
    rows += [run(re.split(r",(?![^\[]*\])", v), args.requests, args.max_tokens) for v in args.variant]
    print("| setting | layers | mean bubble | per stage | output tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        stages = " / ".join(f"{100 * b:.1f}%" for b in r["stage_bubble_fractions"])  # type: ignore[attr-defined]
        print(f"| {', '.join(r['overrides']) or 'defaults'} | {r['layers']} | "  # type: ignore[arg-type]
              f"{100 * r['mean_bubble_fraction']:.1f}% | {stages} | {r['output_tokens_per_s']:.1f} |")  # type: ignore[operator]
    write_json(args.out, {"requests": args.requests, "max_tokens": args.max_tokens, "runs": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
