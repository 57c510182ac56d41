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
