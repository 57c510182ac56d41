"""Paged KV-cache blocks with automatic prefix caching.

Every full block gets a chained hash h_i = hash(h_{i-1}, tokens of block i, cache_salt), so equal prefixes map to the same
blocks. A block is *used* while a request or a live session holds a reference; at ref 0 it goes to the tail of the free
queue but keeps its hash, so a later request with the same prefix can take it back (a prefix hit). Allocation pops from the
head, the least recently freed block, evicting its hash: that is LRU eviction in O(1). Requests free their blocks tail-first,
so a shared prefix outlives the private tails that follow it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def hash_block(prev_hash: int | None, tokens: tuple[int, ...] | list[int], extra: object = None) -> int:
    return hash((prev_hash, tuple(tokens), extra))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_pinned_blocks: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}          # block hash -> block id
        self.pins: OrderedDict[str, list[int]] = OrderedDict()  # session -> pinned block ids, LRU by last use
        self.max_pinned_blocks = num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.num_cached_free = 0                  # free blocks that still hold a hash (kept as a counter: O(1) stats)
        self.prefix_queries = 0                   # prompt tokens looked up
        self.prefix_hits = 0                      # of which found in the cache

    # ---- accounting ---------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_pinned(self) -> int:
        return len({b for ids in self.pins.values() for b in ids})

    # ---- prefix lookup ------------------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of req.token_ids (hashes are computed once per block)."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            prev = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(prev, req.token_ids[i * bs:(i + 1) * bs], req.cache_salt))

    def find_cached_blocks(self, req: Request) -> list[int]:
        """Longest run of cached full blocks at the start of the request, leaving at least the last token to compute
        (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in req.block_hashes[:limit]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    # ---- allocation ---------------------------------------------------------------------------------------------
    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
            self.num_cached_free -= block.block_hash is not None
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:            # evict: the LRU cached block is reused for new content
            self.num_cached_free -= 1
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            self.free_queue[block_id] = None
            self.num_cached_free += block.block_hash is not None

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make req.block_table cover num_computed_tokens (+ the cache hit) + num_new_tokens. All or nothing."""
        cached_blocks = cached_blocks or []
        num_needed_tokens = req.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        have = len(req.block_table) + len(cached_blocks)
        need = max(0, -(-num_needed_tokens // self.block_size) - have)
        # a hit on a free cached block takes it off the free queue, so it does not count as free for the tail
        hit_free = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if need + hit_free > self.num_free:
            self._unpin_until(need + hit_free)
            if need + hit_free > self.num_free:
                return False
        for b in cached_blocks:
            self._touch(b)
        req.block_table.extend(cached_blocks)
        req.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that are full of computed tokens, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(req.block_table))
        for i in range(num_full):
            block = self.blocks[req.block_table[i]]
            if block.block_hash is None:
                h = req.block_hashes[i]
                block.block_hash = h
                self.cached.setdefault(h, block.block_id)

    def free(self, req: Request) -> None:
        """Drop req's references, tail first (private tails are evicted before the shared prefix)."""
        for block_id in reversed(req.block_table):
            self._release(block_id)
        req.block_table = []

    # ---- session pins -------------------------------------------------------------------------------------------
    def pin(self, session_id: str, req: Request) -> None:
        """Keep the full, hashed blocks of a finished session request referenced until the session's next turn, so an
        open-but-idle conversation is not the first thing evicted. Bounded by max_pinned_blocks (LRU by idle time)."""
        if not self.enable_prefix_caching or self.max_pinned_blocks <= 0:
            return
        keep = [b for b in req.block_table if self.blocks[b].block_hash is not None]
        keep = keep[:self.max_pinned_blocks]
        for b in keep:
            self._touch(b)
        self.unpin(session_id)
        self.pins[session_id] = keep
        while self.num_pinned > self.max_pinned_blocks and len(self.pins) > 1:
            oldest = next(iter(self.pins))
            self.unpin(oldest)

    def unpin(self, session_id: str) -> None:
        for b in reversed(self.pins.pop(session_id, [])):
            self._release(b)

    def _unpin_until(self, num_free_needed: int) -> None:
        """Live requests outrank idle sessions: release pins, least recently used first, until enough blocks are free."""
        while self.pins and self.num_free < num_free_needed:
            self.unpin(next(iter(self.pins)))

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_free": self.num_free,
            "kv_blocks_used": self.num_blocks - self.num_free,
            "kv_blocks_cached": self.num_cached_free,
            "kv_blocks_pinned": self.num_pinned,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
        }
