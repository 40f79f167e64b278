"""The Triton paged-attention kernel compiled on a GPU: against SDPA in bf16/fp16 at both block sizes,
and inside a captured CUDA graph (the decode path)."""

from __future__ import annotations

import pytest
import torch

from ppserve.model.attention import AttentionMetadata, SdpaBackend, allocate_kv_cache
from ppserve.model.triton_attention import TritonPagedBackend, triton_available
from ppserve.worker.capture_guard import no_host_transfers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]


def _tables(context_lens, block_size):
    tables, nxt = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(list(range(nxt + n - 1, nxt - 1, -1)))  # descending: a wrong lookup reads other keys
        nxt += n
    return tables, nxt + 1


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_matches_sdpa_on_cuda(block_size, dtype):
    torch.manual_seed(0)
    hq, hkv, d = 32, 8, 128  # Llama-3-8B's heads
    query_lens, context_lens = [1, 300, 1, 64], [700, 300, 45, 64 + 500]
    tables, num_blocks = _tables(context_lens, block_size)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=dtype) for h in (hq, hkv, hkv))
    cache_ref = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cuda")[0].normal_()
    cache_tri = cache_ref.clone()
    build = lambda: AttentionMetadata.build(query_lens, context_lens, tables, block_size, "cuda")  # noqa: E731
    expected = SdpaBackend().forward(q, k, v, cache_ref, build(), d ** -0.5)
    got = TritonPagedBackend().forward(q, k, v, cache_tri, build(), d ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_triton_decode_is_captured_in_a_cuda_graph_without_host_transfers():
    torch.manual_seed(1)
    hq, hkv, d, bs = 8, 2, 64, 16
    ctx = [30, 1, 47, 200]
    tables, num_blocks = _tables(ctx, bs)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], device="cuda")
    ctx_t = torch.tensor(ctx, device="cuda")
    slots = torch.tensor([tables[i][(c - 1) // bs] * bs + (c - 1) % bs for i, c in enumerate(ctx)],
                         device="cuda")
    n = len(ctx)
    meta = AttentionMetadata.for_static_decodes(
        slots, ctx_t, table_t, bs, cu_query_lens_t=torch.arange(n + 1, dtype=torch.int32, device="cuda"),
        decode_token_idx=torch.arange(n, device="cuda"),
        cu_context_lens_t=torch.arange(n + 1, dtype=torch.int32, device="cuda") * bs * width)
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cache = allocate_kv_cache(1, num_blocks, bs, hkv, d, torch.bfloat16, "cuda")[0].normal_()
    cache_ref = cache.clone()
    backend = TritonPagedBackend()
    backend.forward(q, k, v, cache, meta, d ** -0.5)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with no_host_transfers(), torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, d ** -0.5)
    q.normal_()
    graph.replay()
    expected = SdpaBackend().forward(q, k, v, cache_ref,
                                     AttentionMetadata.build([1] * n, ctx, tables, bs, "cuda"), d ** -0.5)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
