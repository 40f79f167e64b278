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
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor

logger = logging.getLogger(__name__)
_K = TypeVar("_K")

_CSRC = Path(__file__).with_name("csrc")  # every .c file here goes into one shared object
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
    sources = sorted(f for f in _CSRC.iterdir() if f.suffix in (".c", ".h"))
    key = hashlib.sha256("\0".join([*(f.read_text() for f in sources), *_COMPILE_FLAGS, *_LINK_FLAGS,
                                    *_LINK_LIBS, version, _cpu_flags(), platform.machine()]).encode()).hexdigest()[:16]
    target = kernel_cache_dir() / f"ppserve_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename into place: stage actors starting together may all build.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for src in (f for f in sources if f.suffix == ".c"):
            objects.append(str(Path(tmp) / f"{src.stem}.o"))
            _run([compiler, *_COMPILE_FLAGS, "-c", str(src), "-o", objects[-1]])
        lib = Path(tmp) / "ppserve_kernels.so"
        _run([compiler, *_LINK_FLAGS, *objects, "-o", str(lib), *_LINK_LIBS])
        os.replace(lib, target)
    return target


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")


@cache
def load_library() -> ctypes.CDLL | None:
    """The kernels' shared object, or None (logged once) where it cannot be built on this machine."""
    if platform.system() != "Linux" or os.environ.get("PPSERVE_DISABLE_NATIVE_KERNELS"):
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: native CPU kernels off, the torch path is used")
        return None
    try:
        return ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernels unavailable (%s): using the torch path", exc)
        return None


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

    def supports(self, dtype: torch.dtype, head_dim: int) -> bool:
        return dtype in self._fns and head_dim <= 256

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


class Elementwise:
    """Fused bfloat16 RMSNorm (alone or after the residual add), SiLU-and-mul and in-place rotary
    (see csrc/elementwise_bf16.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32, nt = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._rms = self._bind(lib.rms_norm_bf16, [ptr, i64, ptr, ptr, i64, i64, f32, nt])
        self._add_rms = self._bind(lib.add_rms_norm_bf16, [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, nt])
        self._silu = self._bind(lib.silu_mul_bf16, [ptr, i64, ptr, i64, i64, nt])
        self._rope = self._bind(lib.rope_bf16, [ptr, i64, ptr, ptr, i64, i64, i64, nt])

    @staticmethod
    def _bind(fn, args):
        fn.argtypes, fn.restype = args, None
        return fn

    @staticmethod
    def applies(x: Tensor) -> bool:
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [T, H] (rows may be strided) -> [T, H]."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms(x.data_ptr(), x.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), x.shape[0],
                  x.shape[1], eps, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: Tensor, y: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """x, y [T, H] -> (x + y, RMSNorm(x + y)), both new tensors, in one pass."""
        if x.shape != y.shape:
            raise ValueError(f"add_rms_norm: shapes differ {tuple(x.shape)} vs {tuple(y.shape)}")
        x, y = x.contiguous(), y.contiguous()
        total, out = torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)
        self._add_rms(x.data_ptr(), y.data_ptr(), weight.contiguous().data_ptr(), total.data_ptr(), out.data_ptr(),
                      x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return total, out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def rope_(self, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate x [T, H, D] in place (token rows may be strided, heads contiguous); cos/sin [T, 1, D]."""
        t, h, d = x.shape
        if d > 1024 or d % 2 or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"rope: unsupported layout shape={tuple(x.shape)} stride={x.stride()}")
        cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, h, d, torch.get_num_threads())


class PrefillAttention:
    """Causal attention of one bf16 prefill chunk on AMX tiles, K/V read through the block table (see
    csrc/prefill_attention_amx.c). Head dim 64 only."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.prefill_attention_bf16_amx
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.argtypes += [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def supports(q: Tensor, kv_cache: Tensor) -> bool:
        return (q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and q.shape[2] == 64
                and q.stride(2) == 1 and q.stride(1) == 64 and kv_cache.is_contiguous())

    def __call__(self, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_len: int, scale: float) -> Tensor:
        """q [ql, Hq, 64] (token rows may be strided); kv_cache [2, blocks, bs, Hkv, 64] already holding
        the chunk's own K/V; block_table [>= blocks needed] int64 -> [ql, Hq, 64]."""
        ql, hq, d = q.shape
        _, _, bs, hkv, _ = kv_cache.shape
        table = block_table.contiguous()
        if table.dtype != torch.int64 or table.numel() * bs < context_len:
            raise ValueError("prefill attention: the block table must be int64 and cover the context")
        out = torch.empty((ql, hq, d), dtype=q.dtype)
        status = self._fn(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), table.data_ptr(),
                          ql, context_len, hq, hkv, d, bs, scale, out.data_ptr(), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"prefill attention kernel failed (status {status}: 1 = unsupported shape, "
                               "2 = out of memory, 3 = built without AMX)")
        return out


class GreedyArgmax:
    """Row-wise argmax of float32 logits with torch.argmax's semantics (see csrc/argmax.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.argmax_rows_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def applies(logits: Tensor) -> bool:
        return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
                and logits.shape[1] > 0 and logits.stride(1) == 1)

    def __call__(self, logits: Tensor) -> list[int]:
        """logits [N, V] -> N indices."""
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._fn(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                 torch.get_num_threads())
        return out.tolist()


class AmxGemm:
    """bf16 GEMM on Intel AMX tiles against a weight prepacked by `pack` (see csrc/gemm_amx.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.gemm_bf16_amx
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    @staticmethod
    def fits(weight: Tensor) -> bool:
        """Weights [N, K] the kernel takes: bf16 on CPU, N and K multiples of 32."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)

    @staticmethod
    def pack(weight: Tensor) -> Tensor:
        """[N, K] -> [N/16, K/32, 16, 16, 2]: 16-column panels in AMX's pair-interleaved B-tile layout."""
        n, k = weight.shape
        return weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    @staticmethod
    def pack_gate_up(weight: Tensor) -> Tensor:
        """[2I, K] (gate rows, then up rows) -> `pack` of the rows reordered so that 16-row panels alternate
        gate, up: the layout `silu_mul` needs (I a multiple of 16)."""
        two_i, k = weight.shape
        halves = weight.detach().reshape(2, two_i // 32, 16, k)  # [gate | up][panel][row in panel]
        return AmxGemm.pack(halves.transpose(0, 1).reshape(two_i, k))

    def __call__(self, x: Tensor, packed: Tensor, bias: Tensor | None, silu_mul: bool = False) -> Tensor:
        """x [M, K] bf16 (any M; rows may be strided) -> x @ W^T + bias, [M, N] bf16; with `silu_mul`
        (a `pack_gate_up` weight, no bias) silu(gate) * up, [M, N/2], with the eager ops' roundings."""
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = packed.shape[0] * 16
        if x.dtype != torch.bfloat16 or k != packed.shape[1] * 32:
            raise ValueError(f"AMX GEMM: input {tuple(x.shape)} {x.dtype} does not match a packed weight [{n}, "
                             f"{packed.shape[1] * 32}]")
        out = torch.empty((m, n // 2 if silu_mul else n), dtype=torch.bfloat16)
        status = self._fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), out.shape[1], m, n, k, int(silu_mul), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"AMX GEMM refused [{m}, {k}] x [{n}, {k}] (status {status})")
        return out


def _bound(kernel: Callable[[ctypes.CDLL], _K]) -> _K | None:
    """`kernel` bound to the shared object, or None where it cannot be built."""
    lib = load_library()
    return None if lib is None else kernel(lib)


@cache
def load_paged_decode() -> PagedDecode | None:
    return _bound(PagedDecode)


@cache
def load_elementwise() -> Elementwise | None:
    return _bound(Elementwise)


@cache
def load_greedy_argmax() -> GreedyArgmax | None:
    return _bound(GreedyArgmax)


@cache
def load_amx_gemm() -> AmxGemm | None:
    """The AMX GEMM where the library was built with AMX and the kernel grants this process tile state."""
    lib = load_library()
    if lib is None or os.environ.get("PPSERVE_DISABLE_AMX"):
        return None
    lib.amx_init.restype = ctypes.c_int
    if lib.amx_init() != 0:
        logger.info("no AMX here (CPU, compiler or kernel): bf16 GEMMs use oneDNN")
        return None
    return AmxGemm(lib)


@cache
def load_prefill_attention() -> PrefillAttention | None:
    """The AMX prefill attention where AMX GEMMs work (same build and tile permission)."""
    lib = load_library()
    return None if lib is None or load_amx_gemm() is None else PrefillAttention(lib)
