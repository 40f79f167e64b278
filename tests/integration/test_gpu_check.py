"""The GPU check's dry run (`--device cpu`): every phase's code path but what needs CUDA, each phase in its
own process with the packages the device image lacks made unimportable (an import of one fails its
phase), so the check cannot rot between GPU sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppserve.gpu_check import ABSENT_ON_DEVICE, PHASES
from ppserve.gpu_check.roofline import plan
from ppserve.gpu_check.verdicts import MAX_NEAR_TIE_FRACTION

ROOT = Path(__file__).resolve().parents[2]
# correctness_pp1 is correctness_pp2's code at pp 1: the dry run takes the pipeline one.
DRY_RUN = [p for p in PHASES if p != "correctness_pp1"]


def test_gpu_check_dry_run_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "-m", "ppserve.gpu_check", "--device", "cpu", "--out", str(out),
                           "--phases", ",".join(DRY_RUN)], capture_output=True, text=True, timeout=600,
                           cwd=ROOT)
    report = json.loads((out / "gpu_check.json").read_text())
    phases = report["phases"]
    assert list(phases) == DRY_RUN
    for name in DRY_RUN:  # each phase wrote its own JSON and log
        assert (out / f"{name}.json").is_file() and (out / f"{name}.log").is_file()
    assert "needs CUDA" in phases["gpu_tests"]["not_run"]
    assert report["not_run"] == ["gpu_tests"] and report["passed"] == DRY_RUN[:-1], report["failed"]
    failed = {n: p.get("error") or p.get("headline") for n, p in phases.items() if n in report["failed"]}
    assert not failed, failed
    env = phases["environment"]
    assert env["made_absent"] == {name: True for name in ABSENT_ON_DEVICE}
    assert phases["kernels"]["split_k_pages_per_split"] >= 4
    runs = phases["correctness_pp2"]["runs"]
    assert {r["dtype_setting"] for r in runs.values()} == {"float32", "auto"}
    assert runs["float32"]["teacher_forced"]["top1_agreement_decided"] == 1.0
    assert runs["float32"]["teacher_forced"]["positions"] > 0 and runs["float32"]["greedy"]["ok"]
    assert runs["float32"]["teacher_forced"]["near_tie_fraction"] <= MAX_NEAR_TIE_FRACTION
    multi = phases["multi_gpu"]  # the multi-process executor, no Ray in any process, rendezvous links
    assert multi["executor"] == "mp" and multi["greedy"]["ok"] and multi["teacher_forced"]["ok"]
    assert sorted(multi["bubble"]["stages"]) == ["0", "1"] and len({w["pid"] for w in multi["workers"]}) == 2
    assert phases["serving"]["finished"] == phases["serving"]["workload"]["requests"]
    assert phases["serving"]["summary"]["prefix_cache_hits"] == 0  # the warm-up's prompts are its own
    times = phases["step_times"]  # the host clock on CPU: every step timed when it ends, no synchronize
    assert times["timer"] == "HostStepTimer" and times["timed"] == times["steps"] > 0
    assert times["lag_counts"] == {"0": times["steps"]} and times["synchronize_calls_in_loop"] == {}
    roofline = phases["roofline"]  # every batch decoded all together for its steps, no run's prompt cached
    assert all(d["steps"] >= plan(cuda=False)["decode_steps"] for d in roofline["decode"])
    assert all(x["cached_prompt_tokens"] == 0 for x in roofline["decode"] + roofline["prefill"])
    assert all(x["runs"] == plan(cuda=False)["repeats"] for x in roofline["prefill"])
    summary = (out / "summary.txt").read_text()
    assert (summary.startswith("phase") and "1 not run (gpu_tests)" in summary
            and "not verified on CPU" in summary)
    assert proc.returncode == 0 and report["ok"] is True, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_a_phase_that_dies_without_its_json_fails_the_check(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase killed at its limit (or by the OOM killer) leaves no JSON: the runner records it as failed
    and goes on; running out of the budget is "not run", neither a pass nor a failure."""
    from ppserve.gpu_check import runner

    monkeypatch.setitem(runner.LIMITS_S, "environment", 0.001)  # killed before it can write anything
    monkeypatch.setattr(runner, "MIN_PHASE_S", 0)
    code = runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "environment"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and report["ok"] is False and report["failed"] == ["environment"]
    assert "killed at its" in report["phases"]["environment"]["error"]
    monkeypatch.setattr(runner, "MIN_PHASE_S", 20)
    code = runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "gpu_tests",
                        "--budget-s", "10"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0 and report["not_run"] == ["gpu_tests"] and not report["failed"]
    assert "out of time" in report["phases"]["gpu_tests"]["not_run"]
