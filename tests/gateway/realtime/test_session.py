"""Realtime WebSocket end to end: the official openai SDK (GA and beta), raw websockets clients, real engine and model.

Every server event is validated with the SDK's own pydantic union. Outputs are kept short (max_output_tokens 16–24):
the default model is tiny and runs in fp32 on CPU.
"""
from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
import websockets
from openai import AsyncOpenAI
from pydantic import TypeAdapter

from tests.gateway.realtime.client import BETA_EVENTS, GA_EVENTS, ID_PREFIX, Raw, expect_error, open_raw
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
    await conn.response.create(response={"temperature": 0})  # greedy: the asserts hold for every run
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


async def test_handshake_subprotocols_and_auth(server):
    key_url = f"ws://{server.auth_prefix}/v1/realtime?model=gpt-realtime"
    # Browser style: `realtime` + key subprotocol → `realtime` echoed, authenticated.
    async with websockets.connect(key_url, subprotocols=["realtime", f"openai-insecure-api-key.{server.api_key}"]) \
            as ws:
        assert ws.subprotocol == "realtime"
        created = await Raw(ws).recv()
        assert created["type"] == "session.created" and created["session"]["model"] == server.engine.model_name
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


async def test_errors_each_answered_once_and_session_continues(server):
    from gateway.realtime.protocol import MAX_FRAME_BYTES

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
                       "item_delete_invalid_item_id", "item_id", "e11")
    await expect_error(raw, {"type": "conversation.item.retrieve", "event_id": "e12", "item_id": "item_nope"},
                       "item_retrieve_invalid_item_id", "item_id", "e12")
    await expect_error(raw, {"type": "conversation.item.truncate", "event_id": "e13", "item_id": "item_nope",
                             "content_index": 0, "audio_end_ms": 0}, "item_truncate_invalid_item_id", "item_id",
                       "e13")
    await expect_error(raw, {"type": "conversation.item.truncate", "event_id": "e14", "item_id": "x",
                             "content_index": "0", "audio_end_ms": 0}, "invalid_type", "content_index", "e14")
    await expect_error(raw, {"type": "conversation.item.create", "event_id": "e15", "previous_item_id": "item_nope",
                             "item": {"type": "message", "role": "user",
                                      "content": [{"type": "input_text", "text": "hi"}]}},
                       "item_create_invalid_previous_item_id", "previous_item_id", "e15")
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
    text, response, _ = await raw.respond({"temperature": 0})
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
    # what other tests left open is theirs to answer for: this test's own 32 sessions must all leave
    before = open_sessions(server), set(server.app.state.sessions)

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
    assert (open_sessions(server), set(server.app.state.sessions)) == before
    assert open_sessions(server) == len(server.app.state.sessions)   # the gauge counts what the registry holds


def open_sessions(server) -> float:
    """The open app's `rtserve_sessions_active` gauge, from its /metrics."""
    text = server.metrics_text()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("rtserve_sessions_active ")))


async def test_stalled_reader_is_disconnected_without_slowing_others(server):
    """A client that stops reading fills its bounded send queue and is dropped; other sessions carry on."""
    def sessions_active() -> float:  # the tight app's own gauge, from its /metrics
        text = httpx.get(f"http://{server.tight_prefix}/metrics", timeout=10).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("rtserve_sessions_active ")))

    ws = await websockets.connect(f"ws://{server.tight_prefix}/v1/realtime", max_size=None, max_queue=1)
    stalled = Raw(ws)
    assert (await stalled.recv())["type"] == "session.created"
    assert sessions_active() == 1
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
        if sessions_active() == 0:
            break
        await asyncio.sleep(0.1)
    assert sessions_active() == 0  # the server ended the stalled session
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


async def test_pins_give_way_to_live_requests_under_kv_pressure(small_server):
    """Idle sessions keep their conversation's KV pinned, at most `pinned_blocks_fraction` of the pool (the least
    recently used session's pin goes first); a live request that needs more pages than the unpinned ones is served
    by releasing pins, and the sessions go on (their next turns prefill again and pin again)."""
    server = small_server
    total = server.stats()["kv_pages_total"]
    cap = int(total * server.engine.engine.args.pinned_blocks_fraction)
    raws, pinned = [], []
    for i in range(4):  # distinct instructions: no shared prefix between the sessions
        raw = await open_raw(server, max_output_tokens=8,
                             instructions=f"Session {i}: you are assistant number {i} of many. " * 16)
        await raw.say(f"Hello from session {i}.")
        _, response, _ = await raw.respond()
        assert response["status"] in ("completed", "incomplete")
        s = await server.wait_idle(pinned_ok=True)
        assert 0 < s["kv_pages_pinned"] <= cap, (s, cap)  # the cap holds however many sessions pin
        pinned.append(s["kv_pages_pinned"])
        raws.append(raw)
    assert 4 * pinned[0] > cap  # (sizes: four sessions' pins do not fit under the cap, so it dropped the oldest)
    # One HTTP request whose prompt needs more pages than the pins leave free.
    s = server.stats()
    page = s["kv_page_size"]
    need = total - s["kv_pages_pinned"] + 8
    prompt = [server.engine.engine.tokenizer.encode(" ocean", add_special_tokens=False)[0]] * (need * page)
    assert len(prompt) < server.engine.max_model_len - 8 and need * page < total * page
    async with httpx.AsyncClient(timeout=300) as h:
        r = await h.post(f"{server.base_url}/completions",
                         json={"model": server.engine.model_name, "prompt": prompt, "max_tokens": 4,
                               "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["choices"][0]["finish_reason"] == "length"
    after = await server.wait_idle(pinned_ok=True)
    assert after["kv_pages_pinned"] < s["kv_pages_pinned"], (s, after)  # pins were released for it
    # Every session still answers, and pins its conversation again.
    for raw in raws:
        await raw.say("Again, please.")
        _, response, _ = await raw.respond()
        assert response["status"] in ("completed", "incomplete")
        assert (await server.wait_idle(pinned_ok=True))["kv_pages_pinned"] > 0
    for raw in raws:
        await raw.ws.close()
    s = await server.wait_idle()
    assert s["kv_pages_pinned"] == 0 and s["kv_pages_used"] == 0


def _all_null(model, **given):
    """An SDK request model with every optional field set to None (so `exclude_unset` sends it as null), as LiveKit's
    plugin builds them, except the fields `given`."""
    return model(**{k: None for k, f in model.model_fields.items() if not f.is_required()} | given)


async def _user_turn(conn, adapter, seen: list, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    while (await recv_validated(conn, adapter, seen))["type"] not in ("conversation.item.done",
                                                                       "conversation.item.created"):
        pass


async def _until_done(conn, adapter, seen: list) -> dict:
    while (ev := await recv_validated(conn, adapter, seen))["type"] != "response.done":
        assert ev["type"] != "error", ev
    return ev["response"]


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
async def test_sdk_null_fields_mean_not_set(server, beta):
    """LiveKit's plugin style: SDK request models whose unused fields are None, sent as null (`exclude_unset`);
    `generate_reply()` sends `response.instructions: null` with its metadata. Every null field is "not set".
    The dicts go through the SDK's connection, whose TypedDict transform keeps the nulls."""
    from openai.types import realtime as ga
    from openai.types.beta.realtime import response_create_event as beta_create
    from openai.types.beta.realtime import session_update_event as beta_update

    adapter = BETA_EVENTS if beta else GA_EVENTS
    instructions = "You are a concise assistant. Answer in one short sentence."
    question = "What is the capital of France?"
    if beta:
        settings = {"modalities": ["text"], "max_response_output_tokens": 16, "instructions": instructions}
        session_update = beta_update.SessionUpdateEvent(type="session.update",
                                                        session=_all_null(beta_update.Session, **settings))
        null_update = beta_update.SessionUpdateEvent(type="session.update", session=_all_null(beta_update.Session))
        reply = beta_create.ResponseCreateEvent(type="response.create", event_id="response_create_1",
                                                response=_all_null(beta_create.Response,
                                                                   metadata={"client_event_id": "response_create_1"}))
    else:
        settings = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 16,
                    "instructions": instructions}
        audio = ga.RealtimeAudioConfig(input=_all_null(ga.RealtimeAudioConfigInput),
                                       output=_all_null(ga.RealtimeAudioConfigOutput))
        session_update = ga.SessionUpdateEvent(type="session.update", session=_all_null(
            ga.RealtimeSessionCreateRequest, audio=audio, **settings))
        null_update = ga.SessionUpdateEvent(type="session.update",
                                            session=_all_null(ga.RealtimeSessionCreateRequest, type="realtime"))
        response_audio = ga.RealtimeResponseCreateAudioOutput(output=_all_null(
            ga.realtime_response_create_audio_output.Output))
        reply = ga.ResponseCreateEvent(type="response.create", event_id="response_create_1", response=_all_null(
            ga.RealtimeResponseCreateParams, audio=response_audio, metadata={"client_event_id": "response_create_1"}))
    # Dumped as LiveKit dumps them (the beta SDK's own `send` of a model would drop every None as a default).
    session_update, null_update, reply = (e.model_dump(by_alias=True, exclude_unset=True, exclude_defaults=False)
                                          for e in (session_update, null_update, reply))
    assert reply["response"]["instructions"] is None and null_update["session"]["instructions"] is None

    client = sdk_client(server)
    connect = client.beta.realtime.connect(model="gpt-4o-realtime-preview") if beta else \
        client.realtime.connect(model="gpt-realtime")
    seen: list = []
    async with connect as conn:
        created = await recv_validated(conn, adapter, seen)
        if beta:
            await recv_validated(conn, adapter, seen)  # conversation.created
        await conn.send(session_update)
        updated = (await recv_validated(conn, adapter, seen))["session"]
        assert updated["instructions"] == instructions
        if beta:  # untouched by null: voice, temperature; null is "off" for VAD, transcription, noise reduction
            assert updated["voice"] == created["session"]["voice"] and updated["temperature"] == created["session"]["temperature"]
            assert updated["turn_detection"] is None and updated["input_audio_transcription"] is None
            assert updated["modalities"] == ["text"] and updated["max_response_output_tokens"] == 16
        else:
            assert updated["audio"]["output"] == created["session"]["audio"]["output"]
            assert updated["audio"]["input"]["turn_detection"] is None
            assert updated["output_modalities"] == ["text"] and updated["max_output_tokens"] == 16
        await conn.send(null_update)  # all null: nothing changes
        assert (await recv_validated(conn, adapter, seen))["session"] == updated
        await _user_turn(conn, adapter, seen, question)
        await conn.send(reply)
        response = await _until_done(conn, adapter, seen)
    assert response["status"] in ("completed", "incomplete"), response
    assert response["metadata"] == {"client_event_id": "response_create_1"}
    assert response["max_output_tokens"] == 16 and 1 <= response["usage"]["output_tokens"] <= 16
    assert response["modalities" if beta else "output_modalities"] == ["text"]

    # The same turn with nothing in response.create renders the same prompt: the session's instructions were used.
    seen_ref: list = []
    connect = client.beta.realtime.connect(model="gpt-4o-realtime-preview") if beta else \
        client.realtime.connect(model="gpt-realtime")
    async with connect as conn:
        for _ in range(2 if beta else 1):
            await recv_validated(conn, adapter, seen_ref)
        await conn.session.update(session=settings)
        await recv_validated(conn, adapter, seen_ref)
        await _user_turn(conn, adapter, seen_ref, question)
        await conn.response.create()
        reference = await _until_done(conn, adapter, seen_ref)
    assert response["usage"]["input_tokens"] == reference["usage"]["input_tokens"]
    assert not [e for e in seen + seen_ref if e["type"] == "error"]
    await server.wait_idle()
