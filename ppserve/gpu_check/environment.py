"""Phase `environment`: what the device is and what ppserve will pick on it."""

from __future__ import annotations

import importlib.util
import platform
import sys
from typing import Any

from ppserve.gpu_check import ABSENT_ON_DEVICE
from ppserve.gpu_check.phase import Context

# Dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (bytes/s) by device name, from the vendors' data
# sheets (SXM parts); the roofline phase reports achieved figures against these.
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         "L40S": (362e12, 0.864e12)}


def device_peaks(gpu_name: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, HBM bytes/s) of a device named like torch names it ("NVIDIA H200"), or None."""
    return next((peak for key, peak in PEAKS.items() if key in gpu_name), None)


def run(ctx: Context) -> dict[str, Any]:
    import torch

    from ppserve.model.backend_select import select_backend
    from ppserve.model.triton_attention import interpreting, triton_available

    info: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda, "triton": triton_available(),
        "triton_interpreter": interpreting(),
        "made_absent": {name: importlib.util.find_spec(name) is None for name in ABSENT_ON_DEVICE},
        "pytest": importlib.util.find_spec("pytest") is not None,
        "auto_attention_backend": select_backend(ctx.device).name,
    }
    if triton_available():
        import triton

        info["triton_version"] = triton.__version__
    if ctx.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible; --device cpu runs the phases that do not need one")
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), gpu_count=torch.cuda.device_count(),
                    peaks=device_peaks(props.name))
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32  # False: fp32 checks are fp32
    return info


def headline(r: dict[str, Any]) -> str:
    where = r.get("gpu") or "cpu"
    return f"{where}, torch {r['torch']} (cuda {r['cuda']}), triton {r.get('triton_version', 'absent')}, " \
           f"attention {r['auto_attention_backend']}"
