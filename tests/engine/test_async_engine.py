"""AsyncEngine: concurrent streams in one event loop equal their offline outputs; abort/cancel frees blocks; bad input
raises typed errors while the engine keeps serving."""
import asyncio

import pytest

from engine import LLM, AsyncEngine, InvalidRequestError, ModelLoadError, PromptTooLongError, SamplingParams
from engine.config import EngineArgs

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


async def test_cancelled_consumer_aborts_and_frees_blocks(aengine):
    ids = aengine.tokenizer.encode("Tell me a very long story about dragons.", add_special_tokens=False)
    got = []

    async def consume():
        async for out in aengine.generate("cancel-me", ids, SamplingParams(temperature=0, max_tokens=500,
                                                                            ignore_eos=True)):
            got.append(out)

    task = asyncio.create_task(consume())
    while len(got) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if aengine.stats()["kv_pages_used"] == 0 and aengine.stats()["requests_running"] == 0:
            break
        await asyncio.sleep(0.02)
    assert aengine.stats()["kv_pages_used"] == 0 and len(got) < 500


async def test_explicit_abort_finishes_stream(aengine):
    ids = aengine.tokenizer.encode("Count to one thousand:", add_special_tokens=False)
    outs = []
    async for out in aengine.generate("abort-me", ids, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)):
        outs.append(out)
        if len(outs) == 2:
            await aengine.abort("abort-me")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert aengine.stats()["kv_pages_used"] == 0


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


def test_prompt_larger_than_kv_pool_is_rejected():
    llm = LLM(kv_cache_memory=64 * 30 * 2 * 3 * 64 * 4)    # 64 KV slots (16 pages of 4)
    with pytest.raises(PromptTooLongError, match="KV cache"):
        llm.generate([[5] * 100], PARAMS)
    assert llm.generate([[5] * 10], PARAMS)[0].finish_reason == "length"


@pytest.mark.parametrize("args,param", [(dict(page_size=3), "page_size"), (dict(page_size=0), "page_size"),
                                        (dict(block_size=8, page_size=16), "page_size"),
                                        (dict(block_size=0), "block_size")])
def test_bad_page_and_block_sizes_raise_typed_errors(args, param):
    with pytest.raises(InvalidRequestError) as e:
        EngineArgs(**args)
    assert e.value.param == param


def test_default_page_size_divides_the_block_size():
    assert (EngineArgs().block_size, EngineArgs().page_size) == (16, 4)
    assert EngineArgs(block_size=6).page_size == 2 and EngineArgs(block_size=1).page_size == 1


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent/model/dir")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np
    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="mamba"):
        LLM(model=str(path))


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
        finally:
            eng.shutdown()
    finally:
        t = threading.Thread(target=lambda: torch.set_num_threads(kernels.default_thread_count()))
        t.start()
        t.join()
