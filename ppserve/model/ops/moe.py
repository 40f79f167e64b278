"""The experts of a mixture-of-experts layer, applied to routed tokens: the grouped path, the kernel's layout.

Every token goes to k experts, so a microbatch of T tokens makes T * k (token, expert) pairs. Both paths
group the pairs by expert and run each expert once over all its tokens, never a loop over tokens:

- `grouped_experts` (CPU, any device): sort the pairs by expert, gather their tokens' rows, run every
  expert's gate/up matmul, SiLU-gate and down matmul over its run of rows, weight each pair by its routing
  probability, and add each token's k results in top-k order (transformers' order, so float32 output
  matches it). On CPU the sort and gather are one native call (`native.MoeRouting.dispatch`, any dtype: a
  permutation of bytes, bit for bit the torch chain `_dispatch`), and in bf16 so are the weighting and the
  sum (`combine`, bit for bit `_weighted_sum`): five and four torch ops before, ~17 us of a 103 us layer at
  64 tokens (H = I = 128, 8 experts top-2, bf16, Zen 5). The matmuls run one of two ways
  (`expert_matmuls`), bit for bit the same (the same GEMM per expert over the same rows):
  - `F.grouped_mm`: one call per projection over all experts, offsets in a tensor: no host sync and two
    ops instead of ~7 per expert (one layer, H = I = 128: 1.2-1.5x faster than the loop at 3-64 tokens on
    8 experts top-2, 1.8-2x at 16 tokens on 64-128 experts top-8);
  - the per-expert loop: reads the offsets on the host and skips idle experts. `F.grouped_mm` walks
    every expert's group, empty ones too, so with fewer pairs than ~0.3 per expert (one decode token on
    8 experts top-2) the loop is faster (grouped_mm 0.9x there, 0.6x at 64 experts top-8). It is also the
    fallback where `F.grouped_mm` is missing or refuses the device, dtype or layout (`uses_grouped_mm`).
  A single token (a batch-1 decode step) takes its k experts straight from its ids: each expert's group
  is its one row anyway, so the matmuls are the same and only the sort, gathers and scatter go (one layer
  of the tiny Qwen3-MoE, float32: the experts from 0.14 to 0.09 ms; `bench_moe.py --parts breakdown`).
  Either way the grouped path is not captured in CUDA graphs (the loop's host read; on CUDA the Triton
  kernel is the fast path).
  In bf16 on CPUs with AMX or AVX512-BF16 a third way comes first: ppserve's panel GEMM (csrc/gemm_amx.c,
  csrc/gemm_avx512.c; `native.panel_gemm`), each expert's weights prepacked once at load (`PanelExperts`),
  SiLU-and-mul in the gate/up GEMM's epilogue as the dense MLP does, and every expert's projection in one
  call (`PanelGemm.grouped`): one call per expert cost about what a decode step's few rows multiply (tiny
  Qwen3-MoE, 16 decodes, bf16, `bench_moe.py --parts breakdown --dtype bfloat16`: a step's experts 1.46 ->
  0.76 ms at H = I = 128 and 6.5 -> 5.5-5.7 ms at H 512, I 1024 on a Zen 4; 1.11 -> 0.52 ms at H = I = 128
  on a Xeon with AMX). oneDNN's bf16 GEMM repacks a weight on every call, which
  at an expert's few rows is a large part of the product (one layer, 64 tokens, H 512, I 256, 8 experts
  top-2, one thread on a Xeon with AMX: the AMX loop 1.4x faster than grouped_mm, 20x the loop over
  tokens; `benchmarks/bench_moe.py --parts grouped --dtype bfloat16`). Its sums may run in another order
  than oneDNN's, so it agrees with the other two rather than equalling them.
- the fused Triton kernel (ppserve/model/triton_moe.py) over the pairs laid out in blocks by expert
  (`ops/moe_align.py`): no host sync, so a decode step of fixed size captures into a CUDA graph.

`experts` picks the path as `model/backend_select.py` picks attention: the Triton kernel on CUDA when
triton imports (or when forced, with a clear error where it cannot run: on CPU only under
TRITON_INTERPRET=1, the CI check), the grouped path otherwise.

Weights: w13 [E, 2 I, H] (each expert's gate rows then up rows, this TP rank's slice of I) and
w2 [E, H, I]; the caller all-reduces the partial sums over TP ranks once, after the experts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model import triton_moe
from ppserve.model.ops import native, silu_mul
from ppserve.model.ops.settings import MOE_KERNELS

EXPERT_MATMULS = ("auto", "grouped_mm", "per_expert")

# `F.grouped_mm` pays for every expert's group, the loop only for experts with tokens: below this many
# (token, expert) pairs per expert the loop wins. Measured crossovers, H = I = 128, float32, one thread:
# between 0.25 and 0.5 on 8 experts top-2, 0.25 and 0.38 on 64 top-8, ~0.25 on 128 top-8.
GROUPED_MM_MIN_PAIRS_PER_EXPERT = 0.3


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `F.grouped_mm` exists and computes on this device type and dtype (torch <= 2.8 had no CPU
    kernel; on CUDA it needs bf16 on SM80+): one tiny call, checked against per-group matmuls, once."""
    if device_type != "cpu" or not hasattr(F, "grouped_mm"):
        return False  # on CUDA the Triton kernel is the fast path; the loop is the grouped fallback
    x = torch.arange(32, dtype=dtype).reshape(4, 8)
    w = torch.arange(192, dtype=dtype).reshape(3, 8, 8)  # [E, N, K] as w13 and w2 are stored
    offs = torch.tensor([1, 1, 4], dtype=torch.int32)  # an idle expert in the middle
    try:
        got = F.grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return torch.equal(got, torch.cat((x[:1] @ w[0].T, x[1:] @ w[2].T)))


def _aligned(t: Tensor) -> bool:
    """grouped_mm's layout rule: every stride but the unit one, and the data, on 16-byte boundaries."""
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def uses_grouped_mm(num_pairs: int, num_experts: int, x: Tensor, w13: Tensor, w2: Tensor,
                    expert_matmuls: str = "auto") -> bool:
    """The dispatch rule between the two ways of running the experts' matmuls (see the module docstring):
    grouped_mm where it runs (this device and dtype, 16-byte aligned rows: hidden and intermediate sizes
    multiples of 4 in float32, of 8 in bf16) and enough pairs per expert, else the loop."""
    if expert_matmuls not in EXPERT_MATMULS:
        raise ValueError(f"unknown expert matmuls {expert_matmuls!r} ({', '.join(EXPERT_MATMULS)})")
    if expert_matmuls == "per_expert":
        return False
    if expert_matmuls == "auto" and num_pairs < GROUPED_MM_MIN_PAIRS_PER_EXPERT * num_experts:
        return False  # decided before the layout checks: a one-token decode step pays for nothing more
    # The gathered rows and the activations are fresh contiguous [P, H] and [P, I] tensors: aligned when
    # the weights' rows (H and I wide) are.
    runs = grouped_mm_runs(x.device.type, x.dtype) and _aligned(w13) and _aligned(w2)
    if expert_matmuls == "grouped_mm":
        if not runs:
            raise ValueError(f"F.grouped_mm does not run on {x.device.type} in {x.dtype} with this torch "
                             f"{torch.__version__} at hidden {x.shape[1]}, expert intermediate {w2.shape[2]} "
                             "(it needs 16-byte aligned rows); use expert_matmuls='per_expert' or 'auto'")
        return True
    return runs


@dataclass(frozen=True)
class PanelExperts:
    """Every expert's weights in the panel GEMM's layout: gate_up [E, 2I/16, H/32, 16, 16, 2] (panels
    alternating gate and up, for the SiLU-and-mul epilogue), down [E, H/16, I/32, 16, 16, 2]; `kernel`
    is the panel kernel that packed them ('amx' | 'avx512'); `each` holds (gate_up[e], down[e]) per expert,
    views taken once, not per call (a batch-1 decode step's experts index them four times a layer)."""

    gate_up: Tensor
    down: Tensor
    kernel: str
    each: tuple[tuple[Tensor, Tensor], ...]


def pack_experts(w13: Tensor, w2: Tensor) -> PanelExperts | None:
    """The experts prepacked for the panel GEMM, or None where it does not apply: not bf16 on CPU, no panel
    kernel here (no AMX or AVX512-BF16, or switched off by the settings), or sides the kernel cannot tile
    (H and this rank's I multiples of 32)."""
    kernel = native.panel_gemm()
    if kernel is None or w13.dtype != torch.bfloat16 or w13.device.type != "cpu":
        return None
    hidden, inter = w2.shape[1], w2.shape[2]
    if hidden % 32 or inter % 32:
        return None
    gate_up, down = torch.stack([kernel.pack_gate_up(w) for w in w13]), torch.stack([kernel.pack(w) for w in w2])
    return PanelExperts(gate_up, down, kernel.kernel, tuple(zip(gate_up.unbind(), down.unbind(), strict=True)))


def grouped_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                    expert_matmuls: str = "auto", packed: PanelExperts | None = None) -> Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k] -> [T, H], the weighted sum of each token's experts.
    `packed` (from `pack_experts`): with expert_matmuls "auto" and bf16 input, the matmuls run on the panel
    GEMM."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    if t == 1 and expert_matmuls != "grouped_mm":
        down = _one_token_experts(x, topk_ids, w13, w2, packed if expert_matmuls == "auto" else None)
        return _weighted_sum(down, topk_weights, t, k, x.dtype)
    # Pair p = token p // k, its (p % k)-th choice; sorted stably by expert, so each expert's rows are
    # one run, ending at ends[e] (int32, as grouped_mm takes its offsets). pos[p]: pair p's row.
    routing = native.moe_routing()
    if routing is not None and routing.accepts(x, topk_ids):
        rows, ends, pos = routing.dispatch(x, topk_ids, num_experts)  # one call, not five ops
    else:
        rows, ends, pos = _dispatch(x, topk_ids, num_experts)
    if packed is not None and expert_matmuls == "auto" and x.dtype == torch.bfloat16:
        down = _panel_expert_matmuls(rows, ends, packed)
    elif uses_grouped_mm(t * k, num_experts, x, w13, w2, expert_matmuls):
        act = silu_mul(F.grouped_mm(rows, w13.transpose(1, 2), offs=ends))  # [P, 2I] -> [P, I]
        down = F.grouped_mm(act, w2.transpose(1, 2), offs=ends)  # [P, H]
    else:
        down = _per_expert_matmuls(rows, ends, w13, w2)
    if routing is not None and routing.combines(down, topk_weights):
        return routing.combine(down, pos, topk_weights)  # the weighted sum below in one pass
    return _weighted_sum(down.index_select(0, pos), topk_weights, t, k, x.dtype)  # back to pair order first


def _dispatch(x: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """`native.MoeRouting.dispatch` in torch ops: (rows in expert order, ends, pos)."""
    k = topk_ids.shape[1]
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True, out_int32=True)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
    return x.index_select(0, order // k), ends, pos


def _weighted_sum(out: Tensor, topk_weights: Tensor, t: int, k: int, dtype: torch.dtype) -> Tensor:
    """Pair-order expert outputs [T k, H] weighted in the routing weights' dtype (float32 for Mixtral, as
    transformers does), then each token's k results summed in top-k order -> [T, H]."""
    weighted = out * topk_weights.reshape(-1, 1)
    per_token = weighted.view(t, k, weighted.shape[1])  # shape spelled out: t may be 0
    if k == 2:
        # One add: a sum of two values rounded once, what `sum` gives (but for the sign of a zero made of two
        # negative zeros), ~3.5x faster than bf16's `sum` over a middle dim (64 tokens of 128: 4.4 / 15 us).
        return (per_token[:, 0] + per_token[:, 1]).to(dtype)
    return per_token.sum(dim=1).to(dtype)


def _one_token_experts(x: Tensor, topk_ids: Tensor, w13: Tensor, w2: Tensor,
                       packed: PanelExperts | None) -> Tensor:
    """One token (a batch-1 decode step): its k experts straight from the ids, in top-k order, which is
    pair order. Each expert's group is that one row either way, so the matmuls are the grouped path's
    (the panel GEMM for bf16 where `packed`, else the torch chain); only the sort, the gathers and the
    scatter back, ~half the layer's time at this size, are left out."""
    if packed is not None and x.dtype == torch.bfloat16:
        gemm = native.panel_gemm(packed.kernel)
        assert gemm is not None  # it packed the experts

        def expert_out(e: int) -> Tensor:
            gate_up, down = packed.each[e]
            return gemm(gemm(x, gate_up, None, silu_mul=True), down, None)
    else:
        def expert_out(e: int) -> Tensor:
            return F.linear(silu_mul(F.linear(x, w13[e])), w2[e])
    return torch.cat([expert_out(e) for e in topk_ids[0].tolist()])  # the host read the per-expert loop makes too


def _per_expert_matmuls(rows: Tensor, ends: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """What the two grouped_mm calls compute, one expert at a time: rows [P, H] sorted by expert -> [P, H]."""
    down = torch.empty(rows.shape[0], w2.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):  # the host sync: one small list
        if end == start:
            continue  # an expert no token chose costs nothing
        act = silu_mul(F.linear(rows[start:end], w13[expert]))  # [n, 2I] -> [n, I]
        down[start:end] = F.linear(act, w2[expert])
        start = end
    return down


def _panel_expert_matmuls(rows: Tensor, ends: Tensor, packed: PanelExperts) -> Tensor:
    """`_per_expert_matmuls` on the panel GEMM: bf16 rows [P, H] sorted by expert -> [P, H]. Every expert's
    gate/up in one call, then every expert's down in another (`PanelGemm.grouped`): the per-expert calls,
    output allocations and copies cost about what a decode step's few rows per expert multiply."""
    gemm = native.panel_gemm(packed.kernel)
    assert gemm is not None  # it packed the experts
    return gemm.grouped(gemm.grouped(rows, packed.gate_up, ends, silu_mul=True), packed.down, ends)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'grouped' or 'triton': what `kernel` ('auto': Triton on CUDA where triton imports) runs on `device`."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r} ({', '.join(MOE_KERNELS)})")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and triton_moe.triton_available() else "grouped"
    return kernel


def experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
            kernel: str = "auto", packed: PanelExperts | None = None) -> Tensor:
    """The experts' weighted output [T, H] by the path `kernel` names ('auto': Triton on CUDA, else grouped;
    the grouped path on the panel GEMM where `packed` is given)."""
    kernel = resolve_kernel(kernel, x.device)
    if kernel == "grouped":
        return grouped_experts(x, topk_ids, topk_weights, w13, w2, packed=packed)
    triton_moe.check_can_run(x.device)
    return triton_moe.fused_moe(x, topk_ids, topk_weights, w13, w2)
