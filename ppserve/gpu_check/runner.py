"""The GPU check's runner: every phase in its own process, inside one time budget, then a summary.

A phase gets the smaller of its own limit and what is left of the budget (less a margin for the
summary). The limits fit inside the default budget with that margin, so a check that runs every phase
to its limit still reaches its summary; under a smaller budget, a phase that would get less than
MIN_PHASE_S is not started, and is "not run". So is every phase after a failed `environment`. The
summary (summary.txt, gpu_check.json) separates passed, failed and not run (verdicts.py), and lists
what a CPU run cannot verify (NOT_VERIFIED_ON_CPU); the exit status is 1 only if a phase failed.
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

from ppserve.gpu_check import NOT_VERIFIED_ON_CPU, PHASES
from ppserve.gpu_check.phase import write_json
from ppserve.gpu_check.verdicts import FAIL, check_verdict, phase_status, verdict_line

# Seconds per phase on an H200 (the device the check is sized for), start-up included; their sum and
# SUMMARY_MARGIN_S fit in BUDGET_S (tests/unit/test_gpu_check_runner.py).
LIMITS_S = {"environment": 20, "kernels": 50, "correctness_pp1": 55, "correctness_pp2": 55, "multi_gpu": 45,
            "serving": 40, "step_times": 30, "roofline": 125, "gpu_tests": 55}
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
    options = {"roofline_layers": args.roofline_layers, "models_dir": args.models_dir, "limit_s": limit_s}
    cmd = [sys.executable, "-m", "ppserve.gpu_check.phase", name, "--out", str(out), "--device", args.device,
           "--options", json.dumps(options)]
    log = out / f"{name}.log"
    result_path = out / f"{name}.json"
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=phase_env(args.device),
                                  cwd=ROOT,
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


def what(result: dict[str, Any]) -> str:
    """One phase's line in the summary: why it did not run, its headline, or its error."""
    return str(result.get("not_run") or result.get("headline") or result.get("error") or "")


def summary_table(phases: dict[str, dict[str, Any]]) -> str:
    rows = [("phase", "status", "s", "headline")]
    for name, r in phases.items():
        rows.append((name, phase_status(r), f"{r.get('wall_s', 0):.0f}", what(r)[:110]))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}" for a, b, c, d in rows)


def summary_text(report: dict[str, Any]) -> str:
    """summary.txt: the table, the verdict line, and the claims a CPU run cannot verify."""
    verdict = {key: report[key] for key in ("passed", "failed", "not_run")}
    lines = [summary_table(report["phases"]), "", f"{verdict_line(verdict)} in {report['seconds']:.0f} s", "",
             "not verified on CPU (only a GPU can confirm):"]
    lines += [f"- {claim}" for claim in report["not_verified_on_cpu"]]
    return "\n".join(lines) + "\n"


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
    no_environment = None
    for name in args.phases:
        left = args.budget_s - (time.perf_counter() - start) - SUMMARY_MARGIN_S
        limit = min(LIMITS_S[name], left)
        if no_environment is not None:
            result: dict[str, Any] = {"not_run": no_environment}
        elif limit < MIN_PHASE_S:
            result = {"not_run": f"out of time ({left:.0f} s of the {args.budget_s:.0f} s budget left)"}
        else:
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            result = run_one(name, args, limit, out)
        report["phases"][name] = result
        print(f"   {phase_status(result)}: {what(result)}", flush=True)
        if name == "environment" and phase_status(result) == FAIL:
            # No device, or no torch: every other phase would fail the same way.
            no_environment = f"the environment phase failed: {what(result)}"
    report["seconds"] = round(time.perf_counter() - start, 1)
    report.update(check_verdict(report["phases"]))
    report["ok"] = not report["failed"]
    report["not_verified_on_cpu"] = list(NOT_VERIFIED_ON_CPU)
    write_json(out / "gpu_check.json", report)
    text = summary_text(report)
    (out / "summary.txt").write_text(text)
    print("\n" + text + f"\n{out / 'gpu_check.json'}", flush=True)
    return 0 if report["ok"] else 1
