"""Block manager: allocation, ref counts, prefix hits, LRU eviction order, pins, and no leaks under random stress."""
import random

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
    assert all(bm.blocks[b].ref_count == 1 for b in req.block_table)
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
    hit = bm.find_cached_blocks(b)
    assert hit == a.block_table[:3]
    # exactly the same 12 tokens: the last block cannot be a hit (its last token must be recomputed for logits)
    c = make_req(range(12), rid="c")
    assert bm.find_cached_blocks(c) == a.block_table[:2]
    assert bm.allocate_slots(b, 1, hit)
    assert [bm.blocks[x].ref_count for x in hit] == [2, 2, 2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 16


def test_cache_salt_isolates_tenants():
    bm = BlockManager(16, 4)
    a = make_req(range(9), salt="tenant-a")
    compute_all(bm, a)
    assert bm.find_cached_blocks(make_req(range(9), salt="tenant-b")) == []
    assert len(bm.find_cached_blocks(make_req(range(9), salt="tenant-a"))) == 2


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
    assert bm.find_cached_blocks(again) == a_blocks[:2]


def test_hit_on_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(4, 2)
    a = make_req([1, 2, 3, 4], rid="a")
    compute_all(bm, a)
    bm.free(a)
    b = make_req([1, 2, 3, 4, 5], rid="b")
    hit = bm.find_cached_blocks(b)
    assert len(hit) == 2
    assert bm.allocate_slots(b, 1, hit)
    assert bm.num_free == 1 and all(x not in bm.free_queue for x in hit)


def test_session_pins_survive_and_yield_to_live_requests():
    bm = BlockManager(8, 2, max_pinned_blocks=4)
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
    bm = BlockManager(16, 2, max_pinned_blocks=4)
    for i, sid in enumerate(["s1", "s2", "s3"]):
        r = make_req([100 * i + t for t in range(5)], rid=sid)
        compute_all(bm, r)
        bm.pin(sid, r)
        bm.free(r)
    assert list(bm.pins) == ["s2", "s3"] and bm.num_pinned == 4
    bm.unpin("s2")
    bm.unpin("s3")
    assert bm.num_free == 16


def test_random_stress_never_leaks():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    live: list[Request] = []
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and len(live) < 12:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            r = make_req(toks, rid=str(step))
            hit = bm.find_cached_blocks(r)
            if bm.allocate_slots(r, r.num_tokens - len(hit) * 4, hit):
                r.num_computed_tokens = len(hit) * 4
                live.append(r)
        elif op < 0.7 and live:
            r = rng.choice(live)                     # decode: one more token
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
        held = sum(len(r.block_table) for r in live)
        assert bm.num_free + len({b for r in live for b in r.block_table} | {b for p in bm.pins.values() for b in p}) \
            == bm.num_blocks
        assert held >= 0
        for blk in bm.blocks:
            assert blk.ref_count >= 0
        assert bm.num_cached_free == sum(bm.blocks[b].block_hash is not None for b in bm.free_queue)
    for r in live:
        bm.free(r)
    for sid in list(bm.pins):
        bm.unpin(sid)
    assert bm.num_free == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    # every cached hash points at a block that still holds that hash
    assert all(bm.blocks[b].block_hash == h for h, b in bm.cached.items())
