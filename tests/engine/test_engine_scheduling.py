"""The scheduling rule with the real model (greedy, fp32: its rows do not depend on the batch, so outputs compare
exactly): a Realtime turn goes before a running HTTP prompt's next prefill chunk, the per-request prefill cap, the
step budget that adapts to `max_itl_ms`, and an identical prefix in flight computed once. Assertions are on what each
step scheduled (`LLMEngine.last_step`) and on the prefix-cache counters, never on time."""
from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from tests.engine.prompts import PROMPTS

BUDGET = 64
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = " ".join(PROMPTS) * 2            # a few hundred tokens: several chunks of BUDGET


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(kv_cache_memory="32MiB", max_num_batched_tokens=BUDGET)


@pytest.fixture
def knobs(engine):
    """Tests turn the scheduling knobs on their engine; each test starts from, and restores, the defaults."""
    sched, budget = engine.scheduler, engine.step_budget
    saved = (sched.long_prefill_token_threshold, sched.share_inflight_prefixes, budget.max_itl_ms,
             budget.max_num_batched_tokens)
    yield sched, budget
    (sched.long_prefill_token_threshold, sched.share_inflight_prefixes, budget.max_itl_ms,
     budget.max_num_batched_tokens) = saved
    assert not engine.has_unfinished()


def step_log(engine: LLMEngine, log: list, tokens: dict) -> None:
    for out in engine.step():
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    log.append([(s.request.request_id, s.num_new_tokens) for s in engine.last_step.scheduled])


def alone(engine: LLMEngine, prompt, params=GREEDY, salt="alone") -> list[int]:
    rid = engine.add_request(prompt, params, cache_salt=salt)
    toks: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            toks += out.new_token_ids
    assert rid
    return toks


def test_realtime_turn_goes_before_a_running_http_prefill_and_decodes_keep_going(engine, knobs):
    log, toks = [], {}
    engine.add_request(LONG, GREEDY, request_id="http", priority=1)
    step_log(engine, log, toks)
    assert log[-1] == [("http", BUDGET)]                       # a running prompt, mid-prefill
    turn = "User: what is the capital of France?\nAssistant:"
    engine.add_request(turn, GREEDY, request_id="turn", priority=0)
    n_turn = engine.requests["turn"].num_prompt_tokens
    step_log(engine, log, toks)
    assert log[-1] == [("turn", n_turn), ("http", BUDGET - n_turn)]
    assert len(toks["turn"]) == 1                              # its first token, one step after it arrived
    while engine.requests.get("turn"):
        step_log(engine, log, toks)
        assert log[-1][0] == ("turn", 1)                       # its decode goes first, the prompt takes the rest
    while engine.has_unfinished():
        step_log(engine, log, toks)
    assert toks["turn"] == alone(engine, turn) and toks["http"] == alone(engine, LONG)


def test_with_a_latency_target_the_step_of_a_realtime_turn_carries_no_http_prefill(engine, knobs):
    _, budget = knobs
    budget.max_itl_ms = 1e9                                    # on, and a target every step meets: sizes stay full
    log, toks = [], {}
    engine.add_request(LONG, GREEDY, request_id="http", priority=1, cache_salt="paused")
    step_log(engine, log, toks)
    assert log[-1] == [("http", BUDGET)]
    turn = "User: what is the capital of France?\nAssistant:"
    engine.add_request(turn, GREEDY, request_id="turn", priority=0, cache_salt="paused")
    step_log(engine, log, toks)
    assert log[-1] == [("turn", engine.requests["turn"].num_prompt_tokens)]   # the HTTP chunk waits a step
    assert len(toks["turn"]) == 1
    step_log(engine, log, toks)
    assert log[-1] == [("turn", 1), ("http", BUDGET - 1)]      # then it goes on around the turn's decode
    while engine.has_unfinished():
        step_log(engine, log, toks)
    assert toks["turn"] == alone(engine, turn) and toks["http"] == alone(engine, LONG)


def test_prefill_cap_per_request_while_others_wait(engine, knobs):
    sched, _ = knobs
    sched.long_prefill_token_threshold = 16
    sched.share_inflight_prefixes = False
    log, toks = [], {}
    engine.add_request(LONG, GREEDY, request_id="a", priority=1, cache_salt="a")
    engine.add_request(LONG, GREEDY, request_id="b", priority=1, cache_salt="b")
    step_log(engine, log, toks)
    assert log[-1] == [("a", 16), ("b", 16)]
    while engine.has_unfinished():
        step_log(engine, log, toks)
    # once b's prompt is done, a's (alone in prefill) is no longer capped
    assert any(dict(s).get("a", 0) > 16 for s in log) or len(toks["a"]) == 8
    assert toks["a"] == toks["b"] == alone(engine, LONG)


def test_step_budget_adapts_to_the_itl_target(engine, knobs):
    _, budget = knobs
    floor = 1 + budget.min_prefill_tokens                      # one decode and the least prefill a step carries
    # a target no step can meet: every step carries the decode and the floor; an easy one: the whole budget
    for target, expect in ((1e-6, floor), (1e9, BUDGET)):
        budget.max_itl_ms = target
        log, toks = [], {}
        engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
                           request_id="stream", cache_salt=str(target))
        step_log(engine, log, toks)                           # the stream is decoding from now on
        prompt = engine.requests[engine.add_request(LONG, GREEDY, request_id="prompt", cache_salt=str(target))]
        while prompt.num_output_tokens == 0:
            left = prompt.num_tokens - prompt.num_computed_tokens
            step_log(engine, log, toks)
            assert engine.last_step.num_decodes == 1 and engine.last_step.token_budget == expect
            assert log[-1] == [("stream", 1), ("prompt", min(expect - 1, left))]
        engine.abort_request("stream")
        while engine.has_unfinished():
            step_log(engine, log, toks)
        assert toks["prompt"] == alone(engine, LONG)


def test_identical_prefix_in_flight_is_computed_once(engine, knobs):
    sched, budget = knobs
    budget.max_num_batched_tokens = 512            # room for all four prompts in one step
    system = PROMPTS[0] + " " + PROMPTS[1] + "\n"
    prompts = [system + q for q in ("Q: a red fruit?", "Q: the sky's colour?", "Q: legs of a spider?", "Q: 2+2?")]
    results = {}
    for share in (False, True):
        sched.share_inflight_prefixes = share
        bm = engine.block_manager
        hits, queries, computed = bm.prefix_hits, bm.prefix_queries, 0
        ids = [engine.add_request(p, GREEDY, cache_salt=f"share={share}") for p in prompts]
        toks = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for out in engine.step():
                toks[out.request_id] += out.new_token_ids
            computed += engine.last_step.num_batched_tokens - engine.last_step.num_decodes
        results[share] = ([toks[r] for r in ids], bm.prefix_hits - hits, bm.prefix_queries - queries, computed)
    n_system = len(engine.tokenizer.encode(system, add_special_tokens=False))
    shared = n_system // engine.block_manager.block_size * engine.block_manager.block_size   # full blocks only
    off, on = results[False], results[True]
    assert on[0] == off[0]                                     # the same tokens either way
    assert off[1] == 0 and on[1] == 3 * shared                 # all four at once: no hit; shared: three hits
    assert on[3] == off[3] - 3 * shared == off[2] - 3 * shared
