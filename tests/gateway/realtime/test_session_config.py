"""Session updates (no engine): partial and atomic, both dialects, every rendered session valid for the SDK."""
from __future__ import annotations

import pytest

from gateway.realtime import protocol as p
from gateway.realtime import session_config as sc
from tests.gateway.realtime.client import BETA_EVENTS, GA_EVENTS


def session_event(session: dict, dialect: str) -> dict:
    return {"type": "session.updated", "event_id": p.new_id("event"), "session": sc.render(session, dialect)}


def test_session_update_partial_and_atomic():
    s = sc.default_session("sess_x", "SmolLM2")
    GA_EVENTS.validate_python(session_event(s, p.GA), strict=True)
    BETA_EVENTS.validate_python(session_event(s, p.BETA), strict=True)
    s2 = sc.apply_update(s, {"type": "realtime", "instructions": "hi", "audio": {"input": {"turn_detection": None},
                                                                               "output": {"voice": "marin"}}}, p.GA)
    assert s2["instructions"] == "hi" and s2["audio"]["input"]["turn_detection"] is None
    assert s2["audio"]["output"]["voice"] == "marin" and s2["audio"]["output"]["speed"] == 1.0
    assert s2["output_modalities"] == ["audio"]
    GA_EVENTS.validate_python(session_event(s2, p.GA), strict=True)
    with pytest.raises(p.ProtocolError) as info:  # one bad field: nothing applied
        sc.apply_update(s2, {"instructions": "new", "audio": {"output": {"speed": 9}}}, p.GA)
    assert info.value.param == "session.audio.output.speed"
    b = sc.apply_update(s, {"modalities": ["text"], "input_audio_format": "g711_ulaw", "temperature": 1.0,
                            "turn_detection": {"type": "semantic_vad", "eagerness": "low"}}, p.BETA)
    assert b["output_modalities"] == ["text"] and b["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    rendered = sc.render(b, p.BETA)
    assert rendered["input_audio_format"] == "g711_ulaw" and rendered["turn_detection"]["eagerness"] == "low"
    BETA_EVENTS.validate_python(session_event(b, p.BETA), strict=True)
    with pytest.raises(p.ProtocolError) as info:
        sc.apply_update(s, {"temperature": 3}, p.BETA)
    assert info.value.code == "invalid_value"
