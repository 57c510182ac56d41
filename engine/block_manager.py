"""Paged KV cache: pages of memory, blocks of prefix cache.

Memory is handed out in *pages* of `page_size` slots (4 by default). A request's `block_table` lists its pages in token
order; it is what the attention kernels read (a kernel's "block" is one page). The prefix cache works on *blocks* of
`block_size` tokens (16 by default): `block_size // page_size` consecutive pages of one table.

Why two sizes: a sequence leaves less than one page unused (its last page is half empty on average), so small pages
waste little memory, and the kernels read the table per token either way (docs/benchmarks.md has the measured waste).
A cache entry covers a block, so a prefix hit is a multiple of `block_size` tokens and the cache keeps one hash and
one entry per block, not per page.

Every full block gets a chained hash h_i = hash(h_{i-1}, tokens of block i, cache_salt), so equal prefixes map to the
same pages. A page is *used* while a request or a live session holds a reference. At ref 0 it goes to the tail of the
free queue but keeps its hash, so a later request with the same prefix can take it back (a prefix hit). Allocation pops
from the head, the least recently freed page; popping a page of a cached block evicts the whole block (its other pages
stay free, without a hash). That is LRU eviction in O(1). Requests free their pages tail-first, so a shared prefix
outlives the private tails that follow it.

Invariant: the pages of a cached block share one ref count. They are referenced together (by the request that filled
them, a hit, a pin) and released together, so when one of them is popped they are all free.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


@dataclass(slots=True)
class Page:
    page_id: int
    ref_count: int = 0
    block_hash: int | None = None   # set while the page belongs to a hashed (full, computed) block
    block: tuple[int, ...] = ()     # the pages of that block, this one included


def hash_block(prev_hash: int | None, tokens: tuple[int, ...] | list[int], extra: object = None) -> int:
    return hash((prev_hash, tuple(tokens), extra))


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, page_size: int | None = None,
                 enable_prefix_caching: bool = True, max_pinned_pages: int | None = None):
        page_size = block_size if page_size is None else page_size
        if page_size < 1 or block_size % page_size:
            raise ValueError(f"block_size ({block_size}) must be a multiple of page_size ({page_size})")
        self.block_size = block_size
        self.page_size = page_size
        self.pages_per_block = block_size // page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self.cached: dict[int, tuple[int, ...]] = {}   # block hash -> the block's pages
        self.pins: OrderedDict[str, list[int]] = OrderedDict()  # session -> pinned page ids, LRU by last use
        self.max_pinned_pages = num_pages // 2 if max_pinned_pages is None else max_pinned_pages
        self.num_cached_free = 0                  # free pages that still hold a hash (kept as a counter: O(1) stats)
        self.prefix_queries = 0                   # prompt tokens looked up
        self.prefix_hits = 0                      # of which found in the cache

    # ---- accounting ---------------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def num_slots(self) -> int:
        return len(self.pages) * self.page_size

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_pinned(self) -> int:
        return len({p for ids in self.pins.values() for p in ids})

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix lookup ------------------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of req.token_ids (hashes are computed once per block)."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            prev = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(prev, req.token_ids[i * bs:(i + 1) * bs], req.cache_salt))

    def find_cached_pages(self, req: Request) -> list[int]:
        """Pages of the longest run of cached full blocks at the start of the request, leaving at least the last token
        to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        scored = req.first_scored_position  # a prompt logprob needs the position before it computed
        limit = (min(req.num_tokens, scored or req.num_tokens) - 1) // self.block_size
        hit: list[int] = []
        for h in req.block_hashes[:limit]:
            pages = self.cached.get(h)
            if pages is None:
                break
            hit.extend(pages)
        return hit

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    # ---- allocation ---------------------------------------------------------------------------------------------
    def _touch(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            del self.free_queue[page_id]
            self.num_cached_free -= page.block_hash is not None
        page.ref_count += 1

    def _pop_free(self) -> int:
        page_id, _ = self.free_queue.popitem(last=False)
        page = self.pages[page_id]
        if page.block_hash is not None:     # evict: the LRU cached block is reused for new content
            self._evict(page)
        page.ref_count = 1
        return page_id

    def _evict(self, page: Page) -> None:
        """Drop the cache entry of page's block and the hash of all its pages (free, by the invariant)."""
        if self.cached.get(page.block_hash) == page.block:
            del self.cached[page.block_hash]
        for p in page.block:
            sibling = self.pages[p]
            assert sibling.ref_count == 0, f"page {p} of an evicted block is still referenced"
            sibling.block_hash = None
            sibling.block = ()
            self.num_cached_free -= 1

    def _release(self, page_id: int) -> None:
        page = self.pages[page_id]
        page.ref_count -= 1
        assert page.ref_count >= 0, f"page {page_id} freed twice"
        if page.ref_count == 0:
            self.free_queue[page_id] = None
            self.num_cached_free += page.block_hash is not None

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_pages: list[int] | None = None) -> bool:
        """Make req.block_table cover num_computed_tokens (+ the cache hit) + num_new_tokens. All or nothing."""
        cached_pages = cached_pages or []
        num_needed_tokens = req.num_computed_tokens + len(cached_pages) * self.page_size + num_new_tokens
        need = max(0, self.pages_for(num_needed_tokens) - len(req.block_table) - len(cached_pages))

        def short() -> int:
            # a hit on a free cached page takes it off the free queue, so it does not count as free for the tail
            return need + sum(1 for p in cached_pages if self.pages[p].ref_count == 0) - self.num_free

        # live requests outrank idle sessions: release pins, least recently used first, until the pages fit
        while short() > 0 and self.pins:
            self.unpin(next(iter(self.pins)))
        if short() > 0:
            return False
        for p in cached_pages:
            self._touch(p)
        req.block_table.extend(cached_pages)
        req.block_table.extend(self._pop_free() for _ in range(need))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register the hashes of req's blocks that are full of computed tokens, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(req)
        r = self.pages_per_block
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(req.block_table) // r)
        for i in range(num_full):
            pages = tuple(req.block_table[i * r:(i + 1) * r])
            if self.pages[pages[0]].block_hash is not None:   # hashed already (a hit, or an earlier step)
                continue
            h = req.block_hashes[i]
            for p in pages:
                self.pages[p].block_hash = h
                self.pages[p].block = pages
            self.cached.setdefault(h, pages)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release req's pages past the first `num_tokens` slots: those allocated for draft tokens that were rejected
        (never hashed: only blocks full of computed tokens are), tail first like `free`."""
        keep = self.pages_for(num_tokens)
        for page_id in reversed(req.block_table[keep:]):
            self._release(page_id)
        del req.block_table[keep:]

    def free(self, req: Request) -> None:
        """Drop req's references, tail first (private tails are evicted before the shared prefix)."""
        for page_id in reversed(req.block_table):
            self._release(page_id)
        req.block_table = []

    # ---- session pins -------------------------------------------------------------------------------------------
    def pin(self, session_id: str, req: Request) -> None:
        """Keep the hashed blocks of a finished session request referenced until the session's next turn, so an
        open-but-idle conversation is not the first thing evicted. Bounded by max_pinned_pages (LRU by idle time)."""
        if not self.enable_prefix_caching or self.max_pinned_pages <= 0:
            return
        keep = [p for p in req.block_table if self.pages[p].block_hash is not None]
        keep = keep[:self.max_pinned_pages // self.pages_per_block * self.pages_per_block]   # whole blocks only
        for p in keep:
            self._touch(p)
        self.unpin(session_id)
        self.pins[session_id] = keep
        while self.num_pinned > self.max_pinned_pages and len(self.pins) > 1:
            self.unpin(next(iter(self.pins)))

    def unpin(self, session_id: str) -> None:
        for p in reversed(self.pins.pop(session_id, [])):
            self._release(p)

    def stats(self) -> dict:
        return {
            "kv_page_size": self.page_size,
            "kv_pages_total": self.num_pages,
            "kv_pages_free": self.num_free,
            "kv_pages_used": self.num_pages - self.num_free,
            "kv_pages_cached": self.num_cached_free,
            "kv_pages_pinned": self.num_pinned,
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
        }
