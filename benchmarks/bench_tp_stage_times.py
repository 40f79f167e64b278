"""How far TP rank 0's step time is from its stage's slowest rank's: the figure behind reporting rank 0's.

A stage's seconds for a step (the scheduler's cost model learns from them) are its prepare span plus its
layers' compute. At tp > 1 they are TP rank 0's alone (worker/stage_times.py): rank 0 broadcasts the
step's input to its group and the layers end in an all-reduce, which completes on rank 0 only when the
slowest rank reaches it, so rank 0's span should already cover the slowest rank's. This measures that on
a real Ray pipeline (gloo on CPU, pp 2 x tp 2, a small random Llama), from the spans every rank records:
per microbatch of stage 0, (slowest rank's prepare + compute - rank 0's) / slowest rank's, and how much
later than rank 0 the last rank's compute ends. Stage 0 only: the last stage's compute span on rank 0
also holds its sampling, which the reported figure leaves out.

    python benchmarks/bench_tp_stage_times.py [--requests 8] [--tokens 32]
        [--out results/bench_tp_stage_times.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from ppserve import LLM, SamplingParams
from ppserve.bench.report import write_json
from ppserve.gpu_check.models import build_random_llama

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=4096, rope_theta=10000.0, max_position_embeddings=1024,
             tie_word_embeddings=False)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def measure(model_dir: Path, requests: int, tokens: int) -> dict[str, Any]:
    prompts = [[3 + (7 * i + j) % 4000 for j in range(16 + 8 * i)] for i in range(requests)]
    with LLM(
        str(model_dir),
        dtype="float32",
        pipeline_parallel_size=2,
        tensor_parallel_size=2,
        token_budget=64,
        block_size=16,
        overrides=["parallel.num_threads=1"],
    ) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        llm.engine.collect_spans()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        spans = llm.engine.collect_spans()
    busy: dict[tuple[int, int], float] = defaultdict(float)  # (step, tp rank) -> prepare + compute ns
    end: dict[tuple[int, int], int] = {}
    for s in spans:
        if s.stage == 0 and s.kind in ("prepare", "compute"):
            busy[(s.step_id, s.tp_rank)] += s.end_ns - s.start_ns
            if s.kind == "compute":
                end[(s.step_id, s.tp_rank)] = s.end_ns
    steps = sorted({step for step, rank in busy if rank == 0 and (step, 1) in busy})
    under = [
        (max(busy[(j, 0)], busy[(j, 1)]) - busy[(j, 0)]) / max(busy[(j, 0)], busy[(j, 1)]) for j in steps
    ]
    later_ms = [max(0, end[(j, 1)] - end[(j, 0)]) / 1e6 for j in steps if (j, 0) in end and (j, 1) in end]
    slower = sum(busy[(j, 1)] > busy[(j, 0)] for j in steps)
    return {
        "microbatches": len(steps),
        "rank1_slower_in": slower,
        "rank0_under_slowest_median": round(statistics.median(under), 4),
        "rank0_under_slowest_p90": round(percentile(under, 90), 4),
        "rank0_under_slowest_max": round(max(under), 4),
        "last_rank_ends_later_ms_median": round(statistics.median(later_ms), 4),
        "last_rank_ends_later_ms_p90": round(percentile(later_ms, 90), 4),
        "stage_ms_median": round(statistics.median(max(busy[(j, 0)], busy[(j, 1)]) for j in steps) / 1e6, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default="results/bench_tp_stage_times.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppserve-tp-") as tmp:
        model_dir = build_random_llama(Path(tmp) / "small", SHAPE, "float32", "cpu")
        r = measure(model_dir, args.requests, args.tokens)
    load = os.getloadavg()[0]
    print(f"stage 0 of pp 2 x tp 2, {r['microbatches']} microbatches (load average {load:.1f}); stage step "
          f"{r['stage_ms_median']:.3f} ms median; rank 1 slower in {r['rank1_slower_in']}")
    print(
        f"rank 0's prepare + compute under the slowest rank's: median {r['rank0_under_slowest_median']:.2%}, "
        f"p90 {r['rank0_under_slowest_p90']:.2%}, max {r['rank0_under_slowest_max']:.2%}"
    )
    print(f"rank 1's compute ends after rank 0's by: median {r['last_rank_ends_later_ms_median']:.3f} ms, "
          f"p90 {r['last_rank_ends_later_ms_p90']:.3f} ms")
    write_json(args.out, {**r, "load_average": load, "requests": args.requests, "tokens": args.tokens})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
