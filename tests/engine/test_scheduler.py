"""Scheduler rules, driven without a model: budget, chunked prefill, decode-first, priorities, preemption order."""
from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_budget import StepBudget


def req(rid, n, priority=0, t=0.0):
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=100), priority=priority, arrival_time=t)


def run_step(sched):
    """Apply a step like the engine does: computed tokens advance, sampling rows get one new token."""
    out = sched.schedule()
    for s in out.scheduled:
        samples = s.samples
        s.request.num_computed_tokens += s.num_new_tokens
        sched.block_manager.cache_full_blocks(s.request)
        if samples:
            s.request.token_ids.append(7)
    return out


def test_budget_respected_and_long_prompt_chunked():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a = req("a", 25)
    sched.add(a)
    chunks = []
    while a.num_output_tokens == 0:
        out = run_step(sched)
        assert out.num_batched_tokens <= 10
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [10, 10, 5]


def test_decodes_go_first_and_prefill_fills_the_rest():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = req("a", 3, t=0), req("b", 30, t=1)
    sched.add(a)
    run_step(sched)                  # a prefilled, sampled
    sched.add(b)
    out = run_step(sched)
    got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got == {"a": 1, "b": 7}   # a's decode + a 7-token chunk of b in one step


def test_max_num_seqs():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(req(str(i), 3, t=i))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["0", "1"]
    assert sched.num_waiting == 2


def test_priority_admits_first():
    sched = Scheduler(BlockManager(100, 4), max_num_seqs=1, max_num_batched_tokens=100)
    sched.add(req("batch", 3, priority=1, t=0))
    sched.add(req("realtime", 3, priority=0, t=1))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["realtime"]


def test_preempts_lowest_priority_newest_and_resumes():
    bm = BlockManager(6, 4)                         # 24 slots
    # the three prompts are equal; without in-flight sharing all three are prefilled in the first step
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, share_inflight_prefixes=False)
    hi, lo_old, lo_new = req("hi", 7, 0, 2), req("lo_old", 7, 1, 0), req("lo_new", 7, 1, 1)
    for r in (lo_old, lo_new, hi):
        sched.add(r)
    run_step(sched)                                 # all three prefilled: 2 blocks each, pool full
    assert bm.num_free == 0
    for _ in range(2):                              # decoding to 9 tokens needs a third block each
        out = run_step(sched)
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["lo_new"]
    assert lo_new.status == RequestStatus.PREEMPTED and lo_new.num_computed_tokens == 0 and not lo_new.block_table
    assert lo_new.num_tokens == 9                    # its prompt and the two tokens it had sampled
    # finishing the others lets the preempted one resume by recomputing prompt + output
    sched.finish(hi, RequestStatus.FINISHED_STOPPED)
    sched.finish(lo_old, RequestStatus.FINISHED_STOPPED)
    out = sched.schedule()
    # the three share their tokens, so both full blocks of its 9 tokens are still in the prefix cache (hi computed
    # them): the resume takes their pages, recomputes only its last token and samples its next token in this step
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(lo_new, 1)] and out.scheduled[0].samples
    assert lo_new.num_computed_tokens == 8 and lo_new.status == RequestStatus.RUNNING
    hit = [p for h in lo_new.block_hashes[:2] for p in bm.cached[h]]
    assert lo_new.block_table[:2] == hit and len(lo_new.block_table) == 3
    assert all(bm.pages[p].ref_count == 1 for p in lo_new.block_table)
    sched.finish(lo_new, RequestStatus.FINISHED_STOPPED)
    assert bm.num_free == 6


def test_request_alone_that_outgrows_pool_finishes_with_length():
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = req("a", 7)
    sched.add(a)
    for _ in range(5):
        out = run_step(sched)
        if out.preempted:
            break
    assert a.status == RequestStatus.FINISHED_LENGTH and a.stop_reason == "kv_cache_full"


# ---- priority that holds, the prefill cap, the latency budget, prefixes in flight -----------------------------------
def distinct(rid, n, priority=0, t=0.0, base=0):
    return Request(rid, list(range(base + 1, base + n + 1)), SamplingParams(max_tokens=100), priority=priority,
                   arrival_time=t)


def test_waiting_realtime_goes_before_a_running_low_priority_prefill_chunk():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=16)
    talk = distinct("talk", 3, priority=0, t=0, base=5000)
    sched.add(talk)
    run_step(sched)                                    # a realtime stream is decoding
    http = distinct("http", 100, priority=1, t=1)
    sched.add(http)
    run_step(sched)                                    # its prompt is running, mid-prefill
    assert http.status == RequestStatus.RUNNING and 0 < http.num_computed_tokens < 100
    turn = distinct("turn", 10, priority=0, t=2, base=1000)
    sched.add(turn)
    out = run_step(sched)
    got = [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]
    # the decode keeps going, then the new realtime prompt whole, then what is left for the HTTP chunk
    assert got == [("talk", 1), ("turn", 10), ("http", 5)]


def test_running_low_priority_prefill_waits_while_realtime_takes_the_budget():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=16)
    http = distinct("http", 100, priority=1, t=0)
    sched.add(http)
    run_step(sched)
    turn = distinct("turn", 40, priority=0, t=1, base=1000)
    sched.add(turn)
    chunks = []
    while turn.num_output_tokens == 0:
        out = run_step(sched)
        chunks.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
    assert chunks == [[("turn", 16)], [("turn", 16)], [("turn", 8), ("http", 8)]]


def test_prefill_cap_per_request_while_others_wait():
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      long_prefill_token_threshold=16)
    a = distinct("a", 100, priority=1, t=0)
    sched.add(a)
    out = run_step(sched)
    assert [s.num_new_tokens for s in out.scheduled] == [64]   # alone: no cap
    b, c = distinct("b", 100, priority=1, t=1, base=1000), distinct("c", 20, priority=1, t=2, base=2000)
    sched.add(b)
    sched.add(c)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 16), ("b", 16), ("c", 16)]


def test_step_budget_shrinks_steps_only_while_streams_run():
    budget = StepBudget(max_num_batched_tokens=512, max_itl_ms=100)
    assert budget.tokens(num_decodes=4) == 512           # nothing measured yet
    budget.observe(512, 1.0, carried_prefill=True)        # 512 tokens took a second
    assert budget.tokens(num_decodes=0) == 512            # no stream to protect
    assert budget.tokens(num_decodes=4) == 51             # 100 ms at 1/512 s per token
    budget.observe(51, 0.2, carried_prefill=True)         # small steps cost more per token: the budget follows
    assert budget.tokens(num_decodes=4) < 51
    budget.observe(4, 10.0, carried_prefill=False)        # decode-only steps do not move it
    assert budget.tokens(num_decodes=40) == 56            # floor: the decodes and min_prefill_tokens
    sched = Scheduler(BlockManager(200, 4), max_num_seqs=8, max_num_batched_tokens=512, step_budget=budget)
    talk = distinct("talk", 3, t=0, base=5000)
    sched.add(talk)
    run_step(sched)
    sched.add(distinct("http", 300, priority=1, t=1))
    out = run_step(sched)
    assert out.token_budget == budget.tokens(1) == out.num_batched_tokens < 512


def test_with_a_latency_target_background_prefill_is_sized_and_paused_for_a_realtime_turn():
    """With `max_itl_ms` on: a step of HTTP prefill alone is sized to the target (a turn that arrives waits at most
    about that long), and a step carrying a Realtime prompt carries no HTTP prefill; the HTTP prompt goes on after."""
    budget = StepBudget(max_num_batched_tokens=512, max_itl_ms=100)
    budget.observe(500, 1.0, carried_prefill=True)         # 2 ms per token: 50 tokens fit the target
    sched = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=512, step_budget=budget)
    assert budget.tokens(num_decodes=0) == 512 and budget.tokens(num_decodes=0, background_only=True) == 50
    http = distinct("http", 300, priority=1, t=0)
    sched.add(http)
    out = run_step(sched)
    assert out.token_budget == 50 and [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("http", 50)]
    turn = distinct("turn", 10, priority=0, t=1, base=1000)
    sched.add(turn)
    out = run_step(sched)
    assert out.token_budget == 512 and [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("turn", 10)]                                     # urgent prefill, no stream yet: full budget, HTTP paused
    out = run_step(sched)                                 # the turn decodes: HTTP prefill fills the rest of the target
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("turn", 1), ("http", 49)]
    off = Scheduler(BlockManager(400, 4), max_num_seqs=8, max_num_batched_tokens=512,
                    step_budget=StepBudget(max_num_batched_tokens=512))
    off.add(distinct("http", 300, priority=1, t=0))
    assert run_step(off).num_batched_tokens == 300        # no target: steps are filled for throughput


def test_within_a_priority_a_prompt_that_fits_the_step_goes_before_long_cold_prompts():
    """Sessions starting cold share small steps under a latency target; a turn that arrives later with little left to
    prefill (its history cached) gets its first token in the next step instead of waiting for every cold prompt."""
    budget = StepBudget(max_num_batched_tokens=512, max_itl_ms=100)
    budget.observe(500, 1.0, carried_prefill=True)         # 50 tokens per step while streams run
    sched = Scheduler(BlockManager(800, 4), max_num_seqs=16, max_num_batched_tokens=512, step_budget=budget)
    sched.add(distinct("warm", 20, t=0, base=5000))
    run_step(sched)                                       # its first token: now a running stream
    for i in range(4):
        sched.add(distinct(f"cold{i}", 400, t=1 + i, base=1000 * (i + 1)))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["warm", "cold0"]   # first come among the long ones
    sched.add(distinct("turn2", 12, t=10, base=9000))
    out = run_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled][:2] == [("warm", 1), ("turn2", 12)]
    assert sum(s.num_new_tokens for s in out.scheduled) <= out.token_budget
    out = run_step(sched)                                 # then the cold prompts go on in arrival order
    assert [s.request.request_id for s in out.scheduled][:3] == ["warm", "turn2", "cold0"]


def test_identical_prefix_in_flight_is_computed_once():
    sched = Scheduler(BlockManager(200, 4, 4), max_num_seqs=8, max_num_batched_tokens=16)
    system = list(range(1, 41))                           # 10 blocks of 4
    reqs = [Request(f"s{i}", system + [100 + i, 200 + i], SamplingParams(max_tokens=100), arrival_time=i)
            for i in range(3)]
    for r in reqs:
        sched.add(r)
    computed = 0
    while any(r.num_output_tokens == 0 for r in reqs):
        out = run_step(sched)
        computed += out.num_batched_tokens - out.num_decodes
    assert reqs[1].num_cached_tokens == reqs[2].num_cached_tokens == 40
    assert computed == 42 + 2 + 2                          # the system prompt once, then each tail
    assert sched.block_manager.prefix_hits == 80


def test_a_follower_goes_its_own_way_where_prompts_differ():
    sched = Scheduler(BlockManager(200, 4, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = Request("a", list(range(1, 41)), SamplingParams(max_tokens=100), arrival_time=0)
    b = Request("b", list(range(1, 9)) + list(range(500, 532)), SamplingParams(max_tokens=100), arrival_time=1)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"] and out.num_deferred == 1
    out = run_step(sched)                                  # a's blocks are cached: b hits its 2 shared blocks
    assert b.num_cached_tokens == 8 and [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        ("a", 1), ("b", 32)]


def test_drafts_take_only_budget_left_after_every_decode_and_only_free_pages():
    """Speculative decoding: a decode with drafts is 1 + len(drafts) query tokens, but a later decode's own token comes
    first, drafts never preempt anyone, and the pages of rejected drafts go back to the pool (BlockManager.trim)."""
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a, b = req("a", 4, t=0), req("b", 4, t=1)
    sched.add(a)
    sched.add(b)
    run_step(sched)                                     # both prompts: 8 tokens > 6, so b is chunked
    run_step(sched)
    assert a.num_tokens - a.num_computed_tokens == 1 and b.num_tokens - b.num_computed_tokens == 1
    a.spec_token_ids = [5, 6, 7, 8, 9]
    out = sched.schedule()
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["a"].spec_token_ids == [5, 6, 7, 8] and by_id["a"].num_new_tokens == 5   # 6 - b's one token
    assert by_id["b"].num_new_tokens == 1 and out.num_spec_tokens == 4 and out.num_batched_tokens == 6
    assert by_id["a"].samples and len(a.block_table) == bm.pages_for(a.num_computed_tokens + 5)
    # verification accepted one draft: the engine advances a by 2 tokens and trims the rejected drafts' slots
    a.token_ids += [5, 3]
    a.num_computed_tokens += 2
    used = bm.num_pages - bm.num_free
    bm.trim(a, a.num_tokens)
    assert len(a.block_table) == bm.pages_for(a.num_tokens) and bm.num_pages - bm.num_free <= used
    b.num_computed_tokens += 1
    b.token_ids.append(7)
    # drafts that need more pages than are free are dropped: a plain decode instead of a preemption
    hog = req("hog", 4 * bm.num_free)                   # holds every free page (outside the scheduler)
    assert bm.allocate_slots(hog, hog.num_tokens) and bm.num_free == 0
    a.spec_token_ids = list(range(20, 26))
    out = sched.schedule()
    by_id = {s.request.request_id: s for s in out.scheduled}
    assert by_id["a"].spec_token_ids == [] and by_id["a"].num_new_tokens == 1 and not out.preempted
