"""Issue 22, the HTTP API as clients use it: logprobs, n > 1, served model names, cached-token usage; through the
official openai SDK against the real engine, responses read with the SDK's own types.

Greedy (temperature 0) or seeded throughout, so no draw of the sampler can pass or fail a test."""
from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import websockets
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.completion_choice import Logprobs

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's own name: what the test server serves
ASK = [{"role": "user", "content": "Describe the sea in a few words."}]
FIXED = {"ignore_eos": True}      # vLLM's extra field: every output runs to max_tokens


def client(server, **kw) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, max_retries=0, **kw)


def _check_chat_entries(entries: list[ChatCompletionTokenLogprob], top: int) -> None:
    for e in entries:
        assert isinstance(e, ChatCompletionTokenLogprob)
        assert e.logprob <= 0.0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:   # greedy: the chosen token is the most likely one
            assert e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token


async def test_chat_logprobs_streamed_and_not(server):
    c = client(server)
    resp = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=3, extra_body=FIXED)
    choice = resp.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == resp.usage.completion_tokens == 8 and choice.finish_reason == "length"
    _check_chat_entries(entries, 3)
    assert "".join(e.token for e in entries) == choice.message.content
    stream = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True,
                                             top_logprobs=3, stream=True, stream_options={"include_usage": True},
                                             extra_body=FIXED)
    streamed, text = [], []
    async for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.delta.content or "")
            if ch.logprobs is not None:
                streamed += ch.logprobs.content
    _check_chat_entries(streamed, 3)
    assert [e.token for e in streamed] == [e.token for e in entries] and "".join(text) == choice.message.content
    # logprobs without top_logprobs: the chosen tokens only; none asked: null
    plain = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0, logprobs=True)
    _check_chat_entries(plain.choices[0].logprobs.content, 0)
    none = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    assert none.choices[0].logprobs is None
    await server.wait_idle(pinned_ok=True)


async def test_completion_logprobs_streamed_and_not(server):
    c = client(server)
    resp = await c.completions.create(model=MODEL, prompt="The ocean is", max_tokens=6, temperature=0, logprobs=2,
                                      extra_body=FIXED)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert isinstance(lp, Logprobs) and len(lp.tokens) == len(lp.token_logprobs) == 6
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == value == max(top.values())   # greedy: the chosen is the top
    chunks = [ch async for ch in await c.completions.create(model=MODEL, prompt="The ocean is", max_tokens=6,
                                                            temperature=0, logprobs=2, stream=True,
                                                            extra_body=FIXED)]
    tokens, offsets = [], []
    for ch in chunks:
        for c_ in ch.choices:
            if c_.logprobs is not None:
                tokens += c_.logprobs.tokens
                offsets += c_.logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset
    await server.wait_idle(pinned_ok=True)


async def test_n_choices_share_the_prompt_and_sum_usage(server):
    c = client(server)
    nonce = uuid.uuid4().hex   # a prompt no earlier test cached
    ask = [{"role": "user", "content": f"Note {nonce}. " + "Tell me about the sea and its waves. " * 8}]
    before = server.stats()
    resp = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, n=3, seed=11, temperature=1.0,
                                           extra_body=FIXED)
    hits = server.stats()["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert [ch.index for ch in resp.choices] == [0, 1, 2] and resp.model == MODEL
    assert all(ch.message.content is not None and ch.finish_reason == "length" for ch in resp.choices)
    assert resp.usage.completion_tokens == 15
    block = server.engine.engine.block_manager.block_size
    assert hits >= 2 * block * ((resp.usage.prompt_tokens - 1) // block)   # choices 1 and 2 took choice 0's KV
    # a seeded n=3 request gives the same choices again (both read the prompt from the cache and run the same
    # batches: the first request computed the prompt itself, so its last bits of logits may differ)
    again = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, n=3, seed=11, temperature=1.0,
                                            extra_body=FIXED)
    assert again.usage.prompt_tokens == resp.usage.prompt_tokens and again.usage.completion_tokens == 15
    # streamed: each choice's role chunk, text and one finish; usage summed
    stream = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=5, n=3, seed=11, temperature=1.0,
                                             stream=True, stream_options={"include_usage": True}, extra_body=FIXED)
    text, roles, reasons, usage = {}, {}, {}, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            roles[ch.index] = roles.get(ch.index, 0) + (ch.delta.role == "assistant")
            if ch.finish_reason:
                reasons[ch.index] = reasons.get(ch.index, []) + [ch.finish_reason]
    assert roles == {0: 1, 1: 1, 2: 1} and reasons == {i: ["length"] for i in range(3)}
    assert [text[i] for i in range(3)] == [ch.message.content for ch in again.choices]
    assert usage.completion_tokens == 15 and usage.prompt_tokens == resp.usage.prompt_tokens
    # completions
    done = await c.completions.create(model=MODEL, prompt=f"{nonce} The sea", max_tokens=3, n=2, temperature=0,
                                      extra_body=FIXED)
    assert [ch.index for ch in done.choices] == [0, 1] and all(ch.finish_reason == "length" for ch in done.choices)
    assert done.usage.completion_tokens == 6
    chunks = [ch async for ch in await c.completions.create(model=MODEL, prompt=f"{nonce} The sea", max_tokens=3,
                                                            n=2, temperature=0, stream=True, extra_body=FIXED)]
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}
    await server.wait_idle(pinned_ok=True)


async def test_n_stream_client_disconnect_aborts_every_choice(server):
    base = await server.wait_idle(pinned_ok=True)
    async with httpx.AsyncClient(timeout=60) as h:
        async with h.stream("POST", f"{server.base_url}/chat/completions", json={
                "model": MODEL, "stream": True, "ignore_eos": True, "seed": 3, "n": 3, "messages": ASK}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                    seen += 1
                    if seen == 12:
                        break
            assert server.stats()["requests_running"] == 3
    s = await server.wait_idle(pinned_ok=True)
    assert s["kv_pages_used"] == base["kv_pages_used"] and s["kv_pages_pinned"] == base["kv_pages_pinned"], (base, s)


async def test_n_with_a_prompt_too_long_is_400_and_starts_nothing(server):
    before = await server.wait_idle(pinned_ok=True)
    with pytest.raises(openai.BadRequestError) as info:
        await client(server).completions.create(model=MODEL, prompt=[1] * (server.engine.max_model_len + 1),
                                                max_tokens=2, n=4)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    after = await server.wait_idle(pinned_ok=True)
    assert after["num_steps"] == before["num_steps"]


async def test_model_names_404_and_retrieve(server):
    from gateway.audio_api import SPEECH_MODELS, TRANSCRIPTION_MODELS

    c = client(server)
    assert [m.id for m in (await c.models.list()).data] == [MODEL, *TRANSCRIPTION_MODELS, *SPEECH_MODELS]
    for name in (MODEL, "whisper-1", "tts-1"):
        card = await c.models.retrieve(name)
        assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await c.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    before = await server.wait_idle(pinned_ok=True)
    for api, kw in ((c.chat.completions, {"messages": ASK}), (c.completions, {"prompt": "Hi"})):
        with pytest.raises(openai.NotFoundError) as info:
            await api.create(model="gpt-4o", max_tokens=2, **kw)
        err = info.value.body
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"]
        assert err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as info:   # an audio model's name is not the chat model's
        await c.chat.completions.create(model="whisper-1", max_tokens=2, messages=ASK)
    assert info.value.body["code"] == "model_not_found" and "/v1/audio/transcriptions" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:   # nor the other way round
        await c.audio.speech.create(model=MODEL, voice="alloy", input="Hi.")
    assert (info.value.body["code"], info.value.body["param"]) == ("model_not_found", "model")
    assert (await server.wait_idle(pinned_ok=True))["num_steps"] == before["num_steps"]


async def test_served_model_names(server):
    """--served-model-name: the names listed, accepted and echoed; the model's own name is then refused."""
    from gateway.app import Settings, create_app

    app = create_app(Settings(served_model_name=["tiny", "tiny-chat"], audio=False), engine=server.engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1/v1") as h:
        c = AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1/v1", http_client=h, max_retries=0)
        assert [m.id for m in (await c.models.list()).data] == ["tiny", "tiny-chat"]
        assert (await c.models.retrieve("tiny-chat")).id == "tiny-chat"
        resp = await c.chat.completions.create(model="tiny-chat", messages=ASK, max_tokens=2, temperature=0)
        assert resp.model == "tiny-chat"
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    await server.wait_idle(pinned_ok=True)


async def test_cached_tokens_on_a_repeated_prompt(server):
    c = client(server)
    ask = [{"role": "user", "content": f"{uuid.uuid4().hex}: " + "Name three colors of the sea. " * 10}]
    first = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, temperature=0)
    again = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached < again.usage.prompt_tokens
    await server.wait_idle(pinned_ok=True)


async def test_min_tokens_holds_off_eos_and_stop_strings(server):
    """vLLM's min_tokens: the greedy answer that ends by EOS after n tokens goes on to min_tokens, unchanged up to
    there; a stop string in the first min_tokens tokens' text does not end it either. Each request in a cache_salt of
    its own, so every run computes its prompt the same way. The question is one whose short greedy answer leads every
    runner-up token, EOS included, by a wide margin on both kernel paths (RTSERVE_VNNI=1 and 0): "What is the capital
    of France?" got a short answer on one path and a long French one on the other."""
    c = client(server)
    ask = [{"role": "user", "content": "What is the capital of Germany?"}]

    async def greedy(**extra):
        return await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=64, temperature=0,
                                               extra_body={"cache_salt": uuid.uuid4().hex, **extra})

    short = await greedy()
    n, text = short.usage.completion_tokens, short.choices[0].message.content
    assert short.choices[0].finish_reason == "stop" and n < 40 and "." in text    # ended by EOS
    longer = await greedy(min_tokens=n + 8)
    assert longer.usage.completion_tokens >= n + 8
    assert longer.choices[0].message.content.startswith(text)
    cut = await greedy(stop=["."])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(".")]
    held = await greedy(stop=["."], min_tokens=n + 8)
    content = held.choices[0].message.content
    assert content.startswith(text) and held.usage.completion_tokens >= n + 8
    assert held.choices[0].finish_reason == "length" or content.count(".") >= text.count(".")
    await server.wait_idle(pinned_ok=True)


def test_generation_config_sources(tmp_path):
    from gateway.generation_config import EMBEDDED_DEFAULTS, sampling_defaults

    assert sampling_defaults("auto", tmp_path, embedded=True) == EMBEDDED_DEFAULTS   # no generation_config.json
    assert sampling_defaults("auto", tmp_path, embedded=False) == {}
    assert sampling_defaults("vllm", tmp_path, embedded=True) == {}
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 0, "do_sample": true, "eos_token_id": 2}')
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": -1}
    assert sampling_defaults("auto", tmp_path, embedded=True) == want
    assert sampling_defaults(str(tmp_path), None, embedded=False) == want
    for bad in ('{"temperature": -1}', "[1]", "{oops"):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(ValueError, match="generation-config"):
            sampling_defaults("auto", tmp_path, embedded=False)
    with pytest.raises(ValueError, match="generation-config"):
        sampling_defaults(str(tmp_path / "missing"), None, embedded=False)


async def test_generation_defaults_fill_only_what_the_client_left_out(server, tmp_path):
    """The embedded model's defaults are in force on the product app; a generation config of temperature 0 makes a
    request without a temperature greedy, and a client's own temperature still wins over it."""
    from gateway.app import Settings, create_app
    from gateway.generation_config import EMBEDDED_DEFAULTS

    assert server.app.state.sampling_defaults == EMBEDDED_DEFAULTS
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.0}')
    app = create_app(Settings(generation_config=str(tmp_path), audio=False), engine=server.engine)
    c = client(server)
    for _ in range(2):   # the second reads the prompt from the cache, as the requests below do
        greedy = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    sampled = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, seed=5, temperature=1.0,
                                              top_p=1.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1/v1") as h:
        g = AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1/v1", http_client=h, max_retries=0)
        by_default = await g.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, seed=5)
        assert by_default.choices[0].message.content == greedy.choices[0].message.content
        own = await g.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, seed=5, temperature=1.0,
                                              top_p=1.0)
        assert own.choices[0].message.content == sampled.choices[0].message.content
    await server.wait_idle(pinned_ok=True)


async def test_realtime_responses_take_the_models_other_sampling_defaults(server):
    """With a generation config of temperature 1 and top_k 1 (every draw is the most likely token), a Realtime
    response that sets no temperature decodes what a greedy response (temperature 0) of the same conversation does:
    its top_k came from the model's defaults. Each session in a cache_salt of its own, so both compute the prompt
    alike."""
    from tests.gateway.realtime.client import open_raw

    state = server.app.state
    defaults, state.sampling_defaults = state.sampling_defaults, {"temperature": 1.0, "top_k": 1}
    answers = []
    try:
        for response in (None, {"temperature": 0}):
            raw = await open_raw(server, max_output_tokens=16,
                                 url=f"{server.realtime_url}?cache_salt={uuid.uuid4().hex}")
            await raw.say("Describe the sea in a few words.")
            text, done, _ = await raw.respond(response)
            assert done["status"] in ("completed", "incomplete") and text   # (incomplete: cut at 16 tokens)
            answers.append(text)
            await raw.ws.close()
    finally:
        state.sampling_defaults = defaults
    assert answers[0] == answers[1]
    await server.wait_idle(pinned_ok=True)


async def test_realtime_session_reports_the_served_name_and_default_temperature(server):
    """A Realtime session names the served model, whatever the client asked for, and starts at the model's default
    temperature (beta sessions show it); the client's own temperature wins."""
    from gateway.generation_config import EMBEDDED_DEFAULTS
    from tests.gateway.realtime.client import BETA_EVENTS, Raw

    ws = await websockets.connect(server.realtime_url + "?model=gpt-4o-realtime-preview", max_size=None,
                                  additional_headers={"OpenAI-Beta": "realtime=v1"})
    async with ws:
        raw = Raw(ws, BETA_EVENTS)
        created = (await raw.recv())["session"]
        assert created["temperature"] == EMBEDDED_DEFAULTS["temperature"]
        assert (await raw.recv())["type"] == "conversation.created"
        await raw.send({"type": "session.update", "session": {"temperature": 0.9}})
        assert (await raw.recv())["session"]["temperature"] == 0.9
    async with websockets.connect(server.realtime_url + "?model=gpt-realtime", max_size=None) as ws:
        assert (await Raw(ws).recv())["session"]["model"] == MODEL
