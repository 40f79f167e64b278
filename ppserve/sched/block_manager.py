"""Paged KV block ids: allocate, share by content, free. The only allocator state in the system.

Workers own the physical KV tensors and receive block ids; nothing here is mirrored on them. For
prefix caching a full block is content-addressed: its key is SHA-256 over its parent block's key, its token
ids and the request's extra keys (its `cache_salt`), so a key names the whole prefix up to and including that
block, and a crafted prompt cannot make its key equal another prompt's. A block has a reference count (the
requests holding it). When the count drops to zero a keyed block keeps its key and waits, cached and
evictable, in an LRU list; it is evicted (its key forgotten) only when a new block is needed and no
never-keyed block is free. Every block is therefore exactly one of: free (no key), cached-and-evictable (a
key, no holder), or referenced by the requests that hold it.

A prompt's block is keyed when the tokens that fill it are scheduled, so a request scheduled later in the
same step, or in a later step, reads it: stages run microbatches in order and write a step's KV before
its attention reads it. A block of generated tokens is keyed when its request lets its blocks go
(finished, cancelled or preempted): only a later request can share it, and a decode step pays no
hashing. Nothing ever writes into a block another
request holds (`check_writable`): a hit stops at least one token short of the request's known tokens, so
what it computes goes into blocks of its own.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque

from ppserve.request import Request

_KEY_DOMAIN = b"ppserve.prefix-cache.v1\0"


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def root_key(req: Request) -> bytes:
    """The key the first block chains from: the request's extra keys (today its cache_salt; LoRA ids
    would join here)."""
    return salted_root_key(req.cache_salt)


def salted_root_key(cache_salt: str | None) -> bytes:
    """`root_key` from the salt alone (the router hashes prompts it holds no Request for), length-prefixed
    so that no two different extra keys encode alike."""
    salt = (cache_salt or "").encode()
    return hashlib.sha256(_KEY_DOMAIN + struct.pack("<Q", len(salt)) + salt).digest()


def block_key(parent: bytes, token_ids: list[int]) -> bytes:
    """A full block's key: SHA-256 over the parent's key and the block's token ids (8 bytes each)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # block_key's encoding of a full block, compiled
        self._pack_block = struct.Struct(f"<{block_size}q").pack
        # FIFO reuse spreads writes over the cache; any order is correct. Never-keyed blocks go first,
        # so cached prefixes survive as long as there is other room.
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; oldest first
        self._refs: dict[int, int] = {}  # block -> how many requests hold it (absent: none)
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        # block -> the request it was allocated to, the only one that writes it (read by the scheduler's
        # check)
        self.writer_of: dict[int, str] = {}
        # Prefix-cache counters, in tokens (vLLM's definitions): every admission queries its known
        # tokens and hits the cached prefix it starts from.
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0  # cached blocks whose key was forgotten to make room

    # ---- capacity --------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a new allocation may take: the free ones and the cached-and-evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a key (held or evictable)."""
        return len(self._key_of)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Extra blocks `req` needs to hold KV for its computed tokens plus `num_new_tokens`."""
        total = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(req.block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def can_start(self, hits: list[int], num_blocks: int) -> bool:
        """Whether a request may take the cached blocks `hits` and `num_blocks` new ones: a hit that
        nobody holds leaves the evictable list, so it counts against the free room too."""
        refs = self._refs
        return num_blocks + sum(1 for b in hits if b not in refs) <= self.num_free

    # ---- the prefix cache ------------------------------------------------------------------------
    def _extend_keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """`req.block_keys` grown to its first `num_blocks` full blocks (each hashed once per request)."""
        keys = req.block_keys
        bs = self.block_size
        if len(keys) < num_blocks:
            prompt, outputs = req.prompt_token_ids, req.output_token_ids
            np = len(prompt)
            parent = keys[-1] if keys else root_key(req)
            for i in range(len(keys), num_blocks):
                lo, hi = i * bs, (i + 1) * bs
                toks = prompt[lo:hi] if hi <= np else (prompt[lo:] + outputs[: hi - np] if lo < np
                                                       else outputs[lo - np: hi - np])
                # = block_key(parent, toks)
                parent = hashlib.sha256(parent + self._pack_block(*toks)).digest()
                keys.append(parent)
        return keys

    def lookup(self, req: Request) -> list[int]:
        """The cached blocks `req` may start from: the longest run of its full blocks whose keys are
        cached, stopping short of its last known token (there must be a token to compute, for logits,
        and it must land in a block of its own). Reads only; `acquire_prefix` takes them."""
        if not self.enable_prefix_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        block_of = self._block_of
        for key in self._extend_keys(req, limit):
            b = block_of.get(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def prefix_in_reach(self, req: Request, seen: set[bytes]) -> int:
        """How many of a request's first tokens it will not compute if scheduled now: for one that holds
        no blocks, its leading full blocks that are cached or in `seen` (the keys of requests counted
        before it, which schedule first and key their blocks as they go), as `lookup` would stop;
        0 for one that holds blocks (its computed tokens say it). Adds its keys to `seen`."""
        if not self.enable_prefix_caching or req.block_ids:
            return 0
        keys = self._extend_keys(req, (req.num_tokens - 1) // self.block_size)
        shared = 0
        for key in keys:
            if key not in seen and key not in self._block_of:
                break
            shared += 1
        seen.update(keys)
        return shared * self.block_size

    def acquire_prefix(self, req: Request, hits: list[int]) -> None:
        """Start a request that holds no blocks from the cached blocks `hits` (from `lookup`, this
        step): it holds them and its first len(hits) blocks of tokens count as computed."""
        if req.block_ids:
            raise AssertionError(f"request {req.request_id} starts from a prefix but already holds KV blocks")
        refs = self._refs
        for b in hits:
            n = refs.get(b, 0)
            if n == 0:
                del self._evictable[b]
            refs[b] = n + 1
        req.block_ids = list(hits)
        req.num_blocks_keyed = len(hits)
        req.num_computed_tokens = len(hits) * self.block_size
        if req.num_cached_tokens is None:  # what the caller is told: its prompt's cached part, first time
            req.num_cached_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.num_query_tokens += req.num_tokens
            self.num_hit_tokens += req.num_computed_tokens

    def cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Key `req`'s blocks that `num_tokens` scheduled tokens fill. A block whose content is already
        cached under another block stays unkeyed (its copy is freed as a plain block)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_tokens // bs, len(req.block_ids))
        done = req.num_blocks_keyed
        if full <= done:
            return
        keys = req.block_keys
        np = len(req.prompt_token_ids)
        if full == done + 1 == len(keys) + 1 and done and done * bs >= np:
            # A decode filled a block of output tokens: the one key, without the general path's slicing.
            toks = req.output_token_ids[done * bs - np: full * bs - np]
            keys.append(hashlib.sha256(keys[-1] + self._pack_block(*toks)).digest())  # = block_key(...)
        else:
            keys = self._extend_keys(req, full)
        key_of, block_of = self._key_of, self._block_of
        for i in range(done, full):
            key = keys[i]
            if key not in block_of:
                b = req.block_ids[i]
                block_of[key] = b
                key_of[b] = key
        req.num_blocks_keyed = full

    def reset_cache(self) -> None:
        """Forget every key (a rebuilt pipeline starts with empty KV); held blocks stay held."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()

    # ---- allocate and free -----------------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        b, _ = self._evictable.popitem(last=False)  # evict the least recently freed cached block
        self.num_evictions += 1
        del self._block_of[self._key_of.pop(b)]
        return b

    def allocate(self, req: Request, num_new_tokens: int) -> list[int]:
        """Grow `req.block_ids` to cover `num_new_tokens` more tokens; returns the new ids."""
        need = self.blocks_needed(req, num_new_tokens)
        if need > self.num_free:
            raise MemoryError(f"request {req.request_id} needs {need} KV blocks, {self.num_free} free")
        new = [self._take_block() for _ in range(need)]
        rid = req.request_id
        for b in new:
            self._refs[b] = 1
            self.writer_of[b] = rid
        req.block_ids.extend(new)
        return new

    def free(self, req: Request) -> int:
        """Drop `req`'s hold on its blocks; returns how many it held. A block nobody holds any more
        becomes free, or cached-and-evictable if keyed; the request's tail blocks are the first
        evicted (they are the least likely to be shared)."""
        # The blocks its generated tokens filled get their keys now (the prompt's got theirs when scheduled).
        # Only over tokens it knows: a decode on a token still in flight (the token ring) is computed but
        # its token is not known when the request is cancelled first.
        self.cache_full_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        n = len(req.block_ids)
        refs = self._refs
        for b in reversed(req.block_ids):
            c = refs.get(b, 0)
            if c <= 0:
                raise AssertionError(f"block {b} freed by {req.request_id} but held by nobody")
            if c > 1:
                refs[b] = c - 1
                continue
            del refs[b]
            if b in self._key_of:
                self._evictable[b] = None
            else:
                self._free.append(b)
        req.block_ids = []
        req.num_blocks_keyed = 0
        return n

    def truncate(self, req: Request, num_blocks: int) -> int:
        """Give back `req`'s blocks past its first `num_blocks`: a tail only rejected drafts wrote, never
        keyed and held by `req` alone, so free at once. Returns how many."""
        tail = req.block_ids[num_blocks:]
        for b in tail:
            if self._refs.get(b) != 1 or b in self._key_of or self.writer_of.get(b) != req.request_id:
                raise AssertionError(f"block {b} of {req.request_id} is shared or keyed: not a draft tail")
            del self._refs[b]
            self._free.append(b)
        del req.block_ids[num_blocks:]
        return len(tail)

    def check_writable(self, req: Request, start: int, num_tokens: int) -> None:
        """Assert that `req` writes tokens [start, start + num_tokens) only into blocks allocated to it:
        a block it shares through a cache hit is read, never written (another request filled it)."""
        bs = self.block_size
        writer = self.writer_of
        rid = req.request_id
        for i in range(start // bs, (start + num_tokens - 1) // bs + 1):
            b = req.block_ids[i]
            if writer.get(b) != rid:
                raise AssertionError(f"request {rid} would write into block {b}, which {writer.get(b)} "
                                     "filled")

    def check(self, holders: list[list[int]] | None = None) -> None:
        """Every block is exactly one of free, cached-and-evictable, or referenced; keys map both ways;
        with `holders` (the block lists of every request that holds blocks), each referenced block's count
        is the number of those lists holding it."""
        free, evictable, refs = self._free, self._evictable, self._refs
        if len(free) + len(evictable) + len(refs) != self.num_blocks:
            raise AssertionError(
                f"KV blocks not conserved: {len(free)} free + {len(evictable)} cached + {len(refs)} used "
                f"!= {self.num_blocks}"
            )
        free_set = set(free)
        if len(free_set) != len(free) or free_set & refs.keys() or free_set & evictable.keys() \
                or evictable.keys() & refs.keys():
            raise AssertionError("a KV block is in two of free, cached-and-evictable and used, or free twice")
        if any(c < 1 for c in refs.values()):
            raise AssertionError("a KV block has a reference count below 1")
        if free_set & self._key_of.keys() or not evictable.keys() <= self._key_of.keys():
            raise AssertionError("a free block carries a key, or an evictable one none")
        if len(self._block_of) != len(self._key_of) or any(self._block_of.get(k) != b
                                                           for b, k in self._key_of.items()):
            raise AssertionError("the prefix cache's key and block maps disagree")
        if holders is not None:
            counts: dict[int, int] = {}
            for blocks in holders:
                for b in blocks:
                    counts[b] = counts.get(b, 0) + 1
            if counts != refs:
                bad = sorted(b for b in counts.keys() | refs.keys() if counts.get(b) != refs.get(b))[:5]
                raise AssertionError(f"KV blocks {bad} are counted by the allocator unlike their holders")
