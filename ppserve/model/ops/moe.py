"""The experts of a mixture-of-experts layer, applied to routed tokens: the grouped path, the kernel's layout.

A microbatch's T * k (token, expert) pairs are grouped by expert; each expert runs once over its tokens:
- `grouped_experts` (CPU, any device): sort the pairs by expert, gather their rows, run each expert's
  gate/up matmul, SiLU-gate and down matmul over its rows, weight each pair and add each token's k results
  in top-k order (transformers' order, so float32 output matches it). On CPU the sort and gather
  (`native.MoeRouting.dispatch`) and, in bf16, the weighting and sum (`combine`) are native calls, bit for
  bit the torch chains. The matmuls (`expert_matmuls`), bit for bit the same either way: `F.grouped_mm`
  over all experts (no host sync), or a per-expert loop that skips idle experts, used below
  GROUPED_MM_MIN_PAIRS_PER_EXPERT and where `F.grouped_mm` refuses (`uses_grouped_mm`). A single token
  takes its k experts straight from its ids. In bf16 on CPUs with AMX or AVX512-BF16 the panel GEMM comes
  first (`PanelExperts`: weights prepacked once, SiLU-and-mul in the epilogue, every expert in one call);
  its sums may run in another order, so it agrees with the other two rather than equalling them.
- the fused Triton kernel (model/triton_moe.py) over the pairs in blocks by expert (`ops/moe_align.py`):
  no host sync, so a fixed-size decode step captures into a CUDA graph.
`experts` picks the Triton kernel on CUDA when triton imports (or when forced), the grouped path otherwise
(docs/decisions.md#moe-expert-matmuls); quantized experts (`QuantizedExperts`) always the grouped path.
Weights: w13 [E, 2I, H] (gate then up rows, this rank's slice of I), w2 [E, H, I]; one all-reduce after.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model import triton_moe
from ppserve.model.ops import native, silu_mul
from ppserve.model.ops.quant_gemm import QuantizedLinear
from ppserve.model.ops.settings import MOE_KERNELS

EXPERT_MATMULS = ("auto", "grouped_mm", "per_expert")

# `F.grouped_mm` pays for every expert's group, the loop only for experts with tokens: below this many
# (token, expert) pairs per expert the loop wins (docs/decisions.md#moe-expert-matmuls).
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


@dataclass(frozen=True)
class QuantizedExperts:
    """One projection of every expert (gate_up or down) held for torch's integer or FP8 kernel, one
    `QuantizedLinear` an expert (ppserve/model/ops/quant_gemm.py)."""

    each: tuple[QuantizedLinear, ...]

    @property
    def kind(self) -> str:
        """The kernel the experts run ('int4', 'int8', 'fp8'): one scheme packs them all."""
        return self.each[0].kind

    @property
    def nbytes(self) -> int:
        return sum(q.nbytes for q in self.each)


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
    gate_up, down = (torch.stack([kernel.pack_gate_up(w) for w in w13]),
                     torch.stack([kernel.pack(w) for w in w2]))
    return PanelExperts(gate_up, down, kernel.kernel,
                        tuple(zip(gate_up.unbind(), down.unbind(), strict=True)))


def grouped_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
                    expert_matmuls: str = "auto", packed: PanelExperts | None = None,
                    quantized: tuple[QuantizedExperts, QuantizedExperts] | None = None) -> Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k] -> [T, H], the weighted sum of each token's experts.
    `packed` (from `pack_experts`): with expert_matmuls "auto" and bf16 input, the matmuls run on the panel
    GEMM. `quantized` (gate_up, down): every expert's matmuls run on its kernel, w13 and w2 unread."""
    t, k = topk_ids.shape
    num_experts = w13.shape[0]
    if quantized is not None:
        expert_matmuls = "per_expert"
    if t == 1 and expert_matmuls != "grouped_mm":
        if quantized is not None:
            gate_up, down_q = quantized
            down = torch.cat([down_q.each[e].linear(silu_mul(gate_up.each[e].linear(x, None)), None)
                              for e in topk_ids[0].tolist()])  # the host read the per-expert loop makes too
        else:
            down = _one_token_experts(x, topk_ids, w13, w2, packed if expert_matmuls == "auto" else None)
        return _weighted_sum(down, topk_weights, t, k, x.dtype)
    # Pair p = token p // k, its (p % k)-th choice; sorted stably by expert, so each expert's rows are
    # one run, ending at ends[e] (int32, as grouped_mm takes its offsets). pos[p]: pair p's row.
    routing = native.moe_routing()
    if routing is not None and routing.accepts(x, topk_ids):
        rows, ends, pos = routing.dispatch(x, topk_ids, num_experts)  # one call, not five ops
    else:
        rows, ends, pos = _dispatch(x, topk_ids, num_experts)
    if quantized is not None:
        down = _per_expert_matmuls(rows, ends, *quantized)
    elif packed is not None and expert_matmuls == "auto" and x.dtype == torch.bfloat16:
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
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=x.device), right=True,
                              out_int32=True)
    pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=x.device))
    return x.index_select(0, order // k), ends, pos


def _weighted_sum(out: Tensor, topk_weights: Tensor, t: int, k: int, dtype: torch.dtype) -> Tensor:
    """Pair-order expert outputs [T k, H] weighted in the routing weights' dtype (float32 for Mixtral, as
    transformers does), then each token's k results summed in top-k order -> [T, H]."""
    weighted = out * topk_weights.reshape(-1, 1)
    per_token = weighted.view(t, k, weighted.shape[1])  # shape spelled out: t may be 0
    if k == 2:
        # One add: a sum of two values rounded once, what `sum` gives (but for the sign of a zero made of two
        # negative zeros), and much faster than bf16's `sum` over a middle dim.
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
    # the host read the per-expert loop makes too
    return torch.cat([expert_out(e) for e in topk_ids[0].tolist()])


def _per_expert_matmuls(rows: Tensor, ends: Tensor, w13: Tensor | QuantizedExperts,
                        w2: Tensor | QuantizedExperts) -> Tensor:
    """What the two grouped_mm calls compute, one expert at a time: rows [P, H] sorted by expert -> [P, H].
    The weights are float [E, N, K] or every expert's quantized kernel."""
    def matmul(w: Tensor | QuantizedExperts, expert: int, a: Tensor) -> Tensor:
        return w.each[expert].linear(a, None) if isinstance(w, QuantizedExperts) else F.linear(a, w[expert])

    down = torch.empty(rows.shape[0], rows.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for expert, end in enumerate(ends.tolist()):  # the host sync: one small list
        if end == start:
            continue  # an expert no token chose costs nothing
        act = silu_mul(matmul(w13, expert, rows[start:end]))  # [n, 2I] -> [n, I]
        down[start:end] = matmul(w2, expert, act)
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
            kernel: str = "auto", packed: PanelExperts | None = None,
            quantized: tuple[QuantizedExperts, QuantizedExperts] | None = None) -> Tensor:
    """The experts' weighted output [T, H] by the path `kernel` names ('auto': Triton on CUDA, else grouped;
    the grouped path on the panel GEMM where `packed` is given, on the quantized kernels where
    `quantized` is, whatever `kernel` says: the Triton kernel takes float weights only)."""
    kernel = resolve_kernel(kernel, x.device)
    if kernel == "grouped" or quantized is not None:
        return grouped_experts(x, topk_ids, topk_weights, w13, w2, packed=packed, quantized=quantized)
    triton_moe.check_can_run(x.device)
    return triton_moe.fused_moe(x, topk_ids, topk_weights, w13, w2)
