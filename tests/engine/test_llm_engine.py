"""LLMEngine in the server's configuration (bf16 on the GGUF's own 4-bit blocks, prefix caching on): preemption by
recompute and chunked prefill under a tight KV pool, and aborts of a waiting and of a half-prefilled request.

The tests drive `step()` by hand, so they see the pool after every step: every page's ref count is the number of
running tables and pins that hold it, the free queue is exactly the pages nobody holds, and a hashed page holds the
block its hash names.

What "correct output" means here: in bf16 on the 4-bit path the numbers of a row depend on the batch it runs in (each
batch size takes its own kernel, see test_each_batch_size_takes_its_kernel), so a greedy request in a busy batch can
pick the other side of a near-tie that it picks alone (bf16 logits tie exactly now and then). `assert_greedy`
therefore replays each output against the request run alone: up to the first difference the tokens must be equal, and
there, with the same context on both sides, the token the busy run chose must be within TIE_NATS of the alone run's
best; then the alone run restarts from the busy run's tokens. A KV page read from the wrong place, a stale prefix
block or a lost chunk turns the context into something else, and the tokens it yields are far from the best
continuation.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from engine import LLM, LLMEngine, PromptTooLongError, SamplingParams
from engine.models.loader import check_architecture, resolve_model_dir
from engine.request import RequestStatus

PAGE_SIZE = 4
BLOCK_SIZE = 16
NUM_PAGES = 30
MAX_NUM_BATCHED_TOKENS = 16   # prompts of 30+ tokens are prefilled in chunks
MAX_NUM_SEQS = 3
TIE_NATS = 0.25               # well above the bf16 noise between kernels, well below what a wrong context costs
REFERENCE_SALT = "reference"  # reference runs never read blocks the run under test computed, nor leave any to it

SYSTEM = ("You are a helpful assistant. Answer every question in one short sentence, be precise and concise, and do "
          "not repeat the question back to the user. If you do not know the answer, say so plainly and briefly.\n")
QUESTIONS = ["What is the capital of France?", "Name a red fruit.", "What colour is the sky?",
             "How many legs has a spider?"]
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
         "repaired every clock in the valley. One winter morning a stranger knocked on his door, carrying a clock "
         "that ran backwards, and asked him to make it run forwards again before the new moon.")


def kv_bytes(num_pages: int, dtype_bytes: int = 2) -> int:
    """The kv_cache_memory that holds exactly num_pages pages of the default model (bf16 unless told)."""
    cfg = check_architecture(resolve_model_dir(None))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_page = 2 * cfg["num_hidden_layers"] * PAGE_SIZE * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    return num_pages * per_page


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine(dtype="bfloat16", quantization="gguf", kv_cache_memory=kv_bytes(NUM_PAGES), page_size=PAGE_SIZE,
                    block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS)
    assert eng.block_manager.num_pages == NUM_PAGES
    return eng


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def encode(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


def assert_pool_consistent(engine: LLMEngine) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    holders = Counter(p for r in sched.running for p in r.block_table)
    holders.update(p for pins in bm.pins.values() for p in pins)
    assert all(page.ref_count == holders[page.page_id] for page in bm.pages), "a page's ref count is off"
    assert set(bm.free_queue) == {page.page_id for page in bm.pages if page.ref_count == 0}
    assert all(not r.block_table for *_, r in sched.waiting), "a waiting request holds pages"
    assert bm.num_cached_free == sum(bm.pages[p].block_hash is not None for p in bm.free_queue)
    for h, pages in bm.cached.items():
        assert len(pages) == bm.pages_per_block
        assert all(bm.pages[p].block_hash == h and bm.pages[p].block == pages for p in pages)
        assert len({bm.pages[p].ref_count for p in pages}) == 1
    for r in sched.running:          # every computed full block of a running request sits in pages hashed as that block
        for i in range(r.num_computed_tokens // bm.block_size):
            pages = r.block_table[i * bm.pages_per_block:(i + 1) * bm.pages_per_block]
            assert all(bm.pages[p].block_hash == r.block_hashes[i] for p in pages), (r.request_id, i)


def assert_idle_and_all_free(engine: LLMEngine) -> None:
    s = engine.stats()
    assert (s["requests_running"], s["requests_waiting"], s["kv_pages_used"]) == (0, 0, 0), s
    assert engine.block_manager.num_free == engine.block_manager.num_pages
    assert_pool_consistent(engine)


def drive(engine: LLMEngine, after_step=None) -> tuple[dict, dict, dict]:
    """Step until no request is left, checking the pool after every step. Returns each request's tokens, logprobs and
    finish reason."""
    tokens, logprobs, reasons = defaultdict(list), defaultdict(list), {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.logprobs or []
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        assert_pool_consistent(engine)
        if after_step is not None:
            after_step()
    return tokens, logprobs, reasons


def run_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], list]:
    rid = engine.add_request(prompt, greedy(max_tokens, logprobs=20), cache_salt=REFERENCE_SALT)
    tokens, logprobs, reasons = drive(engine)
    assert reasons[rid] == "length" and len(tokens[rid]) == max_tokens
    return tokens[rid], logprobs[rid]


def assert_greedy(engine: LLMEngine, prompt: list[int], got: list[int]) -> None:
    """`got` is the greedy continuation of `prompt`, up to near-ties (see the module docstring)."""
    pos = 0
    while pos < len(got):
        ref, ref_logprobs = run_alone(engine, prompt + got[:pos], len(got) - pos)
        k = next((i for i, (a, b) in enumerate(zip(ref, got[pos:])) if a != b), None)
        if k is None:
            return
        chosen_logprob, top = ref_logprobs[k]
        got_logprob = dict(top).get(got[pos + k])
        assert got_logprob is not None and chosen_logprob - got_logprob <= TIE_NATS, \
            f"token {pos + k}: {got[pos + k]} is no near-tie of the greedy {ref[k]} ({got_logprob} vs {chosen_logprob})"
        pos += k + 1


def test_preemption_and_chunked_prefill_with_prefix_caching(engine):
    """Four requests share a two-block system prompt in a pool that holds about two of them: prompts are prefilled in
    chunks, the shared blocks are hit, requests that have output are preempted and recomputed (prompt + output), and
    every output is each request's greedy output alone."""
    prompts = {f"q{i}": encode(engine, SYSTEM + q) for i, q in enumerate(QUESTIONS)}
    shared = next(i for i, col in enumerate(zip(*prompts.values())) if len(set(col)) > 1)
    assert shared >= 2 * BLOCK_SIZE and all(len(p) - shared > MAX_NUM_BATCHED_TOKENS // 4 for p in prompts.values())
    max_tokens = 24
    preemptions_before = engine.scheduler.num_preemptions
    reqs = {}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(max_tokens), request_id=rid)
        reqs[rid] = engine.requests[rid]
    seen_mid_prefill, seen_preempted_with_output = set(), set()

    def watch():
        for rid, r in reqs.items():
            if 0 < r.num_computed_tokens < r.num_prompt_tokens and r.status == RequestStatus.RUNNING:
                seen_mid_prefill.add(rid)
            if r.status == RequestStatus.PREEMPTED and r.num_output_tokens > 0:
                seen_preempted_with_output.add(rid)

    tokens, _, reasons = drive(engine, watch)
    assert reasons == {rid: "length" for rid in prompts}
    assert all(len(tokens[rid]) == max_tokens for rid in prompts)
    # the scenario did what it is for
    assert engine.scheduler.num_preemptions > preemptions_before
    assert seen_preempted_with_output, "no request was preempted after it had output"
    assert seen_mid_prefill == set(prompts), "a prompt was not prefilled in chunks"
    assert sum(r.num_cached_tokens >= 2 * BLOCK_SIZE for r in reqs.values()) >= 1, "the shared prefix was never hit"
    assert_idle_and_all_free(engine)
    for rid, prompt in prompts.items():
        assert_greedy(engine, prompt, tokens[rid])
    assert_idle_and_all_free(engine)


def test_abort_while_waiting(engine):
    """A request queued behind max_num_seqs is aborted before it is scheduled: it finishes with "abort" and no token,
    it held no page, and the running requests finish as they would have."""
    prompts = {f"w{i}": encode(engine, q) for i, q in enumerate(QUESTIONS)}
    max_tokens = 16
    for rid, prompt in prompts.items():
        engine.add_request(prompt, greedy(max_tokens), request_id=rid)
    queued = engine.requests["w3"]
    tokens = defaultdict(list)
    for _ in range(10):                  # until the first three are all running (budget: a few steps)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        assert_pool_consistent(engine)
        if len(engine.scheduler.running) == MAX_NUM_SEQS:
            break
    assert len(engine.scheduler.running) == MAX_NUM_SEQS
    assert queued.status == RequestStatus.WAITING and queued.block_table == [] and queued.num_computed_tokens == 0
    used = engine.stats()["kv_pages_used"]
    assert engine.stats()["requests_waiting"] == 1

    out = engine.abort_request("w3")
    assert out.finished and out.finish_reason == "abort" and out.new_token_ids == [] and out.num_output_tokens == 0
    s = engine.stats()
    assert (s["requests_waiting"], s["requests_running"], s["kv_pages_used"]) == (0, MAX_NUM_SEQS, used)
    assert engine.abort_request("w3") is None            # gone: a second abort is a no-op
    assert_pool_consistent(engine)

    rest, _, reasons = drive(engine)
    assert reasons == {"w0": "length", "w1": "length", "w2": "length"}
    assert_idle_and_all_free(engine)
    for rid in ("w0", "w1", "w2"):
        got = tokens[rid] + rest[rid]
        assert len(got) == max_tokens
        assert_greedy(engine, prompts[rid], got)


def test_abort_mid_prefill(engine):
    """A long prompt is aborted between two chunks of its prefill, next to a short request: its pages are freed at
    once, the short request finishes as it would have, and the blocks it had computed stay valid in the prefix cache
    (the same prompt later hits them and still gets its greedy output)."""
    long_prompt = encode(engine, STORY)
    short_prompt = encode(engine, QUESTIONS[0])
    assert len(long_prompt) > 3 * MAX_NUM_BATCHED_TOKENS
    reference, _ = run_alone(engine, long_prompt, 8)       # salted: computes nothing the run below can hit
    engine.add_request(short_prompt, greedy(16), request_id="short")
    engine.add_request(long_prompt, greedy(8), request_id="long")
    short, long = engine.requests["short"], engine.requests["long"]
    tokens = defaultdict(list)
    for _ in range(20):                  # until two blocks of it are in (a few chunks); the prompt is far longer
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        assert_pool_consistent(engine)
        if long.num_computed_tokens >= 2 * BLOCK_SIZE:
            break
    assert long.status == RequestStatus.RUNNING and long.num_computed_tokens < long.num_prompt_tokens
    assert tokens["long"] == []
    computed_blocks = long.block_hashes[:long.num_computed_tokens // BLOCK_SIZE]
    assert all(h in engine.block_manager.cached for h in computed_blocks)

    out = engine.abort_request("long")
    assert out.finished and out.finish_reason == "abort" and out.num_output_tokens == 0
    assert long.block_table == [] and long not in engine.scheduler.running
    assert engine.stats()["kv_pages_used"] == len(short.block_table)     # only the short request's pages are held
    assert_pool_consistent(engine)

    rest, _, reasons = drive(engine)
    assert reasons == {"short": "length"}
    assert_idle_and_all_free(engine)
    assert_greedy(engine, short_prompt, tokens["short"] + rest["short"])

    # the aborted prefill's full blocks are still cached, and hitting them gives the greedy output
    assert all(h in engine.block_manager.cached for h in computed_blocks)
    engine.add_request(long_prompt, greedy(8), request_id="long-again")
    again = engine.requests["long-again"]
    again_tokens, _, reasons = drive(engine)
    assert reasons == {"long-again": "length"}
    assert again.num_cached_tokens == len(computed_blocks) * BLOCK_SIZE > 0
    if again_tokens["long-again"] != reference:
        assert_greedy(engine, long_prompt, again_tokens["long-again"])
    assert_idle_and_all_free(engine)


def test_prompt_larger_than_kv_pool_is_rejected():
    llm = LLM(kv_cache_memory=kv_bytes(16, dtype_bytes=4), page_size=PAGE_SIZE)    # fp32: 64 KV slots
    assert llm.engine.block_manager.num_slots == 64
    with pytest.raises(PromptTooLongError, match="KV cache"):
        llm.generate([[5] * 100], greedy(12))
    assert llm.generate([[5] * 10], greedy(12))[0].finish_reason == "length"
