"""Phase `gpu_tests`: the `gpu`-marked pytest subset, compiled kernels and captured graphs on the device.

pytest is not in the device image. Where it is missing, the phase looks in `.gpu_check_deps/` of the
checkout (gitignored; made on a machine with a registry by `pip install --target .gpu_check_deps
--python-version 3.12 --only-binary=:all: pytest`, ~15 MB, and carried with the tree). A run that tests
nothing (no CUDA, no pytest, every test skipped or deselected) is "not run", never a pass.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ppserve.gpu_check.phase import Context
from ppserve.gpu_check.verdicts import NOT_RUN, PASS, pytest_status

ROOT = Path(__file__).resolve().parents[2]
DEPS = ROOT / ".gpu_check_deps"
TESTS = ["tests/gpu", "tests/integration/test_decode_graphs.py",
         "tests/unit/test_sampler.py::test_sampling_on_cuda_needs_no_host_sync_until_the_ids"]
# Of the phase's limit, what pytest may not take: this process's start-up and its JSON, so that a pytest
# run that hangs ends here with its output, not with the phase killed at its limit.
PHASE_MARGIN_S = 15.0
DEFAULT_LIMIT_S = 60.0  # the phase's limit when the runner gave none


def run(ctx: Context) -> dict[str, Any]:
    if not ctx.cuda:
        return {"not_run": "needs CUDA (the gpu-marked tests skip without it)"}
    if not (ROOT / "tests" / "gpu").is_dir():
        return {"not_run": f"no tests/gpu under {ROOT} (run from a checkout)"}
    env = dict(os.environ)
    if importlib.util.find_spec("pytest") is None:
        if not DEPS.is_dir():
            return {"not_run": "pytest is not installed; `pip install --target .gpu_check_deps pytest` "
                               "in the checkout to carry it"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DEPS), env.get("PYTHONPATH", "")) if p)
    timeout = max(1.0, float(ctx.options.get("limit_s") or DEFAULT_LIMIT_S) - PHASE_MARGIN_S)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           *TESTS],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    lines = proc.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""  # pytest's counts: its stdout's last line (stderr comes after it)
    status = pytest_status(proc.returncode, summary)
    result: dict[str, Any] = {"ok": status == PASS, "returncode": proc.returncode, "output": tail,
                              "summary": summary}
    if status == NOT_RUN:
        result["not_run"] = f"pytest tested nothing: {summary or f'exit status {proc.returncode}'}"
    return result


def headline(r: dict[str, Any]) -> str:
    return str(r.get("summary", ""))
