"""Paged KV block ids: allocate, grow and free. The only allocator state in the system.

Workers own the physical KV tensors and receive block ids; nothing here is mirrored on them.
"""

from __future__ import annotations

from collections import deque

from ppserve.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO reuse spreads writes over the cache; any order is correct.
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Extra blocks `req` needs to hold KV for its computed tokens plus `num_new_tokens`."""
        total = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(req.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Grow `req.block_ids` to cover `num_new_tokens` more tokens; returns the new ids."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > len(self._free):
            raise MemoryError(f"request {req.request_id} needs {need} KV blocks, {len(self._free)} free")
        new = [self._free.popleft() for _ in range(need)]
        for b in new:
            self._owner[b] = req.request_id
        req.block_ids.extend(new)
        return new

    def free(self, req: Request) -> int:
        """Return all of `req`'s blocks to the pool; returns how many were freed."""
        n = len(req.block_ids)
        for b in req.block_ids:
            owner = self._owner.pop(b, None)
            if owner != req.request_id:
                raise AssertionError(f"block {b} freed by {req.request_id} but owned by {owner}")
            self._free.append(b)
        req.block_ids = []
        return n

    def check(self) -> None:
        """Conservation: every block is either free or owned, never both, never lost."""
        if len(self._free) + len(self._owner) != self.num_blocks:
            raise AssertionError(f"KV blocks not conserved: {len(self._free)} free + {len(self._owner)} used != {self.num_blocks}")
        if len(set(self._free)) != len(self._free) or set(self._free) & self._owner.keys():
            raise AssertionError("a KV block is both free and used, or free twice")
