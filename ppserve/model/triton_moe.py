"""The fused mixture-of-experts kernel in Triton: grouped GEMMs over the tokens sorted by expert.

The (token, expert) pairs of a microbatch are laid out by expert in blocks of BLOCK_M rows, each
expert's run padded to whole blocks (`ops.moe.align_to_blocks`), so every block belongs to one expert.
Two launches then do the experts' work with no loop over experts on the host and no host sync:

1. gate/up: a program takes one block of rows and a tile of the intermediate columns, gathers its rows'
   token activations, multiplies them by its expert's gate and up tiles, and writes silu(gate) * up into
   the padded intermediate buffer.
2. down: a program takes one block and a tile of H, multiplies the block's intermediate rows by its
   expert's down tile, scales each row by its routing weight and writes it to the row's pair.

Padding rows and the blocks past the last used one are masked off (pair id out of range, expert the
sentinel E). The grid is fixed by (T, k, E), so a fixed-size decode step captures into a CUDA graph. A
token's k results are summed in top-k order afterwards (one small torch op). CI checks it on CPU under
TRITON_INTERPRET=1 against the grouped reference (tests/integration/test_moe_kernels.py); there tl.dot
runs in NumPy, so the operands are float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ppserve.model.ops.moe_align import align_to_blocks
from ppserve.model.triton_attention import interpreting, triton_available

BLOCK_M = 16  # rows (pairs) per block: tl.dot's minimum
BLOCK_N = 32
BLOCK_K = 32

__all__ = ["check_can_run", "fused_moe", "triton_available"]

_kernels: dict[bool, tuple[Any, Any]] = {}  # built on first use, per mode (compiled, interpreted)


def check_can_run(device: torch.device) -> None:
    """A clear error where the kernel cannot run."""
    if not triton_available():
        raise ValueError("the Triton MoE kernel needs the triton package (CUDA builds of torch ship it)")
    if device.type != "cuda" and not interpreting():
        raise ValueError("the Triton MoE kernel needs a CUDA device "
                         "(or TRITON_INTERPRET=1 to run it slowly on CPU, for checks)")


def _dot_type(dtype: torch.dtype) -> Any:
    import triton.language as tl

    if dtype == torch.float32 or interpreting():  # NumPy has no bfloat16: see triton_attention._dot_type
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _build() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def rows_times_expert(a_ptr, a_rows, stride_a, row_ok, w_ptr, cols, col_ok, stride_wn, depth,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
        """[BLOCK_M, BLOCK_N] float32: rows a_rows of A (depth wide) times rows `cols` of W, transposed."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, depth, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < depth
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_TY)
            w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            acc += tl.dot(a, w.to(DOT_TY), input_precision=PRECISION).to(tl.float32)
        return acc

    # Kernels find the functions they call among their module's globals (the interpreter re-reads the
    # source with those globals, not the enclosing scope), so the helper of the mode being built goes there.
    globals()["rows_times_expert"] = rows_times_expert

    @triton.jit
    def gate_up_kernel(x_ptr, w_ptr, act_ptr, pair_ids_ptr, block_experts_ptr, num_pairs, hidden, inter,
                       stride_xt, stride_we, stride_wn, stride_at,
                       TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_TY: tl.constexpr,
                       PRECISION: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert < NUM_EXPERTS:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pair_ids_ptr + rows)
            row_ok = pair < num_pairs
            token = tl.where(row_ok, pair // TOP_K, 0)  # gathered: the block's rows are its pairs' tokens
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < inter
            w_gate = w_ptr + expert * stride_we
            gate = rows_times_expert(x_ptr, token, stride_xt, row_ok, w_gate, cols, col_ok, stride_wn, hidden,
                                     BLOCK_M, BLOCK_N, BLOCK_K, DOT_TY, PRECISION)
            up = rows_times_expert(x_ptr, token, stride_xt, row_ok, w_gate + inter * stride_wn, cols, col_ok,
                                   stride_wn, hidden, BLOCK_M, BLOCK_N, BLOCK_K, DOT_TY, PRECISION)
            act = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], act.to(act_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def down_kernel(act_ptr, w_ptr, out_ptr, weights_ptr, pair_ids_ptr, block_experts_ptr, num_pairs, hidden,
                    inter, stride_at, stride_we, stride_wn, stride_ot,
                    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_TY: tl.constexpr, PRECISION: tl.constexpr):
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert < NUM_EXPERTS:
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            pair = tl.load(pair_ids_ptr + rows)
            row_ok = pair < num_pairs
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < hidden
            acc = rows_times_expert(act_ptr, rows, stride_at, row_ok, w_ptr + expert * stride_we, cols,
                                    col_ok, stride_wn, inter, BLOCK_M, BLOCK_N, BLOCK_K, DOT_TY, PRECISION)
            pair = tl.where(row_ok, pair, 0)
            acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + pair[:, None] * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    return gate_up_kernel, down_kernel


def fused_moe(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """The experts' weighted output [T, H] for x [T, H] routed by topk_ids / topk_weights [T, k] over
    w13 [E, 2 I, H] and w2 [E, H, I]: what `ops.moe.grouped_experts` computes, in two launches."""
    import triton

    kernels = _kernels.get(interpreting())
    if kernels is None:
        kernels = _kernels[interpreting()] = _build()
    gate_up_kernel, down_kernel = kernels
    t, k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    layout = align_to_blocks(topk_ids, num_experts, BLOCK_M)
    num_blocks = layout.block_experts.shape[0]
    act = torch.empty(num_blocks * BLOCK_M, inter, dtype=x.dtype, device=x.device)  # padded layout's rows
    # One result per pair, in the routing weights' dtype (float32 for Mixtral) like the reference.
    out_dtype = torch.promote_types(x.dtype, topk_weights.dtype)
    pair_out = torch.empty(t * k, hidden, dtype=out_dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    dot_ty = _dot_type(x.dtype)
    precision = "ieee" if dot_ty == _dot_type(torch.float32) else "tf32"
    if t > 0:
        gate_up_kernel[(num_blocks, triton.cdiv(inter, BLOCK_N))](
            x, w13, act, layout.pair_ids, layout.block_experts, layout.num_pairs, hidden, inter,
            x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            TOP_K=k, NUM_EXPERTS=num_experts, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_TY=dot_ty, PRECISION=precision)
        down_kernel[(num_blocks, triton.cdiv(hidden, BLOCK_N))](
            act, w2, pair_out, weights, layout.pair_ids, layout.block_experts, layout.num_pairs, hidden,
            inter, act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
            NUM_EXPERTS=num_experts, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_TY=dot_ty, PRECISION=precision)
    return pair_out.view(t, k, hidden).sum(dim=1).to(x.dtype)
