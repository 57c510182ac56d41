"""Block manager: allocation, ref counts, prefix hits, LRU eviction order, pins, and no leaks under random stress;
blocks of several pages (the default: 16-token blocks, 4-slot pages)."""
import random
from collections import Counter

import pytest

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_req(tokens, salt=None, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def compute_all(bm, req):
    """Pretend the model computed every token of req (what the engine does after a step)."""
    assert bm.allocate_slots(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_full_blocks(req)


def test_allocate_covers_tokens_and_free_returns_all():
    bm = BlockManager(10, 4)
    req = make_req(range(10))
    assert bm.allocate_slots(req, 10)
    assert len(req.block_table) == 3 and bm.num_free == 7
    assert all(bm.pages[b].ref_count == 1 for b in req.block_table)
    bm.free(req)
    assert bm.num_free == 10 and req.block_table == []


def test_all_or_nothing_when_pool_is_short():
    bm = BlockManager(2, 4)
    req = make_req(range(12))
    assert not bm.allocate_slots(req, 12)
    assert bm.num_free == 2 and req.block_table == []


def test_prefix_hit_shares_blocks_and_keeps_last_token_to_compute():
    bm = BlockManager(16, 4)
    a = make_req(range(12), rid="a")
    compute_all(bm, a)
    b = make_req(list(range(12)) + [99], rid="b")
    hit = bm.find_cached_pages(b)
    assert hit == a.block_table[:3]
    # exactly the same 12 tokens: the last block cannot be a hit (its last token must be recomputed for logits)
    c = make_req(range(12), rid="c")
    assert bm.find_cached_pages(c) == a.block_table[:2]
    assert bm.allocate_slots(b, 1, hit)
    assert [bm.pages[x].ref_count for x in hit] == [2, 2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 16


def test_cache_salt_isolates_tenants():
    bm = BlockManager(16, 4)
    a = make_req(range(9), salt="tenant-a")
    compute_all(bm, a)
    assert bm.find_cached_pages(make_req(range(9), salt="tenant-b")) == []
    assert len(bm.find_cached_pages(make_req(range(9), salt="tenant-a"))) == 2


def test_freed_blocks_stay_cached_and_evict_lru_tail_first():
    bm = BlockManager(6, 2)
    a = make_req([1, 2, 3, 4, 5, 6], rid="a")        # 3 full blocks
    compute_all(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free == 6 and bm.num_cached_free == 3
    # freed tail first: the free queue now ends with a's blocks in reverse order (tail block evicted before head)
    assert list(bm.free_queue)[-3:] == a_blocks[::-1]
    b = make_req([7, 8, 9, 10, 11, 12, 13, 14], rid="b")   # needs 4 blocks: 3 never-used ones, then a's tail block
    assert bm.allocate_slots(b, 8)
    assert a_blocks[2] in b.block_table and a_blocks[0] not in b.block_table
    # a's first two blocks are still a hit
    again = make_req([1, 2, 3, 4, 5, 6, 0], rid="c")
    assert bm.find_cached_pages(again) == a_blocks[:2]


def test_hit_on_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(4, 2)
    a = make_req([1, 2, 3, 4], rid="a")
    compute_all(bm, a)
    bm.free(a)
    b = make_req([1, 2, 3, 4, 5], rid="b")
    hit = bm.find_cached_pages(b)
    assert len(hit) == 2
    assert bm.allocate_slots(b, 1, hit)
    assert bm.num_free == 1 and all(x not in bm.free_queue for x in hit)


def test_session_pins_survive_and_yield_to_live_requests():
    bm = BlockManager(8, 2, max_pinned_pages=4)
    a = make_req([1, 2, 3, 4, 5], rid="a")
    compute_all(bm, a)
    bm.pin("s1", a)
    bm.free(a)
    assert bm.num_pinned == 2 and bm.num_free == 6
    # a request that needs the whole pool reclaims the pin rather than failing
    big = make_req(range(16), rid="big")
    assert bm.allocate_slots(big, 16)
    assert bm.num_pinned == 0
    bm.free(big)
    assert bm.num_free == 8


def test_pin_budget_is_lru_by_session():
    bm = BlockManager(16, 2, max_pinned_pages=4)
    for i, sid in enumerate(["s1", "s2", "s3"]):
        r = make_req([100 * i + t for t in range(5)], rid=sid)
        compute_all(bm, r)
        bm.pin(sid, r)
        bm.free(r)
    assert list(bm.pins) == ["s2", "s3"] and bm.num_pinned == 4
    bm.unpin("s2")
    bm.unpin("s3")
    assert bm.num_free == 16


def test_pages_bound_the_waste_of_a_sequence():
    bm = BlockManager(64, 16, page_size=4)
    req = make_req(range(37))
    assert bm.allocate_slots(req, 37)
    assert len(req.block_table) == 10              # 40 slots for 37 tokens: 16-slot pages would take 48
    req.num_computed_tokens = 37
    req.token_ids += [1, 2, 3, 4]
    assert bm.allocate_slots(req, 4) and len(req.block_table) == 11
    bm.free(req)
    assert bm.num_free == 64


def test_a_block_of_pages_is_hit_and_evicted_whole():
    bm = BlockManager(12, 8, page_size=2)         # 4 pages per block
    a = make_req(range(17), rid="a")              # 2 full blocks and one token: 9 pages
    compute_all(bm, a)
    assert len(a.block_table) == 9 and len(bm.cached) == 2
    b = make_req(list(range(16)) + [99], rid="b")
    assert bm.find_cached_pages(b) == a.block_table[:8]
    first, second = tuple(a.block_table[:4]), tuple(a.block_table[4:8])
    bm.free(a)           # tail first: the queue is 3 unused pages, a's tail page, second[::-1], first[::-1]
    assert bm.num_cached_free == 8
    c = make_req(range(100, 110), rid="c")         # 5 pages: the 3 unused, a's tail page, then second[-1]
    assert bm.allocate_slots(c, 10)
    assert second[-1] in c.block_table
    # popping one page of the second block evicted the whole block: its other pages are free and without a hash
    assert all(bm.pages[p].block_hash is None for p in second) and list(bm.cached.values()) == [first]
    assert bm.num_cached_free == 4
    assert bm.find_cached_pages(b) == list(first)
    bm.free(c)
    assert bm.num_free == 12


def test_pins_keep_whole_blocks():
    bm = BlockManager(32, 8, page_size=2, max_pinned_pages=6)
    a = make_req(range(25), rid="a")               # 3 full blocks of 4 pages
    compute_all(bm, a)
    bm.pin("s1", a)
    bm.free(a)
    assert bm.num_pinned == 4                      # 6 allowed: one whole block, not a block and a half
    assert bm.find_cached_pages(make_req(range(9))) == bm.pins["s1"]
    bm.unpin("s1")
    assert bm.num_free == 32


def test_unpinning_the_pages_a_request_hits_does_not_count_them_free():
    # a session's pin holds a shared prefix; a request hits it but needs the pinned pages' room as well
    bm = BlockManager(4, 2)
    a = make_req([1, 2, 3, 4], rid="a")
    compute_all(bm, a)
    bm.pin("s1", a)
    bm.free(a)
    b = make_req([1, 2, 3, 4, 5, 6, 7, 8, 9], rid="b")    # hits 2 pages, needs 3 more: 5 > 4
    hit = bm.find_cached_pages(b)
    assert len(hit) == 2
    assert not bm.allocate_slots(b, 5, hit)
    assert b.block_table == [] and bm.num_free == 4 and not bm.pins
    small = make_req([1, 2, 3, 4, 5, 6, 7], rid="c")      # hits 2 pages, needs 2 more: fits
    hit = bm.find_cached_pages(small)
    assert bm.allocate_slots(small, 3, hit) and bm.num_free == 0
    bm.free(small)
    assert bm.num_free == 4


@pytest.mark.parametrize("block_size,page_size", [(4, 4), (8, 2), (16, 4)])
def test_random_stress_never_leaks(block_size, page_size):
    rng = random.Random(block_size * 10 + page_size)
    bm = BlockManager(160 // page_size, block_size, page_size=page_size)
    live: list[Request] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(5)]
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and len(live) < 12:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 24))]
            r = make_req(toks, rid=str(step))
            hit = bm.find_cached_pages(r)
            if bm.allocate_slots(r, r.num_tokens - len(hit) * page_size, hit):
                r.num_computed_tokens = len(hit) * page_size
                live.append(r)
        elif op < 0.7 and live:
            r = rng.choice(live)                     # a step: the rest of the prompt, or one more token
            if r.num_computed_tokens == r.num_tokens:
                r.token_ids.append(rng.randrange(50))
            if bm.allocate_slots(r, r.num_tokens - r.num_computed_tokens):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
            else:
                r.token_ids.pop()
        elif op < 0.85 and live:
            r = live.pop(rng.randrange(len(live)))   # finish
            if rng.random() < 0.3:
                bm.pin(f"s{rng.randrange(3)}", r)
            bm.free(r)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))  # abort
        # every page's ref count is the number of tables and pins that hold it; the rest are exactly the free ones
        holders = Counter(p for r in live for p in r.block_table)
        holders.update(p for pins in bm.pins.values() for p in pins)
        assert all(page.ref_count == holders[page.page_id] for page in bm.pages)
        assert set(bm.free_queue) == {page.page_id for page in bm.pages if page.ref_count == 0}
        assert all(len(r.block_table) == -(-r.num_tokens // page_size) for r in live)   # less than a page unused
        assert bm.num_cached_free == sum(bm.pages[p].block_hash is not None for p in bm.free_queue)
        for h, pages in bm.cached.items():           # a cached block: its pages, one hash, one shared ref count
            assert len(pages) == block_size // page_size
            assert {bm.pages[p].block_hash for p in pages} == {h} and all(bm.pages[p].block == pages for p in pages)
            assert len({bm.pages[p].ref_count for p in pages}) == 1
    for r in live:
        bm.free(r)
    for sid in list(bm.pins):
        bm.unpin(sid)
    assert bm.num_free == bm.num_pages
    assert all(b.ref_count == 0 for b in bm.pages)
