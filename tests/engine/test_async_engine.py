"""AsyncEngine: concurrent streams in one event loop equal their offline outputs; an abort or a cancelled consumer stops
the request and frees its pages at once; bad input raises typed errors while the engine keeps serving (a step that
raises: tests/engine/test_fault_isolation.py)."""
import asyncio
import time

import pytest

from engine import LLM, AsyncEngine, InvalidRequestError, PromptTooLongError, SamplingParams

PROMPTS = [f"Question {i}: name a {w} and describe it in one sentence." for i, w in
           enumerate(["fruit", "color", "city", "planet", "river", "tree", "bird", "tool",
                      "song", "sport", "metal", "ocean", "flower", "dog breed", "language", "mountain"])]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def aengine():
    eng = AsyncEngine(kv_cache_memory="128MiB")
    yield eng
    eng.shutdown()


async def collect(eng, rid, ids, params=PARAMS):
    toks, text, last = [], "", None
    async for out in eng.generate(rid, ids, params):
        toks += out.new_token_ids
        text += out.text_delta
        last = out
    return toks, text, last


async def test_16_concurrent_streams_equal_offline(aengine):
    tok = aengine.tokenizer
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    results = await asyncio.gather(*(collect(aengine, f"s{i}", x) for i, x in enumerate(ids)))
    offline = LLM(kv_cache_memory="64MiB").generate(ids, PARAMS)
    for (toks, text, last), off in zip(results, offline):
        assert toks == off.token_ids and text == off.text
        assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 12
    assert aengine.stats()["kv_pages_used"] == 0


# ---- aborts and a failing step, in the server's configuration (bf16 on the GGUF's 4-bit blocks) ---------------------
# An aborted request must stop: it asks for as many tokens as the context holds and ignores EOS, so left alone it would
# run for thousands of steps. Waits are bounded and fail when the bound passes; the bound is far above one step and far
# below the request's natural end.
WAIT_S = 20.0


@pytest.fixture(scope="module")
def served():
    eng = AsyncEngine(kv_cache_memory="128MiB", max_num_seqs=64, dtype="bfloat16", quantization="gguf")
    yield eng
    eng.shutdown()


def endless(eng) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=eng.max_model_len, ignore_eos=True)


def natural_end(eng, prompt: list[int]) -> int:
    """Output tokens an endless request reaches unaborted: the context's end, or the whole KV pool's."""
    s = eng.stats()
    return min(eng.max_model_len, s["kv_pages_total"] * s["kv_page_size"]) - len(prompt)


def idle(s: dict) -> bool:
    return (s["requests_running"], s["requests_waiting"], s["kv_pages_used"]) == (0, 0, 0)


async def wait_for_stats(eng, ok, what: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while not ok(s := eng.stats()):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: engine stats still {s} after {WAIT_S} s")
        await asyncio.sleep(0.01)
    return s


async def assert_nothing_else_generates(eng) -> None:
    """A short request run to its end adds exactly its own tokens to the engine's total: nothing else is generating."""
    before = eng.stats()["generated_tokens_total"]
    toks, _, last = await asyncio.wait_for(
        collect(eng, None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)), WAIT_S)
    assert last.finish_reason == "length" and len(toks) == 4
    assert eng.stats()["generated_tokens_total"] == before + 4


async def test_cancelled_consumer_aborts_and_frees_pages(served):
    assert idle(served.stats())
    ids = served.tokenizer.encode("Tell me a very long story about dragons.", add_special_tokens=False)
    total_before = served.stats()["generated_tokens_total"]
    got = []
    three = asyncio.Event()

    async def consume():
        async for out in served.generate("cancel-me", ids, endless(served)):
            got.extend(out.new_token_ids)
            if len(got) >= 3:
                three.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(three.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = await wait_for_stats(served, idle, "after the consumer was cancelled")
    assert s["generated_tokens_total"] - total_before < natural_end(served, ids)   # stopped, not run to its end
    await assert_nothing_else_generates(served)


async def test_explicit_abort_finishes_stream(served):
    assert idle(served.stats())
    ids = served.tokenizer.encode("Count to one thousand:", add_special_tokens=False)
    outs = []

    async def consume():
        async for out in served.generate("abort-me", ids, endless(served)):
            outs.append(out)
            if len(outs) == 3:
                await served.abort("abort-me")

    await asyncio.wait_for(consume(), WAIT_S)
    last = outs[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.num_output_tokens == sum(len(o.new_token_ids) for o in outs) < natural_end(served, ids)
    assert idle(served.stats())          # at once: the finish is delivered after the pages are freed
    await assert_nothing_else_generates(served)


async def test_bad_requests_raise_typed_errors_and_engine_keeps_serving(aengine):
    with pytest.raises(InvalidRequestError, match="empty"):
        await collect(aengine, "e1", [])
    with pytest.raises(PromptTooLongError, match="context"):
        await collect(aengine, "e2", [5] * (aengine.max_model_len + 10))
    with pytest.raises(InvalidRequestError, match="token ids"):
        await collect(aengine, "e3", [10**9])
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=-0.5)
    assert e.value.param == "temperature"
    toks, _, last = await collect(aengine, "ok", aengine.tokenizer.encode("Hi", add_special_tokens=False))
    assert last.finished and len(toks) == 12


async def test_engine_thread_keeps_the_default_thread_count():
    """A worker that set one intra-op thread for itself (Whisper does) before the engine loads in a fresh thread (the
    gateway loads it with asyncio.to_thread) must not leave the engine with one."""
    import threading

    import torch

    import kernels

    t = threading.Thread(target=lambda: kernels.set_thread_count(1))
    t.start()
    t.join()
    try:
        eng = await asyncio.to_thread(AsyncEngine, kv_cache_memory="64MiB")
        try:
            assert eng.num_threads == kernels.default_thread_count()
            toks, _, _ = await collect(eng, "t", [1, 2, 3])
            assert len(toks) == 12
            assert eng.stats()["intra_op_threads"] == eng.num_threads
        finally:
            eng.shutdown()
    finally:
        t = threading.Thread(target=lambda: torch.set_num_threads(kernels.default_thread_count()))
        t.start()
        t.join()


async def test_engine_thread_keeps_its_thread_count_when_a_worker_sets_its_own_later():
    """The server's order: the engine thread starts, then waits idle while the audio stage starts and Whisper's worker
    sets one intra-op thread for itself; the engine's first step (its first C++ op) must still run on the engine's
    count, not Whisper's (it did not: text was served on one core of two with the audio stage on)."""
    import threading

    import torch

    import kernels

    def in_thread(fn):
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    in_thread(lambda: kernels.set_thread_count(1))   # a fresh thread now starts with one
    made = {}
    # built in a fresh thread, whose stats snapshot says 1, so the engine thread's own count is seen when it lands
    await asyncio.to_thread(in_thread, lambda: made.update(eng=AsyncEngine(kv_cache_memory="64MiB")))
    eng = made["eng"]
    try:
        while eng.stats()["intra_op_threads"] != eng.num_threads:   # the engine thread has set its count
            await asyncio.sleep(0.05)
        in_thread(lambda: kernels.set_thread_count(1))   # Whisper's worker starting
        toks, _, _ = await collect(eng, "t", [1, 2, 3])
        assert len(toks) == 12
        assert eng.stats()["intra_op_threads"] == eng.num_threads == kernels.default_thread_count()
    finally:
        eng.shutdown()
        in_thread(lambda: torch.set_num_threads(kernels.default_thread_count()))
