"""Which kernels a process may use: config fields (`model.*`), each with an environment override.

A stage worker calls `configure` once with its stage spec's settings before it builds its model; the
kernel loaders and the GEMM path choice read `current()`. The environment variables stay as overrides
for experiments (they win over the config): PPSERVE_DISABLE_NATIVE_KERNELS=1, PPSERVE_DISABLE_AMX=1,
PPSERVE_LINEAR_PATH=auto|packed|plain, PPSERVE_KERNEL_CACHE=DIR, PPSERVE_MOE_KERNEL=auto|grouped|triton.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from ppserve.cache import cache_root

LINEAR_PATHS = ("auto", "packed", "plain")
MOE_KERNELS = ("auto", "grouped", "triton")
QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True)
class KernelSettings:
    native: bool = True  # model.native_kernels: ppserve's C kernels on CPU (built on first use)
    amx: bool = True  # model.amx_kernels: the AMX GEMM and prefill attention where the CPU has AMX
    # model.linear_path: panel GEMM, else oneDNN timed per shape; or oneDNN packed | plain
    linear_path: str = "auto"
    # model.kernel_cache_dir: where built kernels are kept (<cache root>/kernels, ppserve/cache.py)
    cache_dir: str | None = None
    moe_kernel: str = "auto"  # model.moe_kernel: the MoE experts' path (ops/moe.py): auto | grouped | triton
    # model.quantization: None, or "int8" (linear weights of a float checkpoint made int8 at load)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.linear_path not in LINEAR_PATHS:
            raise ValueError(f"linear path must be one of {LINEAR_PATHS}, got {self.linear_path!r}")
        if self.moe_kernel not in MOE_KERNELS:
            raise ValueError(f"MoE kernel must be one of {MOE_KERNELS}, got {self.moe_kernel!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    @property
    def kernel_cache(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else cache_root() / "kernels"


_configured = KernelSettings()
_generation = 0  # bumped by every configure: kernels bound under older settings are decided again


def configure(settings: KernelSettings) -> None:
    """Set this process's kernel settings (a stage worker, before building its model)."""
    global _configured, _generation
    if settings != _configured:
        _configured = settings
        _generation += 1


def generation() -> int:
    return _generation


def current() -> KernelSettings:
    """The configured settings with the environment's overrides applied."""
    s = _configured
    env = os.environ
    if env.get("PPSERVE_DISABLE_NATIVE_KERNELS"):
        s = replace(s, native=False)
    if env.get("PPSERVE_DISABLE_AMX"):
        s = replace(s, amx=False)
    if env.get("PPSERVE_LINEAR_PATH"):
        s = replace(s, linear_path=env["PPSERVE_LINEAR_PATH"])
    if env.get("PPSERVE_KERNEL_CACHE"):
        s = replace(s, cache_dir=env["PPSERVE_KERNEL_CACHE"])
    if env.get("PPSERVE_MOE_KERNEL"):
        s = replace(s, moe_kernel=env["PPSERVE_MOE_KERNEL"])
    return s
