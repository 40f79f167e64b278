"""The GPU check's runner and gpu_tests phase as verdict logic (ppserve/gpu_check/runner.py, gpu_tests.py):
no phase process is started, no device."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ppserve.gpu_check import NOT_VERIFIED_ON_CPU, PHASES, gpu_tests, runner
from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.verdicts import phase_status

ROOT = Path(__file__).resolve().parents[2]


def test_phase_limits_fit_inside_the_budget() -> None:
    assert set(runner.LIMITS_S) == set(PHASES)
    assert sum(runner.LIMITS_S.values()) + runner.SUMMARY_MARGIN_S <= runner.BUDGET_S
    assert min(runner.LIMITS_S.values()) >= runner.MIN_PHASE_S  # every phase starts under the default budget


def report_of(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    return report


def test_a_phase_the_budget_never_reaches_is_not_run_not_failed(tmp_path: Path) -> None:
    code = runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "gpu_tests",
                        "--budget-s", "10"])
    report = report_of(tmp_path)
    assert code == 0 and report["ok"] is True
    assert (report["passed"], report["failed"], report["not_run"]) == ([], [], ["gpu_tests"])
    assert "out of time" in report["phases"]["gpu_tests"]["not_run"]
    text = (tmp_path / "summary.txt").read_text()
    assert "gpu_tests  not run" in text
    assert "gpu check incomplete: 0 passed, 0 failed, 1 not run (gpu_tests)" in text


def test_the_summary_separates_pass_fail_and_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = {"environment": {"ok": True, "headline": "cuda"},
               "kernels": {"ok": False, "error": "bad split-K"},
               "gpu_tests": {"ok": False, "not_run": "pytest tested nothing: 3 skipped in 1s"}}
    monkeypatch.setattr(runner, "run_one", lambda name, args, limit, out: dict(results[name]))
    code = runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases",
                        "environment,kernels,gpu_tests"])
    report = report_of(tmp_path)
    assert code == 1 and report["ok"] is False
    assert (report["passed"], report["failed"], report["not_run"]) == (["environment"], ["kernels"],
                                                                       ["gpu_tests"])
    text = (tmp_path / "summary.txt").read_text()
    assert "gpu check FAILED: 1 passed, 1 failed (kernels), 1 not run (gpu_tests)" in text
    assert "kernels      FAIL" in text and "gpu_tests    not run" in text


def test_after_a_failed_environment_the_rest_is_not_run(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    def run_one(name: str, args: Any, limit: float, out: Path) -> dict[str, Any]:
        started.append(name)
        return {"ok": False, "error": "no CUDA device"}

    monkeypatch.setattr(runner, "run_one", run_one)
    code = runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases",
                        "environment,kernels,roofline"])
    report = report_of(tmp_path)
    assert code == 1 and started == ["environment"]
    assert report["failed"] == ["environment"] and report["not_run"] == ["kernels", "roofline"]
    assert "no CUDA device" in report["phases"]["roofline"]["not_run"]


def test_what_a_cpu_run_cannot_verify_is_listed(tmp_path: Path) -> None:
    assert isinstance(NOT_VERIFIED_ON_CPU, list) and all(isinstance(c, str) for c in NOT_VERIFIED_ON_CPU)
    for topic in ("NCCL", "host sync", "flash-attn", "page loop", "decode gather"):
        assert any(topic in claim for claim in NOT_VERIFIED_ON_CPU), topic
    runner.main(["--device", "cpu", "--out", str(tmp_path), "--phases", "gpu_tests", "--budget-s", "10"])
    assert report_of(tmp_path)["not_verified_on_cpu"] == NOT_VERIFIED_ON_CPU
    text = (tmp_path / "summary.txt").read_text()
    assert "not verified on CPU" in text and all(f"- {claim}" in text for claim in NOT_VERIFIED_ON_CPU)


def test_the_gpu_test_list_names_tests_that_exist() -> None:
    node = "tests/unit/test_sampler.py::test_sampling_on_cuda_needs_no_host_sync_until_the_ids"
    assert node in gpu_tests.TESTS
    for entry in gpu_tests.TESTS:
        path, _, name = entry.partition("::")
        assert (ROOT / path).exists(), entry
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), entry


@pytest.mark.parametrize(("returncode", "last_line", "status"), [
    (0, "34 skipped, 11 deselected in 1.78s", "not run"),
    (5, "no tests ran in 0.01s", "not run"),
    (0, "20 passed, 3 skipped in 9.10s", "pass"),
    (1, "1 failed, 19 passed in 9.10s", "FAIL"),
])
def test_gpu_tests_that_all_skipped_are_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                returncode: int,
                                                 last_line: str, status: str) -> None:
    def fake_pytest(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        assert kw["timeout"] == 60 - gpu_tests.PHASE_MARGIN_S  # inside the phase's own limit
        return subprocess.CompletedProcess(cmd, returncode, stdout=f"sss\n{last_line}\n",
                                           stderr="a warning\n")

    monkeypatch.setattr(subprocess, "run", fake_pytest)
    result = gpu_tests.run(Context("gpu_tests", "cuda", tmp_path, {"limit_s": 60}))
    assert phase_status(result) == status
    assert result["summary"] == last_line
    assert phase_status(gpu_tests.run(Context("gpu_tests", "cpu", tmp_path))) == "not run"
