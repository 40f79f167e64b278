"""An in-process engine gives its memory back on shutdown, so a second one in the same process (the GPU
check's next phase, a notebook) starts from the same baseline; and its KV pool is capped at what the
scheduler can use."""

from __future__ import annotations

import gc
import weakref

import torch

from ppserve.engine.llm import LLM
from ppserve.request import SamplingParams
from ppserve.worker.memory import usable_blocks


def live_tensor_bytes() -> int:
    """Bytes of every tensor the garbage collector tracks (parameters, caches, buffers): on CPU the
    stand-in for torch.cuda.memory_allocated."""
    total = 0
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
                total += obj.untyped_storage().nbytes()
        except (ReferenceError, RuntimeError):
            continue
    return total


def build_serve_shutdown(model_dir) -> int:
    llm = LLM(str(model_dir), executor="inproc", pipeline_parallel_size=2, dtype="float32", max_num_seqs=4,
              max_model_len=64, block_size=16)
    workers = llm.engine.executor.workers
    refs = [weakref.ref(w) for w in workers] + [weakref.ref(t) for w in workers for t in w.kv_caches]
    blocks = llm.engine.executor.num_kv_blocks
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
    del workers
    llm.shutdown()  # the LLM object itself stays alive: shutdown alone must let go of the stages
    assert all(r() is None for r in refs), "a stage or its KV cache outlived shutdown"
    return blocks


def test_build_serve_shutdown_twice_returns_to_baseline(tiny_llama_dir) -> None:
    gc.collect()
    baseline = live_tensor_bytes()
    blocks = build_serve_shutdown(tiny_llama_dir)
    # The CPU default budget (1 GiB) would give thousands of blocks: 4 sequences of 64 tokens need 16.
    assert blocks == usable_blocks(4, 64, 16) == 16
    after_first = live_tensor_bytes()
    build_serve_shutdown(tiny_llama_dir)
    after_second = live_tensor_bytes()
    # What one engine holds (weights + KV cache) must be gone both times; a few small tensors may stay
    # (tables cached by shape), never a stage's.
    llm = LLM(str(tiny_llama_dir), executor="inproc", pipeline_parallel_size=2, dtype="float32",
              max_num_seqs=4, max_model_len=64, block_size=16)
    held = live_tensor_bytes() - after_second
    llm.shutdown()
    del llm
    assert held > 0
    assert abs(after_first - baseline) < held / 20, (baseline, after_first, held)
    assert abs(after_second - baseline) < held / 20, (baseline, after_second, held)
