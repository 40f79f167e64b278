"""Which attention backend a stage runs: the one place that knows every backend and where each can run."""

from __future__ import annotations

import importlib.util
import logging

import torch

from ppserve.config import ATTENTION_BACKENDS
from ppserve.model import triton_attention
from ppserve.model.attention import (
    AttentionBackend,
    CpuPagedBackend,
    FlashAttnBackend,
    SdpaBackend,
    flash_attn_available,
    flash_attn_import_error,
)
from ppserve.model.ops import native

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_broken_flash_attn(error: str | None) -> None:
    """Once per process: a flash-attn that is installed but does not import falls back, said plainly."""
    if error and error not in _warned:
        _warned.add(error)
        logger.warning("flash-attn is installed but does not import (%s); using the next attention backend. "
                       "Reinstall flash-attn for this torch/CUDA, or set model.attention_backend", error)


def select_backend(device: torch.device | str, prefer: str = "auto") -> AttentionBackend:
    """'auto' picks on CUDA flash-attn when importable, else the Triton paged kernel (torch ships Triton),
    else SDPA; on CPU the native paged kernel when it builds, else SDPA. A name forces one backend, with a
    clear error where it cannot run ('triton_paged' runs on CPU only under TRITON_INTERPRET=1, slowly:
    that is how CI checks the kernel)."""
    on_cuda = torch.device(device).type == "cuda"
    if prefer == "sdpa":
        return SdpaBackend()
    if prefer == "triton_paged":
        if not triton_attention.triton_available():
            raise ValueError("attention backend 'triton_paged' needs the triton package "
                             "(CUDA builds of torch ship it)")
        if not (on_cuda or triton_attention.interpreting()):
            raise ValueError("attention backend 'triton_paged' needs a CUDA device "
                             "(or TRITON_INTERPRET=1 to run its kernel slowly on CPU, for checks)")
        return triton_attention.TritonPagedBackend()
    if prefer in ("flash_attn", "flash"):
        if not (on_cuda and flash_attn_available()):
            broken = flash_attn_import_error() if importlib.util.find_spec("flash_attn") is not None else None
            raise ValueError("attention backend 'flash_attn' needs a CUDA device and the flash-attn package"
                             + (f"; the installed flash-attn does not import: {broken}" if broken else ""))
        return FlashAttnBackend()
    if prefer == "cpu_paged":
        kernel = None if on_cuda else native.paged_decode()
        if kernel is None:
            raise ValueError("attention backend 'cpu_paged' needs a CPU device and a C compiler to build its "
                             "kernel (see the log for the build error)")
        return CpuPagedBackend(kernel, native.prefill_attention())
    if prefer != "auto":
        raise ValueError(f"unknown attention backend {prefer!r} ({', '.join(ATTENTION_BACKENDS)})")
    if on_cuda:
        if flash_attn_available():
            return FlashAttnBackend()
        if importlib.util.find_spec("flash_attn") is not None and flash_attn_import_error() is not None:
            _warn_broken_flash_attn(flash_attn_import_error())
        return triton_attention.TritonPagedBackend() if triton_attention.triton_available() else SdpaBackend()
    kernel = native.paged_decode()
    return CpuPagedBackend(kernel, native.prefill_attention()) if kernel is not None else SdpaBackend()
