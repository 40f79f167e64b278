"""The split-K decode kernel (few sequences, long contexts) against SDPA, and when the backend uses it.

Runs under Triton's interpreter on CPU (tests/conftest.py), like test_triton_attention.py; the kernels
phase of the GPU check runs it compiled."""

from __future__ import annotations

import pytest
import torch

from ppserve.model import triton_attention
from ppserve.model.attention import AttentionMetadata, SdpaBackend, allocate_kv_cache
from ppserve.model.triton_attention import (
    MIN_PAGES_PER_SPLIT,
    TritonPagedBackend,
    interpreting,
    split_k_plan,
    triton_available,
)
from tests.integration.test_triton_attention import _tables

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs the triton package"),
    pytest.mark.skipif(not interpreting(),
                       reason="CPU check under TRITON_INTERPRET=1 (the GPU check runs it compiled)"),
]


def test_plan_splits_only_where_the_gpu_would_sit_idle() -> None:
    # One sequence of 8192 tokens (512 pages of 16), 8 KV heads: 8 programs for 132 SMs without a split.
    pages = split_k_plan(1, 8, 512, 132)
    assert pages is not None and -(-512 // pages) <= 64 and pages >= MIN_PAGES_PER_SPLIT
    assert split_k_plan(64, 8, 512, 132) is None  # 512 programs already fill the GPU
    assert split_k_plan(1, 8, 6, 132) is None  # 96 tokens: nothing worth splitting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_decode_matches_sdpa(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []
    real = triton_attention.paged_decode_split_k
    monkeypatch.setattr(triton_attention, "paged_decode_split_k",
                        lambda *a: used.append(a[-1]) or real(*a))
    torch.manual_seed(1)
    hq, hkv, d, bs = 8, 2, 64, 16
    ctx = [300, 77, 1]  # a long context, one ending mid-page, one that sees a single key
    tables, num_blocks = _tables(ctx, bs, 1)
    q, k, v = (torch.randn(3, hq, d, dtype=dtype), torch.randn(3, hkv, d, dtype=dtype),
               torch.randn(3, hkv, d, dtype=dtype))
    cache = allocate_kv_cache(1, num_blocks, bs, hkv, d, dtype, "cpu")[0].normal_()
    ref_cache = cache.clone()
    got = TritonPagedBackend().forward(q, k, v, cache, AttentionMetadata.build([1] * 3, ctx, tables, bs),
                                       d ** -0.5)
    expected = SdpaBackend().forward(q, k, v, ref_cache, AttentionMetadata.build([1] * 3, ctx, tables, bs),
                                     d ** -0.5)
    assert used and used[0] >= MIN_PAGES_PER_SPLIT  # the split path ran
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)
