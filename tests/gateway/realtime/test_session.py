"""Realtime WebSocket end to end: the official openai SDK (GA and beta), raw websockets clients, real engine and model.

Every server event is validated with the SDK's own pydantic union. Outputs are kept short (max_output_tokens 16–24):
the default model is tiny and runs in fp32 on CPU.
"""
from __future__ import annotations

import asyncio
import re

import orjson
import pytest
import websockets
from openai import AsyncOpenAI
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GAServerEvent
from pydantic import TypeAdapter

GA_EVENTS = TypeAdapter(GAServerEvent)
BETA_EVENTS = TypeAdapter(BetaServerEvent)
ID_PREFIX = {"resp": re.compile(r"^resp_[A-Za-z0-9]{22}$"), "item": re.compile(r"^item_[A-Za-z0-9]{22}$"),
             "event": re.compile(r"^event_[A-Za-z0-9]{22}$")}
TEXT_SESSION = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 24,
                "instructions": "You are a concise assistant. Answer in one short sentence."}

GA_RESPONSE_SEQUENCE = ["response.created", "rate_limits.updated", "response.output_item.added",
                        "conversation.item.added", "response.content_part.added", "response.output_text.delta",
                        "response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "conversation.item.done", "response.done"]
BETA_RESPONSE_SEQUENCE = ["response.created", "rate_limits.updated", "response.output_item.added",
                          "conversation.item.created", "response.content_part.added", "response.text.delta",
                          "response.text.done", "response.content_part.done", "response.output_item.done",
                          "response.done"]


def sdk_client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, websocket_base_url=server.ws_base_url)


async def recv_validated(conn, adapter: TypeAdapter, seen: list) -> dict:
    """Next event through the SDK (parsed as the SDK does) and validated strictly against the SDK's union."""
    raw = await asyncio.wait_for(conn.recv_bytes(), 60)
    data = orjson.loads(raw)
    parsed = conn.parse_event(raw)
    assert parsed.type == data["type"]
    adapter.validate_python(data, strict=True)
    assert ID_PREFIX["event"].match(data["event_id"]), data["event_id"]
    seen.append(data)
    return data


async def run_turn(conn, adapter, text: str, seen: list) -> tuple[str, dict, list[str]]:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    types = []
    while True:  # item added (+ done in GA)
        ev = await recv_validated(conn, adapter, seen)
        types.append(ev["type"])
        if ev["type"] in ("conversation.item.done", "conversation.item.created"):
            assert ev["item"]["role"] == "user"
            break
    await conn.response.create()
    types, deltas = [], []
    while True:
        ev = await recv_validated(conn, adapter, seen)
        types.append(ev["type"])
        if ev["type"] in ("response.output_text.delta", "response.text.delta"):
            deltas.append(ev["delta"])
        if ev["type"] == "response.done":
            return "".join(deltas), ev["response"], types


def collapse(types: list[str]) -> list[str]:
    out = []
    for t in types:
        if not out or out[-1] != t:
            out.append(t)
    return out


async def test_sdk_ga_three_turns(server):
    client = sdk_client(server)
    seen: list = []
    async with client.realtime.connect(model="gpt-realtime") as conn:
        created = await recv_validated(conn, GA_EVENTS, seen)
        assert created["type"] == "session.created"
        assert created["session"]["type"] == "realtime"
        assert created["session"]["output_modalities"] == ["audio"]  # GA default (see session.py for the text build)
        await conn.session.update(session=TEXT_SESSION)
        updated = await recv_validated(conn, GA_EVENTS, seen)
        assert updated["type"] == "session.updated"
        assert updated["session"]["output_modalities"] == ["text"]
        assert updated["session"]["instructions"] == TEXT_SESSION["instructions"]
        assert updated["session"]["audio"]["output"]["voice"] == "alloy"  # untouched fields survive a partial update
        texts = []
        for n, question in enumerate(["What is the capital of France?", "And of Italy?", "Thanks! Say bye."]):
            text, response, types = await run_turn(conn, GA_EVENTS, question, seen)
            assert collapse(types) == GA_RESPONSE_SEQUENCE, types
            assert response["status"] in ("completed", "incomplete")
            assert ID_PREFIX["resp"].match(response["id"])
            assert response["output"][0]["content"][0] == {"type": "output_text", "text": text}
            assert ID_PREFIX["item"].match(response["output"][0]["id"])
            usage = response["usage"]
            assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
            if n > 0:  # later turns reuse the earlier prompt from the prefix cache
                assert usage["input_token_details"]["cached_tokens"] > 0
            assert text.strip()
            texts.append(text)
    assert len({e["event_id"] for e in seen}) == len(seen)
    await server.wait_idle()


async def test_sdk_beta_three_turns(server):
    client = sdk_client(server)
    seen: list = []
    async with client.beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
        created = await recv_validated(conn, BETA_EVENTS, seen)
        assert created["type"] == "session.created" and created["session"]["type"] == "realtime"
        assert created["session"]["modalities"] == ["audio", "text"]
        conv = await recv_validated(conn, BETA_EVENTS, seen)
        assert conv["type"] == "conversation.created" and conv["conversation"]["id"].startswith("conv_")
        await conn.session.update(session={"modalities": ["text"], "max_response_output_tokens": 16,
                                           "temperature": 0.7, "instructions": "Be brief."})
        updated = await recv_validated(conn, BETA_EVENTS, seen)
        assert updated["type"] == "session.updated"
        assert updated["session"]["modalities"] == ["text"] and updated["session"]["temperature"] == 0.7
        for question in ["Name a color.", "Name another one.", "And a third?"]:
            text, response, types = await run_turn(conn, BETA_EVENTS, question, seen)
            assert collapse(types) == BETA_RESPONSE_SEQUENCE, types
            assert response["modalities"] == ["text"]
            assert response["output"][0]["content"][0]["type"] == "text"
            assert response["output"][0]["content"][0]["text"] == text
    await server.wait_idle()


# ------------------------------------------------------------------------------------------------ raw websockets

class Raw:
    """A raw `websockets` client that validates every server event against the SDK union of its dialect."""

    def __init__(self, ws, adapter: TypeAdapter = GA_EVENTS):
        self.ws, self.adapter, self.n = ws, adapter, 0

    async def send(self, event: dict | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else orjson.dumps(event).decode())

    async def recv(self, timeout: float = 60) -> dict:
        data = orjson.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.adapter.validate_python(data, strict=True)
        return data

    async def until(self, etype: str, timeout: float = 60) -> list[dict]:
        events = []
        while True:
            events.append(await self.recv(timeout))
            if events[-1]["type"] == etype:
                return events

    async def say(self, text: str, **item) -> dict:
        await self.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **item}})
        return (await self.until("conversation.item.done"))[-1]

    async def respond(self, response: dict | None = None) -> tuple[str, dict, list[dict]]:
        await self.send({"type": "response.create", **({"response": response} if response else {})})
        events = await self.until("response.done")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        return text, events[-1]["response"], events


async def open_raw(server, max_output_tokens: int = 16, instructions: str | None = None, **kw) -> Raw:
    ws = await websockets.connect(server.realtime_url, max_size=None, **kw)
    raw = Raw(ws)
    assert (await raw.recv())["type"] == "session.created"
    session = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": max_output_tokens}
    if instructions is not None:
        session["instructions"] = instructions
    await raw.send({"type": "session.update", "session": session})
    assert (await raw.recv())["type"] == "session.updated"
    return raw


async def test_handshake_subprotocols_and_auth(server):
    key_url = f"ws://{server.auth_prefix}/v1/realtime?model=gpt-realtime"
    # Browser style: `realtime` + key subprotocol → `realtime` echoed, authenticated.
    async with websockets.connect(key_url, subprotocols=["realtime", f"openai-insecure-api-key.{server.api_key}"]) \
            as ws:
        assert ws.subprotocol == "realtime"
        created = await Raw(ws).recv()
        assert created["type"] == "session.created" and created["session"]["model"] == "gpt-realtime"
    # Nothing offered → nothing selected (the Python SDK fails the handshake otherwise).
    async with websockets.connect(server.realtime_url) as ws:
        assert ws.subprotocol is None
        assert (await Raw(ws).recv())["type"] == "session.created"
    # Bearer header and ?api-key= also authenticate.
    async with websockets.connect(key_url, additional_headers={"Authorization": f"Bearer {server.api_key}"}) as ws:
        assert (await Raw(ws).recv())["type"] == "session.created"
    async with websockets.connect(key_url + f"&api-key={server.api_key}") as ws:
        assert (await Raw(ws).recv())["type"] == "session.created"
    # Wrong or missing key → refused before the upgrade.
    for kwargs in ({"subprotocols": ["realtime", "openai-insecure-api-key.wrong"]},
                   {"additional_headers": {"Authorization": "Bearer wrong"}}, {}):
        with pytest.raises(websockets.exceptions.InvalidStatus) as info:
            async with websockets.connect(key_url, **kwargs):
                pass
        assert info.value.response.status_code == 401
    # The beta dialect by subprotocol (browsers cannot set the OpenAI-Beta header).
    async with websockets.connect(server.realtime_url, subprotocols=["realtime", "openai-beta.realtime-v1"]) as ws:
        assert ws.subprotocol == "realtime"
        raw = Raw(ws, BETA_EVENTS)
        assert "modalities" in (await raw.recv())["session"]
        assert (await raw.recv())["type"] == "conversation.created"
    # A foreign browser origin is refused; the same origin is fine.
    with pytest.raises(websockets.exceptions.InvalidStatus) as info:
        async with websockets.connect(server.realtime_url, origin="http://evil.example"):
            pass
    assert info.value.response.status_code == 403
    async with websockets.connect(server.realtime_url, origin=server.root_url) as ws:
        assert (await Raw(ws).recv())["type"] == "session.created"


async def test_prefix_reuse_across_turns(server):
    """Turn N's prompt is turn N-1's prompt + answer + the new user turn; only the new turn is prefilled."""
    block = server.engine.engine.args.block_size
    raw = await open_raw(server, max_output_tokens=16,
                         instructions="You are a helpful assistant who answers every question briefly. " * 8)
    previous = None
    for n, question in enumerate(["Tell me about the moon.", "What about the sun?", "And Mars?", "And Venus?"]):
        await raw.say(question)
        hits_before = server.stats()["prefix_cache_hits"]
        _, response, _ = await raw.respond()
        usage = response["usage"]
        cached = usage["input_token_details"]["cached_tokens"]
        assert server.stats()["prefix_cache_hits"] - hits_before >= cached
        if previous is not None:
            carried = previous["input_tokens"] + previous["output_tokens"]  # what the last turn left in the cache
            new_turn = usage["input_tokens"] - carried
            assert new_turn > 0
            # everything before the new turn is served from the cache, up to the last partial block
            assert cached >= (carried - 1) // block * block, (n, usage, previous)
            assert usage["input_tokens"] - cached <= new_turn + block
        previous = usage
    await raw.ws.close()
    await server.wait_idle()
    assert server.stats()["kv_pages_used"] == 0


async def test_cancel_mid_stream_frees_blocks(server):
    await server.wait_idle()
    raw = await open_raw(server, max_output_tokens=4096)
    await raw.say("Write a very long story about a dragon and a knight, with many details.")
    await raw.send({"type": "response.create", "response": {"max_output_tokens": "inf"}})
    events = []
    while True:
        events.append(await raw.recv())
        if events[-1]["type"] == "response.output_text.delta":
            break
    await raw.send({"type": "response.cancel", "event_id": "evt_cancel_1"})
    events += await raw.until("response.done")
    response = events[-1]["response"]
    assert response["status"] == "cancelled"
    assert response["status_details"]["reason"] == "client_cancelled"
    assert response["output"][0]["status"] == "incomplete"
    assert not [e for e in events if e["type"] == "error"]
    s = await server.wait_idle()
    assert s["requests_running"] == 0 and s["kv_pages_used"] == 0  # aborted: nothing held, nothing pinned
    # Cancel sent right behind its response.create (likely handled before the response task first runs).
    await raw.ws.send(orjson.dumps({"type": "response.create"}).decode())
    await raw.ws.send(orjson.dumps({"type": "response.cancel"}).decode())
    events = await raw.until("response.done")
    assert events[-1]["response"]["status"] == "cancelled"
    assert not [e for e in events if e["type"] == "error"]
    assert (await server.wait_idle())["kv_pages_used"] == 0
    # The session goes on; the cancelled partial answer stays in the conversation.
    await raw.say("Just say hello.")
    _, response, _ = await raw.respond({"max_output_tokens": 8})
    assert response["status"] in ("completed", "incomplete")
    await raw.ws.close()


async def test_disconnect_mid_response_aborts(server):
    await server.wait_idle()
    raw = await open_raw(server, max_output_tokens=4096)
    await raw.say("Count from one to one thousand in words.")
    await raw.send({"type": "response.create"})
    while (await raw.recv())["type"] != "response.output_text.delta":
        pass
    assert server.stats()["requests_running"] + server.stats()["requests_waiting"] == 1
    await raw.ws.close()
    s = await server.wait_idle()
    assert s["requests_running"] == 0 and s["requests_waiting"] == 0 and s["kv_pages_used"] == 0


async def expect_error(raw: Raw, event: dict | str | bytes, code: str, param: str | None,
                       event_id: str | None) -> dict:
    """Send one bad event; the very next event must be one `error` naming it."""
    await raw.send(event)
    ev = await raw.recv()
    assert ev["type"] == "error", ev
    err = ev["error"]
    assert (err["code"], err["param"], err["event_id"]) == (code, param, event_id), err
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


async def test_errors_each_answered_once_and_session_continues(server):
    from gateway.protocol import MAX_FRAME_BYTES

    raw = await open_raw(server, max_output_tokens=12)
    await expect_error(raw, "{not json", "invalid_json", None, None)
    await expect_error(raw, "[1, 2]", "invalid_json", None, None)
    await expect_error(raw, {"event_id": "e1"}, "missing_required_parameter", "type", "e1")
    await expect_error(raw, {"type": "no.such.event", "event_id": "e2"}, "invalid_value", "type", "e2")
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "e3"},
                       "missing_required_parameter", "item", "e3")
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "e4",
                             "item": {"type": "message", "role": "user", "content": [{"type": "input_text"}]}},
                       "missing_required_parameter", "item.content[0].text", "e4")
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "e5",
                             "item": {"type": "message", "role": "robot", "content": []}},
                       "invalid_value", "item.role", "e5")
    await expect_error(raw, {"type": "session.update", "event_id": "e6", "session": {"instructions": 5}},
                       "invalid_type", "session.instructions", "e6")
    await expect_error(raw, {"type": "session.update", "event_id": "e7", "session": {"max_output_tokens": 0}},
                       "invalid_value", "session.max_output_tokens", "e7")
    await expect_error(raw, {"type": "session.update", "event_id": "e8", "session": {"bogus": 1}},
                       "unknown_parameter", "session.bogus", "e8")
    await expect_error(raw, {"type": "response.create", "event_id": "e9", "response": {"max_output_tokens": "x"}},
                       "invalid_type", "response.max_output_tokens", "e9")
    await expect_error(raw, {"type": "response.cancel", "event_id": "e10"}, "response_cancel_not_active", None,
                       "e10")
    await expect_error(raw, {"type": "conversation.item.delete", "event_id": "e11", "item_id": "item_nope"},
                       "item_not_found", "item_id", "e11")
    await expect_error(raw, {"type": "conversation.item.retrieve", "event_id": "e12", "item_id": "item_nope"},
                       "item_not_found", "item_id", "e12")
    await expect_error(raw, {"type": "conversation.item.truncate", "event_id": "e13", "item_id": "item_nope",
                             "content_index": 0, "audio_end_ms": 0}, "item_not_found", "item_id", "e13")
    await expect_error(raw, {"type": "conversation.item.truncate", "event_id": "e14", "item_id": "x",
                             "content_index": "0", "audio_end_ms": 0}, "invalid_type", "content_index", "e14")
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "e15", "previous_item_id": "item_nope",
                             "item": {"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "hi"}]}},
                       "item_not_found", "previous_item_id", "e15")
    await expect_error(raw, {"type": "input_audio_buffer.append", "event_id": "e16", "audio": ""},
                       "invalid_value", "audio", "e16")
    big = '{"type": "input_audio_buffer.append", "event_id": "e17", "audio": "' + "A" * MAX_FRAME_BYTES + '"}'
    await expect_error(raw, big, "event_too_large", None, "e17")
    # A second response.create while one is active.
    await raw.say("Tell me a long story about the sea.")
    await raw.send({"type": "response.create", "response": {"max_output_tokens": 64}})
    await raw.send({"type": "response.create", "event_id": "e18"})
    events = await raw.until("response.done")
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "conversation_already_has_active_response"
    assert errors[0]["error"]["event_id"] == "e18"
    # ... and after all that, a normal turn works.
    await raw.say("Say hi.")
    text, response, _ = await raw.respond()
    assert response["status"] in ("completed", "incomplete") and text
    await raw.ws.close()


async def test_conversation_items_and_out_of_band_response(server):
    raw = await open_raw(server, max_output_tokens=12)
    first = await raw.say("My name is Ada.", id="msg_user_1")
    assert first["item"]["id"] == "msg_user_1" and first["previous_item_id"] is None
    await raw.send({"type": "conversation.item.create", "previous_item_id": "root", "item": {
        "type": "message", "role": "system", "content": [{"type": "input_text", "text": "Speak like a pirate."}]}})
    added, done = await raw.recv(), await raw.recv()
    assert added["type"] == "conversation.item.added" and added["previous_item_id"] is None
    assert done["type"] == "conversation.item.done"
    system_id = added["item"]["id"]
    assert system_id.startswith("item_")
    await raw.send({"type": "conversation.item.create", "previous_item_id": "msg_user_1", "item": {
        "id": "msg_asst_1", "type": "message", "role": "assistant",
        "content": [{"type": "output_text", "text": "Ahoy Ada!"}]}})
    added = (await raw.until("conversation.item.done"))[0]
    assert added["previous_item_id"] == "msg_user_1"
    await raw.send({"type": "conversation.item.create", "item": {"id": "msg_user_1", "type": "message",
                    "role": "user", "content": [{"type": "input_text", "text": "dup"}]}})
    assert (await raw.recv())["error"]["code"] == "item_id_already_exists"
    await raw.send({"type": "conversation.item.retrieve", "item_id": "msg_asst_1"})
    got = await raw.recv()
    assert got["type"] == "conversation.item.retrieved"
    assert got["item"]["content"] == [{"type": "output_text", "text": "Ahoy Ada!"}]
    await raw.send({"type": "conversation.item.truncate", "item_id": "msg_asst_1", "content_index": 0,
                    "audio_end_ms": 0})
    truncated = await raw.recv()
    assert truncated["type"] == "conversation.item.truncated" and truncated["item_id"] == "msg_asst_1"
    await raw.send({"type": "conversation.item.truncate", "item_id": "msg_user_1", "content_index": 0,
                    "audio_end_ms": 0})
    assert (await raw.recv())["error"]["param"] == "item_id"
    await raw.send({"type": "conversation.item.delete", "item_id": system_id})
    assert (await raw.recv()) | {"event_id": None} == {"type": "conversation.item.deleted", "item_id": system_id,
                                                       "event_id": None}
    await raw.say("What is my name?")
    text, response, _ = await raw.respond({"instructions": "Answer with one word.", "metadata": {"turn": "a"}})
    assert response["metadata"] == {"turn": "a"} and response["conversation_id"].startswith("conv_")
    # Out of band: conversation "none" with its own input; nothing is added to the conversation.
    text, response, events = await raw.respond({
        "conversation": "none", "metadata": {"kind": "classifier"}, "max_output_tokens": 6,
        "instructions": "Reply with yes or no.",
        "input": [{"type": "item_reference", "id": "msg_user_1"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Is it Ada?"}]}]})
    assert response["conversation_id"] is None and response["metadata"] == {"kind": "classifier"}
    assert not [e for e in events if e["type"].startswith("conversation.")]
    assert response["usage"]["output_tokens"] <= 6
    await raw.ws.close()


@pytest.mark.slow
async def test_32_concurrent_sessions(server):
    await server.wait_idle()

    async def one(i: int) -> list[dict]:
        raw = await open_raw(server, max_output_tokens=16, instructions="You answer briefly.")
        responses = []
        for turn in range(2):
            await raw.say(f"Session {i}, turn {turn}: name a fruit.")
            _, response, _ = await raw.respond()
            responses.append(response)
        assert server.stats()["kv_pages_pinned"] > 0  # the live session keeps its prefix
        await raw.ws.close()
        return responses

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 300)
    assert len(results) == 32
    for responses in results:
        assert all(r["status"] in ("completed", "incomplete") for r in responses)
        assert all(r["usage"]["output_tokens"] >= 1 for r in responses)
    s = await server.wait_idle()
    assert s["kv_pages_used"] == 0 and s["kv_pages_pinned"] == 0 and s["requests_running"] == 0
    assert "rtserve_sessions_active 0.0" in server.metrics_text()


async def test_stalled_reader_is_disconnected_without_slowing_others(server):
    """A client that stops reading fills its bounded send queue and is dropped; other sessions carry on."""
    gauge = server.tight_app.state.metrics.sessions_active
    ws = await websockets.connect(f"ws://{server.tight_prefix}/v1/realtime", max_size=None, max_queue=1)
    stalled = Raw(ws)
    assert (await stalled.recv())["type"] == "session.created"
    await stalled.send({"type": "conversation.item.create", "item": {
        "id": "big", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 200_000}]}})
    for _ in range(300):  # ~60 MB of answers that the client never reads
        await stalled.send({"type": "conversation.item.retrieve", "item_id": "big"})
    other = await open_raw(server, max_output_tokens=8)  # meanwhile a normal session works
    await other.say("Say hi.")
    _, response, _ = await other.respond()
    assert response["status"] in ("completed", "incomplete")
    await other.ws.close()
    for _ in range(300):
        if gauge._value.get() == 0:
            break
        await asyncio.sleep(0.1)
    assert gauge._value.get() == 0  # the server ended the stalled session
    ws.transport.abort()


async def test_cache_salt_isolates_tenants(server):
    """The same long prompt hits the prefix cache within a tenant (salt) and never across tenants."""
    instructions = "You are the support assistant of the Tenant Test Company. Be kind and brief. " * 6

    async def first_turn_cached(salt: str) -> int:
        ws = await websockets.connect(f"{server.realtime_url}?cache_salt={salt}", max_size=None)
        raw = Raw(ws)
        await raw.recv()
        await raw.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                              "max_output_tokens": 4, "instructions": instructions}})
        await raw.recv()
        await raw.say("Hello")
        _, response, _ = await raw.respond()
        await ws.close()
        return response["usage"]["input_token_details"]["cached_tokens"]

    assert await first_turn_cached("tenant-a") == 0
    assert await first_turn_cached("tenant-a") > 64  # same tenant: the shared prefix is found
    assert await first_turn_cached("tenant-b") == 0  # another tenant: isolated
