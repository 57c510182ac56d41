"""OpenAI HTTP API and /metrics against the real engine, through the official openai SDK and httpx.

Every request that asserts on what the model says is greedy (temperature 0) or seeded, so no draw of the sampler can
pass or fail it."""
from __future__ import annotations

import httpx
import openai
import pytest
from openai import AsyncOpenAI

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's own name: what the test server serves
METRIC_NAMES = ["rtserve_sessions_active", "rtserve_requests_running", "rtserve_requests_waiting",
                "rtserve_kv_pages_total", "rtserve_kv_pages_used", "rtserve_kv_pages_cached",
                "rtserve_prefix_cache_queries_total", "rtserve_prefix_cache_hits_total",
                "rtserve_generated_tokens_total", "rtserve_time_to_first_token_seconds_bucket",
                "rtserve_inter_token_latency_seconds_bucket"]
ABORTED_WITHIN = 256  # tokens an aborted request may still make between the client's leaving and the abort


def client(server, **kw) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, **kw)


async def test_chat_completions_non_streaming(server):
    resp = await client(server).chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a planet."}])
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl_")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens > 10
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


async def test_chat_completions_streaming(server):
    stream = await client(server).chat.completions.create(
        model=MODEL, max_tokens=16, seed=7, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello."}])
    text, reasons, usage = [], [], None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(text).strip() and len(reasons) == 1
    assert usage is not None and usage.completion_tokens >= 1


async def test_completions_and_models(server):
    c = client(server)
    resp = await c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.object == "text_completion" and resp.choices[0].text
    assert resp.usage.completion_tokens <= 8
    chunks = [ch async for ch in await c.completions.create(model=MODEL, prompt="One, two,", max_tokens=6,
                                                             seed=7, stream=True)]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)
    models = await c.models.list()
    assert models.data[0].id == server.engine.model_name and "whisper-1" in [m.id for m in models.data]


async def test_completions_answer_a_batch_of_prompts(server):
    """`prompt` as an array of prompts (strings or token-id arrays), as the SDK types it and vLLM serves it: n choices
    per prompt, choice k * n + j being prompt k's sample j, and usage counting each prompt once."""
    c = client(server)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a"]
    alone = [await c.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0) for text in prompts]
    resp = await c.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0, n=2)
    assert [ch.index for ch in resp.choices] == list(range(6))
    assert all("Paris" in ch.text for ch in resp.choices[:2]) and all(" 5" in ch.text for ch in resp.choices[2:4])
    assert all(ch.text and ch.finish_reason == "length" for ch in resp.choices)
    assert resp.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert resp.usage.completion_tokens == 6 * 4

    ids = [[504, 3458, 282], [19556]]
    texts, reasons, usage = {}, {}, None
    async for chunk in await c.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, stream=True,
                                                  stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert set(texts) == set(reasons) == {0, 1} and all(texts.values())
    assert usage.prompt_tokens == 4 and usage.completion_tokens == 6

    async with httpx.AsyncClient(timeout=60) as h:
        async def refused(prompt, **kw) -> dict:
            r = await h.post(f"{server.base_url}/completions", json={"model": MODEL, "prompt": prompt,
                                                                      "max_tokens": 2, **kw})
            assert r.status_code == 400, r.text
            return r.json()["error"]
        assert (await refused(["a", 7]))["param"] == "prompt"          # strings and token ids mixed
        assert (await refused(["a", ""]))["param"] == "prompt[1]"
        assert (await refused(["a", []]))["param"] == "prompt[1]"
        assert (await refused(["a"] * 65, n=2))["param"] == "prompt"   # more than 128 choices
        err = await refused(["a", " b" * 9000])                       # one prompt of the batch over the context
        assert err["param"] == "prompt[1]" and err["code"] == "context_length_exceeded"
        # refused by the engine as it starts, beside a prompt that is running: that one is aborted
        assert "token ids" in (await refused(["The sky is", [10**6]], max_tokens=64))["message"]
    resp = await c.completions.create(model=MODEL, prompt=prompts[:1], max_tokens=4, temperature=0)
    assert "Paris" in resp.choices[0].text


async def test_http_errors_and_auth(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model=MODEL, messages=[])
    assert info.value.body["code"] == "invalid_value" and info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(model=MODEL, max_tokens=4, temperature=-3,
                                        messages=[{"role": "user", "content": "hi"}])
    async with httpx.AsyncClient() as h:
        r = await h.post(f"{server.base_url}/chat/completions", content=b"{oops")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await h.post(f"{server.base_url}/completions", json={"model": MODEL, "prompt": "Hi", "seed": 2**70})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed" and str(2**70) in r.text   # > 64 bits
        assert (await h.get(f"{server.root_url}/health")).json()["status"] == "ok"
    keyed = f"http://{server.auth_prefix}/v1"
    with pytest.raises(openai.AuthenticationError):
        await AsyncOpenAI(api_key="wrong", base_url=keyed).models.list()
    models = await AsyncOpenAI(api_key=server.api_key, base_url=keyed).models.list()
    assert models.data[0].id == server.engine.model_name


async def test_metrics_exposition(server):
    await client(server).chat.completions.create(model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
                                                 messages=[{"role": "user", "content": "Hi"}])
    await server.wait_idle(pinned_ok=True)
    text = server.metrics_text()
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "{" not in line}
    stats = server.stats()
    assert values["rtserve_kv_pages_total"] == stats["kv_pages_total"]
    assert values["rtserve_generated_tokens_total"] >= 4
    assert values["rtserve_prefix_cache_queries_total"] >= values["rtserve_prefix_cache_hits_total"]
    assert 'rtserve_time_to_first_token_seconds_count{api="http"}' in text


async def test_web_demo_served_at_root(server):
    async with httpx.AsyncClient() as h:
        r = await h.get(f"{server.root_url}/")
    assert r.status_code == 200 and "<html" in r.text.lower()


async def test_streaming_client_disconnect_aborts(server):
    """A streaming client that goes away ends its engine request: with EOS ignored and a limit the test would wait
    minutes for, only the abort stops it. The token count stops growing and the gauges are back where they were."""
    base = await server.wait_idle(pinned_ok=True)
    tokens = base["generated_tokens_total"]
    async with httpx.AsyncClient(timeout=60) as h:
        async with h.stream("POST", f"{server.base_url}/chat/completions", json={
                "model": MODEL, "stream": True, "ignore_eos": True, "seed": 7,   # no max_tokens: the whole context
                "messages": [{"role": "user", "content": "Write a very long essay about the ocean."}]}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
                    seen += 1
                    if seen == 8:
                        break
            live = server.stats()
            assert live["requests_running"] == 1, live  # still generating when the client leaves
    s = await server.wait_idle(pinned_ok=True)
    assert s["kv_pages_used"] == base["kv_pages_used"] and s["kv_pages_pinned"] == base["kv_pages_pinned"], (base, s)
    generated = s["generated_tokens_total"] - tokens
    assert 8 <= generated < ABORTED_WITHIN, generated   # stopped a few steps after the client left
