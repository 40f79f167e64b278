"""The experts of a mixture-of-experts layer, applied to routed tokens: the grouped path, the kernel's layout.

Every token goes to k experts, so a microbatch of T tokens makes T * k (token, expert) pairs. Both paths
group the pairs by expert and run each expert once over all its tokens, never a loop over tokens:

- `grouped_experts` (CPU, any device): sort the pairs by expert, one gate/up matmul, SiLU-gate and down
  matmul per expert that has tokens, weight each pair by its routing probability, and add each token's
  k results in top-k order (transformers' order, so float32 output matches it). It reads the
  per-expert token counts on the host, so it is not capturable in a CUDA graph.
- the fused Triton kernel (ppserve/model/triton_moe.py) over the pairs laid out in blocks by expert
  (`ops/moe_align.py`): no host sync, so a decode step of fixed size captures into a CUDA graph.

`experts` picks the path as `model/backend_select.py` picks attention: the Triton kernel on CUDA when
triton imports (or when forced, with a clear error where it cannot run: on CPU only under
TRITON_INTERPRET=1, the CI check), the grouped path otherwise.

Weights: w13 [E, 2 I, H] (each expert's gate rows then up rows, this TP rank's slice of I) and
w2 [E, H, I]; the caller all-reduces the partial sums over TP ranks once, after the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ppserve.model import triton_moe
from ppserve.model.ops import silu_mul
from ppserve.model.ops.settings import MOE_KERNELS


def grouped_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """x [T, H]; topk_ids, topk_weights [T, k] -> [T, H], the weighted sum of each token's experts."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # the host sync: one small list
    rows = x[order // k]  # [P, H] each pair's token, in expert order
    out = torch.empty(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue  # an expert no token chose costs nothing
        seg = slice(start, start + n)
        act = silu_mul(F.linear(rows[seg], w13[expert]))  # [n, 2I] -> [n, I]
        out[order[seg]] = F.linear(act, w2[expert])  # back to pair order
        start += n
    # Weighted in the routing weights' dtype (float32 for Mixtral, as transformers does), then each token's
    # k results summed in top-k order.
    weighted = out * topk_weights.reshape(-1, 1)
    return weighted.view(t, k, -1).sum(dim=1).to(x.dtype)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """'grouped' or 'triton': what `kernel` ('auto': Triton on CUDA where triton imports) runs on `device`."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r} ({', '.join(MOE_KERNELS)})")
    if kernel == "auto":
        return "triton" if device.type == "cuda" and triton_moe.triton_available() else "grouped"
    return kernel


def experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor,
            kernel: str = "auto") -> Tensor:
    """The experts' weighted output [T, H] by the path `kernel` names ('auto': Triton on CUDA, else grouped)."""
    kernel = resolve_kernel(kernel, x.device)
    if kernel == "grouped":
        return grouped_experts(x, topk_ids, topk_weights, w13, w2)
    triton_moe.check_can_run(x.device)
    return triton_moe.fused_moe(x, topk_ids, topk_weights, w13, w2)
