"""Bindings of the native kernels (ctypes over the library build.py makes), one class per kernel.

Every binding answers `accepts(...)`: whether it can take these tensors (dtype, device, layout); the
op functions in ops/__init__.py ask it and fall back to torch otherwise. Loaders return None where the
library cannot be built or the kernel cannot run (no AMX, switched off by the settings).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model.ops.build import load_library
from ppserve.model.ops.settings import current, generation

if TYPE_CHECKING:
    from ctypes import _CDataType, _NamedFuncPointer  # typeshed's names of a C type and a library's function

logger = logging.getLogger(__name__)
_K = TypeVar("_K")


class PagedDecode:
    """Decode attention reading K/V in place through the block table (see csrc/paged_attention.c)."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        args = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
                + [ctypes.c_int64] * 5)
        args += [ctypes.c_float, ctypes.c_int]
        self._fns = {}
        for dtype, name in ((torch.float32, "paged_decode_f32"), (torch.bfloat16, "paged_decode_bf16")):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[dtype] = fn

    def accepts(self, query: Tensor, kv_cache: Tensor) -> bool:
        """Decode queries [N, Hq, D] of a dtype it has a kernel for, D <= 256, the cache of the same dtype."""
        return query.dtype in self._fns and query.shape[2] <= 256 and kv_cache.dtype == query.dtype

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
        keys = kv_cache.data_ptr()  # the V plane one plane's bytes after it (pointers, not two index ops)
        status = self._fns[query.dtype](
            query.data_ptr(), keys, keys + kv_cache.stride(0) * kv_cache.element_size(),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), n, hq,
            hkv, d, bs, scale, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"paged decode kernel failed (status {status}: 1 = unsupported shape, "
                               "2 = out of memory)")
        return out


class Elementwise:
    """Fused bfloat16 RMSNorm (alone or after the residual add), SiLU-and-mul, in-place rotary and Qwen3's
    per-head q/k norm fused with the rotation (see csrc/elementwise_bf16.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, f32, nt = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._rms = self._bind(lib.rms_norm_bf16, [ptr, i64, ptr, ptr, i64, i64, f32, nt])
        self._add_rms = self._bind(lib.add_rms_norm_bf16, [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, nt])
        self._silu = self._bind(lib.silu_mul_bf16, [ptr, i64, ptr, i64, i64, nt])
        self._rope = self._bind(lib.rope_bf16, [ptr, i64, ptr, ptr, i64, i64, i64, nt])
        self._qk_norm_rope = self._bind(lib.qk_norm_rope_bf16,
                                        [ptr, i64, ptr, ptr, ptr, ptr, *[i64] * 4, f32, nt])

    @staticmethod
    def _bind(fn: _NamedFuncPointer, args: list[type[_CDataType]]) -> _NamedFuncPointer:
        fn.argtypes, fn.restype = args, None
        return fn

    @staticmethod
    def accepts(x: Tensor) -> bool:
        """bf16 on CPU: rows [T, H] with unit inner stride, or heads [T, H, D] with H x D contiguous."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return False
        if x.dim() == 2:
            return x.stride(1) == 1
        return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]

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
        self._add_rms(x.data_ptr(), y.data_ptr(), weight.contiguous().data_ptr(), total.data_ptr(),
                      out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return total, out

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter,
                   torch.get_num_threads())
        return out

    @staticmethod
    def _rotation_operands(what: str, x: Tensor, cos: Tensor,
                           sin: Tensor) -> tuple[int, int, int, Tensor, Tensor]:
        """The rotation kernels' checks: x [T, H, D] with heads contiguous (token rows may be strided), D even
        and at most 1024 -> (T, H, D, cos, sin as contiguous [T, D])."""
        t, h, d = x.shape
        if d > 1024 or d % 2 or x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError(f"{what}: unsupported layout shape={tuple(x.shape)} stride={x.stride()}")
        return t, h, d, cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()

    def rope_(self, x: Tensor, cos: Tensor, sin: Tensor) -> None:
        """Rotate x [T, H, D] in place (token rows may be strided, heads contiguous); cos/sin [T, 1, D]."""
        t, h, d, cos, sin = self._rotation_operands("rope", x, cos, sin)
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, h, d,
                   torch.get_num_threads())

    def qk_norm_rope_(self, qk: Tensor, q_weight: Tensor, k_weight: Tensor, q_heads: int, cos: Tensor,
                      sin: Tensor, eps: float) -> None:
        """In place, qk [T, Hq + Hk, D] (token rows may be strided, heads contiguous): each of the first
        `q_heads` heads of a token through RMSNorm with q_weight [D], the others with k_weight [D], then every
        head rotated with cos/sin [T, 1, D]: `rms_norm` per head and then `rope_`, bit for bit, in one
        call."""
        t, h, d, cos, sin = self._rotation_operands("qk_norm_rope", qk, cos, sin)
        if not 0 <= q_heads <= h:
            raise ValueError(f"qk_norm_rope: unsupported layout: {q_heads} query heads of {h} heads")
        if q_weight.shape != (d,) or k_weight.shape != (d,):
            raise ValueError(f"qk_norm_rope: weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} "
                             f"are not [{d}]")
        self._qk_norm_rope(qk.data_ptr(), qk.stride(0), q_weight.contiguous().data_ptr(),
                           k_weight.contiguous().data_ptr(), cos.data_ptr(), sin.data_ptr(), t, q_heads,
                           h - q_heads, d, eps, torch.get_num_threads())


class PrefillAttention:
    """Causal attention of one bf16 prefill chunk, K/V read through the block table, head dim 64 only: on
    AMX tiles (csrc/prefill_attention_amx.c) or with AVX512-BF16 dot products where there is no AMX
    (csrc/prefill_attention_avx512.c). Both take the same arguments and round the same way."""

    KERNELS = {"amx": "prefill_attention_bf16_amx", "avx512": "prefill_attention_bf16_avx512"}

    def __init__(self, lib: ctypes.CDLL, kernel: str = "amx") -> None:
        fn = getattr(lib, self.KERNELS[kernel])
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.argtypes += [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.kernel = kernel

    @staticmethod
    def accepts(q: Tensor, kv_cache: Tensor) -> bool:
        return (q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and q.shape[2] == 64
                and q.stride(2) == 1 and q.stride(1) == 64 and kv_cache.is_contiguous())

    def __call__(self, q: Tensor, kv_cache: Tensor, block_table: Tensor, context_len: int,
                 scale: float) -> Tensor:
        """q [ql, Hq, 64] (token rows may be strided); kv_cache [2, blocks, bs, Hkv, 64] already holding
        the chunk's own K/V; block_table [>= blocks needed] int64 -> [ql, Hq, 64]."""
        ql, hq, d = q.shape
        _, _, bs, hkv, _ = kv_cache.shape
        table = block_table.contiguous()
        if table.dtype != torch.int64 or table.numel() * bs < context_len:
            raise ValueError("prefill attention: the block table must be int64 and cover the context")
        out = torch.empty((ql, hq, d), dtype=q.dtype)
        status = self._fn(q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
                          table.data_ptr(), ql, context_len, hq, hkv, d, bs, scale, out.data_ptr(),
                          torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"prefill attention kernel ({self.kernel}) failed (status {status}: "
                               f"1 = unsupported shape, 2 = out of memory, 3 = built without "
                               f"{self.kernel.upper()})")
        return out


class GreedyArgmax:
    """Row-wise argmax of float32 logits with torch.argmax's semantics (see csrc/argmax.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.argmax_rows_f32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def accepts(logits: Tensor) -> bool:
        return (logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
                and logits.shape[1] > 0 and logits.stride(1) == 1)

    def __call__(self, logits: Tensor) -> list[int]:
        """logits [N, V] -> N indices."""
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._fn(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                 torch.get_num_threads())
        return out.tolist()


class MoeRouting:
    """What an MoE layer does around its grouped expert matmuls (see csrc/moe_route.c): the router (bf16, up
    to 16 experts), the pairs sorted by expert with their token rows gathered (any dtype, a permutation), and
    the experts' outputs weighted and summed back per token (bf16)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, nt = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._dispatch = lib.moe_dispatch
        self._dispatch.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, ptr, ptr, ptr, nt]
        self._dispatch.restype = ctypes.c_int
        self._combine = lib.moe_combine_bf16
        self._combine.argtypes = [ptr, ptr, ptr, nt, i64, i64, i64, ptr, nt]
        self._combine.restype = None
        self._route = lib.moe_route_bf16
        self._route.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, nt, nt, ptr, ptr, ptr, nt]
        self._route.restype = i64

    # Above this many multiply-adds a router's logits GEMM goes to torch (MKL), which is faster there than
    # the kernel's loop (docs/decisions.md#moe-native-routing).
    ROUTE_MAX_MACS = 1 << 17
    # A row of up to 16 experts is one register in the kernel (Mixtral's 8, the tests' 8). Beyond that torch's
    # chain is as fast, so wider routers keep it.
    ROUTE_MAX_EXPERTS = 16

    @classmethod
    def routes(cls, x: Tensor, weight: Tensor) -> bool:
        """bf16 token rows [T, H] on CPU with unit inner stride; the router's float32 weight [E, H]
        contiguous."""
        return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
                and weight.dtype == torch.float32 and weight.is_contiguous()
                and weight.shape[0] <= cls.ROUTE_MAX_EXPERTS)

    def route(self, x: Tensor, weight: Tensor, top_k: int, normalize: bool, weights_f32: bool,
              in_torch: Callable[[Tensor], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """x [T, H] bf16, weight [E, H] float32 -> (routing weights [T, k], float32 where `weights_f32` else
        bf16; expert ids [T, k]). Rows with an exact tie among their best k + 1 take their ids from
        torch.topk over their logits (the kernel's weights stand: tied experts weigh the same); where the
        kernel hands the batch back (a near tie, a NaN), `in_torch` routes it from the bf16 logits as the
        torch router does (see csrc/moe_route.c)."""
        t, h = x.shape
        experts = weight.shape[0]
        ids = torch.empty((t, top_k), dtype=torch.int64)
        weights = torch.empty((t, top_k), dtype=torch.float32 if weights_f32 else torch.bfloat16)
        tied_rows = torch.empty(t, dtype=torch.int64)
        if t * experts * h <= self.ROUTE_MAX_MACS:
            logits, rows = torch.empty((t, experts), dtype=torch.bfloat16), x.data_ptr()
        else:  # a GEMM of real size: torch's, the rest here
            logits, rows = F.linear(x.float(), weight).to(torch.bfloat16), None
        tied = self._route(rows, x.stride(0), weight.data_ptr(), logits.data_ptr(), t, h, experts, top_k,
                           int(normalize), int(weights_f32), weights.data_ptr(), ids.data_ptr(),
                           tied_rows.data_ptr(), torch.get_num_threads())
        if tied == -1:
            raise ValueError(f"MoE route: top-{top_k} of {experts} experts is outside what the kernel takes")
        if tied == -2:
            return in_torch(logits)
        # One topk over every row costs more the longer the batch, the tied rows' three indexing ops the same
        # whatever their number: those only for long batches with few ties.
        if tied and (t < 256 or tied * 4 >= t):
            ids = torch.topk(logits, top_k, dim=-1).indices
        elif tied:
            rows_tied = tied_rows[:tied]
            ids[rows_tied] = torch.topk(logits[rows_tied], top_k, dim=-1).indices
        return weights, ids

    @staticmethod
    def accepts(x: Tensor, topk_ids: Tensor) -> bool:
        """Token rows [T, H] on CPU with unit inner stride, int64 ids [T, k] contiguous."""
        return (x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and topk_ids.dtype == torch.int64
                and topk_ids.is_contiguous())

    def dispatch(self, x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, H], topk_ids [T, k] -> (rows [T k, H]: each pair's token row in expert order, stable;
        ends [E] int32: where each expert's run ends; pos [T k] int64: each pair's row in `rows`)."""
        t, k = topk_ids.shape
        h = x.shape[1]
        rows = torch.empty((t * k, h), dtype=x.dtype)
        ends = torch.empty(num_experts, dtype=torch.int32)
        pos = torch.empty(t * k, dtype=torch.int64)
        size = x.element_size()
        status = self._dispatch(x.data_ptr(), x.stride(0) * size, topk_ids.data_ptr(), t, k, num_experts,
                                h * size, rows.data_ptr(), pos.data_ptr(), ends.data_ptr(),
                                torch.get_num_threads())
        if status == 1:
            raise ValueError(f"MoE dispatch: an expert id outside [0, {num_experts})")
        if status != 0:
            raise RuntimeError(f"MoE dispatch failed (status {status}: 2 = out of memory)")
        return rows, ends, pos

    @staticmethod
    def combines(down: Tensor, topk_weights: Tensor) -> bool:
        """bf16 expert outputs [P, H] contiguous; weights [T, k] bf16 or float32, contiguous."""
        return (down.dtype == torch.bfloat16 and down.is_contiguous() and topk_weights.is_contiguous()
                and topk_weights.dtype in (torch.bfloat16, torch.float32))

    def combine(self, down: Tensor, pos: Tensor, topk_weights: Tensor) -> Tensor:
        """down [T k, H] in expert order, pos from `dispatch`, weights [T, k] -> [T, H] bf16."""
        t, k = topk_weights.shape
        h = down.shape[1]
        out = torch.empty((t, h), dtype=torch.bfloat16)
        self._combine(down.data_ptr(), pos.data_ptr(), topk_weights.data_ptr(),
                      int(topk_weights.dtype == torch.float32), t, k, h, out.data_ptr(),
                      torch.get_num_threads())
        return out


class PanelGemm:
    """bf16 GEMM against a weight prepacked by `pack` into 16-column pair-interleaved panels: on Intel AMX
    tiles (csrc/gemm_amx.c) or with AVX512-BF16 dot products where there is no AMX (csrc/gemm_avx512.c).
    Both take the same layout and arguments and round the same way."""

    KERNELS = {"amx": "gemm_bf16_amx", "avx512": "gemm_bf16_avx512"}
    # Every expert of an MoE layer in one call (`grouped`).
    GROUPED_KERNELS = {"amx": "grouped_gemm_bf16_amx", "avx512": "grouped_gemm_bf16_avx512"}

    def __init__(self, lib: ctypes.CDLL, kernel: str = "amx") -> None:
        fn = getattr(lib, self.KERNELS[kernel])
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        grouped = getattr(lib, self.GROUPED_KERNELS[kernel])
        grouped.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_int, ctypes.c_int]
        grouped.restype = ctypes.c_int
        self._grouped_fn = grouped
        self.kernel = kernel

    @staticmethod
    def accepts(weight: Tensor) -> bool:
        """Weights [N, K] the kernels take: bf16 on CPU, N and K multiples of 32."""
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
                and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)

    @staticmethod
    def pack(weight: Tensor) -> Tensor:
        """[N, K] -> [N/16, K/32, 16, 16, 2]: 16-column panels in the pair-interleaved ("VNNI") layout of an
        AMX B tile; each 64-byte row of a tile is also one AVX512-BF16 dot-product operand."""
        n, k = weight.shape
        return weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()

    @staticmethod
    def pack_gate_up(weight: Tensor) -> Tensor:
        """[2I, K] (gate rows, then up rows) -> `pack` of the rows reordered so that 16-row panels alternate
        gate, up: the layout `silu_mul` needs (I a multiple of 16)."""
        two_i, k = weight.shape
        halves = weight.detach().reshape(2, two_i // 32, 16, k)  # [gate | up][panel][row in panel]
        return PanelGemm.pack(halves.transpose(0, 1).reshape(two_i, k))

    def __call__(self, x: Tensor, packed: Tensor, bias: Tensor | None, silu_mul: bool = False) -> Tensor:
        """x [M, K] bf16 (any M; rows may be strided) -> x @ W^T + bias, [M, N] bf16; with `silu_mul`
        (a `pack_gate_up` weight, no bias) silu(gate) * up, [M, N/2], with the eager ops' roundings."""
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        n = packed.shape[0] * 16
        if x.dtype != torch.bfloat16 or k != packed.shape[1] * 32:
            raise ValueError(f"{self.kernel} GEMM: input {tuple(x.shape)} {x.dtype} does not match a packed "
                             f"weight [{n}, {packed.shape[1] * 32}]")
        out = torch.empty((m, n // 2 if silu_mul else n), dtype=torch.bfloat16)
        if m == 0:  # an empty microbatch part: nothing to compute (the kernels refuse M = 0)
            return out
        status = self._fn(x.data_ptr(), x.stride(0), packed.data_ptr(),
                          None if bias is None else bias.data_ptr(), out.data_ptr(), out.shape[1], m, n, k,
                          int(silu_mul), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{self.kernel} GEMM refused [{m}, {k}] x [{n}, {k}] (status {status})")
        return out

    def grouped(self, x: Tensor, packed: Tensor, ends: Tensor, silu_mul: bool = False) -> Tensor:
        """Rows of x [P, K] sorted by expert, expert e's rows ending at ends[e] (int32 [E], non-decreasing,
        ends[-1] = P), each times its expert's packed weight packed[e] ([E, ...] of `pack` or, with
        `silu_mul`, of `pack_gate_up`) -> [P, N] (or [P, N/2]): what calling this GEMM per expert gives, bit
        for bit, in one call (experts with no rows cost nothing)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        p, k = x.shape
        num_experts, n = packed.shape[0], packed.shape[1] * 16
        if (x.dtype != torch.bfloat16 or k != packed.shape[2] * 32 or ends.shape != (num_experts,)
                or ends.dtype != torch.int32):
            raise ValueError(f"{self.kernel} grouped GEMM: input {tuple(x.shape)} {x.dtype}, "
                             f"ends {tuple(ends.shape)} {ends.dtype} do not match {num_experts} packed "
                             f"weights [{n}, {packed.shape[2] * 32}]")
        if p != int(ends[-1]):
            raise ValueError(f"{self.kernel} grouped GEMM: the experts' rows end at {int(ends[-1])}, "
                             f"not at {p}")
        if not packed.is_contiguous():  # the kernel finds expert e's weight e strides in
            raise ValueError(f"{self.kernel} grouped GEMM: the packed weights must be one contiguous tensor")
        ends = ends.contiguous()
        out = torch.empty((p, n // 2 if silu_mul else n), dtype=torch.bfloat16)
        if p == 0:
            return out
        status = self._grouped_fn(x.data_ptr(), x.stride(0), packed.data_ptr(), packed.stride(0),
                                  ends.data_ptr(), num_experts, out.data_ptr(), out.shape[1], n, k,
                                  int(silu_mul), torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{self.kernel} grouped GEMM refused [{p}, {k}] x {num_experts} x [{n}, {k}] "
                               f"(status {status}: {'ends not non-decreasing' if status == 2 else 'shape'})")
        return out


_LOADED: dict[str, object] = {}  # kernel name -> its binding, or None where it cannot run here
_loaded_under = [generation()]  # the settings generation _LOADED was decided under


def _bound(name: str, make: Callable[[ctypes.CDLL], _K], needs_amx: bool = False) -> _K | None:
    """The kernel `make` binds, bound once per process (and again after `settings.configure`)."""
    if _loaded_under[0] != generation():
        forget_loaded()
    if name not in _LOADED:
        lib = load_library()
        if lib is not None and needs_amx and not _amx_granted(lib):
            lib = None
        _LOADED[name] = None if lib is None else make(lib)
    return _LOADED[name]  # type: ignore[return-value]


def _amx_granted(lib: ctypes.CDLL) -> bool:
    """AMX where the config allows it, the library was built with it and the kernel grants tile state."""
    if not current().amx:
        return False
    lib.amx_init.restype = ctypes.c_int
    if lib.amx_init() != 0:
        logger.info("no AMX here (CPU, compiler or kernel): bf16 GEMMs use AVX512-BF16 or oneDNN")
        return False
    return True


def forget_loaded() -> None:
    """Decide every kernel again (new settings, or a test that changed the environment)."""
    _LOADED.clear()
    load_library.cache_clear()
    _loaded_under[0] = generation()


def paged_decode() -> PagedDecode | None:
    return _bound("paged_decode", PagedDecode)


def elementwise() -> Elementwise | None:
    return _bound("elementwise", Elementwise)


def greedy_argmax() -> GreedyArgmax | None:
    return _bound("greedy_argmax", GreedyArgmax)


def moe_routing() -> MoeRouting | None:
    return _bound("moe_routing", MoeRouting)


def panel_gemm(kernel: str | None = None) -> PanelGemm | None:
    """The bf16 GEMM on prepacked panels: AMX where AMX is granted, else the AVX512-BF16 one where the
    library was built with it, else None (torch's oneDNN paths serve bf16 GEMMs). `model.linear_path:
    packed | plain` asks for oneDNN, so then None too. `kernel` ('amx' or 'avx512') asks for that one only
    (None where it cannot run here), whatever the linear path."""
    if kernel is None and current().linear_path != "auto":
        return None
    return _amx_else_avx512(kernel, PanelGemm, "gemm_bf16_avx512_built")


def prefill_attention(kernel: str | None = None) -> PrefillAttention | None:
    """The prefill attention kernel: AMX where the AMX GEMM works (same build and tile permission), else
    the AVX512-BF16 one where the library was built with it, else None (SDPA serves prefill chunks).
    `kernel` ('amx' or 'avx512') asks for that one only (None where it cannot run here)."""
    return _amx_else_avx512(kernel, PrefillAttention, "prefill_attention_bf16_avx512_built")


_Twin = TypeVar("_Twin", PanelGemm, PrefillAttention)


def _amx_else_avx512(kernel: str | None, binding: type[_Twin], avx512_built: str) -> _Twin | None:
    """A kernel written twice, for AMX and for AVX512-BF16 (`binding(lib, 'amx' | 'avx512')`): the AMX one
    where AMX is granted, else the other where the library was built with it (`avx512_built()` says)."""
    if kernel is not None and kernel not in binding.KERNELS:
        raise ValueError(f"unknown {binding.__name__} kernel {kernel!r} ({', '.join(binding.KERNELS)})")
    amx = _bound(f"{binding.__name__}:amx", binding, needs_amx=True) if kernel != "avx512" else None
    if amx is not None or kernel == "amx":
        return amx

    def make(lib: ctypes.CDLL) -> _Twin | None:
        built = getattr(lib, avx512_built)
        built.restype = ctypes.c_int
        return binding(lib, "avx512") if built() else None

    return _bound(f"{binding.__name__}:avx512", make)
