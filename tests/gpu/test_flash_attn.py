"""FlashAttnBackend against SdpaBackend on random paged data (needs CUDA and flash-attn)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from ppserve.model.attention import (
    AttentionMetadata,
    FlashAttnBackend,
    SdpaBackend,
    allocate_kv_cache,
)
from ppserve.model.backend_select import select_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn"),
]


def _mixed_batch(block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Two decodes, a first prefill chunk and a later prefill chunk, on shuffled blocks."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens = [1, 37, 1, 20]
    context_lens = [300, 37, 45, 20 + 260]
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    return AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cuda")


@pytest.mark.parametrize("block_size", [16, 256])  # 16: gathered varlen path; 256: native paged path
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attn_matches_sdpa(block_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hq, hkv, d = 8, 2, 64
    num_blocks = 4 * (-(-600 // block_size)) + 8
    meta = _mixed_batch(block_size, num_blocks, seed=block_size)
    t = meta.num_tokens
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(t, hkv, d, device="cuda", dtype=dtype)
    cache_ref = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cuda")[0]
    cache_ref.normal_()  # earlier context: random history the queries must attend to
    cache_fa = cache_ref.clone()
    scale = d ** -0.5
    expected = SdpaBackend().forward(q, k, v, cache_ref, meta, scale)
    got = FlashAttnBackend().forward(q, k, v, cache_fa, meta, scale)
    torch.testing.assert_close(cache_fa, cache_ref)  # both wrote the same new K/V
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


# 16: SDPA over gathered blocks; 256: flash_attn_with_kvcache
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_attn_decode_only_matches_sdpa(block_size: int) -> None:
    """The decode-only path (the one CUDA graphs capture) against SDPA."""
    torch.manual_seed(1)
    hq, hkv, d, dtype = 8, 2, 64, torch.bfloat16
    num_blocks = 4 * (-(-600 // block_size)) + 8
    rng = random.Random(block_size)
    free = list(range(num_blocks))
    rng.shuffle(free)
    context_lens = [300, 1, 45, 513]
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    meta = AttentionMetadata.build([1] * 4, context_lens, tables, block_size, "cuda")
    q, k, v = (torch.randn(4, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))
    cache_ref = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cuda")[0].normal_()
    cache_fa = cache_ref.clone()
    expected = SdpaBackend().forward(q, k, v, cache_ref, meta, d ** -0.5)
    got = FlashAttnBackend().forward(q, k, v, cache_fa, meta, d ** -0.5)
    torch.testing.assert_close(cache_fa, cache_ref)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_auto_selects_flash_attn_on_cuda() -> None:
    assert type(select_backend("cuda")) is FlashAttnBackend
