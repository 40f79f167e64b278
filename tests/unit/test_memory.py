"""KV cache sizing from a fake memory profile (the GPU arithmetic, no GPU)."""

from __future__ import annotations

import pytest

from ppserve.worker.memory import GiB, kv_budget_bytes, split_blocks


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
