"""The Triton paged-attention backend (the GPU path that needs no extra package) against SDPA.

On CPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
triton is imported): slow, but the same kernel source, so its indexing, masking and online softmax are
checked here; tests/gpu runs it compiled.
"""

from __future__ import annotations

import random

import pytest
import torch

from ppserve.model.attention import AttentionMetadata, SdpaBackend, allocate_kv_cache
from ppserve.model.backend_select import select_backend
from ppserve.model.triton_attention import TritonPagedBackend, interpreting, triton_available

pytestmark = [
    pytest.mark.skipif(not triton_available(), reason="needs the triton package (pip install triton)"),
    pytest.mark.skipif(not interpreting(),
                       reason="CPU check of the kernel under TRITON_INTERPRET=1 (tests/gpu "
                       "runs it compiled)"),
]


def _tables(context_lens: list[int], block_size: int, seed: int) -> tuple[list[list[int]], int]:
    """Each sequence's blocks drawn at random from a shuffled pool, so that a wrong table lookup reads
    somebody else's keys."""
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 4
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    return [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens], num_blocks


def _compare(query_lens, context_lens, hq, hkv, d, block_size, dtype, seed=0) -> None:
    torch.manual_seed(seed)
    tables, num_blocks = _tables(context_lens, block_size, seed)
    t = sum(query_lens)
    q = torch.randn(t, hq, d, dtype=dtype)
    k = torch.randn(t, hkv, d, dtype=dtype)
    v = torch.randn(t, hkv, d, dtype=dtype)
    # random history
    cache_ref = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu")[0].normal_()
    cache_tri = cache_ref.clone()
    scale = d ** -0.5
    expected = SdpaBackend().forward(q, k, v, cache_ref,
                                     AttentionMetadata.build(query_lens, context_lens, tables, block_size),
                                     scale)
    got = TritonPagedBackend().forward(q, k, v, cache_tri,
                                       AttentionMetadata.build(query_lens, context_lens, tables, block_size),
                                       scale)
    torch.testing.assert_close(cache_tri, cache_ref)  # both wrote the step's K/V to the same slots
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


# A decode, a first prefill chunk longer than a row tile, a decode over a partly filled last block,
# and a later chunk of a prompt (its queries see earlier context plus a causal part of their own).
QUERY_LENS = [1, 37, 1, 20]
CONTEXT_LENS = [61, 37, 45, 20 + 50]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])  # plain multi-head; a GQA group of 4 (Llama-3's)
def test_mixed_microbatch_matches_sdpa(dtype, hq, hkv):
    _compare(QUERY_LENS, CONTEXT_LENS, hq, hkv, 64, 16, dtype)


def test_large_pages_and_head_dim_128():
    """Page 256 (flash-attn's size, what a GPU deployment may share between backends) and Llama's head dim."""
    _compare([1, 40, 1], [300, 40, 257], 4, 2, 128, 256, torch.float32, seed=3)


def test_head_dim_that_is_not_a_power_of_two():
    _compare([1, 9], [30, 9], 2, 1, 80, 16, torch.float32, seed=4)  # padded to 128 lanes, masked


def test_blocks_smaller_than_the_kernel_page_fall_back_to_sdpa():
    _compare(QUERY_LENS, CONTEXT_LENS, 4, 2, 32, 4, torch.float32, seed=5)
    assert not TritonPagedBackend().reads_cache_in_place(8) and TritonPagedBackend().reads_cache_in_place(16)


def test_decode_only_static_metadata_with_padding_rows():
    """The shape a CUDA graph replays (worker/decode_graphs.py): decode rows padded to a fixed width,
    padding rows decoding one token in the pad block, tables padded with it. Real rows equal SDPA."""
    torch.manual_seed(6)
    hq, hkv, d, bs = 4, 2, 64, 16
    ctx = [30, 1, 47]
    tables, num_blocks = _tables(ctx, bs, 6)
    width, max_blocks, pad = 5, 4, num_blocks
    table_t = torch.full((width, max_blocks), pad, dtype=torch.int64)
    for i, row in enumerate(tables):
        table_t[i, :len(row)] = torch.tensor(row)
    ctx_t = torch.tensor(ctx + [1] * (width - len(ctx)))
    slots = torch.tensor([tables[i][(c - 1) // bs] * bs + (c - 1) % bs
                          for i, c in enumerate(ctx)] + [pad * bs] * 2)
    meta = AttentionMetadata.for_static_decodes(
        slots, ctx_t, table_t, bs, cu_query_lens_t=torch.arange(width + 1, dtype=torch.int32),
        decode_token_idx=torch.arange(width),
        cu_context_lens_t=torch.arange(width + 1, dtype=torch.int32) * bs * max_blocks)
    q, k, v = (torch.randn(width, h, d) for h in (hq, hkv, hkv))
    cache = allocate_kv_cache(1, num_blocks + 1, bs, hkv, d, torch.float32, "cpu")[0].normal_()
    cache_ref = cache.clone()
    got = TritonPagedBackend().forward(q, k, v, cache, meta, d ** -0.5)
    expected = SdpaBackend().forward(q[:3], k[:3], v[:3], cache_ref,
                                     AttentionMetadata.build([1] * 3, ctx, tables, bs), d ** -0.5)
    torch.testing.assert_close(got[:3], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got[3:]).all()


def test_auto_picks_triton_on_cuda_without_flash_attn(monkeypatch):
    import ppserve.model.backend_select as backend_select

    monkeypatch.setattr(backend_select, "flash_attn_available", lambda: False)
    assert isinstance(select_backend("cuda"), TritonPagedBackend)
    assert isinstance(select_backend("cpu", "triton_paged"), TritonPagedBackend)  # interpreter on
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend("cpu", "triton_paged")
    with pytest.raises(ValueError, match="triton_paged"):
        select_backend("cpu", "flashattention")  # unknown names list every backend


def test_a_model_on_the_triton_backend_equals_transformers(tiny_llama_dir):
    """Every attention call of a whole pipeline (pp=2, chunked prefill, decodes) through the kernel:
    greedy float32 tokens equal transformers."""
    from ppserve import LLM, SamplingParams
    from tests.oracle import reference_greedy

    prompts = [[5, 9, 13, 200, 7], list(range(3, 40))]
    expected = reference_greedy(tiny_llama_dir, prompts, 6)
    # max_num_seqs: the start-up warm-up and timing run that many decodes, seconds each under the interpreter.
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
             token_budget=24, max_num_seqs=4, block_size=16, attention_backend="triton_paged") as llm:
        assert all(type(w.model.attn_backend) is TritonPagedBackend for w in llm.engine.executor.workers)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert got == expected
