"""Malformed and out-of-order client events found by fuzzing the Realtime gateway: each gets one OpenAI-shaped
`error` (or, where valid, its normal answer) and the session goes on — no poisoned session state, no internal error.

Every event received is validated against the SDK's union (`Raw.recv`), so an accepted value that makes
`session.updated` invalid for strict clients fails here too.
"""
from __future__ import annotations

import json

import pytest
import websockets

from gateway.realtime.protocol import MAX_DEPTH
from tests.gateway.realtime.client import BETA_EVENTS, Raw, expect_error, open_raw


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


async def still_updates(raw: Raw, session: dict | None = None) -> dict:
    """A valid session.update after the bad event is still answered with session.updated."""
    await raw.send({"type": "session.update", "session": session or {"type": "realtime", "instructions": "hi"}})
    ev = await raw.recv()
    assert ev["type"] == "session.updated", ev
    return ev["session"]


@pytest.mark.parametrize("event, param", [
    ({"type": "session.update", "session": {"tracing": {"metadata": nested(300)}}}, None),
    ({"type": "session.update", "session": {"tools": [{"type": "function", "name": "f",
                                                        "parameters": nested(300)}]}}, None),
    ({"type": "session.update", "session": {"audio": {"output": {"voice": {"id": "a", "x": nested(300)}}}}}, None),
    ({"type": "response.create", "response": {"conversation": "none", "metadata": {"a": nested(300)}}}, None),
])
async def test_deep_nesting_is_rejected_and_does_not_poison_the_session(server, event, param):
    # Was: the update was committed, then session.updated failed to serialize (orjson's 255-level limit) with a
    # server_error — and so did every later session.update of that session.
    raw = await open_raw(server)
    deep = json.dumps({**event, "event_id": "deep"})  # the stdlib encoder: orjson itself stops at 255 levels
    await expect_error(raw, deep, "invalid_value", param, "deep")
    await still_updates(raw)
    # Up to the limit is fine (the event itself is one level).
    ok = await still_updates(raw, {"type": "realtime", "tracing": {"metadata": nested(MAX_DEPTH - 4)}})
    assert ok["tracing"]["metadata"] == nested(MAX_DEPTH - 4)
    await raw.ws.close()


@pytest.mark.parametrize("session, code, param", [
    ({"tool_choice": {"type": "function"}}, "missing_required_parameter", "session.tool_choice.name"),
    ({"tool_choice": {"type": "mcp"}}, "missing_required_parameter", "session.tool_choice.server_label"),
    ({"tool_choice": {"type": "function", "name": "f", "x": 1}}, "unknown_parameter", "session.tool_choice.x"),
    ({"truncation": "x"}, "invalid_value", "session.truncation"),
    ({"truncation": 5}, "invalid_type", "session.truncation"),
    ({"truncation": {"type": "retention_ratio"}}, "missing_required_parameter", "session.truncation.retention_ratio"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 2}}, "invalid_value",
     "session.truncation.retention_ratio"),
    ({"include": "x"}, "invalid_type", "session.include"),
    ({"include": [1]}, "invalid_value", "session.include[0]"),
    ({"prompt": 5}, "invalid_type", "session.prompt"),
    ({"prompt": {"version": "1"}}, "missing_required_parameter", "session.prompt.id"),
    ({"reasoning": 5}, "invalid_type", "session.reasoning"),
    ({"reasoning": {"effort": "max"}}, "invalid_value", "session.reasoning.effort"),
    ({"parallel_tool_calls": "x"}, "invalid_type", "session.parallel_tool_calls"),
    ({"tracing": {"workflow_name": 5}}, "invalid_type", "session.tracing.workflow_name"),
    ({"tracing": {"bogus": 1}}, "unknown_parameter", "session.tracing.bogus"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1", "bogus": 1}}}}, "unknown_parameter",
     "session.audio.input.transcription.bogus"),
    ({"audio": {"input": {"noise_reduction": {"bogus": 1}}}}, "unknown_parameter",
     "session.audio.input.noise_reduction.bogus"),
    ({"audio": {"output": {"voice": {"id": "v", "bogus": 1}}}}, "unknown_parameter",
     "session.audio.output.voice.bogus"),
])
async def test_ga_session_fields_are_validated(server, session, code, param):
    # Was: accepted as is, and the session.updated echoing them failed the SDK's schema (strict clients drop it).
    raw = await open_raw(server)
    await expect_error(raw, {"type": "session.update", "event_id": "u1", "session": session}, code, param, "u1")
    await still_updates(raw)
    await raw.ws.close()


@pytest.mark.parametrize("session", [
    {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}},
    {"tool_choice": {"type": "mcp", "server_label": "s", "name": None}},
    {"truncation": "disabled"},
    {"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 100}}},
    {"include": ["item.input_audio_transcription.logprobs"]},
    {"include": None},
    {"prompt": {"id": "pmpt_1", "variables": {"a": "b"}, "version": None}},
    {"reasoning": {"effort": "low"}},
    {"parallel_tool_calls": False},
    {"tracing": {"workflow_name": "w", "group_id": "g", "metadata": {"k": [1, 2]}}},
])
async def test_ga_session_fields_valid_values_still_accepted(server, session):
    raw = await open_raw(server)
    got = await still_updates(raw, {"type": "realtime", **session})
    key, value = next(iter(session.items()))
    if isinstance(value, dict):  # a null member is "not set" (test_session_config), so not echoed
        value = {k: v for k, v in value.items() if v is not None}
    assert got[key] == value
    await raw.ws.close()


async def test_beta_include_is_validated(server):
    raw = Raw(await websockets.connect(server.realtime_url, additional_headers={"OpenAI-Beta": "realtime=v1"}),
              BETA_EVENTS)
    assert [(await raw.recv())["type"] for _ in range(2)] == ["session.created", "conversation.created"]
    await expect_error(raw, {"type": "session.update", "event_id": "b1", "session": {"include": 5}},
                       "invalid_type", "session.include", "b1")
    await still_updates(raw, {"instructions": "hi"})
    await raw.ws.close()


@pytest.mark.parametrize("response, code, param", [
    ({"tool_choice": {"type": "function"}}, "missing_required_parameter", "response.tool_choice.name"),
    ({"prompt": 5}, "invalid_type", "response.prompt"),
    ({"reasoning": 5}, "invalid_type", "response.reasoning"),
    ({"parallel_tool_calls": "x"}, "invalid_type", "response.parallel_tool_calls"),
])
async def test_response_create_fields_are_validated(server, response, code, param):
    # Was: accepted, and a response was started from the malformed request.
    raw = await open_raw(server)
    await expect_error(raw, {"type": "response.create", "event_id": "r1", "response": response}, code, param, "r1")
    await still_updates(raw)
    await raw.ws.close()


@pytest.mark.parametrize("item, code, param", [
    ({"status": "bogus"}, "invalid_value", "item.status"),
    ({"object": 5}, "invalid_value", "item.object"),
])
async def test_item_status_and_object_are_validated(server, item, code, param):
    raw = await open_raw(server)
    event = {"type": "conversation.item.create", "event_id": "i1",
             "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x"}], **item}}
    await expect_error(raw, event, code, param, "i1")
    done = await raw.say("hi", status="completed", object="realtime.item")
    assert done["item"]["status"] == "completed"
    await raw.ws.close()


async def test_response_on_an_empty_conversation_without_instructions(server):
    # Was: the chat template refused an empty message list; the response failed with an internal server_error
    # (and a traceback in the log). OpenAI's models speak first here.
    raw = await open_raw(server, max_output_tokens=8, instructions="")
    _, response, events = await raw.respond()
    assert response["status"] in ("completed", "incomplete"), response
    assert not [e for e in events if e["type"] == "error"]
    # The conversation goes on normally after it.
    await raw.say("Say hi.")
    _, response, _ = await raw.respond()
    assert response["status"] in ("completed", "incomplete"), response
    await raw.ws.close()
    s = await server.wait_idle()
    assert s["requests_running"] == 0 and s["requests_waiting"] == 0
