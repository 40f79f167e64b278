"""Phase `gpu_tests`: the `gpu`-marked pytest subset, compiled kernels and captured graphs on the device.

pytest is not in the device image. Where it is missing, the phase looks in `.gpu_check_deps/` of the
checkout (gitignored; made on a machine with a registry by `pip install --target .gpu_check_deps
--python-version 3.12 --only-binary=:all: pytest`, ~15 MB, and carried with the tree) before it reports
itself skipped.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ppserve.gpu_check.phase import Context

ROOT = Path(__file__).resolve().parents[2]
DEPS = ROOT / ".gpu_check_deps"
TESTS = ["tests/gpu", "tests/integration/test_decode_graphs.py"]


def run(ctx: Context) -> dict[str, Any]:
    if not ctx.cuda:
        return {"skipped": "needs CUDA (the gpu-marked tests skip without it)"}
    if not (ROOT / "tests" / "gpu").is_dir():
        return {"skipped": f"no tests/gpu under {ROOT} (run from a checkout)"}
    env = dict(os.environ)
    if importlib.util.find_spec("pytest") is None:
        if not DEPS.is_dir():
            return {"skipped": "pytest is not installed; `pip install --target .gpu_check_deps pytest` "
                               "in the checkout to carry it"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DEPS), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *TESTS],
                          cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=float(ctx.options.get("gpu_tests_timeout_s") or 120))
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    return {"ok": proc.returncode == 0, "returncode": proc.returncode, "output": tail,
            "summary": tail[-1] if tail else ""}


def headline(r: dict[str, Any]) -> str:
    return str(r.get("summary", ""))
