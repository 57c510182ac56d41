"""Memory caps of a Realtime session (gateway/realtime/limits.py, the send queue in session.py), with a real WebSocket
client: an item over the item cap, a conversation over its byte and item caps, and a client that stops reading while
the server queues large events. Each refusal is one `error` event with `param` and the session goes on; the engine
and the session gauge are back to their baseline after."""
from __future__ import annotations

import asyncio

import websockets

from gateway.realtime.limits import MAX_CONVERSATION_BYTES, MAX_CONVERSATION_ITEMS, MAX_ITEM_BYTES
from gateway.realtime.session import SessionLimits
from tests.gateway.realtime.client import Raw, expect_error, open_raw

MIB = 1024 * 1024


def message(text: str, item_id: str | None = None) -> dict:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {"type": "conversation.item.create", "item": {**item, **({"id": item_id} if item_id else {})}}


async def back_to_baseline(server) -> None:
    s = await server.wait_idle()
    assert s["kv_pages_used"] == 0 and s["kv_pages_pinned"] == 0
    for _ in range(100):
        if not server.app.state.sessions:
            break
        await asyncio.sleep(0.1)
    assert not server.app.state.sessions
    assert "rtserve_sessions_active 0.0" in server.metrics_text()


async def test_item_and_conversation_byte_caps(server):
    assert SessionLimits().max_item_bytes == MAX_ITEM_BYTES and 3 * MAX_ITEM_BYTES < MAX_CONVERSATION_BYTES
    raw = await open_raw(server)
    # one item over the item cap (the 10 MiB items): refused, nothing stored
    err = await expect_error(raw, {**message("x" * (10 * MIB)), "event_id": "big"}, "item_too_large", "item", "big")
    assert str(MAX_ITEM_BYTES) in err["message"]
    await expect_error(raw, {"type": "response.create", "event_id": "oob", "response": {
        "conversation": "none", "input": [message("y" * (MAX_ITEM_BYTES + 1))["item"]]}},
        "item_too_large", "response.input[0]", "oob")
    # items just under the item cap until the conversation's byte cap
    size = MAX_ITEM_BYTES - 1024
    fits = MAX_CONVERSATION_BYTES // size
    for i in range(fits):
        await raw.send(message("z" * size, f"item{i}"))
        assert (await raw.until("conversation.item.done"))[-1]["item"]["id"] == f"item{i}"
    await expect_error(raw, {**message("z" * size), "event_id": "over"}, "conversation_too_large", "item", "over")
    # deleting makes room again, and the session still answers
    await raw.send({"type": "conversation.item.delete", "item_id": "item0"})
    assert (await raw.recv())["type"] == "conversation.item.deleted"
    await raw.send(message("z" * size, "again"))
    assert (await raw.until("conversation.item.done"))[-1]["item"]["id"] == "again"
    for i in range(1, fits):
        await raw.send({"type": "conversation.item.delete", "item_id": f"item{i}"})
    await raw.send({"type": "conversation.item.delete", "item_id": "again"})
    for _ in range(fits):
        assert (await raw.recv())["type"] == "conversation.item.deleted"
    await raw.say("Say hi.")
    _, response, _ = await raw.respond()
    assert response["status"] in ("completed", "incomplete")
    await raw.ws.close()
    await back_to_baseline(server)


async def test_conversation_item_cap(server):
    raw = await open_raw(server)
    for i in range(MAX_CONVERSATION_ITEMS):  # pipelined: all sent, then all answers read
        await raw.send(message("hi", f"i{i}"))
    for i in range(MAX_CONVERSATION_ITEMS):
        assert (await raw.until("conversation.item.done"))[-1]["item"]["id"] == f"i{i}"
    err = await expect_error(raw, {**message("one more"), "event_id": "full"}, "conversation_too_large", "item",
                             "full")
    assert str(MAX_CONVERSATION_ITEMS) in err["message"]
    await raw.send({"type": "conversation.item.delete", "item_id": "i0"})
    assert (await raw.recv())["type"] == "conversation.item.deleted"
    await raw.send(message("one more", "last"))
    assert (await raw.until("conversation.item.done"))[-1]["item"]["id"] == "last"
    await raw.ws.close()
    await back_to_baseline(server)


async def test_send_queue_is_bounded_in_bytes(server):
    """The issue's case: retrieves of a large item on a socket that is never read. The queue holds far fewer events
    than its event cap, but their bytes pass the byte cap: the session is closed, its memory let go."""
    limits = SessionLimits()
    item_size = 4 * MIB
    retrieves = 40  # 160 MiB of answers: far above the byte cap, far below the event cap
    assert retrieves * item_size > 4 * limits.send_queue_max_bytes and retrieves < limits.send_queue_max
    ws = await websockets.connect(server.realtime_url, max_size=None, max_queue=1)
    stalled = Raw(ws)
    created = await stalled.recv()
    session = server.app.state.sessions[created["session"]["id"]]
    await stalled.send(message("x" * item_size, "big"))
    for _ in range(retrieves):
        await stalled.send({"type": "conversation.item.retrieve", "item_id": "big"})
    other = await open_raw(server, max_output_tokens=8)  # meanwhile a normal session works
    await other.say("Say hi.")
    _, response, _ = await other.respond()
    assert response["status"] in ("completed", "incomplete")
    await other.ws.close()
    for _ in range(300):  # the server ends the stalled session on its own
        if len(server.app.state.sessions) == 0:
            break
        await asyncio.sleep(0.1)
    assert not server.app.state.sessions
    assert "bytes queued" in session.close_reason  # the byte cap, not the events cap or the send timeout
    got = 0  # what reached the client before the close: well short of every retrieve
    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), 60)
            got += '"conversation.item.retrieved"' in frame
    except websockets.ConnectionClosed:
        pass
    assert got < retrieves
    await back_to_baseline(server)
