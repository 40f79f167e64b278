"""The (token, expert) pairs laid out for the fused MoE kernel: sorted by expert, padded to whole blocks.

Each expert's run of pairs is padded to a multiple of the kernel's row block and every block is tagged
with its expert, so one program multiplies one block by one expert's weights. Every shape depends only
on T, k, the expert count and the block, and nothing is read back to the host: the layout of a decode
step of fixed size is built inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockLayout:
    """The (token, expert) pairs sorted by expert, each expert's run padded to `block` rows.

    `pair_ids[i]` is the pair in row i of the padded layout (`num_pairs` in a padding row); `block_experts[b]`
    the expert of block b (`num_experts` for the blocks after the last used one). Sizes are upper bounds
    fixed by (T, k, E, block): num_pairs + E * (block - 1) rows, rounded up to whole blocks."""

    pair_ids: Tensor  # [num_blocks * block] int64
    block_experts: Tensor  # [num_blocks] int64
    block: int
    num_pairs: int


def align_to_blocks(topk_ids: Tensor, num_experts: int, block: int) -> BlockLayout:
    """Lay the pairs of topk_ids [T, k] out by expert in blocks of `block` rows; device ops only, no sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would read its output size back
    padded = (counts + block - 1) // block * block
    padded_ends = torch.cumsum(padded, 0)
    first_row = padded_ends - padded  # where each expert's run starts in the padded layout
    first_pair = torch.cumsum(counts, 0) - counts  # and in the sorted, unpadded order
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - first_pair[sorted_experts]  # place within its expert
    num_blocks = -(-(pairs + num_experts * (block - 1)) // block)
    pair_ids = torch.full((num_blocks * block,), pairs, dtype=torch.int64, device=flat.device)
    pair_ids[first_row[sorted_experts] + rank] = order
    block_starts = torch.arange(num_blocks, device=flat.device) * block
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)  # num_experts past the end
    return BlockLayout(pair_ids, block_experts, block, pairs)
