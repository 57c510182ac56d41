"""Validated HTTP requests (gateway/http_models.py, gateway/http_api.py) against the real server.

Every field of chat and completions gets a value of the wrong JSON type and, where it has a range or a set of values,
one outside it: each is a 400 in OpenAI's error shape naming the field in `param`, with no Python text, and none
reaches the engine. The crash cases of issue 21 are refused while a stream runs to its end. A body over the byte cap is
a 413, a prompt longer than the context by characters is refused before it is tokenized, `max_tokens` beyond the context
is a 400 naming the limit, a non-streaming request stops when its client goes, and unknown /v1 routes answer JSON.
Requests sent through the openai SDK where it sends the value as given, through httpx where it would change it
(`stream`)."""
from __future__ import annotations

import asyncio
import inspect

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from gateway.http_models import ChatCompletionRequest, CompletionRequest
from tests.gateway.realtime.client import open_raw

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's own name: what the test server serves
ABORTED_WITHIN = 256  # tokens an aborted request may still make between the client's leaving and the abort
MESSAGES = [{"role": "user", "content": "Say hi."}]
PYTHON_TEXT = ("Traceback", "<class", "NoneType", "pydantic", "Input should", "object has no attribute",
               "not supported between", "Error(", "validation error", "dict_type", "https://errors")

# field -> (a value of the wrong type, a value out of range or None, the param of the out-of-range error)
COMMON = {
    "model": (5, None, None),
    "max_tokens": ("16", 0, "max_tokens"),
    "temperature": ("hot", 2.5, "temperature"),
    "top_p": ("1", 0, "top_p"),
    "n": (1.5, 0, "n"),
    "stream": ("yes", None, None),
    "stream_options": ("x", {"include_usage": True, "extra": 1}, "stream_options.extra"),
    "stop": (1, ["s"] * 17, "stop"),
    "seed": ("7", 2**64, "seed"),
    "frequency_penalty": ([1], 2.5, "frequency_penalty"),
    "presence_penalty": ({"a": 1}, -2.5, "presence_penalty"),
    "logit_bias": ("x", {"15": 101}, "logit_bias.15"),
    "user": (5, None, None),
    "top_k": (1.5, 18446744073709551615, "top_k"),
    "min_p": ("0.1", 1.5, "min_p"),
    "repetition_penalty": (True, 0, "repetition_penalty"),
    "ignore_eos": ("true", None, None),
    "min_tokens": ("2", -1, "min_tokens"),
    "stop_token_ids": ("x", [-1], "stop_token_ids[0]"),
    "cache_salt": ({"a": 1}, "s" * 1025, "cache_salt"),
    "structured_outputs": ("json", None, None),
    "guided_json": (5, None, None),
    "guided_regex": (5, None, None),
    "guided_choice": ("a", None, None),
    "guided_grammar": (["root"], None, None),
}
CHAT = {
    **COMMON,
    "messages": ("hi", [], "messages"),
    "max_completion_tokens": (1.5, 0, "max_completion_tokens"),
    "logprobs": (1, None, None),
    "top_logprobs": ("2", 21, "top_logprobs"),
    "response_format": ("json", {"type": "xml"}, "response_format.type"),
    "tools": ({"type": "function"}, [{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
    "tool_choice": (5, "sometimes", "tool_choice"),
    "parallel_tool_calls": ("yes", None, None),
    "modalities": ("text", ["video"], "modalities[0]"),
    "audio": ("alloy", {"voice": "alloy", "format": "ogg"}, "audio.format"),
    "prediction": ("x", None, None),
    "functions": ({"name": "f"}, None, None),
    "function_call": (5, None, None),
    "web_search_options": ("on", None, None),
    "reasoning_effort": (1, None, None),
    "verbosity": (1, "loud", "verbosity"),
    "metadata": ("x", {"k": 1}, "metadata.k"),
    "store": ("no", None, None),
    "service_tier": (1, None, None),
    "safety_identifier": (1, None, None),
    "prompt_cache_key": (1, None, None),
    "prompt_cache_retention": (24, None, None),
    "prompt_cache_options": ("x", None, None),
    "moderation": ("x", None, None),
}
COMPLETIONS = {
    **COMMON,
    "prompt": (None, [], "prompt"),
    "logprobs": (True, 6, "logprobs"),
    "best_of": ("1", 0, "best_of"),
    "echo": ("no", None, None),
    "suffix": (5, None, None),
}
# nested fields: (fields, the param)
NESTED_CHAT = [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "messages[0].mood"),
    ({"messages": [5]}, "messages[0]"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5}}}, "response_format.json_schema.name"),
    ({"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice.function.name"),
]
UNSUPPORTED_CHAT = [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
                    ({"logit_bias": {"15": 5}}, "logit_bias"), ({"modalities": ["text", "audio"]}, "audio"),
                    ({"min_tokens": 5}, "min_tokens"),   # more than max_tokens (4)
                    ({"stream_options": {"include_usage": True}}, "stream_options"),
                    ({"messages": [{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
                     "messages[0].content[0].type")]
UNSUPPORTED_COMPLETIONS = [({"echo": True}, "echo"),
                           ({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
                           ({"prompt": ["one", 2]}, "prompt"), ({"prompt": ["one", ""]}, "prompt[1]"),
                           ({"min_tokens": 5}, "min_tokens"), ({"max_tokens": None, "min_tokens": 10**6}, "min_tokens")]
SDK_CHAT = set(inspect.signature(AsyncOpenAI(api_key="x").chat.completions.create).parameters)
SDK_COMPLETIONS = set(inspect.signature(AsyncOpenAI(api_key="x").completions.create).parameters)


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, max_retries=0)


def test_the_tables_cover_every_field():
    """A field added to a request model must be added to the table, so it is tested too."""
    assert set(CHAT) == {f.alias or n for n, f in ChatCompletionRequest.model_fields.items()}
    assert set(COMPLETIONS) == {f.alias or n for n, f in CompletionRequest.model_fields.items()}


async def _send(server, chat: bool, fields: dict) -> dict:
    """One request with `fields` over the defaults; returns the error object of its (required) 400."""
    body = {"model": MODEL, "max_tokens": 4, **({"messages": MESSAGES} if chat else {"prompt": "Hi"}), **fields}
    sdk = SDK_CHAT if chat else SDK_COMPLETIONS
    if "stream" in fields:   # the SDK picks its response type by `stream`: send the exact value with httpx
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(f"{server.base_url}/{'chat/completions' if chat else 'completions'}", json=body)
        assert r.status_code == 400, (fields, r.status_code, r.text)
        return r.json()["error"]
    known = {k: v for k, v in body.items() if k in sdk}
    extra = {k: v for k, v in body.items() if k not in sdk}
    api = client(server).chat.completions if chat else client(server).completions
    with pytest.raises(openai.BadRequestError) as info:
        await api.create(**known, extra_body=extra)
    assert info.value.status_code == 400
    return info.value.body


def _check(err: dict, param: str, code: str | None = None) -> None:
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert code is None or err["code"] == code, err
    assert param.split("[")[0].split(".")[0] in err["message"], err
    assert not any(t in err["message"] for t in PYTHON_TEXT), err


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_every_field_wrong_type_and_out_of_range_is_400_with_param(server, chat):
    table = CHAT if chat else COMPLETIONS
    before = await server.wait_idle(pinned_ok=True)
    for field, (wrong, out_of_range, param) in table.items():
        _check(await _send(server, chat, {field: wrong}), field, "invalid_type")
        if out_of_range is not None:
            _check(await _send(server, chat, {field: out_of_range}), param)
    for fields, param in (NESTED_CHAT if chat else []):
        _check(await _send(server, chat, fields), param)
    for fields, param in UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETIONS:
        _check(await _send(server, chat, fields), param)
    for missing in ("model", "messages" if chat else "prompt"):
        body = {"model": MODEL, "max_tokens": 4, **({"messages": MESSAGES} if chat else {"prompt": "Hi"})}
        del body[missing]
        async with httpx.AsyncClient(timeout=60) as h:
            r = await h.post(f"{server.base_url}/{'chat/completions' if chat else 'completions'}", json=body)
        assert r.status_code == 400
        _check(r.json()["error"], missing, "missing_required_parameter")
    _check(await _send(server, chat, {"frobnicate": 1}), "frobnicate", "unknown_parameter")
    _check(await _send(server, chat, {"priority": -10}), "priority", "unsupported_parameter")   # a vLLM extra
    after = await server.wait_idle(pinned_ok=True)
    assert after["num_steps"] == before["num_steps"], "a rejected request reached the engine"
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]


POISON = [  # issue 21: each of these reached the engine and failed its step for everyone (or was a 500)
    (True, {"cache_salt": {"a": 1}}, "cache_salt"),
    (True, {"stop": [["x"]]}, "stop[0]"),
    (True, {"top_k": 18446744073709551615}, "top_k"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    (True, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text"),
    (True, {"stream": True, "stream_options": "x"}, "stream_options"),
    (True, {"stop": [1]}, "stop[0]"),
    (False, {"cache_salt": {"a": 1}}, "cache_salt"),
    (False, {"stop": [["x"]]}, "stop[0]"),
    (False, {"top_k": 18446744073709551615}, "top_k"),
    (False, {"prompt": "Hi", "temperature": "hot"}, "temperature"),
]


async def test_poison_requests_are_400_while_streams_complete(server):
    """Each poison is refused while 4 HTTP streams and 4 Realtime responses are in flight (one poison after each chunk
    of the first stream), and every one of them ends as it would alone: each stream every token it asked for,
    finish_reason length; each Realtime response normally, with no error event."""
    base = await server.wait_idle(pinned_ok=True)
    raws = []
    for i in range(4):
        raw = await open_raw(server, max_output_tokens=64)
        await raw.say(f"Write a long story about the sea, number {i}.")
        await raw.send({"type": "response.create"})
        raws.append(raw)
    want = 2 * len(POISON)
    streams = [await client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell me about the sea, part {i}."}], max_tokens=want,
        seed=3, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for i in range(4)]

    async def drain(stream, poisons=None) -> tuple[list, object]:
        reasons, usage = [], None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            if poisons is not None and not reasons and (poison := next(poisons, None)) is not None:
                chat, fields, param = poison
                _check(await _send(server, chat, fields), param)
        return reasons, usage

    poisons = iter(POISON)
    results = await asyncio.gather(drain(streams[0], poisons), *(drain(s) for s in streams[1:]))
    assert next(poisons, None) is None, "the first stream ended before every poison was sent"
    for reasons, usage in results:
        assert reasons == ["length"] and usage.completion_tokens == want, (reasons, usage)
    for raw in raws:
        events = await raw.until("response.done")
        assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
        assert not [e for e in events if e["type"] == "error"]
        await raw.ws.close()
    await server.wait_idle(pages_used=base["kv_pages_used"])   # the sessions' pins released too


async def test_body_over_the_cap_is_413(server):
    from gateway.http_api import DEFAULT_MAX_REQUEST_BYTES

    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * DEFAULT_MAX_REQUEST_BYTES + b'"}'

    async def chunked():   # no Content-Length: refused while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    base = await server.wait_idle(pinned_ok=True)
    async with httpx.AsyncClient(timeout=60) as h:
        for content in (big, chunked()):
            r = await h.post(f"{server.base_url}/completions", content=content,
                             headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BYTES) in err["message"], err
    # the cap is the app's setting (`--max-request-bytes`)
    from gateway.app import Settings, create_app

    small = create_app(Settings(audio=False, max_request_bytes=1024), engine=server.engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=small), base_url="http://127.0.0.1") as h:
        r = await h.post("/v1/completions", json={"model": MODEL, "prompt": "a" * 1024, "max_tokens": 1})
        assert r.status_code == 413 and "1024 bytes" in r.json()["error"]["message"], r.text
    after = await server.wait_idle(pinned_ok=True)
    assert after["prompt_tokens_total"] == base["prompt_tokens_total"]


async def test_prompt_too_long_by_characters_and_max_tokens_beyond_the_context(server):
    """A prompt with more characters than the context can hold tokens of (the longest vocabulary entry times the
    context) is refused without reaching the engine; `max_tokens` beyond the context's room is a 400 naming it."""
    engine = server.engine
    context = engine.max_model_len
    longest = max(len(t) for t in engine.tokenizer.get_vocab())
    c = client(server)
    base = await server.wait_idle(pinned_ok=True)
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model=MODEL, prompt="a" * (context * longest + 1), max_tokens=4)
    _check(info.value.body, "prompt", "context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": "b" * (context * longest // 2 + 1)},
            {"role": "user", "content": "c" * (context * longest // 2 + 1)}])
    _check(info.value.body, "messages", "context_length_exceeded")
    assert (await server.wait_idle(pinned_ok=True))["prompt_tokens_total"] == base["prompt_tokens_total"]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES, **{field: context})
        _check(info.value.body, field, "invalid_value")
        assert str(context) in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model=MODEL, prompt="Hi", max_tokens=100_000)
    _check(info.value.body, "max_tokens", "invalid_value")


async def test_non_streaming_request_is_aborted_when_its_client_goes(server):
    """A non-streaming request with EOS ignored and no max_tokens would fill the whole context: when its client
    disconnects, the engine request ends a few steps later and everything it held is freed."""
    base = await server.wait_idle(pinned_ok=True)
    tokens = base["generated_tokens_total"]

    async def post():
        async with httpx.AsyncClient(timeout=600) as h:
            await h.post(f"{server.base_url}/chat/completions", json={
                "model": MODEL, "ignore_eos": True, "seed": 7,
                "messages": [{"role": "user", "content": "Write a very long essay about the ocean."}]})

    task = asyncio.create_task(post())
    while server.stats()["generated_tokens_total"] - tokens < 8:   # generating
        assert not task.done(), task
        await asyncio.sleep(0.02)
    assert server.stats()["requests_running"] == 1
    task.cancel()   # the client goes: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await task
    s = await server.wait_idle(pinned_ok=True)
    assert s["kv_pages_used"] == base["kv_pages_used"] and s["kv_pages_pinned"] == base["kv_pages_pinned"], (base, s)
    assert 8 <= s["generated_tokens_total"] - tokens < ABORTED_WITHIN


async def test_unknown_v1_routes_are_json_404_and_wrong_methods_405(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as info:
        await c.embeddings.create(model=MODEL, input="hi")
    assert info.value.body["code"] == "not_found" and "/v1/embeddings" in info.value.body["message"]
    async with httpx.AsyncClient(timeout=30) as h:
        for path in ("/v1/audio/translations", "/v1/responses", "/v1/nothing/here"):
            r = await h.post(f"{server.root_url}{path}", json={})
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (path, r.text)
        r = await h.get(f"{server.base_url}/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
        assert r.json()["error"]["code"] == "method_not_allowed"
        r = await h.delete(f"{server.base_url}/models")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await h.get(f"{server.base_url}/realtime")
        assert r.status_code == 426 and r.json()["error"]["code"] == "upgrade_required"
        r = await h.get(f"{server.root_url}/")
        assert r.status_code == 200 and "<html" in r.text.lower()
        r = await h.post(f"http://{server.auth_prefix}/v1/embeddings", json={})
        assert r.status_code == 401, r.text   # the key is checked first


async def test_neutral_and_advisory_fields_are_accepted(server):
    """What SDKs and OpenAI-targeted clients send by default is served: fields we do not implement at their neutral
    value, advisory fields, vLLM's extras; a temperature below vLLM's greedy threshold decodes greedily."""
    c = client(server)
    ask = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
           {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    greedy = await c.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
    r = await c.chat.completions.create(
        model=MODEL, messages=ask, max_completion_tokens=8, temperature=1e-9, n=1, logprobs=False, logit_bias={},
        modalities=["text"], user="u1", metadata={"k": "v"}, store=False, service_tier="auto",
        safety_identifier="s", prompt_cache_key="p", parallel_tool_calls=True, tool_choice="none",
        extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "min_tokens": 1, "cache_salt": "tenant-a",
                    "stop_token_ids": [], "ignore_eos": False})
    assert r.choices[0].message.content == greedy.choices[0].message.content
    r = await c.completions.create(model=MODEL, prompt=["Red, green,"], max_tokens=4, temperature=0, n=1, best_of=1,
                                   echo=False, logprobs=None, stop=["\n"], user="u1", seed=2**63 - 1)
    assert r.choices[0].text is not None and r.usage.completion_tokens <= 4
    # an assistant message the SDK gave back, as is, continues the conversation
    again = await c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        *ask, greedy.choices[0].message.model_dump(), {"role": "user", "content": "Another?"}])
    assert again.usage.prompt_tokens > greedy.usage.prompt_tokens
