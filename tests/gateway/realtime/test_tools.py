"""Realtime function calls against the real engine (SmolLM2, our own tool prompt and the Hermes-style call format of
gateway/tools.py): the official openai SDK in both dialects, a spoken turn, openai-agents' RealtimeAgent, out-of-band
responses, the prefix cache across tool turns, and bad tool input answered with `error` events naming `param`.

Every server event is validated against the SDK's types. Decoding is greedy (temperature 0) or constrained by the
tool_choice grammar, so every assertion holds for every run."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from tests.gateway.realtime.client import BETA_EVENTS, GA_EVENTS, PCM16, VOICE_SESSION, expect_error, open_raw, \
    open_voice, send_speech, utterance
from tests.gateway.realtime.test_session import collapse, recv_validated, sdk_client

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
               "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
          "parameters": WEATHER_PARAMS},
         {"type": "function", "name": "get_time", "description": "Current time in a timezone.",
          "parameters": TIME_PARAMS}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = "What's the weather like in Paris right now?"
RESULT = json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})
CALL_MARKUP = re.compile(r"<tool_call>|</tool_call>|\"arguments\"")

CALL_SEQUENCE = {"ga": ["response.created", "rate_limits.updated", "response.output_item.added",
                        "conversation.item.added", "response.function_call_arguments.delta",
                        "response.function_call_arguments.done", "response.output_item.done",
                        "conversation.item.done", "response.done"],
                 "beta": ["response.created", "rate_limits.updated", "response.output_item.added",
                          "conversation.item.created", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.done"]}


def check_call(item: dict, names=("get_weather", "get_time")) -> dict:
    """A completed function_call item of a known tool whose arguments validate against its schema."""
    assert item["type"] == "function_call" and item["status"] == "completed", item
    assert item["name"] in names and item["call_id"].startswith("call_"), item
    args = json.loads(item["arguments"])
    jsonschema.validate(args, SCHEMAS[item["name"]])
    return args


def check_call_events(events: list[dict], item: dict, index: int = 0) -> None:
    """The call's streamed arguments add up to the item's, and its .done carries call_id, name and arguments."""
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item["id"]]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done" and e["item_id"] == item["id"]]
    assert "".join(e["delta"] for e in deltas) == item["arguments"]
    assert all(e["call_id"] == item["call_id"] and e["output_index"] == index for e in deltas + done)
    assert len(done) == 1 and done[0]["arguments"] == item["arguments"] and done[0]["name"] == item["name"]


async def sdk_events_until(conn, adapter, seen: list, etype: str) -> list[dict]:
    events = []
    while True:
        events.append(await recv_validated(conn, adapter, seen))
        if events[-1]["type"] == etype:
            return events


@pytest.mark.parametrize("dialect,choice", [("ga", "required"), ("ga", "named"), ("beta", "required"),
                                            ("beta", "named")])
async def test_sdk_function_call_round_trip(server, dialect, choice):
    """call → function_call_output → answer, through the official SDK; every event validates against its types."""
    beta = dialect == "beta"
    adapter = BETA_EVENTS if beta else GA_EVENTS
    client = sdk_client(server)
    connect = client.beta.realtime.connect if beta else client.realtime.connect
    tool_choice = {"type": "function", "name": "get_weather"} if choice == "named" else "required"
    seen: list = []
    async with connect(model="gpt-realtime") as conn:
        await sdk_events_until(conn, adapter, seen, "conversation.created" if beta else "session.created")
        session = {"instructions": "You are a helpful assistant. Use the tools.", "tools": TOOLS,
                   "tool_choice": "auto"}
        session |= ({"modalities": ["text"], "max_response_output_tokens": 120} if beta else
                    {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 120})
        await conn.session.update(session=session)
        updated = (await sdk_events_until(conn, adapter, seen, "session.updated"))[-1]
        assert [t["name"] for t in updated["session"]["tools"]] == ["get_weather", "get_time"]
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": ASK}]})
        await sdk_events_until(conn, adapter, seen, "conversation.item.created" if beta else "conversation.item.done")
        await conn.response.create(response={"tool_choice": tool_choice, "parallel_tool_calls": False,
                                             "temperature": 0})
        events = await sdk_events_until(conn, adapter, seen, "response.done")
        assert collapse([e["type"] for e in events]) == CALL_SEQUENCE[dialect], [e["type"] for e in events]
        response = events[-1]["response"]
        assert response["status"] == "completed" and len(response["output"]) == 1, response
        call = response["output"][0]
        check_call(call, ("get_weather",) if choice == "named" else ("get_weather", "get_time"))
        check_call_events(events, call)
        added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
        assert added["type"] == "function_call" and added["status"] == "in_progress" and added["id"] == call["id"]
        # the tool's result, then the answer that uses it
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": RESULT})
        created = await sdk_events_until(conn, adapter, seen,
                                          "conversation.item.created" if beta else "conversation.item.done")
        assert created[-1]["item"]["type"] == "function_call_output"
        await conn.response.create(response={"temperature": 0})   # the session's tool_choice: auto
        events = await sdk_events_until(conn, adapter, seen, "response.done")
        follow_up = events[-1]["response"]
        assert follow_up["status"] == "completed" and len(follow_up["output"]) == 1, follow_up
        text = follow_up["output"][0]["content"][0]["text"]
        # SmolLM2-135M is not trained on tool use: its answer restates the result (greedy, the same every run)
        assert "21" in text and not CALL_MARKUP.search(text), text
        # the follow-up extends the tool turn's prompt (tools in the system message, the call as the model wrote
        # it): every full block of that prompt comes from the prefix cache
        bs = block_size(server)
        cached = follow_up["usage"]["input_token_details"]["cached_tokens"]
        assert cached >= response["usage"]["input_tokens"] // bs * bs, (cached, response["usage"])
    assert len({e["event_id"] for e in seen}) == len(seen)
    await server.wait_idle(pinned_ok=True)


def block_size(server) -> int:
    return getattr(getattr(getattr(server.engine, "engine", None), "args", None), "block_size", 16)


async def test_out_of_band_responses_with_tools(server):
    """`conversation: "none"` with `input` items: the call comes back in response.done only, and a second
    out-of-band response with the call and its output answers; the conversation never changes."""
    raw = await open_raw(server, max_output_tokens=120)
    ask = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}
    await raw.send({"type": "response.create", "response": {
        "conversation": "none", "input": [ask], "tools": TOOLS, "tool_choice": "required",
        "parallel_tool_calls": False, "temperature": 0, "metadata": {"topic": "weather"}}})
    events = await raw.until("response.done")
    assert not [e for e in events if e["type"].startswith("conversation.") or e["type"] == "error"], events
    response = events[-1]["response"]
    assert response["conversation_id"] is None and response["status"] == "completed", response
    assert len(response["output"]) == 1
    call = response["output"][0]
    check_call(call)
    check_call_events(events, call)
    await raw.send({"type": "response.create", "response": {
        "conversation": "none", "tools": TOOLS, "temperature": 0,
        "input": [ask, {k: call[k] for k in ("type", "call_id", "name", "arguments")},
                  {"type": "function_call_output", "call_id": call["call_id"], "output": RESULT}]}})
    events = await raw.until("response.done")
    assert not [e for e in events if e["type"].startswith("conversation.") or e["type"] == "error"], events
    answer = events[-1]["response"]
    assert answer["status"] == "completed" and answer["output"][0]["type"] == "message", answer
    text = answer["output"][0]["content"][0]["text"]
    assert "21" in text and not CALL_MARKUP.search(text), text
    # the session's own conversation is still empty: a function_call_output there answers no call
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "late", "item": {
        "type": "function_call_output", "call_id": call["call_id"], "output": RESULT}},
        "invalid_value", "item.call_id", "late")
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)


async def test_spoken_turn_with_a_required_call_speaks_no_json(server):
    """Speech in, tool_choice required: the automatic response is a function_call item whose arguments validate, and
    nothing of it is spoken (TTS only ever gets the text part, and there is none)."""
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 120, "tools": TOOLS,
                                    "tool_choice": "required", "parallel_tool_calls": False})
    pcm, _, _ = utterance("what is the weather in paris", PCM16)
    await raw.stream(pcm, PCM16)
    events = await raw.until("response.done")
    transcript = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert "weather" in transcript["transcript"].lower(), transcript
    response = events[-1]["response"]
    assert response["status"] == "completed" and [i["type"] for i in response["output"]] == ["function_call"]
    check_call(response["output"][0])
    check_call_events(events, response["output"][0])
    spoken = [e for e in events if e["type"].startswith("response.output_audio")
              or e["type"].startswith("response.content_part")]
    assert not spoken, spoken
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}
BAD_PATTERN = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}  # a valid schema xgrammar refuses


def tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "name": name, "parameters": parameters}


async def test_bad_tool_input_is_an_error_event_and_the_session_goes_on(server):
    before = await server.wait_idle(pinned_ok=True)
    raw = await open_raw(server, max_output_tokens=120)
    await raw.send({"type": "session.update", "session": {"type": "realtime", "tools": TOOLS}})
    assert (await raw.recv())["type"] == "session.updated"
    bad_events = [  # (event, code, param): each answered by one error event, nothing else
        ({"type": "session.update", "session": {"tools": [TOOLS[0], tool(BAD_SCHEMA)]}}, "session.tools[1].parameters"),
        ({"type": "session.update", "session": {"tools": [tool(BAD_PATTERN)]}}, "session.tools[0].parameters"),
        ({"type": "session.update", "session": {"tools": [tool({}, "bad name")]}}, "session.tools[0].name"),
        ({"type": "session.update", "session": {"tools": [tool({}), tool({})]}}, "session.tools[1].name"),
        ({"type": "session.update", "session": {"tool_choice": {"type": "function", "name": "nope"}}},
         "session.tool_choice"),
        ({"type": "session.update", "session": {"tools": [TOOLS[1]],
                                                "tool_choice": {"type": "function", "name": "get_weather"}}},
         "session.tool_choice"),
        ({"type": "response.create", "response": {"tools": [tool(BAD_SCHEMA)]}}, "response.tools[0].parameters"),
        ({"type": "response.create", "response": {"tool_choice": {"type": "function", "name": "nope"}}},
         "response.tool_choice"),
        ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_missing",
                                                       "output": "18 degrees"}}, "item.call_id"),
        ({"type": "response.create", "response": {"conversation": "none", "input": [
            {"type": "function_call_output", "call_id": "call_missing", "output": "18 degrees"}]}},
         "response.input[0].call_id"),
    ]
    for i, (event, param) in enumerate(bad_events):
        await expect_error(raw, {**event, "event_id": f"bad{i}"}, "invalid_value", param, f"bad{i}")
    # a schema that is valid JSON Schema but that the grammar compiler refuses: the response fails, naming the tool
    await raw.send({"type": "response.create", "event_id": "uncompilable",
                    "response": {"tools": [TOOLS[0], tool(UNCOMPILABLE)], "tool_choice": "required"}})
    events = await raw.until("response.done")
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["param"]) for e in errors] == [("invalid_value", "response.tools[1].parameters")], errors
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["output"] == []
    # one function call item too long for the context alone: its arguments, then a tool output
    huge = " ".join(["weather"] * (server.engine.max_model_len * 2))
    for item, param in (({"type": "function_call", "call_id": "call_big", "name": "get_weather",
                          "arguments": json.dumps({"city": huge})}, "item.arguments"),
                        ({"type": "function_call_output", "call_id": "call_big", "output": huge}, "item.output")):
        await raw.send({"type": "conversation.item.create", "item": {**item, "id": f"item_{param[5:]}"}})
        await raw.until("conversation.item.done")
        if param == "item.output":
            await raw.send({"type": "conversation.item.delete", "item_id": "item_arguments"})
            await raw.until("conversation.item.deleted")
            await raw.send({"type": "conversation.item.create", "item": {
                "type": "function_call", "call_id": "call_big", "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}'}, "previous_item_id": "root"})
            await raw.until("conversation.item.done")
        await raw.send({"type": "response.create"})
        events = await raw.until("response.done")
        errors = [e["error"] for e in events if e["type"] == "error"]
        assert [(e["code"], e["param"]) for e in errors] == [("context_length_exceeded", param)], errors
        assert events[-1]["response"]["status"] == "failed"
    await raw.send({"type": "conversation.item.delete", "item_id": "item_output"})
    await raw.until("conversation.item.deleted")
    # the session goes on, its tools as they were before the rejected updates
    await raw.send({"type": "session.update", "session": {"instructions": "You are a helpful assistant."}})
    updated = (await raw.until("session.updated"))[-1]["session"]
    assert updated["tools"] == TOOLS and updated["tool_choice"] == "auto"
    await raw.say(ASK)
    _, response, events = await raw.respond({"tool_choice": "required", "parallel_tool_calls": False,
                                             "temperature": 0})
    assert response["status"] == "completed" and not [e for e in events if e["type"] == "error"]
    check_call(response["output"][0])
    await raw.ws.close()
    after = await server.wait_idle()
    assert after["structured_requests"] == 0 and after["requests_running"] == 0
    assert after["kv_pages_used"] <= before["kv_pages_used"]
    assert re.search(r"^rtserve_requests_running 0\.0$", server.metrics_text(), re.M)


@pytest.mark.parametrize("spoken", [False, True])
async def test_openai_agents_realtime_agent_runs_a_function_tool(server, spoken):
    """openai-agents' RealtimeAgent with a @function_tool and tool_choice "required", typed or spoken (speech in,
    server VAD, spoken replies): the SDK runs the tool with the arguments the server streamed (schema-valid), sends
    its output and a response.create, and that response completes."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    calls: list[dict] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append({"city": city})
        return f"21 degrees and sunny in {city}"

    agent = RealtimeAgent(name="weather", instructions="You answer questions about the weather. Use the tools.",
                          tools=[get_weather])
    settings = {"output_modalities": ["audio" if spoken else "text"], "tool_choice": "required",
                "parallel_tool_calls": False, "max_output_tokens": 120}
    if not spoken:
        settings["turn_detection"] = None
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    session = await runner.run(model_config={"url": server.realtime_url, "headers": {},
                                             "initial_model_settings": settings})
    tool_ends, done, audio_events = [], [], []
    async with session:
        if spoken:
            pcm, _, _ = utterance("what is the weather in paris", PCM16)
            await send_speech(session, pcm)
        else:
            await session.send_message(ASK)
        async with asyncio.timeout(300):
            async for event in session:
                if event.type == "error":
                    raise AssertionError(event.error)
                if event.type == "tool_end":
                    tool_ends.append(event)
                if event.type == "audio":
                    audio_events.append(event)
                data = getattr(getattr(event, "data", None), "data", None)
                if isinstance(data, dict) and data.get("type") == "response.done":
                    done.append(data["response"])
                    if tool_ends and len(done) >= 2:  # the response that called, then the one after the output
                        break
    # the first response is one call; the SDK ran the tool on it and sent the output and a response.create
    assert done[0]["status"] == "completed" and [i["type"] for i in done[0]["output"]] == ["function_call"]
    first = done[0]["output"][0]
    assert tool_ends[0].arguments == first["arguments"]
    jsonschema.validate(json.loads(first["arguments"]), get_weather.params_json_schema)
    assert calls[0] == json.loads(first["arguments"]) and calls[0]["city"]
    assert tool_ends[0].output == f"21 degrees and sunny in {calls[0]['city']}"
    # the follow-up completes; tool_choice is still "required", so it is a call again, which the SDK runs too
    assert done[1]["status"] == "completed" and [i["type"] for i in done[1]["output"]] == ["function_call"]
    assert len(calls) <= 2 and all(c["city"] for c in calls), calls
    assert not audio_events   # calls only: nothing spoken, no JSON read out
    await server.wait_idle(pinned_ok=True)
