"""Step efficiency side by side: ppserve pp=1 and pp=2, transformers `generate`, and vLLM for CPU, one run.

One workload (default: 48 requests, prompts of 128-1024 tokens cut from real English text, 64 greedy
output tokens each with ignore_eos) goes through every engine, each in its own process pinned to the
same cores. Per engine: wall time, output and total tokens/s, mean TTFT and TBT, peak RSS, and model
FLOP utilization (the workload's model FLOPs / wall time / the matmul rate measured in this same run).
vLLM runs when its virtual environment exists (benchmarks/install_vllm_cpu.sh) and is left out otherwise.

    python benchmarks/bench_step_efficiency.py                      # the full comparison
    python benchmarks/bench_step_efficiency.py --engines ppserve-pp1,vllm --rounds 3   # ratios over 3 rounds
    python benchmarks/bench_step_efficiency.py --num-requests 2 --min-len 16 --max-len 32 \\
        --output-len 4 --engines ppserve-pp1,hf                     # a smoke run
    python benchmarks/bench_step_efficiency.py --shared-prefix 8,1024,64 --num-requests 64 --prefix-caching \\
        --engines ppserve-pp1,ppserve-pp2,vllm                      # shared prompts, both engines caching

Prefix caching is off in every engine unless --prefix-caching turns it on in ppserve and vLLM alike.

Writes results/step_efficiency.json (or --out) and prints a markdown table. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    EngineResult,
    ModelShape,
    latency_figures,
    load_workload,
    peak_rss_mib,
    save_workload,
    trace_prompt_lengths,
    workload_flops,
)

REPO = Path(__file__).resolve().parents[1]
ALL_ENGINES = ("ppserve-pp1", "ppserve-pp2", "hf", "vllm")
DEFAULT_VLLM_VENV = Path(os.environ.get("VLLM_VENV", "~/.cache/ppserve/vllm-venv")).expanduser()


# ---------------------------------------------------------------------------------------------
# The matmul rate: the ceiling the engines are measured against
# ---------------------------------------------------------------------------------------------

def matmul_rate(shape: ModelShape, threads: int, tokens: int = 512, rounds: int = 5) -> dict[str, float]:
    """Best GFLOP/s of `F.linear` at this model's layer shapes with `tokens` rows, fp32 and bf16,
    plus a square 2048^3 bf16 GEMM; the best of a few rounds (other work on the cores only slows it)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    h, i = shape.hidden, shape.intermediate
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    mats = [(qkv, h), (h, shape.num_heads * shape.head_dim), (2 * i, h), (h, i)]
    out: dict[str, float] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        ws = [torch.randn(o, k).to(dtype) for o, k in mats]
        xs = [torch.randn(tokens, k).to(dtype) for _, k in mats]
        flops = sum(2 * tokens * o * k for o, k in mats)
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for w, x in zip(ws, xs, strict=True):
                F.linear(x, w)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_model_shapes_gflops"] = flops / best / 1e9
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        F.linear(a, b)
        best = min(best, time.perf_counter() - t0)
    out["bf16_square_gflops"] = 2 * 2048**3 / best / 1e9
    out["bf16_peak_gflops"] = max(out["bf16_model_shapes_gflops"], out["bf16_square_gflops"])
    return out


# ---------------------------------------------------------------------------------------------
# Engine runners (each runs in its own process: `--run-engine NAME`)
# ---------------------------------------------------------------------------------------------

def run_ppserve(workload: Path, pp: int, dtype: str, token_budget: int, partition: str = "even",
                prefix_caching: bool = False) -> EngineResult:
    from ppserve import LLM, SamplingParams

    prompts, output_len, model_dir = load_workload(workload)
    threads = 2 // pp if pp <= 2 else 1
    overrides = [f"parallel.num_threads={threads}", f"parallel.cpus_per_worker={threads}",
                 f"parallel.partition_mode={partition}",
                 f"cache.enable_prefix_caching={'true' if prefix_caching else 'false'}"]
    with LLM(model_dir, dtype=dtype, token_budget=token_budget, pipeline_parallel_size=pp, trace=False,
             overrides=overrides) as llm:
        warm = [p[:32] for p in prompts[:2]]
        llm.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))  # oneDNN primitives, Ray warm-up
        sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - start
        pids = [os.getpid()] + [d.pid for d in llm.engine.executor.describe() if d.pid]
        rss = peak_rss_mib(sorted(set(pids)), with_children=False)
        blocks = llm.engine.executor.num_kv_blocks
        block_size = llm.engine.executor.block_size  # cache.block_size, or the attention kernel's page
        llm_ranges = llm.engine.executor.ranges
        llm_stats = llm.engine.stats()
    ttft, tbt, p99 = latency_figures(start, [o.token_times for o in outs])
    return EngineResult(
        engine=f"ppserve-pp{pp}",
        wall_s=wall,
        num_requests=len(prompts),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(len(o.token_ids) for o in outs),
        mean_ttft_s=ttft,
        mean_tbt_s=tbt,
        p99_tbt_s=p99,
        peak_rss_mib=rss,
        extra={
            "dtype": dtype,
            "threads_per_stage": threads,
            "token_budget": token_budget,
            "partition": partition,
            "prefix_caching": prefix_caching,
            "prefix_cache_hit_rate": llm_stats.prefix_cache_hit_rate,
            "layers": [list(r) for r in llm_ranges],
            "kv_blocks": blocks,
            "kv_tokens": blocks * block_size,
            "first_tokens": [o.token_ids[:8] for o in outs],
        },
    )


def run_hf(workload: Path, dtype: str, batch_size: int) -> EngineResult:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    torch.set_num_threads(2)
    prompts, output_len, model_dir = load_workload(workload)
    tdtype = torch.bfloat16 if dtype in ("bfloat16", "auto") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).eval()
    model.generation_config.eos_token_id = None  # ignore_eos

    class Stamp(StoppingCriteria):
        """Called once after every generated token of the batch: its time is that token's time."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def generate(batch: list[list[int]], new: int, stamp: Stamp | None = None) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        crit = StoppingCriteriaList([stamp]) if stamp is not None else None
        with torch.inference_mode():
            g = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                               stopping_criteria=crit)
        return g[:, width:].tolist()

    generate([p[:32] for p in prompts[:2]], 2)  # warm-up
    times: list[list[float]] = []
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        stamp = Stamp()
        batch = prompts[b:b + batch_size]
        tokens.extend(generate(batch, output_len, stamp))
        times.extend([list(stamp.times)] * len(batch))
    wall = time.perf_counter() - start
    ttft, tbt, p99 = latency_figures(start, times)
    return EngineResult(
        engine=f"hf-generate-b{batch_size}", wall_s=wall, num_requests=len(prompts),
        prompt_tokens=sum(map(len, prompts)), output_tokens=sum(map(len, tokens)), mean_ttft_s=ttft,
        mean_tbt_s=tbt, p99_tbt_s=p99, peak_rss_mib=peak_rss_mib(),
        extra={"dtype": str(tdtype).replace("torch.", ""), "batch_size": batch_size,
               "first_tokens": [t[:8] for t in tokens]},
    )


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

def pin_cores(cores: str) -> None:
    ids = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, ids)


def spawn(name: str, args: argparse.Namespace, workload: Path) -> EngineResult | None:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    if name == "vllm":
        python = DEFAULT_VLLM_VENV / "bin" / "python"
        if not python.exists():
            print(f"[vllm] left out: no vLLM venv at {DEFAULT_VLLM_VENV} (benchmarks/install_vllm_cpu.sh)")
            return None
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=args.cores)
        cmd = [str(python), str(Path(__file__).with_name("vllm_cpu_runner.py")), "--workload", str(workload),
               "--dtype", args.vllm_dtype or args.dtype, "--max-num-batched-tokens", str(args.token_budget)]
        if args.prefix_caching:
            cmd.append("--enable-prefix-caching")
    else:
        cmd = [
            sys.executable,
            __file__,
            "--run-engine",
            name,
            "--workload",
            str(workload),
            "--dtype",
            args.dtype,
            "--token-budget",
            str(args.token_budget),
            "--hf-batch",
            str(args.hf_batch),
            "--partition-mode",
            args.partition_mode,
        ]
        if args.prefix_caching:
            cmd.append("--prefix-caching")
    print(f"[{name}] running ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.engine_timeout,
                          preexec_fn=lambda: pin_cores(args.cores))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        print(f"[{name}] failed (exit {proc.returncode}) after {time.perf_counter() - t0:.0f} s:\n{tail}")
        return None
    res = EngineResult(**json.loads(lines[-1][len("RESULT "):]))
    print(f"[{name}] done in {time.perf_counter() - t0:.0f} s (wall {res.wall_s:.1f} s)", flush=True)
    return res


def run_rounds(engines: list[str], args: argparse.Namespace, workload: Path) -> list[dict[str, EngineResult]]:
    """Every engine once per round; odd rounds in reverse order, so slow drift of the shared machine does
    not always fall on the same engine."""
    by_round = []
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
        order = engines if rnd % 2 == 0 else engines[::-1]
        by_round.append({e: r for e in order if (r := spawn(e, args, workload)) is not None})
    return by_round


def median_runs(engines: list[str], by_round: list[dict[str, EngineResult]]
                ) -> tuple[list[EngineResult], dict[str, list[float]]]:
    """Per engine, the run with the median wall time (the table's row), and every round's wall time."""
    results, walls = [], {}
    for e in engines:
        runs = sorted((rr[e] for rr in by_round if e in rr), key=lambda r: r.wall_s)
        if runs:
            results.append(runs[(len(runs) - 1) // 2])
            walls[e] = [round(rr[e].wall_s, 2) if e in rr else None for rr in by_round]
    return results, walls


def same_round_ratios(by_round: list[dict[str, EngineResult]]) -> dict[str, dict[str, Any]]:
    """ppserve pp=1 throughput over each other engine's, within each round (same workload: the inverse
    ratio of wall times), and the median over rounds: the figure the machine's noise disturbs least."""
    out: dict[str, dict[str, Any]] = {}
    others = sorted({e for rr in by_round for e in rr} - {"ppserve-pp1"})
    for e in others:
        ratios = [
            rr[e].wall_s / rr["ppserve-pp1"].wall_s for rr in by_round if e in rr and "ppserve-pp1" in rr
        ]
        if ratios:
            out[e] = {"per_round": [round(x, 3) for x in ratios], "median": statistics.median(ratios)}
    return out


def agreement(a: list[list[int]], b: list[list[int]], n: int) -> float:
    """Fraction of requests whose first n tokens agree."""
    pairs = list(zip(a, b, strict=True))
    return sum(x[:n] == y[:n] for x, y in pairs) / max(1, len(pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trace", help="take prompt lengths from this request trace CSV (e.g. ../shared/traces/"
                    "splitwise_conv.csv) instead of --min-len/--max-len")
    ap.add_argument(
        "--prefill-scale", type=float, default=0.25, help="with --trace: prompt lengths scaled by this"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--shared-prefix",
        metavar="GROUPS,PREFIX,QUESTION",
        help="prompts share system prompts: GROUPS prefixes of PREFIX tokens, each followed by "
        "num_requests / GROUPS distinct QUESTION-token questions (instead of --min/--max-len)",
    )
    ap.add_argument(
        "--prefix-caching", action="store_true", help="prefix caching on in ppserve and vLLM alike"
    )
    ap.add_argument(
        "--engines", default=",".join(ALL_ENGINES), help=f"comma-separated subset of {ALL_ENGINES}"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        help="ppserve's and transformers' dtype, and vLLM's unless --vllm-dtype",
    )
    ap.add_argument(
        "--vllm-dtype",
        help="vLLM's dtype (default: --dtype); on a CPU without native bf16 both serve "
        "float32 (bf16 there is emulated, slower in every engine)",
    )
    ap.add_argument(
        "--token-budget", type=int, default=512, help="ppserve token budget = vLLM max_num_batched_tokens"
    )
    ap.add_argument(
        "--partition-mode",
        default="even",
        help="ppserve pp>1: parallel.partition_mode (even|cost|calibrated)",
    )
    ap.add_argument("--hf-batch", type=int, default=8, help="transformers static batch size")
    ap.add_argument("--cores", default="0-1", help="cores every engine is pinned to")
    ap.add_argument("--rounds", type=int, default=1, help="run every engine this many times, alternating; "
                    "the table shows each engine's median run, plus same-round throughput ratios")
    ap.add_argument("--engine-timeout", type=float, default=1800.0)
    ap.add_argument("--model", default=None, help="HF directory; default SmolLM2-135M-Instruct")
    ap.add_argument("--out", default=str(REPO / "results" / "step_efficiency.json"))
    ap.add_argument("--run-engine", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.run_engine:  # child process: one engine, one RESULT line
        wl = Path(args.workload)
        if args.run_engine.startswith("ppserve-pp"):
            res = run_ppserve(wl, int(args.run_engine[len("ppserve-pp"):]), args.dtype, args.token_budget,
                              args.partition_mode, args.prefix_caching)
        elif args.run_engine == "hf":
            res = run_hf(wl, args.dtype, args.hf_batch)
        else:
            raise SystemExit(f"unknown engine {args.run_engine!r}")
        print("RESULT " + res.to_json(), flush=True)
        return

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ALL_ENGINES]
    if unknown:
        raise SystemExit(f"unknown engines {unknown}; choose from {ALL_ENGINES}")
    from transformers import AutoTokenizer

    from ppserve.bench.prompts import text_windows
    from ppserve.model.loader import read_hf_config, resolve_model

    model_dir = resolve_model(args.model)
    shape = ModelShape.from_hf_config(read_hf_config(model_dir))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if args.shared_prefix:
        from ppserve.bench.prompts import PromptBuilder
        from ppserve.sim.workload import shared_prefix

        groups, prefix, question = (int(x) for x in args.shared_prefix.split(","))
        reqs = shared_prefix(groups, max(1, args.num_requests // groups), prefix, question, args.output_len)
        lengths = [r.prompt_len for r in reqs]
    elif args.trace:
        lengths = trace_prompt_lengths(args.trace, args.num_requests, args.prefill_scale)
    else:
        if not 1 <= args.min_len <= args.max_len:
            raise SystemExit(f"need 1 <= --min-len <= --max-len, got {args.min_len}, {args.max_len}")
        rng = random.Random(args.seed)
        lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_requests)]
    if args.shared_prefix:
        prompts = PromptBuilder(tok, shape.vocab, args.seed).build_for(reqs)
    else:
        prompts = text_windows(tok, lengths, args.seed)
    out_path = Path(args.out)
    workload = out_path.with_name(out_path.stem + "_workload.json")
    save_workload(workload, prompts, args.output_len, str(model_dir))
    flops = workload_flops(shape, [len(p) for p in prompts], args.output_len)

    pin_cores(args.cores)
    threads = len(os.sched_getaffinity(0))
    rates = [matmul_rate(shape, threads)]
    by_round = run_rounds(engines, args, workload)
    rates.append(matmul_rate(shape, threads))  # before and after: the better one is the ceiling
    results, walls = median_runs(engines, by_round)
    rate = {k: max(r[k] for r in rates) for k in rates[0]}
    peak = rate["bf16_peak_gflops"] * 1e9

    ref = next((r for r in results if r.engine.startswith("hf")), None)
    hf_tps = ref.output_tok_s if ref else None
    rows = []
    for r in results:
        row = {
            "engine": r.engine,
            "wall_s": r.wall_s,
            "output_tok_s": r.output_tok_s,
            "total_tok_s": r.total_tok_s,
            "mean_ttft_s": r.mean_ttft_s,
            "mean_tbt_ms": r.mean_tbt_s * 1e3,
            "p99_tbt_ms": r.p99_tbt_s * 1e3,
            "peak_rss_mib": r.peak_rss_mib,
            "achieved_gflops": flops / r.wall_s / 1e9,
            "mfu_bf16_peak": flops / r.wall_s / peak,
            "mfu_bf16_model_shapes": flops / r.wall_s / (rate["bf16_model_shapes_gflops"] * 1e9),
            "speedup_vs_hf": (r.output_tok_s / hf_tps) if hf_tps else None,
        }
        if ref is not None and r is not ref:
            a, b = r.extra.get("first_tokens"), ref.extra.get("first_tokens")
            if a and b:
                row["first8_agree_with_hf"] = agreement(a, b, 8)
                row["first1_agree_with_hf"] = agreement(a, b, 1)
        rows.append(row)
    report = {
        "workload": {
            "num_requests": len(prompts),
            "prompt_tokens": sum(map(len, prompts)),
            "output_len": args.output_len,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "model_dir": str(model_dir),
            "model_flops": flops,
            "cores": args.cores,
        },
        "matmul_rate": rate,
        "rows": rows,
        "raw": [asdict(r) for r in results],
        "rounds": args.rounds,
        "walls_per_round": walls,
        "ratios_vs_ppserve_pp1": same_round_ratios(by_round),
        "command": " ".join(sys.argv),
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    print_table(report)
    print(f"\nwrote {out_path}")


def print_table(report: dict[str, Any]) -> None:
    w, rate = report["workload"], report["matmul_rate"]
    print(
        f"\nworkload: {w['num_requests']} requests, {w['prompt_tokens']} prompt tokens, {w['output_len']} "
        "output "
        f"tokens each; model FLOPs {w['model_flops'] / 1e12:.2f} TFLOP; cores {w['cores']}"
    )
    print(
        f"matmul rate (same run): bf16 {rate['bf16_model_shapes_gflops']:.0f} GFLOP/s at model shapes x512, "
        f"{rate['bf16_square_gflops']:.0f} square 2048; fp32 {rate['fp32_model_shapes_gflops']:.0f} at model "
        "shapes\n"
    )
    print(
        "| engine | wall s | out tok/s | total tok/s | mean TTFT s | mean TBT ms | p99 TBT ms | peak RSS MiB "
        "| GFLOP/s | MFU (bf16 peak) | x HF | first-8 agree w/ HF |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        sp = f"{r['speedup_vs_hf']:.2f}" if r.get("speedup_vs_hf") else "-"
        ag = f"{r['first8_agree_with_hf']:.0%}" if "first8_agree_with_hf" in r else "-"
        print(
            f"| {r['engine']} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.0f} | "
            f"{r['mean_ttft_s']:.2f} | {r['mean_tbt_ms']:.0f} | {r['p99_tbt_ms']:.0f} | "
            f"{r['peak_rss_mib']:.0f} | "
            f"{r['achieved_gflops']:.0f} | {r['mfu_bf16_peak']:.1%} | {sp} | {ag} |"
        )
    if report.get("rounds", 1) > 1:
        print(f"\n{report['rounds']} rounds; rows are each engine's median run. Wall s per round: "
              + "; ".join(f"{e} {walls}" for e, walls in report["walls_per_round"].items()))
    for e, r in report.get("ratios_vs_ppserve_pp1", {}).items():
        print(f"ppserve-pp1 throughput / {e}, same round: {r['per_round']} -> median {r['median']:.2f}x")


if __name__ == "__main__":
    main()
