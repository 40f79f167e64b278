"""What PP=2 costs a memory-bound decode round on one CPU: the default model's weights streamed per round.

A decode round (every running sequence one token further) reads every weight once at pp = 1, where the
stage's two threads split each GEMM's columns (tensor parallelism in all but name). At pp = 2 with two
decode groups in flight each stage reads its layers' weights once per microbatch, twice per round, with
one thread: the round reads the model twice, and each core streams at its own rate. This times the
panel GEMMs of a round both ways on this machine, the pp = 2 stages as two processes pinned to their
cores and run at the same time (as the stages' actors are), so that the two weight streams compete as
they do in a run:

- pp = 1: one process, 2 threads, every layer and the LM head, `--rows` x 2 rows, once;
- pp = 2: stage 0 (layers 0 .. split - 1) and stage 1 (the rest and the LM head), 1 thread each,
  `--rows` rows (one decode group), twice.

    python benchmarks/analysis_weight_stream.py [--rows 24] [--split 17] [--seconds 6]

Prints per-round milliseconds and each stream's GB/s; writes results/analysis_weight_stream.json. Not a
test. The round's other work (attention over the context, norms, sampling) is not here: this is the part
of the round that PP makes larger.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from ppserve.bench.report import write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import HIDDEN, INTER, LAYERS, PROJECTIONS, VOCAB  # noqa: E402  (the default model's linears)

REPO = Path(__file__).resolve().parents[1]
# Per layer (out, in, SiLU-and-mul epilogue): qkv, o, gate/up, down.
LAYER_SHAPES = tuple((out, inp, name == "gate_up") for name, (out, inp) in PROJECTIONS.items())

WORKER = """
import json, statistics, sys, time, torch
from ppserve.model.ops import native
first, last, head, rows, threads, seconds, shapes, vocab, hidden, inter = json.loads(sys.argv[1])
torch.set_num_threads(threads)
gemm = native.panel_gemm()
if gemm is None:
    print("RESULT null"); sys.exit(0)
g = torch.Generator().manual_seed(0)
weights = []
for _ in range(first, last):
    for n, k, silu in shapes:
        w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
        weights.append((gemm.pack_gate_up(w) if silu else gemm.pack(w), k, silu))
if head:
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).bfloat16()
    weights.append((gemm.pack(w), hidden, False))
inputs = {k: torch.randn(rows, k).bfloat16() for k in (hidden, inter)}
def one_pass():
    for packed, k, silu in weights:
        gemm(inputs[k], packed, None, silu_mul=silu)
for _ in range(3):
    one_pass()
times, end = [], time.perf_counter() + seconds
while time.perf_counter() < end:
    t = time.perf_counter(); one_pass(); times.append(time.perf_counter() - t)
mb = sum(p.numel() * 2 for p, _, _ in weights) / 1e6
print("RESULT " + json.dumps({"kernel": gemm.kernel, "pass_ms": statistics.median(times) * 1e3, "mb": mb,
                              "passes": len(times)}))
"""


def start(first: int, last: int, head: bool, rows: int, threads: int, seconds: float,
          cores: str | None) -> subprocess.Popen[str]:
    spec = [first, last, head, rows, threads, seconds, LAYER_SHAPES, VOCAB, HIDDEN, INTER]
    cmd = [sys.executable, "-c", WORKER, json.dumps(spec)]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def result(proc: subprocess.Popen[str]) -> dict[str, float] | None:
    out, err = proc.communicate()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed (exit {proc.returncode}):\n{err[-2000:]}")
    parsed: dict[str, float] | None = json.loads(lines[-1][len("RESULT "):])
    return parsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rows", type=int, default=24, help="rows of one decode group (pp = 1 runs twice as many)"
    )
    ap.add_argument(
        "--split", type=int, default=17, help="stage 0's layers at pp = 2 (the cost split's 17 / 13)"
    )
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", default="results/analysis_weight_stream.json")
    args = ap.parse_args()
    if not 0 < args.split < LAYERS:
        ap.error(f"--split must be in 1 .. {LAYERS - 1}")

    pp1 = result(start(0, LAYERS, True, 2 * args.rows, 2, args.seconds, None))
    if pp1 is None:
        print("no panel GEMM on this CPU (it needs AMX or AVX512-BF16): nothing to time")
        return
    stages = [start(0, args.split, False, args.rows, 1, args.seconds, "0"),
              start(args.split, LAYERS, True, args.rows, 1, args.seconds, "1")]
    s0, s1 = (result(p) for p in stages)
    assert s0 is not None and s1 is not None
    pp2_round = 2 * max(s0["pass_ms"], s1["pass_ms"])
    report = {
        "kernel": pp1["kernel"], "rows_per_group": args.rows, "split": [args.split, LAYERS - args.split],
        "pp1": {**pp1, "round_ms": pp1["pass_ms"], "gb_s": pp1["mb"] / pp1["pass_ms"]},
        "pp2_stage0": {**s0, "gb_s": s0["mb"] / s0["pass_ms"]},
        "pp2_stage1": {**s1, "gb_s": s1["mb"] / s1["pass_ms"]},
        "pp2_round_ms": pp2_round, "pp2_over_pp1_round": pp2_round / pp1["pass_ms"],
        "load_average": os.getloadavg(),
    }
    print(
        f"panel kernel {pp1['kernel']}; a decode round of {2 * args.rows} sequences, the default model's "
        "linears"
    )
    print("| layout | weights read per round | GEMM ms per round | GB/s per stream |")
    print("|---|---|---|---|")
    print(
        f"| pp = 1, 2 threads, one pass of {2 * args.rows} rows | {pp1['mb']:.0f} MB | {pp1['pass_ms']:.2f} "
        "| "
        f"{report['pp1']['gb_s']:.1f} |"
    )
    print(
        f"| pp = 2, stage 0 ({args.split} layers), 1 thread, two passes of {args.rows} rows | "
        f"{2 * s0['mb']:.0f} MB | "
        f"{2 * s0['pass_ms']:.2f} | {report['pp2_stage0']['gb_s']:.1f} |"
    )
    print(f"| pp = 2, stage 1 ({LAYERS - args.split} layers + LM head), the same | {2 * s1['mb']:.0f} MB | "
          f"{2 * s1['pass_ms']:.2f} | {report['pp2_stage1']['gb_s']:.1f} |")
    print(f"pp = 2's round (its slower stage) / pp = 1's: {report['pp2_over_pp1_round']:.2f}x "
          f"(+{pp2_round - pp1['pass_ms']:.1f} ms a round); load average {os.getloadavg()[0]:.2f}")
    print(f"wrote {write_json(args.out, report)}")


if __name__ == "__main__":
    main()
