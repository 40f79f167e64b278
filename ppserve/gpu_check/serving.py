"""Phase `serving`: Poisson arrivals through the engine, as a server would drive it.

The SmolLM2-135M-shaped checkpoint at `dtype: auto`, pp 2 on the in-process executor (both stages on the
one GPU, one after another: the bubble figure is the pipeline's bookkeeping on real device times, not a
two-GPU pipeline), replayed by the benchmark harness: TTFT, TBT, throughput and the bubble report from
the stages' spans (on a GPU, compute spans are CUDA event times).
"""

from __future__ import annotations

import random
from typing import Any

from ppserve.gpu_check.models import checkpoint, shape_for
from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.prompts import PromptSource


def workload(cuda: bool) -> dict[str, Any]:
    if cuda:
        return dict(requests=64, rate=32.0, prompt=(32, 512), output=(16, 96))
    return dict(requests=6, rate=40.0, prompt=(4, 24), output=(2, 6))


def run(ctx: Context) -> dict[str, Any]:
    from ppserve.bench.harness import replay
    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams
    from ppserve.sim.workload import WorkloadRequest, poisson_arrivals

    shape = shape_for("smollm2", ctx.cuda)
    model_dir = checkpoint(ctx.models_dir, "smollm2", shape, "float32", ctx.device)
    w = workload(ctx.cuda)
    rng = random.Random(0)
    arrivals = poisson_arrivals(w["requests"], w["rate"], seed=0)
    reqs = [WorkloadRequest(t, rng.randint(*w["prompt"]), rng.randint(*w["output"])) for t in arrivals]
    # The warm-up's prompts are its own (a replayed one would reach the engine cached, and its TTFT would
    # time no prefill), as long as the longest, so what a long prompt runs compiles before the replay.
    source = PromptSource(shape["vocab_size"], seed=0)
    warm_up = source.draw([w["prompt"][1]] * 2)
    prompts = source.draw([r.prompt_len for r in reqs])
    # max_model_len bounds the KV pool (worker/memory.py usable_blocks) to what this workload can fill.
    with LLM(str(model_dir), executor="inproc", pipeline_parallel_size=2, max_model_len=1024,
             cuda_graphs="auto" if ctx.cuda else "eager") as llm:
        dtype = str(llm.engine.executor.workers[0].dtype).removeprefix("torch.")
        llm.generate(warm_up, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: Triton compiles
        result = replay(llm.engine, reqs, prompts, name="gpu_check", progress=False)
    summary = result.summary()
    done = summary["num_finished"]
    ok = done == len(reqs) and not result.aborted
    return {"ok": ok, "dtype": dtype, "workload": w, "finished": done, "summary": summary}


def headline(r: dict[str, Any]) -> str:
    s = r["summary"]
    lat, bub = s["latency"], s.get("bubbles", {})
    return (f"{r['finished']}/{r['workload']['requests']} requests ({r['dtype']}): TTFT p50 "
            f"{lat['ttft_s']['p50'] * 1e3:.1f} ms, TBT p50 {lat['tbt_s']['p50'] * 1e3:.2f} ms p99 "
            f"{lat['tbt_s']['p99'] * 1e3:.2f} ms, {s['throughput']['output_tokens_per_s']:.0f} tok/s, "
            f"bubble {bub.get('mean_bubble_fraction', float('nan')):.1%}")
