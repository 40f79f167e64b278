"""A prompt's routing keys: the block manager's content keys of its first full blocks.

They are the keys a replica's prefix cache stores (block_manager.block_key chained from the salted root),
so two prompts share a routing key exactly when a replica that computed one could reuse that block for
the other; a different `cache_salt` never shares.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppserve.sched.block_manager import block_key, salted_root_key

DEFAULT_MAX_BLOCKS = 32  # enough to tell conversations apart; hashing more only costs the router time


def prefix_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                max_blocks: int = DEFAULT_MAX_BLOCKS) -> list[bytes]:
    """Chained keys of the first `max_blocks` full blocks of `token_ids` (a partial last block has none)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys: list[bytes] = []
    parent = salted_root_key(cache_salt)
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = block_key(parent, [int(t) for t in token_ids[start:start + block_size]])
        keys.append(parent)
    return keys
