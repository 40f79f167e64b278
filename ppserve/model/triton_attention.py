"""Paged attention in Triton: the GPU path that needs nothing beyond torch (which ships Triton).

One kernel serves a whole mixed microbatch (prefill chunks and decodes) and reads K/V in place through
the block table: no gather copy, no host sync, so CUDA graphs capture it. A program owns one sequence,
one KV head and a tile of rows, where a row is (query token, query head of that KV head's group): a
decode's whole group of query heads shares one pass over its K/V, and a prefill chunk's tokens fill the
tile. It walks the sequence's KV pages up to the last position its rows may see (causal, aligned
bottom-right: query i of a chunk of q tokens in a context of c sits at position c - q + i) with an
online softmax in float32.

Correct on CPU too under Triton's interpreter (TRITON_INTERPRET=1), which is how CI checks it against
SDPA; the speed is a GPU matter.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch
from torch import Tensor

from ppserve.model.attention import AttentionBackend, AttentionMetadata, SdpaBackend, write_kv

BLOCK_M = 16  # rows (query token x group head) per program


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


_kernels: dict[bool, Any] = {}  # built on first use, one per mode (compiled, interpreted)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_type(dtype: torch.dtype) -> Any:
    """The operand type of the kernel's two matrix products. On a GPU: the model's dtype (bf16/fp16 on
    tensor cores, float32 accumulators). Under the interpreter: float32, because it computes tl.dot in
    NumPy, which has no bfloat16 (a bf16 dot there returns garbage); loads, stores and the softmax
    still run in the model's dtype, so the CPU check covers everything but the tensor-core rounding."""
    import triton.language as tl

    if dtype == torch.float32 or interpreting():
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        q_ptr, kv_ptr, out_ptr, block_tables_ptr, cu_q_ptr, ctx_ptr, scale,
        stride_qt, stride_qh, stride_kv_kind, stride_kv_block, stride_kv_slot, stride_kv_head,
        stride_ot, stride_oh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        ctx = tl.load(ctx_ptr + seq)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = tok < q_len
        if tile * BLOCK_M < q_len * GROUP:
            q_pos = ctx - q_len + tok  # bottom-right causal alignment
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TY)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
            seen = ctx - q_len + last_tok + 1  # keys the tile's last row may see
            slots = tl.arange(0, PAGE)
            # A while loop, not range(cdiv(seen, PAGE)): Triton's interpreter (the CPU check) cannot turn a
            # loaded scalar into a Python int under NumPy >= 2.4; compiled, both lower to the same loop.
            page = 0
            while page * PAGE < seen:
                block = tl.load(block_tables_ptr + seq * stride_bt + page)
                k_ptrs = (kv_ptr + block * stride_kv_block + slots[:, None] * stride_kv_slot
                          + kv_head * stride_kv_head + d[None, :])
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
                v = tl.load(k_ptrs + stride_kv_kind, mask=d_ok[None, :], other=0.0)
                s = tl.dot(q, tl.trans(k.to(DOT_TY)), input_precision=PRECISION).to(tl.float32) * scale
                key_pos = page * PAGE + slots
                visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < ctx) & row_ok[:, None]
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION).to(tl.float32)
                m_i = m_new
                page += 1
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return paged_attention_kernel


def paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, cu_query_lens: Tensor, context_lens: Tensor,
                    max_query_len: int, scale: float) -> Tensor:
    """q [T, Hq, D] over the paged cache [2, blocks, page, Hkv, D]: causal attention of each sequence's
    queries (cu_query_lens [S + 1] int32 offsets into q) over its first context_lens[s] cached tokens
    (the step's own K/V already written) -> [T, Hq, D]."""
    import triton

    kernel = _kernels.get(interpreting())
    if kernel is None:
        kernel = _kernels[interpreting()] = _build_kernel()

    t, hq, d = q.shape
    _, _, page, hkv, _ = kv_cache.shape
    group = hq // hkv
    seqs = block_tables.shape[0]
    out = torch.empty_like(q)
    if t == 0 or seqs == 0:
        return out
    kv = kv_cache  # read in its own dtype, converted in registers (cache.dtype may differ from q's)
    tiles = triton.cdiv(max_query_len * group, BLOCK_M)
    kernel[(seqs, tiles, hkv)](
        q, kv, out, block_tables, cu_query_lens, context_lens, scale,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE=page, BLOCK_M=BLOCK_M,
        DOT_TY=_dot_type(q.dtype),
        # float32 stays float32 (no TF32 rounding): it is the dtype exactness is checked in
        PRECISION="ieee" if _dot_type(q.dtype) == _dot_type(torch.float32) else "tf32",
    )
    return out


class TritonPagedBackend(AttentionBackend):
    """Every sequence of a microbatch, prefill chunks and decodes, in one Triton launch over the paged
    cache. The default on CUDA when flash-attn is not installed; CUDA-graph capturable (decode-only
    microbatches read only the metadata's tensors)."""

    name = "triton_paged"
    MIN_PAGE = 16  # tl.dot needs 16 keys per page; smaller blocks go to SDPA

    def __init__(self) -> None:
        self._fallback = SdpaBackend()

    def reads_cache_in_place(self, block_size: int) -> bool:
        return block_size >= self.MIN_PAGE

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float) -> Tensor:
        if meta.block_size < self.MIN_PAGE:
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefill_seqs:  # decode-only: the tensors a CUDA graph's static buffers hold
            ctx, tables = meta.decode_context_lens, meta.decode_block_tables
            cu_q = meta.cu_query_lens_t
        else:
            if "triton_ctx" not in meta.scratch:  # once per step, shared by the layers
                meta.scratch["triton_ctx"] = meta.cu_context_lens_t.diff()
            ctx, tables, cu_q = meta.scratch["triton_ctx"], meta.block_tables, meta.cu_query_lens_t
        return paged_attention(q, kv_cache, tables, cu_q, ctx, meta.max_query_len, scale)
