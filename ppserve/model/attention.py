"""Paged attention over a flattened mixed batch of prefill chunks and decodes (SDPA and flash-attn backends).

A step's tokens from all sequences are concatenated without padding: q/k/v are [T, heads, head_dim].
Each layer's KV cache is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V);
a sequence's tokens live in the blocks listed in its row of the block table.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model.ops.native import PagedDecode, PrefillAttention

logger = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached tokens each sequence's queries may see."""

    slot_mapping: Tensor  # [T] int64: block_id * block_size + offset for each new token
    query_lens: list[int]  # per sequence: tokens computed this step
    context_lens: list[int]  # per sequence: KV length after this step (earlier tokens + query_len)
    block_tables: Tensor  # [S, max_blocks] int64, padded with 0
    block_size: int
    # Derived by build(); kept as fields so backends do no Python work per layer.
    cu_query_lens: list[int]  # [S + 1] token offsets of each sequence in the flat batch
    decode_seqs: list[int]  # sequences with query_len == 1 (decodes, or 1-token prefill chunks)
    prefill_seqs: list[int]  # sequences with query_len > 1
    decode_token_idx: Tensor  # [Nd] int64: flat token index of each decode's query
    decode_context_lens: Tensor  # [Nd] int64
    decode_block_tables: Tensor  # [Nd, blocks needed by the longest decode] int64
    cu_query_lens_t: Tensor  # [S + 1] int32, for flash-attn
    cu_context_lens_t: Tensor  # [S + 1] int32, for flash-attn
    max_query_len: int
    max_context_len: int
    # Tensors derived on first use by the first layer of a step and reused by the others (masks, gather
    # indices): the backends' per-step work is done once, not once per layer.
    scratch: dict[object, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.cu_query_lens[-1]

    @functools.cached_property
    def prefill_runs(self) -> list[tuple[int, int]]:
        """The prefill chunks as runs (first sequence, number of sequences), in batch order: consecutive
        sequences that are whole prompts (no earlier context) of one length make one run, which attention
        takes in one batched call; any other chunk is a run of one. Derived once per step, on first use."""
        runs: list[tuple[int, int]] = []
        for i in self.prefill_seqs:
            ql = self.query_lens[i]
            fresh = self.context_lens[i] == ql
            if runs and fresh:
                first, n = runs[-1]
                if first + n == i and self.query_lens[first] == ql and self.context_lens[first] == ql:
                    runs[-1] = (first, n + 1)
                    continue
            runs.append((i, 1))
        return runs

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @classmethod
    def build(cls, query_lens: Sequence[int], context_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str = "cpu",
              slot_mapping: Tensor | None = None) -> AttentionMetadata:
        """Build metadata from per-sequence lists; computes the slot mapping unless one is given."""
        query_lens, context_lens = [int(x) for x in query_lens], [int(x) for x in context_lens]
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError(f"per-sequence lists differ in length: {len(query_lens)}, "
                             f"{len(context_lens)}, {len(block_tables)}")
        for i, (q, c, bt) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
            if q < 1 or c < q:
                raise ValueError(f"sequence {i}: query_len {q} must be >= 1 and <= context_len {c}")
            if len(bt) * block_size < c:
                raise ValueError(f"sequence {i}: {len(bt)} blocks of {block_size} cannot hold {c} tokens")
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        cu_ctx = [0]
        for c in context_lens:
            cu_ctx.append(cu_ctx[-1] + c)
        if slot_mapping is None:
            slots: list[int] = []
            for q, c, bt in zip(query_lens, context_lens, block_tables, strict=True):
                slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(c - q, c))
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        width = max((len(bt) for bt in block_tables), default=0)
        padded = [list(bt) + [0] * (width - len(bt)) for bt in block_tables]
        tables = torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(padded), width)
        decodes = decode_indices(query_lens)
        return cls.from_device(
            query_lens, context_lens, block_size, slot_mapping=slot_mapping, block_tables=tables,
            decode_index=torch.tensor(decodes, dtype=torch.int64, device=device),
            decode_token_idx=torch.tensor([cu[i] for i in decodes], dtype=torch.int64, device=device),
            decode_context_lens=torch.tensor([context_lens[i] for i in decodes], dtype=torch.int64,
                                             device=device),
            cu_query_lens_t=torch.tensor(cu, dtype=torch.int32, device=device),
            cu_context_lens_t=torch.tensor(cu_ctx, dtype=torch.int32, device=device),
        )

    @classmethod
    def from_device(cls, query_lens: list[int], context_lens: list[int], block_size: int, *,
                    slot_mapping: Tensor, block_tables: Tensor, decode_index: Tensor,
                    decode_token_idx: Tensor, decode_context_lens: Tensor, cu_query_lens_t: Tensor,
                    cu_context_lens_t: Tensor) -> AttentionMetadata:
        """Metadata from tensors already on the device (the stage's input batch uploads them in one
        copy: worker/staging.py) and the per-sequence lengths the backends loop over on the host.
        `block_tables` [S, >= the batch's widest table]; `decode_index` the decodes' rows in it."""
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        decodes = decode_indices(query_lens)
        dec_blocks = -(-max((context_lens[i] for i in decodes), default=0) // block_size)
        return cls(
            slot_mapping=slot_mapping,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=block_size,
            cu_query_lens=cu,
            decode_seqs=decodes,
            prefill_seqs=[i for i, q in enumerate(query_lens) if q > 1],
            decode_token_idx=decode_token_idx,
            decode_context_lens=decode_context_lens,
            decode_block_tables=block_tables.index_select(0, decode_index)[:, :dec_blocks],
            cu_query_lens_t=cu_query_lens_t,
            cu_context_lens_t=cu_context_lens_t,
            max_query_len=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
        )

    @classmethod
    def for_static_decodes(cls, slot_mapping: Tensor, context_lens: Tensor, block_tables: Tensor,
                           block_size: int, cu_query_lens_t: Tensor, decode_token_idx: Tensor,
                           cu_context_lens_t: Tensor) -> AttentionMetadata:
        """Decode-only metadata made of given device buffers only (a CUDA graph's static inputs).

        Everything the backends read on the decode path is one of these tensors, and nothing here
        copies host data to the device or syncs: a graph captured with this metadata and replayed after
        new values are copied into the buffers sees the new values. The caller allocates the buffers once:
        `cu_query_lens_t` = [0..n] int32, `decode_token_idx` = [0..n) int64, `cu_context_lens_t` = multiples
        of the table's capacity (int32). The Python lists are fixed at their shapes: query lengths all 1,
        context lengths the table's capacity (an upper bound; only `decode_context_lens`, the tensor, is
        read per token).
        """
        n, width = block_tables.shape
        capacity = width * block_size
        return cls(
            slot_mapping=slot_mapping,
            query_lens=[1] * n,
            context_lens=[capacity] * n,
            block_tables=block_tables,
            block_size=block_size,
            cu_query_lens=list(range(n + 1)),
            decode_seqs=list(range(n)),
            prefill_seqs=[],
            decode_token_idx=decode_token_idx,
            decode_context_lens=context_lens,
            decode_block_tables=block_tables,
            cu_query_lens_t=cu_query_lens_t,
            cu_context_lens_t=cu_context_lens_t,
            max_query_len=1,
            max_context_len=capacity,
        )

    def context_slots(self) -> Tensor:
        """[sum(context_lens)] int64: cache slots of every sequence's whole context, in sequence order;
        derived once per step (the first layer's call) and shared by the others."""
        cached = self.scratch.get("context_slots")
        if cached is None:
            cached = self.scratch["context_slots"] = self._context_slots()
        return cached

    def _context_slots(self) -> Tensor:
        device = self.block_tables.device
        ctx = self.cu_context_lens_t.diff().to(torch.int64)  # [S]
        # The total is known on the host: given as output_size, repeat_interleave does not read it back.
        seq_of = torch.repeat_interleave(torch.arange(len(ctx), device=device), ctx,
                                         output_size=sum(self.context_lens))  # [sum ctx]
        pos = (torch.arange(seq_of.numel(), device=device)
               - self.cu_context_lens_t[:-1].to(torch.int64)[seq_of])
        block = self.block_tables[seq_of, pos // self.block_size]
        return block * self.block_size + pos % self.block_size


def decode_indices(query_lens: Sequence[int]) -> list[int]:
    """The sequences that compute one token this step (decodes, or 1-token prefill chunks)."""
    return [i for i, q in enumerate(query_lens) if q == 1]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                             num_layers: int = 1) -> int:
    """Bytes one block costs over `num_layers` layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * block_size * num_kv_heads * head_dim * elem * num_layers


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[Tensor]:
    """One zeroed cache tensor per layer. Zeros, not empty: masked-out slots are still multiplied by 0
    inside attention, and uninitialised memory may hold NaN bit patterns that would survive that."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def write_kv(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter this step's k/v [T, Hkv, D] into the cache at their flat slots: both planes in one scatter
    (the pair stacked first), half the ops of one per plane (docs/decisions.md#kv-write-one-scatter)."""
    _, _, _, hkv, d = kv_cache.shape
    kv_cache.view(2, -1, hkv, d).index_copy_(1, slot_mapping, torch.stack((k, v)).to(kv_cache.dtype))


class AttentionBackend(ABC):
    """Writes the step's K/V into the paged cache, then computes causal attention for every token."""

    name: str = "abstract"
    preferred_block_size: int = 16  # the KV block size this backend is fastest with (cache.block_size unset)

    def reads_cache_in_place(self, block_size: int) -> bool:
        """Whether decodes read K/V through the block table (no gather): their cost does not grow with
        the table's width, so one CUDA-graph width serves all."""
        return False

    def decode_gather_bytes(self, seqs: int, max_len: int, block_size: int, num_kv_heads: int, head_dim: int,
                            kv_dtype: torch.dtype, dtype: torch.dtype) -> int:
        """The transient bytes one layer's decode of `seqs` sequences of up to `max_len` tokens allocates
        when the backend gathers K/V out of the cache (0 where it reads them in place): K and V [seqs,
        L, Hkv, D] in the cache's dtype (again in the compute dtype when they differ) and the mask [seqs,
        L], L the table's width in tokens. The memory profile runs short sequences, so it adds this."""
        if self.reads_cache_in_place(block_size):
            return 0
        width = -(-max_len // block_size) * block_size
        kv_elem, elem = kv_dtype.itemsize, dtype.itemsize
        per_copy = seqs * width * num_kv_heads * head_dim
        converted = 2 * per_copy * elem if kv_dtype != dtype else 0
        return 2 * per_copy * kv_elem + converted + seqs * width * (elem + 1)

    def interpreted(self, device: torch.device) -> bool:
        """Whether this backend's kernels run under an interpreter on `device` (Triton's, off CUDA): a
        correctness check whose step times say nothing about serving."""
        return False

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""


class SdpaBackend(AttentionBackend):
    """torch SDPA: all decodes in one padded call with a key-padding mask; whole prompts of one length
    side by side in the batch in one batched call (`AttentionMetadata.prefill_runs`), other prefill
    chunks one by one.

    Cached context is gathered block by block with one `index_select` per K and V over the flattened
    block table (a contiguous copy of whole blocks, faster than advanced indexing). Grouped-query
    heads are folded into the query length ([Hq] -> [Hkv, G]) instead of expanding K/V to every query head.
    Masks and gather indices are built once per step (`meta.scratch`) and shared by all layers.
    """

    name = "sdpa"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float) -> Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefill_seqs:
            return self._decodes(q, kv_cache, meta, scale)
        out = torch.empty_like(q)
        if meta.decode_seqs:
            out.index_copy_(0, meta.decode_token_idx, self._decodes(q.index_select(0, meta.decode_token_idx),
                                                                    kv_cache, meta, scale))
        batch_prompts = self._batches_whole_prompts(q, kv_cache)
        for first, n in meta.prefill_runs if batch_prompts else [(i, 1) for i in meta.prefill_seqs]:
            start, end = meta.cu_query_lens[first], meta.cu_query_lens[first + n]
            if n == 1:
                out[start:end] = self._chunk(q[start:end], k[start:end], v[start:end], kv_cache, meta, first,
                                             scale)
            else:
                out[start:end] = self._whole_prompts(q[start:end], k[start:end], v[start:end], n, scale)
        return out

    def _batches_whole_prompts(self, q: Tensor, kv_cache: Tensor) -> bool:
        """Whether a run of whole prompts of one length goes in one batched call (`_whole_prompts`)."""
        return True

    @staticmethod
    def _whole_prompts(q: Tensor, k: Tensor, v: Tensor, n: int, scale: float) -> Tensor:
        """n whole prompts of one length, back to back: q [n L, Hq, D], k/v [n L, Hkv, D] -> [n L, Hq, D] in
        one batched causal call. Each row's arithmetic is what one call per prompt does (the same output,
        bit for bit), without a call's fixed cost per prompt (docs/decisions.md#whole-prompts-batched)."""
        def heads_first(x: Tensor) -> Tensor:
            return cast(Tensor, x.unflatten(0, (n, -1))).transpose(1, 2)  # [n, H, L, D]

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), is_causal=True,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).flatten(0, 1)

    def _decodes(self, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """query [Nd, Hq, D] (the decodes' tokens, in decode order) -> [Nd, Hq, D]."""
        nd, hq, d = query.shape
        _, num_blocks, bs, hkv, _ = kv_cache.shape
        nb = meta.decode_block_tables.shape[1]
        if "dec_mask" not in meta.scratch:
            valid = torch.arange(nb * bs, device=query.device)[None, :] < meta.decode_context_lens[:, None]
            bias = torch.zeros(valid.shape, dtype=query.dtype, device=query.device)
            # [Nd, 1, 1, L]
            meta.scratch["dec_mask"] = bias.masked_fill_(~valid, float("-inf"))[:, None, None, :]
            meta.scratch["dec_blocks"] = meta.decode_block_tables.reshape(-1)
        blocks = meta.scratch["dec_blocks"]
        # [Nd * nb, bs * Hkv * D] -> [Nd, Hkv, nb * bs, D] (a strided view; SDPA reads it as is)
        keys = (kv_cache[0].view(num_blocks, -1).index_select(0, blocks)
                .view(nd, nb * bs, hkv, d).transpose(1, 2))
        values = (kv_cache[1].view(num_blocks, -1).index_select(0, blocks)
                  .view(nd, nb * bs, hkv, d).transpose(1, 2))
        grouped = query.view(nd, hkv, hq // hkv, d)  # query heads of one KV head side by side
        keys, values = keys.to(query.dtype), values.to(query.dtype)  # no-op unless cache.dtype differs
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=meta.scratch["dec_mask"],
                                             scale=scale)
        return out.reshape(nd, hq, d)

    def _chunk(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, seq: int,
               scale: float) -> Tensor:
        ql, ctx = meta.query_lens[seq], meta.context_lens[seq]
        gqa = q.shape[1] != k.shape[1]
        query = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, ql, D]
        if ctx == ql:
            # No earlier context: this step's own k/v are the whole context, no cache read needed.
            keys = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
            values = v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:
            _, num_blocks, bs, hkv, d = kv_cache.shape
            nb = -(-ctx // bs)
            key = ("chunk", seq)
            if key not in meta.scratch:
                # Query i sits at position ctx - ql + i and sees keys 0..that position (bottom-right causal).
                q_pos = torch.arange(ctx - ql, ctx, device=q.device)[:, None]
                visible = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # [ql, ctx]
                # An additive bias, not a bool mask: SDPA would convert a bool mask again in every layer.
                bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
                meta.scratch[key] = bias.masked_fill_(~visible, float("-inf"))
            blocks = meta.block_tables[seq, :nb]
            # [nb, bs * Hkv * D] -> [1, Hkv, ctx, D]
            keys = kv_cache[0].view(num_blocks, -1).index_select(0, blocks).view(nb * bs, hkv, d)[:ctx]
            values = kv_cache[1].view(num_blocks, -1).index_select(0, blocks).view(nb * bs, hkv, d)[:ctx]
            keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-op unless cache.dtype differs
            out = F.scaled_dot_product_attention(query, keys.transpose(0, 1).unsqueeze(0),
                                                 values.transpose(0, 1).unsqueeze(0),
                                                 attn_mask=meta.scratch[key], scale=scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)  # [ql, Hq, D]


class CpuPagedBackend(SdpaBackend):
    """Native kernels that read K/V in place through the block table instead of gathering every context
    into a copy: decodes through csrc/paged_attention.c, and bf16 prefill chunks with head_dim 64 through
    csrc/prefill_attention_amx.c on CPUs with AMX or csrc/prefill_attention_avx512.c on CPUs with
    AVX512-BF16 only; everything else through SDPA.

    The gather is most of a bf16 decode step at long contexts; the decode kernel reads each cached K/V
    row once per step. The prefill kernels also skip the key blocks a query tile cannot see
    (docs/decisions.md#cpu-paged-attention).
    """

    name = "cpu_paged"

    def reads_cache_in_place(self, block_size: int) -> bool:
        return True

    def __init__(self, kernel: PagedDecode, prefill: PrefillAttention | None = None) -> None:
        self._kernel = kernel
        self._prefill = prefill

    def _batches_whole_prompts(self, q: Tensor, kv_cache: Tensor) -> bool:
        """Not where the prefill kernel takes the chunks: one call per prompt of it is at least as fast as
        one batched SDPA call (docs/decisions.md#whole-prompts-batched)."""
        return self._prefill is None or not self._prefill.accepts(q, kv_cache)

    def _chunk(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata, seq: int,
               scale: float) -> Tensor:
        if self._prefill is None or not self._prefill.accepts(q, kv_cache):
            return super()._chunk(q, k, v, kv_cache, meta, seq, scale)
        ctx = meta.context_lens[seq]
        blocks = meta.block_tables[seq, :-(-ctx // meta.block_size)]
        return self._prefill(q, kv_cache, blocks, ctx, scale)

    def _decodes(self, query: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        if not self._kernel.accepts(query, kv_cache):
            return super()._decodes(query, kv_cache, meta, scale)
        return self._kernel(query, kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale)


def flash_attn_available() -> bool:
    """Installed and importable on a CUDA machine. A wheel built for another torch or CUDA is found by
    `find_spec` and then fails at import (a missing symbol in its extension): that is not available."""
    return (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
            and flash_attn_import_error() is None)


_FLASH_IMPORT: list[str | None] = []  # the import's outcome, tried once per process


def flash_attn_import_error() -> str | None:
    """Why importing flash-attn's kernels fails here (its message), or None when it imports."""
    if not _FLASH_IMPORT:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
            _FLASH_IMPORT.append(None)
        except Exception as e:  # ImportError, OSError from a broken extension, RuntimeError from its init
            _FLASH_IMPORT.append(f"{type(e).__name__}: {e}")
    return _FLASH_IMPORT[0]


class FlashAttnBackend(AttentionBackend):
    """flash-attn varlen kernel over the whole mixed batch in one call.

    Upstream flash-attn 2 reads a paged cache directly (`block_table=`) only when the block size is a
    multiple of 256; for smaller blocks this backend gathers each sequence's context through the block
    table into a contiguous varlen K/V first. flash-attn needs fp16/bf16: float32 batches go to SDPA.
    """

    name = "flash_attn"
    preferred_block_size = 256  # flash-attn 2 reads a paged cache in place only for multiples of 256

    def reads_cache_in_place(self, block_size: int) -> bool:
        return block_size % 256 == 0

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # optional, GPU only

        # flash-attn is untyped: both return a tensor
        self._varlen: Callable[..., Tensor] = flash_attn_varlen_func
        self._with_kvcache: Callable[..., Tensor] = flash_attn_with_kvcache
        self._fallback = SdpaBackend()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float) -> Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16):
            return self._fallback.forward(q, k, v, kv_cache, meta, scale)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if not meta.prefill_seqs:
            return self._decodes(q, kv_cache, meta, scale)
        common = dict(cu_seqlens_q=meta.cu_query_lens_t, cu_seqlens_k=meta.cu_context_lens_t,
                      max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_context_len,
                      softmax_scale=scale, causal=True)  # flash-attn >= 2.1 aligns causal bottom-right
        if meta.block_size % 256 == 0 and kv_cache.dtype == q.dtype:
            return self._varlen(q, kv_cache[0], kv_cache[1], block_table=_int32(meta, "block_tables"),
                                **common)
        _, _, _, hkv, d = kv_cache.shape
        slots = meta.context_slots()  # [sum ctx]
        keys = kv_cache[0].view(-1, hkv, d).index_select(0, slots).to(q.dtype)  # [sum ctx, Hkv, D]
        values = kv_cache[1].view(-1, hkv, d).index_select(0, slots).to(q.dtype)
        return self._varlen(q, keys, values, **common)

    def _decodes(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
        """A decode-only batch (K/V already written). Reads only tensors of `meta` and launches no
        host-synchronising op, so CUDA graphs can capture it: flash-attn's paged KV-cache kernel where
        the block size allows, else SDPA over the gathered blocks."""
        if meta.block_size % 256 == 0 and kv_cache.dtype == q.dtype:
            out = self._with_kvcache(q.unsqueeze(1), kv_cache[0], kv_cache[1],
                                     cache_seqlens=_int32(meta, "decode_context_lens"),
                                     block_table=_int32(meta, "decode_block_tables"),
                                     softmax_scale=scale, causal=True)
            return out.squeeze(1)
        return self._fallback._decodes(q, kv_cache, meta, scale)


def _int32(meta: AttentionMetadata, field: str) -> Tensor:
    """flash-attn's int32 copy of a metadata tensor, converted once per step and shared by every layer
    (inside a captured decode graph the one conversion is part of the graph, so it is redone per replay)."""
    key = field + "_i32"
    if key not in meta.scratch:
        meta.scratch[key] = getattr(meta, field).to(torch.int32)
    return meta.scratch[key]
