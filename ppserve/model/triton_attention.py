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
# the page loops' software-pipeline depth: one page's loads in flight under the other's dots
PIPELINE_STAGES = 2


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
        stride_ot, stride_oh, stride_bt, table_width,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr, DYNAMIC_TRIPS: tl.constexpr,
        NUM_STAGES: tl.constexpr,
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
            # A counted `for` that Triton's software pipeliner overlaps (the next page's loads under this
            # page's dots); a data-dependent `while` it does not pipeline. Compiled, the trip count is the
            # tile's own pages; the interpreter (the CPU check) cannot take a loaded scalar as a range
            # bound, so there it walks the table's width with the pages past `seen` masked (no loads,
            # nothing visible: the same result).
            n_pages = tl.cdiv(seen, PAGE)
            if DYNAMIC_TRIPS:
                trips = n_pages
            else:
                trips = table_width
            for page in tl.range(0, trips, num_stages=NUM_STAGES):
                live = page < n_pages
                block = tl.load(block_tables_ptr + seq * stride_bt + page, mask=live, other=0)
                k_ptrs = (kv_ptr + block * stride_kv_block + slots[:, None] * stride_kv_slot
                          + kv_head * stride_kv_head + d[None, :])
                live_slots = (slots * 0 + page) < n_pages  # [PAGE]: `live` for every slot (the interpreter
                kv_ok = live_slots[:, None] & d_ok[None, :]  # widens a scalar mask's & to int32)
                k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
                v = tl.load(k_ptrs + stride_kv_kind, mask=kv_ok, other=0.0)
                s = tl.dot(q, tl.trans(k.to(DOT_TY)), input_precision=PRECISION).to(tl.float32) * scale
                key_pos = page * PAGE + slots
                visible = ((key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] < ctx) & row_ok[:, None]
                           & live_slots[None, :])
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v.to(DOT_TY),
                                                    input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return paged_attention_kernel


def paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, cu_query_lens: Tensor,
                    context_lens: Tensor, max_query_len: int, scale: float) -> Tensor:
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
        out.stride(0), out.stride(1), block_tables.stride(0), block_tables.shape[1],
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)), PAGE=page, BLOCK_M=BLOCK_M,
        DOT_TY=_dot_type(q.dtype), DYNAMIC_TRIPS=not interpreting(), NUM_STAGES=PIPELINE_STAGES,
        # float32 stays float32 (no TF32 rounding): it is the dtype exactness is checked in
        PRECISION="ieee" if _dot_type(q.dtype) == _dot_type(torch.float32) else "tf32",
    )
    return out


# Split-K decode: a decode-only microbatch of few sequences gives the kernel above one program per
# (sequence, KV head), a handful of an H200's 132 SMs, each walking a long context alone. Splitting each
# context into pieces of PAGES_PER_SPLIT pages gives every piece its own program (its partial softmax:
# running max, sum and unnormalised output), and a second small kernel combines the pieces. Whether and
# how much to split depends on shapes only (sequences, KV heads, the table's width), so a CUDA graph
# captures one fixed plan per shape.
MIN_PAGES_PER_SPLIT = 4  # at page 16: 64 keys, below which a piece costs more to combine than to walk
MAX_SPLITS = 64
CPU_SM_COUNT = 132  # the interpreter has no SMs: plan as on an H100/H200, so CI walks the GPU's decisions
_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


def split_k_plan(num_seqs: int, num_kv_heads: int, table_width: int, sms: int) -> int | None:
    """Pages per split for a decode-only microbatch, or None when the plain kernel fills the GPU
    already (at least one program per SM) or the contexts are too short to be worth splitting."""
    programs = num_seqs * num_kv_heads
    if programs >= sms or table_width < 2 * MIN_PAGES_PER_SPLIT:
        return None
    want = min(MAX_SPLITS, -(-2 * sms // programs))  # ~2 programs per SM
    pages = max(MIN_PAGES_PER_SPLIT, -(-table_width // want))
    return pages if -(-table_width // pages) >= 2 else None


def _build_split_k_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def split_k_decode_kernel(
        q_ptr, kv_ptr, acc_ptr, m_ptr, l_ptr, block_tables_ptr, ctx_ptr, scale,
        stride_qt, stride_qh, stride_kv_kind, stride_kv_block, stride_kv_slot, stride_kv_head, stride_bt,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_M: tl.constexpr, PAGES_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_TY: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + seq)
        rows = tl.arange(0, BLOCK_M)  # the query heads of this KV head's group (one decode token)
        row_ok = rows < GROUP
        head = kv_head * GROUP + rows
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_TY)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        slots = tl.arange(0, PAGE)
        last = tl.minimum(split * PAGES_PER_SPLIT + PAGES_PER_SPLIT, (ctx + PAGE - 1) // PAGE)
        # A fixed trip count (the split's pages, a constant), pipelined; pages past the context masked.
        for i in tl.range(0, PAGES_PER_SPLIT, num_stages=NUM_STAGES):
            page = split * PAGES_PER_SPLIT + i
            live = page < last
            block = tl.load(block_tables_ptr + seq * stride_bt + page, mask=live, other=0)
            k_ptrs = (kv_ptr + block * stride_kv_block + slots[:, None] * stride_kv_slot
                      + kv_head * stride_kv_head + d[None, :])
            # [PAGE]: `live` for every slot (see paged_attention_kernel)
            live_slots = (slots * 0 + page) < last
            kv_ok = live_slots[:, None] & d_ok[None, :]
            k = tl.load(k_ptrs, mask=kv_ok, other=0.0)
            v = tl.load(k_ptrs + stride_kv_kind, mask=kv_ok, other=0.0)
            s = tl.dot(q, tl.trans(k.to(DOT_TY)), input_precision=PRECISION).to(tl.float32) * scale
            visible = ((page * PAGE + slots)[None, :] < ctx) & row_ok[:, None] & live_slots[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_TY), v.to(DOT_TY),
                                                input_precision=PRECISION).to(tl.float32)
            m_i = m_new
        part = (seq * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M] partial index per query head
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)

    @triton.jit
    def split_k_combine_kernel(
        acc_ptr, m_ptr, l_ptr, out_ptr, stride_ot, stride_oh,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        sp_ok = sp < NUM_SPLITS
        base = (seq * NUM_HEADS + head) * NUM_SPLITS
        m = tl.load(m_ptr + base + sp, mask=sp_ok, other=float("-inf"))
        l = tl.load(l_ptr + base + sp, mask=sp_ok, other=0.0)  # noqa: E741 - the softmax sum, as in the papers
        m_max = tl.max(m, 0)
        w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for a piece past the context
        w = tl.where(sp_ok, w, 0.0)
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(acc_ptr + (base + sp)[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
        denom = tl.sum(l * w, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
        tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_DIM)

    return split_k_decode_kernel, split_k_combine_kernel


_split_k_kernels: dict[bool, tuple[Any, Any]] = {}


def paged_decode_split_k(q: Tensor, kv_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
                         scale: float, pages_per_split: int) -> Tensor:
    """One decode token per sequence (q [N, Hq, D]) over the paged cache, each context split into pieces
    of `pages_per_split` pages walked in parallel, then combined -> [N, Hq, D]. Same result as
    paged_attention up to float32 summation order."""
    import triton

    kernels = _split_k_kernels.get(interpreting())
    if kernels is None:
        kernels = _split_k_kernels[interpreting()] = _build_split_k_kernels()
    decode, combine = kernels
    n, hq, d = q.shape
    _, _, page, hkv, _ = kv_cache.shape
    out = torch.empty_like(q)
    if n == 0:
        return out
    splits = -(-block_tables.shape[1] // pages_per_split)
    block_d = max(16, triton.next_power_of_2(d))
    acc = torch.empty(n, hq, splits, block_d, dtype=torch.float32, device=q.device)
    m = torch.empty(n, hq, splits, dtype=torch.float32, device=q.device)
    lsum = torch.empty_like(m)
    dot_ty = _dot_type(q.dtype)
    decode[(n, hkv, splits)](
        q, kv_cache, acc, m, lsum, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0),
        NUM_HEADS=hq, GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, PAGE=page,
        BLOCK_M=max(16, triton.next_power_of_2(hq // hkv)), PAGES_PER_SPLIT=pages_per_split,
        NUM_SPLITS=splits,
        DOT_TY=dot_ty, PRECISION="ieee" if dot_ty == _dot_type(torch.float32) else "tf32",
        NUM_STAGES=PIPELINE_STAGES,
    )
    combine[(n, hq)](acc, m, lsum, out, out.stride(0), out.stride(1), NUM_HEADS=hq, HEAD_DIM=d,
                     BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out


class TritonPagedBackend(AttentionBackend):
    """Every sequence of a microbatch, prefill chunks and decodes, in one Triton launch over the paged
    cache. The default on CUDA when flash-attn is not installed; CUDA-graph capturable (decode-only
    microbatches read only the metadata's tensors)."""

    name = "triton_paged"
    MIN_PAGE = 16  # tl.dot needs 16 keys per page; smaller blocks go to SDPA

    def __init__(self) -> None:
        self._fallback = SdpaBackend()
        if torch.cuda.is_available():  # read the SM count now, not first inside a CUDA graph capture
            sm_count(torch.device("cuda", torch.cuda.current_device()))

    def reads_cache_in_place(self, block_size: int) -> bool:
        return block_size >= self.MIN_PAGE

    def interpreted(self, device: torch.device) -> bool:
        return device.type != "cuda"  # off CUDA the kernels run only under TRITON_INTERPRET=1

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float) -> Tensor:
        if meta.block_size < self.MIN_PAGE:
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefill_seqs:  # decode-only: the tensors a CUDA graph's static buffers hold
            ctx, tables = meta.decode_context_lens, meta.decode_block_tables
            pages = split_k_plan(tables.shape[0], kv_cache.shape[3], tables.shape[1], sm_count(q.device))
            if pages is not None:  # few sequences, long tables: the context split over more SMs
                return paged_decode_split_k(q, kv_cache, tables, ctx, scale, pages)
            cu_q = meta.cu_query_lens_t
        else:
            if "triton_ctx" not in meta.scratch:  # once per step, shared by the layers
                meta.scratch["triton_ctx"] = meta.cu_context_lens_t.diff()
            ctx, tables, cu_q = meta.scratch["triton_ctx"], meta.block_tables, meta.cu_query_lens_t
        return paged_attention(q, kv_cache, tables, cu_q, ctx, meta.max_query_len, scale)
