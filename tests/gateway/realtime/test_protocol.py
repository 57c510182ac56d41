"""Protocol-level unit tests (no engine): dialect translation of events, frame parsing, error events, ids."""
from __future__ import annotations

import pytest

from gateway.realtime import protocol as p
from tests.gateway.realtime.client import BETA_EVENTS, GA_EVENTS


def test_dialect_translation_of_events():
    item = {"id": "item_1", "object": "realtime.item", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hi"}]}
    ev = {"type": "conversation.item.added", "event_id": "event_1", "previous_item_id": None, "item": item}
    beta = p.to_dialect(ev, p.BETA)
    assert beta["type"] == "conversation.item.created" and beta["item"]["content"][0]["type"] == "text"
    BETA_EVENTS.validate_python(beta, strict=True)
    assert p.to_dialect({"type": "conversation.item.done", "item": item}, p.BETA) is None
    assert p.to_dialect({"type": "response.output_text.delta"}, p.BETA)["type"] == "response.text.delta"
    assert p.to_dialect(ev, p.GA) is ev


def test_frame_parsing_errors():
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame(b"\xff")
    assert info.value.code == "invalid_json"
    with pytest.raises(p.ProtocolError) as info:
        p.parse_frame('{"type": 3, "event_id": "e"}')
    assert (info.value.code, info.value.param, info.value.event_id) == ("invalid_type", "type", "e")
    err = p.error_event(p.ProtocolError("m", "c", "x"), "evt")
    GA_EVENTS.validate_python(err, strict=True)
    assert err["error"]["event_id"] == "evt"
    assert p.new_id("resp").startswith("resp_") and len(p.new_id("resp")) == 27
