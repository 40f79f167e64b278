"""flash-attn's paged path, checked on CPU with a stand-in `flash_attn` module.

The stand-in implements the two entry points ppserve calls with flash-attn's documented semantics
(varlen with `block_table` over a paged cache, and `flash_attn_with_kvcache`) in plain torch, and
records every call. That proves what the GPU would run: at block size 256 every prefill chunk and
decode reads K/V in place through the block table (no gather copy of any context), the int32 tables
are built once per step rather than once per layer, and the outputs equal SDPA.
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from ppserve.model.attention import AttentionMetadata, FlashAttnBackend, SdpaBackend, allocate_kv_cache


def _attend(q, keys, values, scale):
    """q [n, Hq, D] over keys/values [c, Hkv, D], causal aligned bottom-right."""
    n, c, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), keys.float()) * scale
    visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    probs = F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hnc,chd->nhd", probs, values.float()).to(q.dtype)


def _paged(cache, table, length):
    """The first `length` tokens of a sequence whose blocks are `table`."""
    return torch.cat([cache[b] for b in table.tolist()])[:length] if length else cache[0][:0]


class FakeFlashAttn(types.ModuleType):
    def __init__(self):
        super().__init__("flash_attn")
        self.calls: list[tuple[str, bool, torch.Tensor | None]] = []

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, block_table=None):
        assert causal and cu_seqlens_q.dtype == torch.int32
        self.calls.append(("varlen", block_table is not None, block_table))
        out = torch.empty_like(q)
        for s in range(len(cu_seqlens_q) - 1):
            q0, q1 = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
            c0, c1 = int(cu_seqlens_k[s]), int(cu_seqlens_k[s + 1])
            if block_table is None:  # k, v: contiguous varlen [sum ctx, Hkv, D]
                keys, values = k[c0:c1], v[c0:c1]
            else:  # k, v: the paged cache [blocks, page, Hkv, D]
                assert block_table.dtype == torch.int32
                keys, values = _paged(k, block_table[s], c1 - c0), _paged(v, block_table[s], c1 - c0)
            out[q0:q1] = _attend(q[q0:q1], keys, values, softmax_scale)
        return out

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        assert causal and block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        self.calls.append(("kvcache", True, block_table))
        out = torch.empty_like(q)
        for s in range(q.shape[0]):
            n = int(cache_seqlens[s])
            out[s] = _attend(q[s], _paged(k_cache, block_table[s], n), _paged(v_cache, block_table[s], n),
                             softmax_scale)
        return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    fake = FakeFlashAttn()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    return fake


@pytest.fixture
def no_gather(monkeypatch):
    def refuse(self):
        raise AssertionError("the paged path gathered a context copy")

    monkeypatch.setattr(AttentionMetadata, "context_slots", refuse)


def _batch(query_lens, context_lens, block_size, seed=0):
    rng = random.Random(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    return tables, num_blocks


def _run_layers(backend, query_lens, context_lens, block_size, layers=3):
    """`layers` attention calls sharing one step's metadata (as a model's layers do) against SDPA."""
    torch.manual_seed(0)
    hq, hkv, d, dtype = 4, 2, 32, torch.bfloat16
    tables, num_blocks = _batch(query_lens, context_lens, block_size)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    ref_meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size)
    t = sum(query_lens)
    for _ in range(layers):
        q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hkv, hkv))
        cache = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu")[0].normal_()
        cache_ref = cache.clone()
        got = backend.forward(q, k, v, cache, meta, d ** -0.5)
        expected = SdpaBackend().forward(q, k, v, cache_ref, ref_meta, d ** -0.5)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_mixed_microbatch_at_block_256_reads_the_cache_in_place(fake_flash_attn, no_gather):
    _run_layers(FlashAttnBackend(), [1, 40, 1, 30], [300, 40, 257, 30 + 256], 256)
    kinds = {(kind, paged) for kind, paged, _ in fake_flash_attn.calls}
    assert kinds == {("varlen", True)}
    tables = {id(table) for _, _, table in fake_flash_attn.calls}
    assert len(tables) == 1  # one int32 block table for the step, shared by the layers


def test_decode_only_microbatch_at_block_256_uses_the_kv_cache_kernel(fake_flash_attn, no_gather):
    _run_layers(FlashAttnBackend(), [1, 1, 1], [300, 1, 513], 256)
    assert [kind for kind, _, _ in fake_flash_attn.calls] == ["kvcache"] * 3
    assert len({id(table) for _, _, table in fake_flash_attn.calls}) == 1


def test_block_16_gathers_because_flash_attn_2_cannot_page_it(fake_flash_attn):
    """The contrast that makes 256 the default block size with flash-attn."""
    _run_layers(FlashAttnBackend(), [1, 20], [40, 20], 16, layers=1)
    assert fake_flash_attn.calls[0][:2] == ("varlen", False)
    assert FlashAttnBackend.preferred_block_size == 256 and FlashAttnBackend().reads_cache_in_place(256)
