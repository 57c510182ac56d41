"""Tool calling on /v1/chat/completions with the official openai SDK against the real engine (SmolLM2, whose chat
template does not take tools, so the gateway's own tool prompt and the Hermes-style call format of gateway/tools.py):
required / named / auto, non-streaming and streamed, a round trip with a tool result, and 400s with `param` for bad
tool input with the engine back to idle after them.

Sampled requests carry a `seed`; every assertion holds for every sample."""
from __future__ import annotations

import json
import re
import uuid

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from gateway import tools as tl

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's own name: what the test server serves
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone.",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="x", base_url=server.base_url)


def check_calls(calls, names=("get_weather", "get_time")) -> list[tuple[str, dict]]:
    """Every call is a known tool whose arguments validate against its schema; returns (name, arguments)."""
    assert calls, "no tool call"
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_"), c
        assert c.function.name in names, c.function.name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    assert len({c.id for c in calls}) == len(calls)
    return out


async def collect_stream(stream):
    """Reassemble a streamed chat completion from its chunks: content, calls by index, finish reasons."""
    content, calls, reasons = [], {}, []
    async for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                content.append(ch.delta.content)
            for tc in ch.delta.tool_calls or ():
                if tc.index not in calls:   # the first chunk of a call names it
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return "".join(content), [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("tool_choice", ["required", "named"])
async def test_forced_call_parsed_by_sdk_and_schema_valid(server, tool_choice):
    c = client(server)
    choice = NAMED if tool_choice == "named" else "required"
    names = ("get_weather",) if tool_choice == "named" else ("get_weather", "get_time")
    for seed in range(4):
        r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                                            max_tokens=200, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content is None, ch.message.content
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls, names)
    # parallel calls allowed (the default): one or more calls, each valid, unless the budget cut the last one
    for seed in range(2):
        r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed,
                                            max_tokens=200)
        ch = r.choices[0]
        calls = ch.message.tool_calls
        if ch.finish_reason == "length":
            calls = calls[:-1] or None
        else:
            assert ch.finish_reason == "tool_calls", ch
        if calls:
            check_calls(calls, names)
    await server.wait_idle(pinned_ok=True)
    assert server.stats()["structured_requests"] == 0


async def test_streamed_call_reassembles_to_the_same_call(server):
    c = client(server)
    for seed in range(3):
        kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed, max_tokens=200,
                      parallel_tool_calls=False)
        whole = await c.chat.completions.create(**kwargs)
        content, calls, reasons = await collect_stream(await c.chat.completions.create(stream=True, **kwargs))
        assert content == "" and reasons == ["tool_calls"], (content, reasons)
        assert len(calls) == 1
        args = json.loads(calls[0]["arguments"])
        jsonschema.validate(args, SCHEMAS[calls[0]["name"]])
        ref = whole.choices[0].message.tool_calls[0].function   # same seed, same tokens: the same call
        assert (calls[0]["name"], calls[0]["arguments"]) == (ref.name, ref.arguments)
    # the SDK's stream helper assembles the same call from the chunks
    async with c.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=7,
                                         max_tokens=200, parallel_tool_calls=False) as stream:
        final = await stream.get_final_completion()
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    assert [n for n, _ in check_calls(ch.message.tool_calls, ("get_weather",))] == ["get_weather"]


async def test_auto_is_text_or_a_valid_call(server):
    c = client(server)
    asks = [ASK, [{"role": "user", "content": "Tell me a one-line joke."}]]
    for seed in range(4):
        for messages in asks:
            r = await c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=seed,
                                                max_tokens=150)
            ch = r.choices[0]
            assert "<tool_call>" not in (ch.message.content or ""), ch.message.content
            if ch.message.tool_calls:
                assert ch.finish_reason in ("tool_calls", "length"), ch
                complete = ch.message.tool_calls if ch.finish_reason == "tool_calls" else ch.message.tool_calls[:-1]
                if complete:   # a call cut by max_tokens is the last one
                    check_calls(complete)
            else:
                assert ch.finish_reason in ("stop", "length") and isinstance(ch.message.content, str), ch
            content, calls, reasons = await collect_stream(await c.chat.completions.create(
                model=MODEL, messages=messages, tools=TOOLS, seed=seed, max_tokens=150, stream=True))
            assert "<tool_call" not in content and "</tool_call" not in content, content
            assert content == (ch.message.content or "")
            assert [(x["name"], x["arguments"]) for x in calls] == \
                [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or ()]
            assert reasons == [ch.finish_reason]


def few_shot(n: int) -> list[dict]:
    """n earlier weather turns (call, result, answer), then a new weather question."""
    msgs = []
    for i, city in enumerate(["London", "Rome", "Madrid", "Paris", "Vienna", "Lisbon"][:n]):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}
        msgs += [{"role": "user", "content": f"What's the weather in {city}?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": "20 degrees, cloudy"},
                 {"role": "assistant", "content": f"It is 20 degrees and cloudy in {city}."}]
    return msgs + [{"role": "user", "content": "What's the weather in Berlin?"}]


async def test_auto_opens_a_call_the_grammar_completes(server):
    """SmolLM2-135M rarely calls on its own; after six earlier tool turns it does (greedy), and the call the
    grammar completes comes back parsed, non-streamed and streamed alike. Why six: after three, `<tool_call>` led
    `<tool_response>` (a copy of the results it had seen) by a near tie, which int8 activations or a prefix-cache hit
    could turn over; after six the lead holds on both kernel paths by far more than they move logits. Each request
    in a cache_salt of its own, so every run computes its prompt the same way."""
    c = client(server)
    kwargs = dict(model=MODEL, messages=few_shot(6), tools=TOOLS, temperature=0, max_tokens=100)
    r = await c.chat.completions.create(**kwargs, extra_body={"cache_salt": uuid.uuid4().hex})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    assert check_calls(ch.message.tool_calls) == [("get_weather", {"city": "Berlin", "unit": "celsius"})]
    content, calls, reasons = await collect_stream(await c.chat.completions.create(
        stream=True, **kwargs, extra_body={"cache_salt": uuid.uuid4().hex}))
    assert (content, reasons) == ("", ["tool_calls"])
    ref = ch.message.tool_calls[0].function
    assert [(x["name"], x["arguments"]) for x in calls] == [(ref.name, ref.arguments)]


def rendered(server, messages, tool_req) -> tuple[str, list[int]]:
    """The prompt as the app renders it (its own renderer and tools module)."""
    renderer = server.app.state.renderer
    msgs, template_tools = tl.render(messages, tool_req, renderer.takes_tools())
    text = renderer.template(msgs, tools=template_tools)
    return text, renderer.encode(text)


async def test_round_trip_with_tool_result(server):
    c = client(server)
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees and sunny"}]
    r = await c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=300)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.tool_calls is None and ch.message.content, ch
    assert not server.app.state.renderer.takes_tools()   # SmolLM2: our own tool turns
    flat = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": "call_abc123"}]
    text, ids = rendered(server, flat, tl.parse_request({"tools": TOOLS, "tool_choice": "none"}))
    assert r.usage.prompt_tokens == len(ids)
    assert ('<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}</tool_call><|im_end|>') in text, text
    assert "<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response><|im_end|>" in text, text
    assert "Function result" not in text and "<tools>" not in text   # none: no tool definitions rendered
    # auto: the definitions are in the system message, and the answer is text or a valid call
    r = await c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=300)
    text, ids = rendered(server, flat, tl.parse_request({"tools": TOOLS}))
    assert r.usage.prompt_tokens == len(ids)
    assert text.startswith("<|im_start|>system\n") and '<tools>\n{"type": "function", "function": {"name": ' \
        '"get_weather"' in text
    ch = r.choices[0]
    if ch.message.tool_calls:
        check_calls(ch.message.tool_calls)
    else:
        assert ch.finish_reason in ("stop", "length") and ch.message.content


async def test_tools_change_the_prompt(server):
    c = client(server)
    plain = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, temperature=0)
    with_tools = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=1, temperature=0)
    _, ids = rendered(server, ASK, tl.parse_request({"tools": TOOLS, "tool_choice": "required"}))
    assert with_tools.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens + 50


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
BAD = [  # (request fields, the param the 400 names)
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "nope"}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "book_flight"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"extra_body": {"tools": TOOLS[0]}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": ASK + [{"role": "tool", "content": "18 degrees"}]}, "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nowhere", "content": "18 degrees"}]},
     "messages[1].tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                               "function": {"name": "get_weather"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
]


async def test_bad_tool_input_is_400_with_param_and_leaves_nothing_running(server):
    c = client(server)
    before = await server.wait_idle(pinned_ok=True)
    for fields, param in BAD:
        fields = {"messages": ASK, **fields}
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, max_tokens=8, **fields)
        assert info.value.body["param"] == param, (fields, info.value.body)
    after = await server.wait_idle(pinned_ok=True)
    assert after["num_steps"] == before["num_steps"], "a rejected request reached the engine"
    assert after["prompt_tokens_total"] == before["prompt_tokens_total"]
    assert after["structured_requests"] == 0 and after["requests_running"] == 0
    assert after["kv_pages_used"] == before["kv_pages_used"]
    metrics = server.metrics_text()
    assert re.search(r"^rtserve_requests_running 0\.0$", metrics, re.M)
    # the server serves on
    r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200,
                                        temperature=0, parallel_tool_calls=False)
    check_calls(r.choices[0].message.tool_calls, ("get_weather",))


# --- The model's own call format: Llama 3.1's template and llama3_json, and --no-enable-auto-tool-choice -------------

@pytest.fixture(scope="module")
def llama_server(server):
    """The product app on the shared engine (SmolLM2's weights) with Llama 3.1's chat template (`--chat-template`), so
    the tool-call parser is detected as llama3_json; and under /noauto the default app with
    `--no-enable-auto-tool-choice`. Its own uvicorn thread; the engine stays the session's."""
    import threading
    import time

    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from gateway.app import Settings, create_app
    from tests.conftest import Server, _free_port
    from tests.gateway.test_tools import LLAMA31_TEMPLATE

    app = create_app(Settings(chat_template=LLAMA31_TEMPLATE, audio=False), engine=server.engine)
    noauto = create_app(Settings(enable_auto_tool_choice=False, audio=False), engine=server.engine)
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(Starlette(routes=[Mount("/noauto", app=noauto), Mount("/", app=app)]),
                                       host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, name="test-uvicorn-llama", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the Llama-template server did not start"
        time.sleep(0.05)
    yield Server("127.0.0.1", port, server.engine, app)
    uv.should_exit = True
    thread.join(timeout=10)


async def test_llama31_template_forced_calls_streamed_and_not(llama_server):
    assert llama_server.app.state.tool_call_parser == "llama3_json"
    c = client(llama_server)
    _, ids = rendered(llama_server, ASK, tl.parse_request({"tools": TOOLS, "tool_choice": "required"}))
    for choice, names in (("required", ("get_weather", "get_time")), (NAMED, ("get_weather",))):
        for seed in range(3):
            kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=200)
            r = await c.chat.completions.create(**kwargs)
            ch = r.choices[0]
            assert r.usage.prompt_tokens == len(ids)   # rendered by Llama 3.1's template, tools in the user turn
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            assert len(ch.message.tool_calls) == 1   # the template's one call per turn
            (name, _), = check_calls(ch.message.tool_calls, names)
            content, calls, reasons = await collect_stream(await c.chat.completions.create(stream=True, **kwargs))
            assert (content, reasons) == ("", ["tool_calls"])
            ref = ch.message.tool_calls[0].function   # same seed, same tokens: the same call
            assert [(x["name"], x["arguments"]) for x in calls] == [(ref.name, ref.arguments)]
    await llama_server.wait_idle(pinned_ok=True)
    assert llama_server.stats()["structured_requests"] == 0


async def test_llama31_template_auto_and_round_trip(llama_server):
    c = client(llama_server)
    for seed in range(3):   # auto: text, or a call the grammar completes; no call JSON in the content either way
        r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, seed=seed, max_tokens=120)
        ch = r.choices[0]
        assert '"parameters"' not in (ch.message.content or ""), ch.message.content
        if ch.finish_reason == "tool_calls":
            check_calls(ch.message.tool_calls)
        else:
            assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None, ch
    call = {"id": "call_abc123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_abc123", "content": "18 degrees and sunny"}]
    r = await c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=60)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.tool_calls is None and ch.message.content, ch
    flat = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                  {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": "call_abc123"}]
    text, ids = rendered(llama_server, flat, tl.parse_request({"tools": TOOLS, "tool_choice": "none"}))
    assert r.usage.prompt_tokens == len(ids)
    # the call as Llama 3.1 writes it, the result as its ipython turn
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": '
            '"Paris", "unit": "celsius"}}<|eot_id|>') in text, text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 degrees and sunny"<|eot_id|>' in text, text
    # two calls in one assistant turn: the template refuses them, a 400 and not a 500
    two = ASK + [{"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_2"}]}]
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model=MODEL, messages=two, tools=TOOLS, max_tokens=8)
    assert info.value.body["param"] == "messages" and "single tool-calls" in info.value.body["message"]


async def test_auto_tool_choice_disabled_is_vllms_400(llama_server):
    c = AsyncOpenAI(api_key="x", base_url=f"{llama_server.root_url}/noauto/v1")
    before = await llama_server.wait_idle(pinned_ok=True)
    for fields in ({}, {"tool_choice": "auto"}):   # auto is also the default when tools are sent
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, **fields)
        assert info.value.body["param"] == "tool_choice"
        assert '"auto" tool choice requires --enable-auto-tool-choice' in info.value.body["message"]
    after = await llama_server.wait_idle(pinned_ok=True)
    assert after["num_steps"] == before["num_steps"], "a rejected request reached the engine"
    # the forced choices do not need it
    r = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200,
                                        temperature=0, parallel_tool_calls=False)
    check_calls(r.choices[0].message.tool_calls, ("get_weather",))
    r = await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)   # no tools: as before
    assert r.choices[0].message.content is not None

