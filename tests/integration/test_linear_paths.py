"""bf16 linears: on CPUs with AMX or AVX512-BF16, ppserve's panel kernel for every weight it can take;
otherwise a per-shape timed choice between the prepacked oneDNN primitive and plain F.linear (and for small
row counts the prepacked primitive run padded to 64 rows)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ppserve.model.ops import gemm, native
from ppserve.model.ops.gemm import SMALL_GEMM_ROWS, PackedWeight, can_prepack, fastest_path


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(gemm, "_FASTEST", {})
    monkeypatch.delenv("PPSERVE_LINEAR_PATH", raising=False)


def test_the_fastest_path_wins_and_is_remembered_per_shape(monkeypatch) -> None:
    now = [0.0]  # the timer fastest_path reads: it moves only when a candidate "runs"
    monkeypatch.setattr(gemm, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def candidate(seconds: float):
        def fn() -> torch.Tensor:
            now[0] += seconds
            return torch.zeros(1)
        return fn

    slow, fast = candidate(0.004), candidate(0.0)
    small, big = (8, 4, 32), (8, 4, 64)
    assert fastest_path(small, lambda: {("packed", 32): slow, ("plain", 32): slow,
                                        ("packed", 64): fast}) == ("packed", 64)
    assert fastest_path(big, lambda: {("packed", 64): fast, ("plain", 64): slow}) == ("packed", 64)

    def never() -> dict:
        raise AssertionError("a remembered shape must not be timed again")

    assert fastest_path(small, never) == ("packed", 64)
    assert gemm._FASTEST == {small: ("packed", 64), big: ("packed", 64)}


def test_environment_forces_a_path(monkeypatch) -> None:
    def never() -> dict:
        raise AssertionError("a forced path must not be timed")

    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "plain")
    assert fastest_path((8, 4, 32), never) == ("plain", 32)
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "packed")
    assert fastest_path((8, 4, 32), never) == ("packed", 32)
    assert gemm._FASTEST == {}


@pytest.mark.parametrize("rows", [1, 48, 512, 600])
def test_every_path_agrees(monkeypatch, rows: int) -> None:
    torch.manual_seed(rows)
    weight = torch.randn(576, 1536).bfloat16()
    bias = torch.randn(576).bfloat16()
    if not can_prepack(weight):
        pytest.skip("this CPU has no native bf16: there is no packed path")
    x = torch.randn(rows, 1536).bfloat16()
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    onednn = PackedWeight()
    onednn.pack(weight, use_panels=False)
    assert onednn.panels is None and onednn.packed is not None
    for path in ("packed", "plain"):
        monkeypatch.setenv("PPSERVE_LINEAR_PATH", path)
        got = onednn.linear(x, weight, bias)
        assert got.shape == (rows, 576)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    padded = onednn.run(x, weight, bias, ("packed", max(SMALL_GEMM_ROWS, gemm.row_bucket(rows))))[:rows]
    torch.testing.assert_close(padded.float(), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "auto")
    torch.testing.assert_close(onednn.linear(x, weight, bias).float(), want, rtol=2e-2, atol=2e-2)
    bucket = gemm.row_bucket(rows)
    kind, ran_rows = gemm._FASTEST[(576, 1536, bucket)]
    assert kind in ("packed", "plain") and ran_rows in (bucket, SMALL_GEMM_ROWS)

    default = PackedWeight()
    default.pack(weight)
    if native.panel_gemm() is None:
        assert default.panels is None and default.packed is not None  # no panel kernel here: oneDNN as above
        return
    # With AMX or AVX512-BF16 the panel kernel serves every row count, untimed, and no oneDNN copy is kept.
    assert default.panels is not None and default.packed is None
    gemm._FASTEST.clear()
    torch.testing.assert_close(default.linear(x, weight, bias).float(), want, rtol=2e-2, atol=2e-2)
    assert gemm._FASTEST == {}


def test_weights_the_panel_kernel_cannot_take_stay_with_onednn() -> None:
    weight = torch.randn(100, 64).bfloat16()  # 100 outputs: not a multiple of 32
    if not can_prepack(weight):
        pytest.skip("this CPU has no native bf16: there is no packed path")
    fast = PackedWeight()
    fast.pack(weight)
    assert fast.panels is None and fast.packed is not None
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(fast.linear(x, weight, None).float(), (x.float() @ weight.float().T),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 37, 512])
def test_gate_up_with_silu_in_the_panel_kernels_epilogue(rows: int) -> None:
    from ppserve.model.layers import MergedColumnParallelLinear

    if native.panel_gemm() is None:
        pytest.skip("no AMX or AVX512-BF16 here: the MLP runs gate/up and SiLU-and-mul separately")
    torch.manual_seed(rows)
    gate_up = MergedColumnParallelLinear(576, [1536, 1536], dtype=torch.bfloat16)
    gate_up.weight.data.normal_(0, 0.05)
    gate_up.prepack()
    assert gate_up.gate_up_panels is not None
    x = torch.randn(rows, 576).bfloat16()
    gate, up = torch.nn.functional.linear(x, gate_up.weight).chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # the eager chain, each op rounding to bf16
    got = gate_up.silu_mul(x)
    assert got is not None and got.shape == (rows, 1536)
    # the GEMMs accumulate in different orders, then three roundings follow: within two bf16 steps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-3)
    # a plain forward still works
    torch.testing.assert_close(gate_up(x).float(), torch.cat([gate, up], -1).float())
    assert gate_up.silu_mul(x.float()) is None  # float32: the caller's eager path


def test_row_buckets_cover_every_row_count_up_to_the_limit() -> None:
    assert gemm.row_buckets(1) == [32]
    assert gemm.row_buckets(100) == [32, 64, 96, 128]
    assert gemm.row_buckets(1000)[-4:] == [480, 512, 768, 1024]
    for rows in range(1, 1100, 7):
        assert gemm.row_bucket(rows) in gemm.row_buckets(1100)


def test_warm_up_primes_every_bucket_so_that_no_serving_step_times_a_path(monkeypatch) -> None:
    """A new row bucket's first GEMM times its paths (the demo's first prefill microbatches took 168 / 165 ms
    on its stages where warm ones take ~101 / ~70). `prime_linear_paths`, run at warm-up, times every bucket
    a stage can reach: decoder layers up to the token budget, the LM head up to the rows that get logits."""
    from torch import nn

    from ppserve.model.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        prime_linear_paths,
    )
    from ppserve.model.parallel import TPContext

    stage = nn.ModuleDict({
        "up": ColumnParallelLinear(64, 96, dtype=torch.bfloat16),
        "down": RowParallelLinear(96, 64, bias=True, dtype=torch.bfloat16),
        "head": ParallelLMHead(256, 64, TPContext(), torch.bfloat16, "cpu"),
    })
    if not can_prepack(stage["up"].weight):
        pytest.skip("this CPU has no native bf16: there is no packed path")
    with torch.no_grad():
        for p in stage.parameters():
            p.normal_()
    for m in stage.values():
        m.fast.pack(m.weight, use_panels=False)  # the timed oneDNN path, also on a CPU with a panel kernel
    assert prime_linear_paths(stage, max_tokens=100, max_logit_rows=40) == 4 + 4 + 2
    assert set(gemm._FASTEST) == ({(96, 64, b) for b in (32, 64, 96, 128)}
                                  | {(64, 96, b) for b in (32, 64, 96, 128)}
                                  | {(256, 64, 32), (256, 64, 64)})
    assert prime_linear_paths(stage, max_tokens=100, max_logit_rows=40) == 0  # nothing left to time

    def no_timing() -> float:
        raise AssertionError("a primed bucket must not be timed while serving")

    monkeypatch.setattr(gemm, "time", SimpleNamespace(perf_counter=no_timing))
    x = torch.randn(70, 64).bfloat16()
    hidden = stage["down"](stage["up"](x))
    assert stage["head"](hidden[:33]).shape == (33, 256)
