"""Scheduler rules, driven without a model: budget, chunked prefill, decode-first, priorities, preemption order."""
from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


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
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
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
