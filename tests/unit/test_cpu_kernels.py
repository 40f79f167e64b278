"""The native CPU paged-decode kernel against the torch gather + SDPA path, and its build fallback."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from ppserve.model.attention import (
    AttentionMetadata,
    CpuPagedBackend,
    SdpaBackend,
    allocate_kv_cache,
)
from ppserve.model.backend_select import select_backend
from ppserve.model.ops import native

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler to build the kernel")


def _batch(query_lens: list[int], context_lens: list[int], block_size: int, num_blocks: int,
           seed: int) -> AttentionMetadata:
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)  # blocks scattered through the cache, as after many allocations and frees
    tables = [[free.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    return AttentionMetadata.build(query_lens, context_lens, tables, block_size)


def _clear_kernel_caches() -> None:
    native.forget_loaded()


@needs_compiler
def test_kernel_builds_here(tmp_path, monkeypatch) -> None:
    # CI machines have a compiler: the fast path must really be taken there, not silently skipped, and
    # it must build from scratch (an empty cache), not only load a library an earlier run left behind.
    monkeypatch.setenv("PPSERVE_KERNEL_CACHE", str(tmp_path))
    _clear_kernel_caches()
    try:
        assert native.paged_decode() is not None
        assert native.elementwise() is not None
        assert native.greedy_argmax() is not None
        assert len(list(tmp_path.glob("ppserve_kernels-*.so"))) == 1
        assert isinstance(select_backend("cpu"), CpuPagedBackend)
        assert isinstance(select_backend("cpu", "cpu_paged"), CpuPagedBackend)
    finally:
        _clear_kernel_caches()  # later tests load from the default cache again


@needs_compiler
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# Block sizes above 16 (48: not a multiple of 16) and head_dim 256 take the bf16 block paths in pieces or
# only in part (values fall back to the per-token loop above head_dim 128).
@pytest.mark.parametrize("hq,hkv,d,block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 128, 16),
                                                 (6, 2, 16, 1), (9, 3, 64, 48), (4, 2, 256, 32)])
def test_mixed_batch_matches_sdpa(dtype: torch.dtype, tol: float, hq: int, hkv: int, d: int,
                                  block_size: int) -> None:
    """Decodes of lengths 1, block-aligned and ragged, beside two prefill chunks (bf16 with head_dim 64:
    the AMX prefill kernel where the CPU has AMX, else the AVX512-BF16 one where it has that; otherwise
    SDPA)."""
    torch.manual_seed(hq * d + block_size)
    query_lens = [1, 1, 7, 1, 1, 20]
    context_lens = [1, 4 * block_size, 7, 3 * block_size + 5, 57, 20 + 33]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 5
    meta = _batch(query_lens, context_lens, block_size, num_blocks, seed=d)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hkv, hkv))
    cache_ref = allocate_kv_cache(1, num_blocks, block_size, hkv, d, dtype, "cpu")[0].normal_()
    cache_native = cache_ref.clone()
    scale = d ** -0.5
    expected = SdpaBackend().forward(q, k, v, cache_ref, meta, scale)
    got = select_backend("cpu", "cpu_paged").forward(q, k, v, cache_native, meta, scale)
    assert torch.equal(cache_native, cache_ref)  # both wrote this step's K/V to the same slots
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_compiler
def test_decode_only_batch_with_strided_block_table() -> None:
    """A decode-only step passes the block table as a column slice (row stride > its width)."""
    torch.manual_seed(1)
    meta = _batch([1, 1, 1], [200, 3, 64], 16, 40, seed=3)
    assert meta.decode_block_tables.stride(0) >= meta.decode_block_tables.shape[1]
    q, k, v = torch.randn(3, 6, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cache = allocate_kv_cache(1, 40, 16, 2, 64, torch.float32, "cpu")[0].normal_()
    expected = SdpaBackend().forward(q, k, v, cache.clone(), meta, 0.1)
    got = select_backend("cpu", "cpu_paged").forward(q, k, v, cache, meta, 0.1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_compiler
def test_loading_keeps_denormals() -> None:
    # A shared object linked with -ffast-math would switch the process to flush-to-zero on load and
    # change every float32 result torch computes afterwards.
    code = ("import torch; from ppserve.model.ops import native; "
            "assert native.paged_decode() is not None; "
            "x = torch.tensor([1e-39]); assert (x * 1.5).item() != 0.0, 'denormals flushed'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_build_failure_falls_back_to_sdpa(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PPSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that always fails
    _clear_kernel_caches()
    try:
        assert native.paged_decode() is None
        backend = select_backend("cpu")
        assert type(backend) is SdpaBackend
        with pytest.raises(ValueError, match="cpu_paged"):
            select_backend("cpu", "cpu_paged")
        assert native.elementwise() is None
        assert native.greedy_argmax() is None
        assert native.panel_gemm() is None
        assert native.prefill_attention() is None
        from ppserve.worker.sampler import greedy

        assert greedy(torch.tensor([[0.0, 2.0, 1.0]])) == [1]  # torch.argmax serves instead
    finally:
        _clear_kernel_caches()
    assert not list(tmp_path.glob("*.so"))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("cpu", "magic")


def _one_ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 results of the same rounded arithmetic: equal, or one bf16 step apart where float32 sums
    were accumulated in a different order."""
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -7)


@needs_compiler
def test_fused_rms_norm_matches_eager_bf16() -> None:
    from ppserve.model.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5, torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(37, 2 * 96, dtype=torch.bfloat16)[:, :96]  # strided rows, as a slice of a wider output
    got = norm(x)
    want = norm.weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                          ).to(torch.bfloat16)
    _one_ulp_close(got, want)
    assert norm(x.float()).dtype == torch.float32  # float32 takes the eager path


@needs_compiler
@pytest.mark.parametrize("cols", [96, 576, 100])  # 100: a row that ends inside a 16-lane vector
def test_fused_add_rms_norm_matches_eager_bf16(cols: int) -> None:
    from ppserve.model.layers import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(cols, 1e-5, torch.bfloat16)
    norm.weight.data.normal_()
    x, y = torch.randn(37, cols, dtype=torch.bfloat16) * 3, torch.randn(37, cols, dtype=torch.bfloat16)
    x_before, y_before = x.clone(), y.clone()
    total, normed = norm.add_and_norm(x, y)
    assert torch.equal(total, x + y)  # one bf16 rounding of a float32 sum, as torch's add
    _one_ulp_close(normed, norm(x + y))
    assert torch.equal(x, x_before) and torch.equal(y, y_before)  # inputs untouched
    total32, normed32 = norm.float().add_and_norm(x.float(), y.float())  # float32: the eager ops exactly
    assert torch.equal(total32, x.float() + y.float()) and torch.equal(normed32, norm(x.float() + y.float()))


@needs_compiler
def test_fused_silu_mul_matches_eager_bf16() -> None:
    fused = native.elementwise()
    assert fused is not None
    torch.manual_seed(1)
    gate_up = torch.randn(29, 2 * 85, dtype=torch.bfloat16) * 4
    # gates past e^x's float32 range (below -88 used to come out NaN), zeros and tiny values
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 1e-30, -1e-30])
    gate, up = gate_up.chunk(2, dim=-1)
    _one_ulp_close(fused.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    # Wide gates at the model's width. Two roundings in a row (silu to bf16, then the product): where
    # float32 exp implementations put silu one bf16 step apart, the product can be two steps apart.
    wide = torch.randn(64, 2 * 1536, dtype=torch.bfloat16) * 12
    gate, up = wide.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(wide).float(), (torch.nn.functional.silu(gate) * up).float(),
                               atol=1e-6, rtol=2 ** -6)
    inf_nan = torch.tensor([[float("inf"), float("-inf"), float("nan"), 1.0] * 4 + [1.0] * 16],
                           dtype=torch.bfloat16)
    gate, up = inf_nan.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(inf_nan), torch.nn.functional.silu(gate) * up, equal_nan=True)


@needs_compiler
@pytest.mark.parametrize("d", [64, 40])  # 40: half a head (20) is not a whole 16-lane vector
def test_fused_rope_in_place_matches_eager_bf16(d: int) -> None:
    from ppserve.model.layers import RotaryEmbedding

    torch.manual_seed(2)
    rope = RotaryEmbedding(d, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(100, 117), torch.bfloat16)
    qkv = torch.randn(17, 7 * d, dtype=torch.bfloat16)
    qk = qkv[:, :5 * d].view(17, 5, d)  # q and k heads of a fused QKV output, rows strided
    want = RotaryEmbedding.apply(qk.clone(), cos, sin)  # the eager ops (a new tensor)
    v_before = qkv[:, 5 * d:].clone()
    got = RotaryEmbedding.apply(qk, cos, sin, inplace=True)
    assert got.data_ptr() == qk.data_ptr()  # rotated in place
    _one_ulp_close(got, want)
    assert torch.equal(qkv[:, 5 * d:], v_before)  # the V part of the row is untouched


@needs_compiler
@pytest.mark.parametrize("d", [128, 40])  # 40: half a head (20) is not a whole 16-lane vector
def test_fused_qk_norm_rope_equals_the_norm_and_rotation_kernels(d: int) -> None:
    from ppserve.model.layers import RotaryEmbedding

    fused = native.elementwise()
    assert fused is not None
    torch.manual_seed(4)
    hq, hk, t = 8, 2, 23
    cos, sin = RotaryEmbedding(d, 10000.0).cos_sin(torch.arange(50, 50 + t), torch.bfloat16)
    q_w, k_w = torch.randn(d, dtype=torch.bfloat16), torch.randn(d, dtype=torch.bfloat16)
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16) * 5
    qk = qkv[:, :(hq + hk) * d].view(t, hq + hk, d)  # rows strided, as in a fused QKV output
    normed = torch.cat((fused.rms_norm(qk[:, :hq].reshape(-1, d), q_w, 1e-6).view(t, hq, d),
                        fused.rms_norm(qk[:, hq:].reshape(-1, d), k_w, 1e-6).view(t, hk, d)), dim=1)
    fused.rope_(normed, cos, sin)
    v_before = qkv[:, (hq + hk) * d:].clone()
    fused.qk_norm_rope_(qk, q_w, k_w, hq, cos, sin, 1e-6)
    assert torch.equal(qk, normed)  # the two kernels' arithmetic, bit for bit
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)
    with pytest.raises(ValueError, match="weights"):
        fused.qk_norm_rope_(qk, q_w[:-2], k_w, hq, cos, sin, 1e-6)
    with pytest.raises(ValueError, match="layout"):
        fused.qk_norm_rope_(qk, q_w, k_w, hq + hk + 1, cos, sin, 1e-6)


@needs_compiler
def test_greedy_argmax_matches_torch() -> None:
    kernel = native.greedy_argmax()
    assert kernel is not None
    torch.manual_seed(4)
    logits = torch.randn(37, 49152 + 16)[:, :49152]  # strided rows, as a slice of a padded vocabulary
    assert kernel(logits) == logits.argmax(-1).tolist()
    odd = torch.randn(12, 37)  # a row length that ends inside a 16-lane vector
    odd[0] = 1.0  # all equal: the first index
    odd[1, [3, 20, 36]] = 9.0  # ties in different lanes and in the tail: the first one
    odd[2, 5], odd[2, 30] = float("nan"), float("nan")  # NaN counts as the maximum, the first one wins
    odd[3, 33] = float("nan")  # a NaN in the scalar tail
    odd[4] = float("-inf")
    odd[5, 17] = float("inf")
    odd[6, 0] = float("nan")
    odd[7, 36] = 50.0  # the maximum in the tail
    assert kernel(odd) == odd.argmax(-1).tolist()
    short = torch.randn(3, 5)
    assert kernel(short) == short.argmax(-1).tolist()
    assert not kernel.accepts(torch.randn(2, 4).bfloat16())  # other dtypes stay with torch


_Twin = TypeVar("_Twin", native.PanelGemm, native.PrefillAttention)


def _kernel_or_skip(load: Callable[[str], _Twin | None], kind: str) -> _Twin:
    """The `kind` ('amx' | 'avx512') version of a kernel written for both, or skip where it cannot run
    here."""
    kernel = load(kind)
    if kernel is None:
        pytest.skip(f"the {kind} {load.__name__} kernel cannot run on this machine (CPU, compiler or kernel)")
    assert kernel.kernel == kind
    return kernel


def _gemm_or_skip(kind: str) -> native.PanelGemm:
    return _kernel_or_skip(native.panel_gemm, kind)


@needs_compiler
# Both panel kernels: AMX tiles, and AVX512-BF16 dot products for CPUs without AMX.
@pytest.mark.parametrize("kind", ["amx", "avx512"])
# row counts on and off the kernels' blocks (AMX: 32 rows, 1, 37 and 500 run their last block from a padded
# copy; AVX512: 6 rows and 64 columns, and 960 / 576 columns end in a part block)
@pytest.mark.parametrize(("m", "n", "k"), [(32, 576, 576), (64, 960, 576), (512, 576, 1536), (96, 3072, 576),
                                           (1, 576, 576), (37, 960, 576), (500, 576, 1536), (5, 32, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_gemm_matches_linear(kind: str, m: int, n: int, k: int, with_bias: bool) -> None:
    gemm = _gemm_or_skip(kind)
    torch.manual_seed(m + n + k)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(m, k + 64, dtype=torch.bfloat16)[:, :k]  # strided rows, as a slice of a wider output
    got = gemm(x, gemm.pack(weight), bias)
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    # float32 accumulation rounded once to bf16: within one bf16 step of the float32 result
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize("m", [1, 7, 40])
def test_panel_gemm_silu_mul_epilogue(kind: str, m: int) -> None:
    gemm = _gemm_or_skip(kind)
    torch.manual_seed(m)
    weight = torch.randn(2 * 96, 128, dtype=torch.bfloat16) * 0.1  # gate rows, then up rows: I = 96
    x = torch.randn(m, 128, dtype=torch.bfloat16)
    gate, up = torch.nn.functional.linear(x.float(), weight.float()).bfloat16().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up  # the eager chain, each op rounding to bf16
    got = gemm(x, gemm.pack_gate_up(weight), None, silu_mul=True)
    assert got.shape == (m, 96)
    # the GEMMs accumulate in other orders than float32, then three roundings follow: within two bf16 steps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=1e-3)


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: str, silu_mul: bool) -> None:
    """Batch invariance: the first m rows of a GEMM equal, bit for bit, the GEMM of those m rows alone, at
    row counts that run AMX's tiles configured to fewer rows (1-15, 16-31) and full blocks. So a token's
    bf16 result does not change with the microbatch it shares (a decode alone or beside a prefill chunk)."""
    gemm = _gemm_or_skip(kind)
    torch.manual_seed(7)
    weight = torch.randn(2 * 96 if silu_mul else 160, 256, dtype=torch.bfloat16) * 0.1
    packed = gemm.pack_gate_up(weight) if silu_mul else gemm.pack(weight)
    x = torch.randn(70, 256, dtype=torch.bfloat16)
    whole = gemm(x, packed, None, silu_mul=silu_mul)
    for m in (1, 3, 15, 16, 17, 31, 32, 33, 64):
        assert torch.equal(gemm(x[:m], packed, None, silu_mul=silu_mul), whole[:m]), m


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
def test_panel_gemm_layout_and_refusals(kind: str) -> None:
    gemm = _gemm_or_skip(kind)
    weight = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).bfloat16()
    packed = gemm.pack(weight)
    # panel 1, k-block 1, pair row 3, column 5 holds W[16 + 5, 32 + 2 * 3 + {0, 1}]
    assert torch.equal(packed[1, 1, 3, 5], weight[21, 38:40])
    assert gemm.accepts(weight) and not gemm.accepts(weight[:, :48]) and not gemm.accepts(weight.float())
    with pytest.raises(ValueError, match="does not match"):
        gemm(torch.randn(48, 96, dtype=torch.bfloat16), packed, None)  # K of 96 against a weight of K 64
    with pytest.raises(ValueError, match="does not match"):
        gemm(torch.randn(48, 64), packed, None)  # float32 input
    with pytest.raises(ValueError, match="unknown PanelGemm kernel"):
        native.panel_gemm("avx2")
    assert gemm(torch.randn(0, 64, dtype=torch.bfloat16), packed, None).shape == (0, 32)  # an empty batch


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize("silu_mul", [False, True])
# rows per expert: idle experts first, in the middle and last; one crowded expert (over a 6-row block); none;
# experts over AMX's 32-row blocks, and last blocks of 1-15 and 16-31 rows (AMX configures its tiles to them)
@pytest.mark.parametrize("counts", [[0, 3, 0, 1, 9, 0], [2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 13], [0] * 6,
                                    [5, 40, 0, 24, 1, 64]])
def test_grouped_panel_gemm_equals_one_call_per_expert(kind: str, silu_mul: bool, counts: list[int]) -> None:
    """Every expert of an MoE layer in one call: the same GEMM per expert over the same rows as calling the
    kernel once per expert, so bit for bit its result."""
    gemm = _gemm_or_skip(kind)
    torch.manual_seed(sum(counts) + silu_mul)
    n, k = (2 * 96, 128) if silu_mul else (96, 128)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.1 for _ in counts]
    packed = torch.stack([gemm.pack_gate_up(w) if silu_mul else gemm.pack(w) for w in weights])
    rows = torch.randn(sum(counts), k + 32, dtype=torch.bfloat16)[:, :k]  # strided rows, as gathered
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    got = gemm.grouped(rows, packed, ends, silu_mul=silu_mul)
    bounds = [0, *ends.tolist()]
    want = [gemm(rows[bounds[e]:bounds[e + 1]], packed[e], None, silu_mul=silu_mul)
            for e in range(len(counts))]
    assert got.shape == (sum(counts), n // 2 if silu_mul else n)
    assert torch.equal(got, torch.cat(want))


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
def test_grouped_panel_gemm_refuses_bad_groups(kind: str) -> None:
    gemm = _gemm_or_skip(kind)
    packed = torch.stack([gemm.pack(torch.randn(32, 64, dtype=torch.bfloat16)) for _ in range(3)])
    rows = torch.randn(5, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows end at 4, not at 5"):
        gemm.grouped(rows, packed, torch.tensor([1, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="do not match 3 packed weights"):
        gemm.grouped(rows, packed, torch.tensor([1, 5], dtype=torch.int32))  # two ends for three experts
    with pytest.raises(ValueError, match="do not match"):
        gemm.grouped(rows, packed, torch.tensor([1, 3, 5]))  # int64 ends
    with pytest.raises(RuntimeError, match="ends not non-decreasing"):
        gemm.grouped(rows, packed, torch.tensor([3, 1, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="one contiguous tensor"):
        gemm.grouped(rows, packed.transpose(3, 4), torch.tensor([1, 3, 5], dtype=torch.int32))  # same shape


def test_a_forced_onednn_path_turns_the_panel_gemm_off(monkeypatch) -> None:
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "packed")
    assert native.panel_gemm() is None  # model.linear_path: packed | plain means oneDNN for every weight
    monkeypatch.setenv("PPSERVE_LINEAR_PATH", "auto")
    assert (native.panel_gemm() is native.panel_gemm("amx")
            or native.panel_gemm() is native.panel_gemm("avx512"))


def _prefill_or_skip(kind: str) -> native.PrefillAttention:
    return _kernel_or_skip(native.prefill_attention, kind)


def _reference_chunk_attention(q: torch.Tensor, cache: torch.Tensor, blocks: list[int], ctx: int,
                               scale: float) -> torch.Tensor:
    """float32 attention of a chunk's queries (the last ql positions of ctx) over the cached context."""
    ql, hq, d = q.shape
    _, _, bs, hkv, _ = cache.shape
    keys = cache[0][blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
    values = cache[1][blocks].reshape(-1, hkv, d)[:ctx].float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - ql, ctx)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


@needs_compiler
# ql and ctx off the kernel's 16-query and 32-key grids, a first chunk (ql == ctx), one query, block sizes
# 16 and 48, grouped (9/3) and plain (4/4) heads.
# Both kernels: AMX tiles, and AVX512-BF16 (lanes = a tile's queries) for CPUs without AMX.
@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize(("ql", "ctx", "hq", "hkv", "block_size"),
                         [(486, 786, 9, 3, 16), (512, 512, 9, 3, 16), (37, 37, 4, 4, 48), (1, 100, 9, 3, 16),
                          (50, 333, 4, 4, 48), (16, 33, 9, 3, 16), (130, 200, 2, 1, 16)])
def test_prefill_attention_matches_reference(kind: str, ql: int, ctx: int, hq: int, hkv: int,
                                             block_size: int) -> None:
    kernel = _prefill_or_skip(kind)
    torch.manual_seed(ql + ctx)
    num_blocks = -(-ctx // block_size) + 7
    cache = torch.randn(2, num_blocks, block_size, hkv, 64).bfloat16()
    blocks = torch.randperm(num_blocks)[:-(-ctx // block_size)]
    qkv = torch.randn(ql, (hq + 2 * hkv) * 64).bfloat16() * 2
    q = qkv[:, :hq * 64].view(ql, hq, 64)  # token rows strided, as in a fused QKV output
    assert kernel.accepts(q, cache)
    got = kernel(q, cache, blocks, ctx, 0.125)
    want = _reference_chunk_attention(q, cache, blocks.tolist(), ctx, 0.125)
    # bf16 inputs and probabilities, float32 accumulation: a few bf16 steps of outputs of order 1
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
def test_prefill_attention_refuses_what_it_cannot_do(kind: str) -> None:
    kernel = _prefill_or_skip(kind)
    cache = torch.randn(2, 4, 16, 2, 64).bfloat16()
    assert not kernel.accepts(torch.randn(8, 4, 32).bfloat16(), cache)  # head_dim 32: SDPA serves it
    assert not kernel.accepts(torch.randn(8, 4, 64), cache)  # float32
    with pytest.raises(ValueError, match="cover the context"):
        kernel(torch.randn(8, 4, 64).bfloat16(), cache, torch.tensor([0, 1]), 40, 0.125)
    with pytest.raises(RuntimeError, match="unsupported shape"):
        # 3 heads over 2 KV heads
        kernel(torch.randn(8, 3, 64).bfloat16(), cache, torch.tensor([0]), 8, 0.125)
    with pytest.raises(ValueError, match="unknown PrefillAttention kernel"):
        native.prefill_attention("avx2")


@needs_compiler
@pytest.mark.parametrize("kind", ["amx", "avx512"])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_whole_prompts_batch_only_where_the_prefill_kernel_does_not_take_them(kind: str, head_dim: int,
                                                                             monkeypatch) -> None:
    """Three whole 5-token prompts side by side: one batched SDPA call where the prefill kernel cannot take
    them (head dim 32), one kernel call per prompt where it can (its calls beat a batched bf16 SDPA call)."""
    backend = CpuPagedBackend(native.paged_decode(), _prefill_or_skip(kind))
    meta = AttentionMetadata.build([5, 5, 5], [5, 5, 5], [[0], [1], [2]], block_size=8)
    assert meta.prefill_runs == [(0, 3)]
    q, k, v = (torch.randn(15, 4, head_dim).bfloat16() for _ in range(3))
    cache = torch.zeros(2, 3, 8, 4, head_dim, dtype=torch.bfloat16)
    calls = {"batched": 0, "chunk": 0}
    whole, chunk = backend._whole_prompts, backend._chunk
    monkeypatch.setattr(backend, "_whole_prompts",
                        lambda *a: calls.__setitem__("batched", calls["batched"] + 1) or whole(*a))
    monkeypatch.setattr(backend, "_chunk",
                        lambda *a: calls.__setitem__("chunk", calls["chunk"] + 1) or chunk(*a))
    out = backend.forward(q, k, v, cache, meta, head_dim ** -0.5)
    assert calls == ({"batched": 0, "chunk": 3} if head_dim == 64 else {"batched": 1, "chunk": 0})
    torch.testing.assert_close(out.float(),
                               SdpaBackend().forward(q, k, v, cache.clone(), meta, head_dim ** -0.5).float(),
                               atol=2e-2, rtol=2e-2)
