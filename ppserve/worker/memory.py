"""How much accelerator memory the KV cache gets, the way vLLM sizes it. Pure arithmetic.

After the weights are loaded, the communicators warmed up (their buffers allocated) and one forward of
the largest microbatch profiled (logits and sampling included), the cache takes what is left of
`utilization` x total memory:

    kv = utilization * total - in_use - transient_peak

`in_use` is total - free as the driver reports it: weights, the CUDA context, NCCL buffers, the caching
allocator's reserve, and any other process on the GPU. `transient_peak` is how far the profiled forward
rose above what stays allocated (activations, logits), which every later step may need again. Decode
CUDA graphs are captured after the cache exists (they point at it) and live in the 1 - utilization
margin; the start-up log shows what they took.
"""

from __future__ import annotations

GiB = float(1 << 30)


def kv_budget_bytes(total: int, free: int, transient_peak: int, utilization: float) -> int:
    """Bytes for the KV cache; ValueError naming the setting when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"cache.gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    in_use = total - free
    budget = int(utilization * total) - in_use - transient_peak
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {utilization:g} x {total / GiB:.1f} GiB "
            f"(cache.gpu_memory_utilization) minus {in_use / GiB:.2f} GiB in use and a {transient_peak / GiB:.2f} "
            "GiB peak for the largest microbatch; raise cache.gpu_memory_utilization, lower "
            "scheduler.token_budget, or spread the layers over more stages"
        )
    return budget


def split_blocks(budget: int, bytes_per_block: list[int]) -> int:
    """Blocks every stage sharing one device can have: the same count for each (the scheduler's allocator
    is one), so the budget is divided by the sum of the stages' per-block bytes."""
    per_block = sum(bytes_per_block)
    if per_block <= 0:
        raise ValueError("a KV block must cost some bytes")
    return max(1, budget // per_block)
