"""The MoE block's parts: the router against transformers' on its edge cases, the grouped CPU path against a
per-token loop, and the Triton fused-MoE kernel against the grouped path under TRITON_INTERPRET=1 (tests/
conftest.py sets it before triton is imported; tests/gpu would run it compiled)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ppserve.model.arch import MoeSpec
from ppserve.model.moe import ExpertShard, SparseMoeBlock, TopKRouter
from ppserve.model.ops import moe as moe_ops
from ppserve.model.ops import native
from ppserve.model.ops.moe import experts, grouped_experts, grouped_mm_runs, pack_experts, uses_grouped_mm
from ppserve.model.ops.moe_align import align_to_blocks
from ppserve.model.ops.settings import KernelSettings, configure
from ppserve.model.parallel import TPContext
from ppserve.model.triton_attention import interpreting, triton_available
from ppserve.worker.capture_guard import no_host_transfers

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs the triton package")
needs_interpreter = pytest.mark.skipif(not interpreting(),
                                       reason="CPU check of the kernel under TRITON_INTERPRET=1")


def per_token_loop(x, ids, weights, w13, w2):
    """The definition, one token and one choice at a time."""
    out = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, weights.dtype))
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = F.linear(x[t], w13[ids[t, j]]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, w2[ids[t, j]])
    return out.to(x.dtype)


def random_experts(t, h, inter, e, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    return x, ids, weights, w13, w2


def test_grouped_path_equals_the_per_token_loop():
    x, ids, weights, w13, w2 = random_experts(37, 64, 48, 8, 2)
    ids[:20, 0] = 3  # one expert crowded, others likely idle
    ids[:20, 1] = 5
    torch.testing.assert_close(grouped_experts(x, ids, weights, w13, w2),
                               per_token_loop(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "one expert", "idle experts", "top-1"])
def test_grouped_mm_equals_the_per_expert_loop_bit_for_bit(dtype, routing):
    """The two ways of running the grouped path's matmuls make the same GEMM per expert over the same
    rows, so their outputs are equal bitwise, whichever experts get no token."""
    if not grouped_mm_runs("cpu", dtype):
        pytest.skip(f"F.grouped_mm does not run on CPU in {dtype} with torch {torch.__version__}")
    k = 1 if routing == "top-1" else 2
    x, ids, weights, w13, w2 = random_experts(24, 64, 48, 8, k, dtype, seed=3)
    if routing == "one expert":  # every pair to expert 5 (both choices: an expert may get a token twice)
        ids[:] = 5
    elif routing == "idle experts":  # experts 0, 3, 4 and 7 (the first and the last among them) get nothing
        ids = torch.tensor([[1, 2], [6, 5], [2, 6], [5, 1]]).repeat(6, 1)
    got = grouped_experts(x, ids, weights, w13, w2, expert_matmuls="grouped_mm")
    expected = grouped_experts(x, ids, weights, w13, w2, expert_matmuls="per_expert")
    assert got.dtype == dtype and torch.equal(got, expected)
    if dtype == torch.float32:  # and both are the definition
        torch.testing.assert_close(got, per_token_loop(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_weighted_sum_of_a_tokens_experts_is_the_sum_in_top_k_order(dtype, k):
    """Top-2 takes one add instead of a sum over the pair: a sum of two rounded once either way, equal bit
    for bit (scales from 1e-3 to 1e30)."""
    g = torch.Generator().manual_seed(k)
    for scale in (1e-3, 1.0, 1e30):
        out = (torch.randn(64 * k, 96, generator=g) * scale).to(dtype)
        w = torch.rand(64, k, generator=g).to(dtype)
        got = moe_ops._weighted_sum(out, w, 64, k, dtype)
        assert torch.equal(got, (out * w.reshape(-1, 1)).view(64, k, 96).sum(dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("panels", [False, True])
def test_one_token_takes_its_experts_directly_with_the_grouped_paths_numbers(dtype, panels):
    """A batch-1 decode step skips the sort, gathers and scatter: each of its experts' groups is its one
    row either way, so its output equals, bit for bit, that token's row of a sorted (two-token) run in
    which the other token chose other experts, on the torch chain and on the panel GEMM alike."""
    if panels and (dtype != torch.bfloat16 or native.panel_gemm() is None):
        pytest.skip("the panel GEMM runs bf16 on CPUs with AMX or AVX512-BF16")
    x, ids, weights, w13, w2 = random_experts(2, 64, 64, 8, 2, dtype, seed=5)
    ids = torch.tensor([[6, 1], [3, 4]])  # disjoint: every expert's group in the two-token run is one row
    packed = pack_experts(w13, w2) if panels else None
    assert panels == (packed is not None)
    pair = grouped_experts(x, ids, weights, w13, w2, packed=packed)
    one = grouped_experts(x[:1], ids[:1], weights[:1], w13, w2, packed=packed)
    assert one.shape == (1, 64) and torch.equal(one[0], pair[0])
    if dtype == torch.float32:
        torch.testing.assert_close(one, per_token_loop(x[:1], ids[:1], weights[:1], w13, w2), atol=1e-5,
                                   rtol=1e-5)


def test_the_expert_matmuls_dispatch_rule():
    x, ids, weights, w13, w2 = random_experts(4, 64, 48, 8, 2)
    runs = grouped_mm_runs("cpu", torch.float32)
    assert uses_grouped_mm(8, 8, x, w13, w2) == runs  # enough pairs per expert
    assert not uses_grouped_mm(2, 8, x, w13, w2)  # one decode token on 8 experts: most groups empty, the loop
    assert not uses_grouped_mm(64, 8, x, w13, w2, "per_expert")
    with pytest.raises(ValueError, match="unknown expert matmuls 'cutlass'"):
        uses_grouped_mm(8, 8, x, w13, w2, "cutlass")
    for way in ("grouped_mm", "per_expert") if runs else ("per_expert",):  # a microbatch with no tokens
        assert grouped_experts(x[:0], ids[:0], weights[:0], w13, w2, expert_matmuls=way).shape == (0, 64)
    # An expert intermediate of 6 floats: 24-byte rows, which grouped_mm refuses; auto takes the loop and
    # the result is still right, asking for grouped_mm by name says why not.
    x, ids, weights, w13, w2 = random_experts(8, 64, 6, 8, 2)
    assert not uses_grouped_mm(16, 8, x, w13, w2)
    torch.testing.assert_close(grouped_experts(x, ids, weights, w13, w2),
                               per_token_loop(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="expert intermediate 6 .*16-byte aligned rows"):
        grouped_experts(x, ids, weights, w13, w2, expert_matmuls="grouped_mm")


@pytest.mark.parametrize("routing", ["random", "one expert", "idle experts", "top-1", "no tokens"])
def test_the_panel_expert_path_agrees_with_the_torch_paths(routing, monkeypatch):
    """bf16 on the panel GEMM (AMX or AVX512-BF16): float32 accumulation in another order than oneDNN's, so
    agreement within bf16 steps with the torch path and with the float32 definition, never a silent
    fallback."""
    if native.panel_gemm() is None:
        pytest.skip("no AMX or AVX512-BF16 here: bf16 experts run on torch's matmuls")
    k = 1 if routing == "top-1" else 2
    x, ids, weights, w13, w2 = random_experts(24, 64, 64, 8, k, torch.bfloat16, seed=4)
    if routing == "one expert":
        ids[:] = 5
    elif routing == "idle experts":
        ids = torch.tensor([[1, 2], [6, 5], [2, 6], [5, 1]]).repeat(6, 1)
    elif routing == "no tokens":
        x, ids, weights = x[:0], ids[:0], weights[:0]
    packed = pack_experts(w13, w2)
    assert (packed is not None and packed.gate_up.shape == (8, 8, 2, 16, 16, 2)
            and packed.down.shape == (8, 4, 2, 16, 16, 2))
    panel_runs = []
    real = moe_ops._panel_expert_matmuls
    monkeypatch.setattr(moe_ops, "_panel_expert_matmuls", lambda *args: panel_runs.append(1) or real(*args))
    got = grouped_experts(x, ids, weights, w13, w2, packed=packed)
    assert panel_runs == [1]
    torch_path = grouped_experts(x, ids, weights, w13, w2, expert_matmuls="per_expert")
    assert got.dtype == torch.bfloat16 and got.shape == torch_path.shape
    torch.testing.assert_close(got.float(), torch_path.float(), rtol=2 ** -6, atol=2e-2)
    definition = per_token_loop(x.float(), ids, weights, w13.float(), w2.float())
    torch.testing.assert_close(got.float(), definition, rtol=2 ** -6, atol=3e-2)
    # asking for a torch path by name bypasses the panel one
    assert torch.equal(grouped_experts(x, ids, weights, w13, w2, expert_matmuls="per_expert", packed=packed),
                       torch_path)
    assert panel_runs == [1]


def test_only_what_the_panel_gemm_takes_is_packed():
    x, ids, weights, w13, w2 = random_experts(4, 64, 64, 8, 2, torch.bfloat16)
    assert pack_experts(w13.float(), w2.float()) is None  # float32 stays on torch, bit-exact
    _, _, _, w13_narrow, w2_narrow = random_experts(4, 64, 48, 8, 2, torch.bfloat16)
    assert pack_experts(w13_narrow, w2_narrow) is None  # a TP slice of 48 columns: not a 32-multiple
    try:
        # model.linear_path: plain, torch's GEMMs for everything
        configure(KernelSettings(linear_path="plain"))
        assert pack_experts(w13, w2) is None
        configure(KernelSettings(amx=False))  # model.amx_kernels: false leaves the AVX512-BF16 kernel, if any
        packed = pack_experts(w13, w2)
        assert (packed.kernel if packed else None) == (None if native.panel_gemm("avx512") is None
                                                       else "avx512")
    finally:
        configure(KernelSettings())
    block = SparseMoeBlock(64, MoeSpec(8, 2, 64, True, True, (0,)), TPContext(), torch.bfloat16, "cpu")
    block.prepack()
    assert (block.panels is not None) == (native.panel_gemm() is not None)
    block32 = SparseMoeBlock(64, MoeSpec(8, 2, 64, True, True, (0,)), TPContext(), torch.float32, "cpu")
    block32.prepack()
    assert block32.panels is None


def test_block_layout_is_sorted_padded_and_needs_no_host_sync():
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])
    with no_host_transfers("the MoE block layout"):  # what a CUDA graph's decode step runs
        layout = align_to_blocks(ids, num_experts=4, block=4)
    assert layout.pair_ids.shape == (-(-(6 + 4 * 3) // 4) * 4,)
    # expert 0: pairs 1, 5; expert 1: pair 3; expert 2: pairs 0, 2, 4; expert 3: none; 6 marks padding.
    assert layout.pair_ids[:12].tolist() == [1, 5, 6, 6, 3, 6, 6, 6, 0, 2, 4, 6]
    assert layout.block_experts.tolist() == [0, 1, 2, 4, 4]


@needs_triton
@needs_interpreter
@pytest.mark.parametrize(("t", "h", "inter", "e", "k", "dtype"), [
    (13, 64, 48, 8, 2, torch.float32),  # a prefill chunk, intermediate not a multiple of the tile
    (1, 40, 24, 4, 1, torch.float32),  # one decode, top-1, hidden not a multiple of the tile
    (40, 64, 32, 4, 2, torch.bfloat16),  # experts with more rows than a block
])
# Mixtral's float32 weights; Qwen's model dtype
@pytest.mark.parametrize("weights_dtype", [torch.float32, None])
def test_triton_fused_moe_matches_the_grouped_path(t, h, inter, e, k, dtype, weights_dtype):
    from ppserve.model.triton_moe import fused_moe

    x, ids, weights, w13, w2 = random_experts(t, h, inter, e, k, dtype, seed=t)
    weights = weights.to(weights_dtype or dtype)
    got = fused_moe(x, ids, weights, w13, w2)
    expected = grouped_experts(x, ids, weights, w13, w2)
    assert got.dtype == expected.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@needs_triton
def test_the_kernel_choice_and_its_errors(monkeypatch):
    x, ids, weights, w13, w2 = random_experts(3, 16, 16, 4, 2)
    with pytest.raises(ValueError, match="unknown MoE kernel 'cutlass'"):
        experts(x, ids, weights, w13, w2, "cutlass")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        experts(x, ids, weights, w13, w2, "triton")
    torch.testing.assert_close(experts(x, ids, weights, w13, w2), grouped_experts(x, ids, weights, w13, w2))


# ---- the router against transformers' -----------------------------------------------------------------

def hf_and_ours(family: str, router_rows: torch.Tensor | None = None):
    """transformers' sparse block of `family` with random weights, and ours loaded with the same tensors."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                             norm_topk_prob=False)
        hf = Qwen3MoeSparseMoeBlock(cfg)
        spec = MoeSpec(8, 2, 16, normalize_topk=False, weights_in_model_dtype=True, sparse_layers=(0,))
    else:
        cfg = MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)
        hf = MixtralSparseMoeBlock(cfg)
        spec = MoeSpec(8, 2, 16, normalize_topk=True, weights_in_model_dtype=False, sparse_layers=(0,))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
        if router_rows is not None:
            hf.gate.weight.copy_(router_rows)
    ours = SparseMoeBlock(32, spec, TPContext(), torch.float32, "cpu")
    ours.gate.weight_loader(ours.gate.weight, hf.gate.weight.detach())
    ours.experts.gate_up.weight_loader(ours.experts.gate_up.weight, hf.experts.gate_up_proj.detach(),
                                       ExpertShard(None, "gate_up"))
    ours.experts.down.weight_loader(ours.experts.down.weight, hf.experts.down_proj.detach(),
                                    ExpertShard(None, "down"))
    return hf.eval(), ours


def router_edge_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Router rows [8, 32] for two edge cases: every token to expert 6 (and its second choice, expert 1),
    the other six experts getting no token; and exact ties, experts 2, 3 and 5 having the same row, so
    their logits are bitwise equal."""
    crowded = torch.zeros(8, 32)
    crowded[6, 0], crowded[1, 0] = 50.0, 25.0
    tied = torch.randn(8, 32, generator=torch.Generator().manual_seed(8)) * 0.1
    tied[2, 0] = 0.5  # with x[:, 0] >= 1, their logits lead
    tied[3] = tied[5] = tied[2] = tied[2] * 30
    return crowded, tied


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_edge_cases_match_transformers(family):
    x = torch.randn(12, 32, generator=torch.Generator().manual_seed(12))
    # In [1, 2.5]: the crowded rows' second choice, 25 x[0] below the first, keeps a float32 probability
    # (at x[0] = 4.2 it underflowed to 0, tied with the six idle experts' and torch.topk chose among them).
    x[:, 0] = x[:, 0].abs().clamp(max=1.5) + 1.0
    crowded, tied = router_edge_rows()
    for rows in (None, crowded, tied):
        hf, ours = hf_and_ours(family, rows)
        with torch.no_grad():
            _, hf_weights, hf_ids = hf.gate(x)
            weights, ids = ours.gate(x)
            assert torch.equal(ids, hf_ids)  # ties decided as transformers decides them
            if rows is crowded:
                assert (ids == torch.tensor([6, 1])).all()
            if rows is tied:
                logits = F.linear(x, tied)
                assert torch.equal(logits[:, 2], logits[:, 3]) and torch.equal(logits[:, 3], logits[:, 5])
                assert bool(torch.isin(ids, torch.tensor([2, 3, 5])).any())  # the tie is among the chosen
            torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
            assert weights.dtype == hf_weights.dtype
            torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_bf16_router_on_cpu_takes_float32_logits_rounded_as_the_bf16_gemm_rounds(family, monkeypatch):
    """`TopKRouter.prepack` keeps a float32 copy of a bf16 router for CPU (oneDNN's bf16 GEMM costs 4x at a
    router's shape); the logits are rounded to bf16, so the choices and weights are the bf16 GEMM's, ties
    included. (The routing kernel, switched off here, is checked against this chain below.)"""
    monkeypatch.setattr(native, "moe_routing", lambda: None)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(64)).bfloat16()
    x[:, 0] = x[:, 0].abs().clamp(max=1.5) + 1.0
    for rows in (None, *router_edge_rows()):
        _, ours = hf_and_ours(family, rows)
        gate = ours.gate.to(torch.bfloat16)  # in place
        want_weights, want_ids = gate(x)  # before prepack: F.linear in bf16
        gate.prepack()
        assert gate.weight_f32 is not None and gate.weight_f32.dtype == torch.float32
        weights, ids = gate(x)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    _, ours = hf_and_ours(family, None)
    ours.gate.prepack()  # float32 models keep the one path
    assert ours.gate.weight_f32 is None


# ---- the native routing kernels (csrc/moe_route.c) -------------------------------------------------------

def routing_or_skip() -> native.MoeRouting:
    kernel = native.moe_routing()
    if kernel is None:
        pytest.skip("no native kernel library here (no C compiler, or switched off)")
    return kernel


def bf16_router(family: str, logits: torch.Tensor | None = None, tokens: int = 64):
    """A prepacked bf16 router and its input. With `logits` [T, E] (bf16 values): one-hot token rows and
    router columns holding those logits, so that the router's logits are exactly them."""
    _, ours = hf_and_ours(family, None)
    gate = ours.gate.to(torch.bfloat16)
    if logits is None:
        x = torch.randn(tokens, 32).bfloat16()
    else:
        x = torch.zeros(logits.shape[0], 32, dtype=torch.bfloat16)
        x[torch.arange(logits.shape[0]), torch.arange(logits.shape[0])] = 1.0
        with torch.no_grad():
            gate.weight.zero_()
            gate.weight[:, :logits.shape[0]] = logits.T.bfloat16()
    gate.prepack()
    return gate, x


def kernel_routing(kernel, gate, x) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The routing kernel on the router's input: (weights, ids, how many times it handed the batch back)."""
    handed_back: list[torch.Tensor] = []

    def in_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        handed_back.append(logits)
        return gate.choose(logits)

    weights, ids = kernel.route(x, gate.weight_f32, gate.spec.top_k, gate.spec.normalize_topk,
                                not gate.spec.weights_in_model_dtype, in_torch)
    return weights, ids, len(handed_back)


def torch_routing(gate, x):
    """What the torch chain gives for the bf16 router: its logits' choices and weights."""
    return gate.choose(F.linear(x.float(), gate.weight_f32).to(torch.bfloat16))


@pytest.mark.parametrize(("family", "normalize"),
                         [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
@pytest.mark.parametrize("logits_in", ["kernel", "torch"])
def test_the_routing_kernel_chooses_as_the_torch_chain(family, normalize, logits_in, monkeypatch):
    """The same experts in the same order, and the same weights to within one rounding of the weights' dtype
    (its e^x is not torch's): bf16 weights (Qwen3-MoE, renormalized or not) and float32 ones (Mixtral). Up to
    ROUTE_MAX_MACS the kernel computes the logits itself; above, torch's GEMM does."""
    kernel = routing_or_skip()
    if logits_in == "torch":
        monkeypatch.setattr(native.MoeRouting, "ROUTE_MAX_MACS", 0)
    for seed in range(4):
        torch.manual_seed(seed)
        gate, x = bf16_router(family)
        gate.spec = dataclasses.replace(gate.spec, normalize_topk=normalize)
        weights, ids, _ = kernel_routing(kernel, gate, x)
        want_weights, want_ids = torch_routing(gate, x)
        assert torch.equal(ids, want_ids) and weights.dtype == want_weights.dtype
        tol = 2 ** -8 if weights.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(weights, want_weights, atol=0, rtol=tol)
        assert torch.equal(*(gate(x)[1], want_ids))  # the router's forward takes the kernel


@pytest.mark.parametrize(("experts", "top_k"), [(32, 4), (128, 8)])
def test_the_routing_kernel_is_right_for_wide_routers_too(experts, top_k):
    """Routers of more than 16 experts stay on torch's chain (`MoeRouting.routes`: no faster there), but the
    kernel's general row path (one pass keeping the k + 1 best) chooses as the chain does, ties included:
    rows of bf16 logits in a narrow range, where equal logits among the best k + 1 are common (a few of 384
    rows at 32 experts, whose ids are then fixed row by row; most rows at 128, one topk over all)."""
    kernel = routing_or_skip()
    torch.manual_seed(experts)
    gate = TopKRouter(64, MoeSpec(experts, top_k, 16, True, True, (0,)), torch.bfloat16, "cpu")
    with torch.no_grad():
        gate.weight.copy_(torch.randn(experts, 64) * 0.02)
    gate.prepack()
    assert not kernel.routes(torch.zeros(1, 64, dtype=torch.bfloat16), gate.weight_f32)
    x = torch.randn(384, 64).bfloat16()  # 32 experts: some tied rows among many, fixed one by one
    weights, ids, _ = kernel_routing(kernel, gate, x)
    want_weights, want_ids = torch_routing(gate, x)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_exact_ties_take_torch_topks_ids_and_the_kernels_weights(family):
    """torch.topk breaks exact ties by its selection algorithm's visiting order, which the kernel does not
    imitate: a batch with equal logits among a row's k + 1 best takes its ids from torch.topk over the
    logits. The weights of tied experts are equal, so the kernel's stand."""
    kernel = routing_or_skip()
    logits = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0, 0.0, 1.0, 0.25],  # three tied at the top
                           [1.0, 0.5, 0.75, 0.5, 0.5, -2.0, 0.0, 0.25],  # tied second choice and beyond
                           [0.125] * 8,  # all tied
                           [3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # no tie in its best three
    gate, x = bf16_router(family, logits)
    weights, ids, handed_back = kernel_routing(kernel, gate, x)
    want_weights, want_ids = torch_routing(gate, x)
    assert handed_back == 0 and torch.equal(ids, want_ids)
    assert torch.equal(ids[3], torch.tensor([0, 2]))
    torch.testing.assert_close(weights, want_weights, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_near_ties_and_nan_logits_go_back_to_the_torch_chain(family):
    """Distinct logits whose probabilities come within a few float32 ulps (torch's e^x may make them equal),
    and a NaN logit, are torch's to decide: the kernel hands the batch back and the result is the chain's."""
    kernel = routing_or_skip()
    tiny = torch.tensor([1e-7, 1.0039e-7, 0.0, -1e-7, -2e-7, -3e-7, -4e-7, -5e-7]).bfloat16()
    assert tiny[0] != tiny[1]
    for bad in (tiny, torch.tensor([0.5, float("nan"), 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])):
        logits = torch.stack([bad.float(), torch.arange(8.0) / 4])
        gate, x = bf16_router(family, logits)
        weights, ids, handed_back = kernel_routing(kernel, gate, x)
        want_weights, want_ids = torch_routing(gate, x)
        assert handed_back == 1 and torch.equal(ids, want_ids)
        assert torch.equal(weights, want_weights) or bool(torch.isnan(want_weights).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("routing", ["random", "one expert", "idle experts", "top-1", "top-8 of 64"])
def test_the_native_dispatch_is_the_stable_sort_by_expert(dtype, routing):
    """One call for the torch chain's sort, searchsorted and gather (`moe._dispatch`): the same rows, run ends
    and positions, bit for bit, in any dtype (it moves bytes)."""
    kernel = routing_or_skip()
    e, k = (64, 8) if routing == "top-8 of 64" else (8, 1 if routing == "top-1" else 2)
    x, ids, _, _, _ = random_experts(24, 40, 16, e, k, dtype, seed=7)
    if routing == "one expert":
        ids[:] = 5
    elif routing == "idle experts":
        ids = torch.tensor([[1, 2], [6, 5], [2, 6], [5, 1]]).repeat(6, 1)
    got, want = kernel.dispatch(x, ids, e), moe_ops._dispatch(x, ids, e)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    strided = torch.randn(24, 64).to(dtype)[:, :40]  # rows with a stride beyond H
    assert torch.equal(kernel.dispatch(strided, ids, e)[0], moe_ops._dispatch(strided, ids, e)[0])
    with pytest.raises(ValueError, match="expert id"):
        kernel.dispatch(x, torch.full_like(ids, e), e)


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("h", [96, 100])  # 100: a row that ends inside a 16-lane vector
def test_the_native_combine_equals_the_weighted_sum_bit_for_bit(weights_dtype, k, h):
    """The experts' outputs back to pair order, weighted and summed in top-k order in one pass: the torch
    chain's arithmetic (bf16 weights round each product, float32 ones do not; one rounding of the sum), at
    scales from 1e-3 to 1e30."""
    kernel = routing_or_skip()
    g = torch.Generator().manual_seed(k)
    for scale in (1e-3, 1.0, 1e30):
        down = (torch.randn(64 * k, h, generator=g) * scale).bfloat16()
        pos = torch.randperm(64 * k, generator=g)
        w = torch.rand(64, k, generator=g).to(weights_dtype)
        want = moe_ops._weighted_sum(down.index_select(0, pos), w, 64, k, torch.bfloat16)
        got = kernel.combine(down, pos, w)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# ---- CUDA graphs -----------------------------------------------------------------------------------------

@needs_triton
def test_the_fused_moe_wrapper_launches_with_no_host_transfer(monkeypatch):
    """What a captured decode step runs around the two launches (layout, buffers, the top-k sum) reads
    nothing back to the host, and the grids depend on shapes only. The launches themselves are stood in
    for here (the interpreter copies tensors to NumPy, which a real capture never sees)."""
    from ppserve.model import triton_moe

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setitem(triton_moe._kernels, interpreting(), (Recorder(), Recorder()))
    x, ids, weights, w13, w2 = random_experts(5, 64, 48, 8, 2)
    with no_host_transfers("the fused MoE step"):
        out = triton_moe.fused_moe(x, ids, weights, w13, w2)
    assert out.shape == (5, 64)
    blocks = -(-(5 * 2 + 8 * 15) // 16)
    assert grids == [(blocks, 2), (blocks, 2)]  # 48 / 32 intermediate tiles, 64 / 32 hidden tiles


def test_moe_models_capture_only_on_the_triton_kernel(tmp_path):
    """An MoE stage on the grouped path is not capturable, so decode graphs opt out ('auto') or refuse
    (asked for by name); dense models are unaffected."""
    from ppserve import LLM
    from ppserve.model.loader import load_stage_model
    from tests.model_helpers import make_tiny_qwen3_dir

    model_dir = make_tiny_qwen3_dir(tmp_path / "m", num_layers=2, dense_layers=())
    stage = load_stage_model(model_dir, 0, 2)
    assert not stage.capturable
    for layer in stage.layers:
        layer.mlp.kernel = "triton"
    assert stage.capturable == (triton_available())
    with pytest.raises(ValueError,
                       match="cuda_graphs=eager: this model's MoE layers run the grouped expert path"):
        LLM(str(model_dir), dtype="float32", executor="inproc", overrides=["model.cuda_graphs=eager"])


@needs_triton
@needs_interpreter
def test_a_model_on_the_triton_moe_kernel_equals_transformers(tmp_path):
    """model.moe_kernel=triton: every sparse layer of a pipeline (pp=2, chunked prefill, decodes) through the
    fused kernel, under the interpreter; greedy float32 tokens equal transformers."""
    from ppserve import LLM, SamplingParams
    from ppserve.model.moe import SparseMoeBlock
    from tests.model_helpers import make_tiny_qwen3_dir
    from tests.oracle import reference_greedy

    model_dir = make_tiny_qwen3_dir(tmp_path / "m", num_layers=2, dense_layers=(), experts=4, seed=2)
    prompts = [[5, 9, 13, 200, 7, 11, 40]]
    expected = reference_greedy(model_dir, prompts, 3)
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=4,
             max_num_seqs=4, block_size=4, overrides=["model.moe_kernel=triton"]) as llm:
        blocks = [m for w in llm.engine.executor.workers
                  for m in w.model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == 2 and all(b.kernel == "triton" for b in blocks)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True))]
    assert got == expected
    with pytest.raises(ValueError, match="model.moe_kernel must be auto, grouped or triton"):
        LLM(str(model_dir), executor="inproc", overrides=["model.moe_kernel=cutlass"])
