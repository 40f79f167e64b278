"""KV cache sizing from a fake memory profile (the GPU arithmetic, no GPU), a stage's memory on CPU,
and the dtype a worker resolves."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ppserve.worker.devices import resolve_dtype, resolve_kv_dtype
from ppserve.worker.memory import DEFAULT_CPU_KV_BYTES, GiB, StageMemory, kv_budget_bytes, split_blocks


def test_kv_budget_is_utilization_minus_in_use_minus_peak() -> None:
    total = int(80 * GiB)
    # An 8B model's 16 GiB of weights, 1.5 GiB of context and NCCL buffers: 62.5 GiB free after loading.
    free = total - int(17.5 * GiB)
    peak = int(2 * GiB)  # the largest microbatch's activations and logits
    budget = kv_budget_bytes(total, free, peak, 0.9)
    assert budget == int(0.9 * total) - int(17.5 * GiB) - peak
    assert budget / GiB == pytest.approx(52.5, abs=0.01)
    # Another process on the GPU counts against the budget too (the driver's free memory is the truth).
    assert kv_budget_bytes(total, free - int(10 * GiB), peak, 0.9) == budget - int(10 * GiB)


def test_nothing_left_names_the_setting() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(int(24 * GiB), int(2 * GiB), int(1 * GiB), 0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kv_budget_bytes(100, 100, 0, 1.5)


def test_stages_sharing_a_device_split_by_their_block_costs() -> None:
    # Two stages in one process on one GPU, the second with the LM head and fewer layers.
    assert split_blocks(1000, [6, 4]) == 100
    assert split_blocks(5, [6, 4]) == 1


def _stage_memory(device: str = "cpu") -> StageMemory:
    # What StageMemory reads of a stage: its local layers and KV heads (model), the head size (arch).
    model = SimpleNamespace(num_local_layers=3, num_kv_heads_local=2)
    arch = SimpleNamespace(head_dim=8)
    return StageMemory(model, arch, block_size=16, dtype=torch.float32,
                       kv_dtype=torch.bfloat16, device=torch.device(device), profile_tokens=64,
                       profile_seqs=4)


def test_a_block_costs_k_and_v_of_every_local_layer() -> None:
    # K+V, tokens, heads, dim, bf16, layers
    assert _stage_memory().kv_bytes_per_block() == 2 * 16 * 2 * 8 * 2 * 3


def test_cpu_budget_is_the_setting_or_the_default() -> None:
    mem = _stage_memory()
    assert mem.kv_budget_bytes(None, 0.9) == DEFAULT_CPU_KV_BYTES
    assert mem.kv_budget_bytes(float(1 << 20), 0.9) == 1 << 20  # > 1: bytes
    assert mem.num_blocks(float(1 << 20)) == (1 << 20) // mem.kv_bytes_per_block()
    assert mem.num_blocks(1000.0) == 1  # never fewer than one block


def test_memory_phases_are_logged_in_order() -> None:
    mem = _stage_memory()
    mem.note("weights loaded")
    mem.note("KV cache allocated", kv_blocks=7)
    assert [e["phase"] for e in mem.log] == ["weights loaded", "KV cache allocated"]
    assert mem.log[1]["kv_blocks"] == 7 and mem.log[0]["rss_gib"] > 0


def test_dtypes_by_name_and_auto() -> None:
    arch = SimpleNamespace(torch_dtype="float16")
    assert resolve_dtype("bfloat16", arch, torch.device("cpu")) is torch.bfloat16
    assert resolve_dtype("auto", arch, torch.device("cuda", 0)) is torch.float16
    assert resolve_dtype("auto", arch, torch.device("cpu")) in (torch.bfloat16, torch.float32)
    assert resolve_kv_dtype("auto", torch.float32) is torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32) is torch.bfloat16


def test_a_gathering_decode_at_the_longest_context_is_in_the_peak() -> None:
    """SDPA (and flash-attn below 256-token blocks) gathers each decode's whole context per layer; the
    profile's short sequences never show it, so the stage adds it, growing with max_model_len, and a
    backend that reads the cache in place adds nothing."""
    from ppserve.model import triton_attention
    from ppserve.model.attention import SdpaBackend

    def memory(backend: object, max_len: int) -> StageMemory:
        model = SimpleNamespace(num_local_layers=3, num_kv_heads_local=2, attn_backend=backend)
        return StageMemory(model, SimpleNamespace(head_dim=8), block_size=16, dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16, device=torch.device("cpu"), profile_tokens=64,
                           profile_seqs=4, max_model_len=max_len)

    short, long = (memory(SdpaBackend(), 1000).decode_gather_bytes(),
                   memory(SdpaBackend(), 4000).decode_gather_bytes())
    width = -(-4000 // 16) * 16
    assert long == 2 * 4 * width * 2 * 8 * 2 + 4 * width * 3  # K and V, bf16, and the mask (bf16 + bool)
    assert short < long
    assert memory(triton_attention.TritonPagedBackend(), 4000).decode_gather_bytes() == 0


def test_context_slots_are_derived_once_per_step_without_reading_the_total_back() -> None:
    from ppserve.model.attention import AttentionMetadata

    meta = AttentionMetadata.build([3, 1], [5, 7], [[2, 0], [1, 3]], 4, torch.device("cpu"))
    slots = meta.context_slots()
    want = ([2 * 4 + p for p in range(4)] + [0 * 4 + 0] + [1 * 4 + p for p in range(4)]
            + [3 * 4 + p for p in range(3)])
    assert slots.tolist() == want
    assert meta.context_slots() is slots  # the other layers reuse it
