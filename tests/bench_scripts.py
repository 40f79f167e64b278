"""Benchmark scripts (benchmarks/*.py are scripts, not a package) loaded as modules, so that a test can run
a benchmark's own code on a tiny input and check what does not depend on the clock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `ppserve_bench_<name>` (loaded once)."""
    module_name = f"ppserve_bench_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
