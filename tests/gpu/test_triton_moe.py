"""The Triton fused-MoE kernel compiled on a GPU: against the grouped path at Qwen3-30B-A3B's expert shapes,
inside a captured CUDA graph (a decode step's experts), and a whole Qwen3-MoE pipeline with decode graphs."""

from __future__ import annotations

import pytest
import torch

from ppserve.model.ops.moe import grouped_experts
from ppserve.model.triton_attention import triton_available
from ppserve.worker.capture_guard import no_host_transfers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not triton_available(), reason="needs triton"),
]


def _experts(t, h, inter, e, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * inter ** -0.5).to(dtype)
    ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=-1).indices
    weights = torch.rand(t, k, device="cuda", generator=g).softmax(-1)
    return x, ids, weights, w13, w2


@pytest.mark.parametrize("t", [1, 37, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_moe_matches_the_grouped_path_on_cuda(t, dtype):
    from ppserve.model.triton_moe import fused_moe

    x, ids, weights, w13, w2 = _experts(t, 2048, 768, 128, 8, dtype)  # Qwen3-30B-A3B's experts
    got = fused_moe(x, ids, weights.to(dtype), w13, w2)
    expected = grouped_experts(x, ids, weights.to(dtype), w13, w2)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


def test_fused_moe_replays_in_a_cuda_graph():
    """A decode step's experts captured once and replayed with other routing: equal to running it eagerly."""
    from ppserve.model.triton_moe import fused_moe

    x, ids, weights, w13, w2 = _experts(16, 1024, 256, 32, 4, torch.bfloat16, seed=1)
    fused_moe(x, ids, weights, w13, w2)  # compile outside the capture
    static_x, static_ids, static_w = x.clone(), ids.clone(), weights.clone()
    graph = torch.cuda.CUDAGraph()
    with no_host_transfers("the fused MoE capture"), torch.cuda.graph(graph):
        out = fused_moe(static_x, static_ids, static_w, w13, w2)
    x2, ids2, weights2, _, _ = _experts(16, 1024, 256, 32, 4, torch.bfloat16, seed=2)
    static_x.copy_(x2)
    static_ids.copy_(ids2)
    static_w.copy_(weights2)
    graph.replay()
    torch.testing.assert_close(out.float(), fused_moe(x2, ids2, weights2, w13, w2).float(), atol=0, rtol=0)


def test_a_qwen3_moe_pipeline_with_decode_graphs_equals_transformers(tmp_path):
    from ppserve import LLM, SamplingParams
    from tests.model_helpers import make_tiny_qwen3_dir
    from tests.oracle import random_prompts, reference_greedy

    model_dir = make_tiny_qwen3_dir(tmp_path / "m")
    prompts = random_prompts(3, (5, 40, 90))
    expected = reference_greedy(model_dir, prompts, 12)
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=32,
             overrides=["model.cuda_graphs=capture"]) as llm:
        assert all(w.graphs is not None and w.model.capturable for w in llm.engine.executor.workers)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    assert got == expected
