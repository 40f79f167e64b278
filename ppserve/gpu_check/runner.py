"""The GPU check's runner: every phase in its own process, inside one time budget, then a summary.

A phase gets the smaller of its own limit and what is left of the budget (less a margin for the
summary); one that would get less than MIN_PHASE_S is not started (and fails the check: not run is
not passed). The exit status is 1 if any phase failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ppserve.gpu_check import PHASES
from ppserve.gpu_check.phase import write_json

# Seconds per phase on an H200 (the device the check is sized for), start-up included.
LIMITS_S = {"environment": 60, "kernels": 120, "correctness_pp1": 120, "correctness_pp2": 120, "serving": 120,
            "step_times": 60, "roofline": 200, "gpu_tests": 150}
BUDGET_S = 480  # the whole check: 8 minutes
MIN_PHASE_S = 20
SUMMARY_MARGIN_S = 5
ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding `ppserve`


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ppserve.gpu_check",
                                description="The one-shot GPU check (see ppserve/gpu_check/__init__.py).")
    p.add_argument("--out", required=True, help="folder for gpu_check.json, each phase's JSON and log")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: every phase's code path that needs no CUDA, on shrunk models (what CI runs)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check")
    p.add_argument("--models-dir", default=None,
                   help="where the built checkpoints go (default: a temporary folder, removed at the end; "
                        "not under --out, whose files a device run brings back)")
    p.add_argument("--keep-models", action="store_true", help="keep the built checkpoints after the check")
    p.add_argument("--roofline-layers", type=int, default=None,
                   help="decoder layers of the Llama-3-8B-shaped model (default 16 on cuda: the per-layer "
                        "shapes are the 8B's, half the depth keeps the check inside its budget)")
    args = p.parse_args(argv)
    args.phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    unknown = [s for s in args.phases if s not in PHASES]
    if unknown:
        p.error(f"unknown phases {unknown}; known: {list(PHASES)}")
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if args.roofline_layers is not None and args.roofline_layers < 1:
        p.error("--roofline-layers must be >= 1")
    return args


def phase_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA: a dry run must not touch a GPU
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels run interpreted on CPU (chosen before import)
    return env


def run_one(name: str, args: argparse.Namespace, limit_s: float, out: Path) -> dict[str, Any]:
    options = {"roofline_layers": args.roofline_layers, "models_dir": args.models_dir}
    cmd = [sys.executable, "-m", "ppserve.gpu_check.phase", name, "--out", str(out), "--device", args.device,
           "--options", json.dumps(options)]
    log = out / f"{name}.log"
    result_path = out / f"{name}.json"
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=phase_env(args.device), cwd=ROOT,
                                  timeout=limit_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = round(time.perf_counter() - t0, 1)
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
    else:  # killed (time limit, OOM killer) or crashed below Python: the log says what it got to
        tail = log.read_text(errors="replace").strip().splitlines()[-20:]
        why = f"killed at its {limit_s:.0f} s limit" if code is None else f"exited {code} without its JSON"
        result = {"ok": False, "error": why, "log_tail": tail}
        write_json(result_path, result)
    result["wall_s"] = seconds
    return result


def status(result: dict[str, Any]) -> str:
    if result.get("skipped"):
        return "skip"
    return "ok" if result.get("ok") else "FAIL"


def summary_table(phases: dict[str, dict[str, Any]]) -> str:
    rows = [("phase", "status", "s", "headline")]
    for name, r in phases.items():
        what = r.get("skipped") or r.get("headline") or r.get("error") or ""
        rows.append((name, status(r), f"{r.get('wall_s', 0):.0f}", str(what)[:110]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made_models_dir = args.models_dir is None
    if made_models_dir:
        args.models_dir = tempfile.mkdtemp(prefix="ppserve-gpu-check-models-")
    try:
        return run_all(args, out)
    finally:
        if made_models_dir and not args.keep_models:
            shutil.rmtree(args.models_dir, ignore_errors=True)


def run_all(args: argparse.Namespace, out: Path) -> int:
    start = time.perf_counter()
    report: dict[str, Any] = {"device": args.device, "budget_s": args.budget_s,
                              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "phases": {}}
    for name in args.phases:
        left = args.budget_s - (time.perf_counter() - start) - SUMMARY_MARGIN_S
        limit = min(LIMITS_S[name], left)
        if limit < MIN_PHASE_S:
            # Not run is not passed: a check that ran out of time says so in its verdict.
            result: dict[str, Any] = {"ok": False, "error": f"not run: out of time ({left:.0f} s of the "
                                                            f"{args.budget_s:.0f} s budget left)"}
        else:
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            result = run_one(name, args, limit, out)
        report["phases"][name] = result
        print(f"   {status(result)}: {result.get('skipped') or result.get('headline') or result.get('error')}",
              flush=True)
        if name == "environment" and not result.get("ok"):
            break  # no device, or no torch: every other phase would fail the same way
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["ok"] = all(r.get("ok") or r.get("skipped") for r in report["phases"].values())
    write_json(out / "gpu_check.json", report)
    table = summary_table(report["phases"])
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    print(f"\ngpu check {'passed' if report['ok'] else 'FAILED'} in {report['seconds']:.0f} s: {out / 'gpu_check.json'}",
          flush=True)
    return 0 if report["ok"] else 1
