"""Decode-only microbatches through the CUDA-graph runner's padded static buffers.

On CPU the runner runs in `eager` mode: the same buffers, padding and pad block a captured graph replays,
without the capture. The GPU tests (marked `gpu`) capture real graphs and compare against eager CUDA.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ppserve.engine.llm import LLM
from ppserve.request import SamplingParams
from ppserve.worker.decode_graphs import graph_batch_sizes, round_up_to, table_widths
from tests.oracle import reference_greedy

MAX_NEW = 12


def test_batch_sizes_and_widths() -> None:
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert table_widths(1) == [1]
    assert table_widths(40) == [1, 2, 4, 8, 16, 32, 40]
    assert round_up_to(5, [1, 2, 4, 8]) == 8
    assert round_up_to(9, [1, 2, 4, 8]) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _generate(model_dir, prompts, **kwargs):
    with LLM(str(model_dir), dtype=kwargs.pop("dtype", "float32"), executor="inproc", **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        worker = llm.engine.executor.workers[0]
        # What the assertions read, taken before shutdown gives the stage's cache and graphs back.
        kept = SimpleNamespace(graphs=worker.graphs, kv_caches=list(worker.kv_caches))
        return [o.token_ids for o in outs], kept, llm.engine.scheduler.num_preemptions


@pytest.mark.parametrize("max_batch", [3, 64])  # 3: batches above the cap run eagerly, below are padded
def test_padded_decodes_match_transformers(tiny_llama_dir, max_batch: int) -> None:
    prompts = _prompts(0, 11)
    expected = reference_greedy(tiny_llama_dir, prompts, MAX_NEW)
    # block_size 4 and a small cache: tables of many widths, and preemption (recompute) on the way
    got, worker, preemptions = _generate(tiny_llama_dir, prompts, cuda_graphs="eager",
                                         cuda_graph_max_batch=max_batch, block_size=4, num_kv_blocks=60,
                                         token_budget=24)
    assert got == expected
    assert worker.graphs is not None and worker.graphs.num_runs > 0
    assert preemptions > 0
    assert worker.kv_caches[0].shape[1] == 61  # the block manager's 60 plus the pad block


def test_padded_decodes_on_a_pipeline(ray_session, tiny_llama_dir) -> None:
    """pp=2: the second stage's padded rows come in as hidden states, not token ids."""
    prompts = _prompts(3, 7)
    with LLM(str(tiny_llama_dir), dtype="float32", pipeline_parallel_size=2, cuda_graphs="eager",
             cuda_graph_max_batch=4, block_size=4, token_budget=16) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


def test_padding_writes_only_the_pad_block(tiny_llama_dir) -> None:
    """Same run with and without the padded path: every KV block the block manager owns ends up the same;
    only the pad block differs (it takes the padding rows' K/V)."""
    prompts = _prompts(1, 5)
    common = dict(block_size=4, num_kv_blocks=80, token_budget=32)
    plain_tokens, plain, _ = _generate(tiny_llama_dir, prompts, cuda_graphs="off", **common)
    padded_tokens, padded, _ = _generate(tiny_llama_dir, prompts, cuda_graphs="eager", **common)
    assert padded_tokens == plain_tokens
    assert padded.graphs is not None and padded.graphs.num_runs > 0
    for a, b in zip(plain.kv_caches, padded.kv_caches, strict=True):
        torch.testing.assert_close(b[:, :80], a, rtol=1e-5, atol=1e-5)
        assert b[:, 80].abs().sum() > 0  # the padding rows went somewhere: here


def test_capture_mode_needs_cuda(tiny_llama_dir) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA"):
        _generate(tiny_llama_dir, [[5, 6]], cuda_graphs="capture")


def test_bad_cuda_graph_settings_are_rejected() -> None:
    from ppserve.config import ModelConfig

    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelConfig(cuda_graphs="sometimes")
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        ModelConfig(cuda_graph_max_batch=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 256])  # 256: flash-attn's paged decode kernel inside the graph
@pytest.mark.parametrize("backend", ["auto", "triton_paged"])
def test_captured_graphs_match_eager_cuda(tiny_llama_dir, dtype: str, block_size: int, backend: str) -> None:
    prompts = _prompts(2, 9)
    common = dict(dtype=dtype, block_size=block_size, token_budget=32, cuda_graph_max_batch=8,
                  attention_backend=backend)
    # The same padded inputs run eagerly and replayed from captured graphs: the same kernels on the same
    # shapes, so every generated token agrees, in bf16 too.
    padded, _, _ = _generate(tiny_llama_dir, prompts, cuda_graphs="eager", **common)
    graphed, worker, _ = _generate(tiny_llama_dir, prompts, cuda_graphs="capture", **common)
    assert worker.graphs is not None and worker.graphs.graphs and worker.graphs.num_runs > 0
    assert graphed == padded
    if dtype == "float32":
        assert graphed == reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


@pytest.mark.parametrize("backend", ["sdpa", "cpu_paged"])
@pytest.mark.parametrize("first_stage", [True, False])
def test_the_captured_region_makes_no_host_copy_or_sync(tiny_llama_dir, backend: str,
                                                        first_stage: bool) -> None:
    """What a CUDA graph captures (the runner's forward over its static buffers, metadata included) runs
    here eagerly under the guard that a capture uses: a host copy or a sync anywhere in it fails."""
    from ppserve.model.backend_select import select_backend
    from ppserve.model.loader import load_stage_model
    from ppserve.worker.capture_guard import HostTransferInCapture, no_host_transfers
    from ppserve.worker.decode_graphs import DecodeGraphRunner

    start, end = (0, 2) if first_stage else (2, 4)
    model = load_stage_model(tiny_llama_dir, start, end, attn_backend=select_backend("cpu", backend))
    caches = [torch.zeros(2, 9, 4, model.num_kv_heads_local, model.arch.head_dim) for _ in range(2)]
    runner = DecodeGraphRunner(model, caches, block_size=4, max_batch=4, max_blocks=8, pad_block=8,
                               dtype=torch.float32, device=torch.device("cpu"), capture=False)
    for width in runner.widths:
        for batch in runner.batch_sizes:
            with no_host_transfers("the decode graph"):
                out = runner._forward(batch, width)
            assert out.shape[0] == batch
    # The guard does catch the kind of call that broke capture before (a list copied to the device).
    with pytest.raises(HostTransferInCapture, match="tensor"), no_host_transfers():
        torch.tensor([0, 1, 2])
    with pytest.raises(HostTransferInCapture, match="item"), no_host_transfers():
        torch.zeros(1).item()
