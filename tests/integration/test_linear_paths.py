"""bf16 linears choose, per GEMM shape, between the prepacked oneDNN primitive and plain F.linear."""

from __future__ import annotations

import time

import pytest
import torch

from ppserve.model import layers
from ppserve.model.layers import PackedWeight, can_prepack, packed_is_faster


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(layers, "_PACKED_FASTER", {})
    monkeypatch.delenv("PPSERVE_LINEAR_PATH", raising=False)


def _sleeper(seconds: float):
    def fn() -> torch.Tensor:
        time.sleep(seconds)
        return torch.zeros(1)
    return fn


def test_the_faster_path_wins_and_is_remembered_per_shape() -> None:
    shape = torch.Size([8, 4])
    slow, fast = _sleeper(0.004), _sleeper(0.0)
    assert packed_is_faster(shape, 32, with_packed=slow, plain=fast) is False
    assert packed_is_faster(shape, 64, with_packed=fast, plain=slow) is True
    # remembered: the same shape is not timed again, even if the paths now behave the other way
    assert packed_is_faster(shape, 32, with_packed=fast, plain=slow) is False
    assert layers._PACKED_FASTER == {(8, 4, 32): False, (8, 4, 64): True}


def test_environment_forces_a_path(monkeypatch) -> None:
    def never() -> torch.Tensor:
        raise AssertionError("a forced path must not be timed")

    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "plain")
    assert packed_is_faster(torch.Size([8, 4]), 32, with_packed=never, plain=never) is False
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "packed")
    assert packed_is_faster(torch.Size([8, 4]), 32, with_packed=never, plain=never) is True
    assert layers._PACKED_FASTER == {}


@pytest.mark.parametrize("rows", [1, 48, 512, 600])
def test_both_paths_agree(monkeypatch, rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(576, 1536).bfloat16()
    bias = torch.randn(576).bfloat16()
    if not can_prepack(weight):
        pytest.skip("this CPU has no native bf16: there is no packed path")
    fast = PackedWeight()
    fast.pack(weight)
    x = torch.randn(rows, 1536).bfloat16()
    outs = {}
    for path in ("packed", "plain"):
        monkeypatch.setenv("PPSERVE_LINEAR_PATH", path)
        outs[path] = fast.linear(x, weight, bias)
    assert outs["packed"].shape == (rows, 576)
    torch.testing.assert_close(outs["packed"].float(), outs["plain"].float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "auto")
    torch.testing.assert_close(fast.linear(x, weight, bias).float(), outs["plain"].float(), rtol=2e-2, atol=2e-2)
    assert (576, 1536, layers.row_bucket(rows)) in layers._PACKED_FASTER
