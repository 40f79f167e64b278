"""Native CPU kernels, built on first use with the system C compiler and loaded with ctypes.

Why C and ctypes rather than a torch C++ extension: the kernel needs no torch headers, so it builds in
about a second (a torch extension takes ~45 s and needs ninja) and the build can happen lazily inside
every stage actor. It runs its loops under OpenMP on the libgomp torch already loaded, with the thread
count torch uses in the calling thread.

The shared object is cached under ~/.cache/ppserve/kernels (or $PPSERVE_KERNEL_CACHE), keyed by the
source, the compiler flags, the compiler and the CPU's feature flags (it is built with -march=native).
When no compiler is present or the build fails, `load_paged_decode()` returns None and callers fall
back to the pure-torch path; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
# -ffast-math lets gcc vectorise the dot-product reductions and expf (libmvec). It is passed to the compile
# step only: linking a shared object with it would pull in crtfastmath, which switches the whole process
# (torch included) to flush-denormals-to-zero when the library loads.
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_LINK_LIBS = ["-lmvec", "-lm"]


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("PPSERVE_KERNEL_CACHE", Path.home() / ".cache" / "ppserve" / "kernels"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), *_COMPILE_FLAGS, *_LINK_FLAGS, *_LINK_LIBS, version,
                                    _cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    target = kernel_cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename into place: stage actors starting together may all build.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, lib = Path(tmp) / "paged_attention.o", Path(tmp) / "paged_attention.so"
        for cmd in ([compiler, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
                    [compiler, *_LINK_FLAGS, str(obj), "-o", str(lib), *_LINK_LIBS]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.replace(lib, target)
    return target


class PagedDecode:
    """Decode attention reading K/V in place through the block table (see csrc/paged_attention.c)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
        args += [ctypes.c_float, ctypes.c_int]
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"), (torch.bfloat16, "paged_decode_bf16")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, head_dim: int, group: int) -> bool:
        return dtype in self._fns and head_dim <= 256 and group <= 64

    def __call__(self, query: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                 scale: float) -> Tensor:
        """query [N, Hq, D]; kv_cache [2, blocks, block_size, Hkv, D]; block_tables [N, >= needed] int64
        (rows may be a strided slice); context_lens [N] int64 -> [N, Hq, D]."""
        n, hq, d = query.shape
        _, _, bs, hkv, _ = kv_cache.shape
        query = query.contiguous()
        if not (kv_cache.is_contiguous() and query.dtype == kv_cache.dtype and block_tables.stride(1) == 1
                and block_tables.dtype == torch.int64 and context_lens.dtype == torch.int64):
            raise ValueError("paged decode: cache must be contiguous and match the query dtype; "
                             "block tables and context lengths int64 with unit column stride")
        context_lens = context_lens.contiguous()
        out = torch.empty_like(query)
        status = self._fns[query.dtype](
            query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), n, hq, hkv, d, bs, scale,
            torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"paged decode kernel failed (status {status}: 1 = unsupported shape, 2 = out of memory)")
        return out


@cache
def load_paged_decode() -> PagedDecode | None:
    """The native kernel, or None (logged once) where it cannot be built on this machine."""
    if platform.system() != "Linux" or os.environ.get("PPSERVE_DISABLE_NATIVE_KERNELS"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: decode attention uses the torch (gather + SDPA) path")
        return None
    try:
        return PagedDecode(ctypes.CDLL(str(_build(compiler))))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native paged-attention kernel unavailable (%s): using the torch path", exc)
        return None
