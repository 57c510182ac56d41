"""WebSocket handshake rules (no engine): subprotocols, authentication, dialect, origin."""
from __future__ import annotations

import pytest

from gateway.realtime import protocol as p
from gateway.handshake import negotiate


@pytest.mark.parametrize("offered, expected", [([], None), (["realtime"], "realtime"),
                                               (["realtime", "openai-insecure-api-key.k"], "realtime"),
                                               (["openai-insecure-api-key.k"], None)])
def test_subprotocol_echoed_only_when_offered(offered, expected):
    assert negotiate({}, {}, offered, None, None).subprotocol == expected


def test_auth_and_dialect():
    assert negotiate({}, {}, [], "k", None).reject[0] == 401
    assert negotiate({}, {}, ["openai-insecure-api-key.k"], "k", None).reject is None
    assert negotiate({"authorization": "Bearer k"}, {}, [], "k", None).reject is None
    assert negotiate({}, {"api-key": "k"}, [], "k", None).reject is None
    assert negotiate({"authorization": "Bearer x"}, {}, [], "k", None).reject[0] == 401
    assert negotiate({"openai-beta": "realtime=v1"}, {}, [], None, None).dialect == p.BETA
    assert negotiate({}, {}, ["realtime", "openai-beta.realtime-v1"], None, None).dialect == p.BETA
    assert negotiate({}, {"model": "m"}, [], None, None).dialect == p.GA
    assert negotiate({"origin": "http://a.example", "host": "b:1"}, {}, [], None, None).reject[0] == 403
    assert negotiate({"origin": "http://a.example", "host": "b"}, {}, [], None, ["http://a.example"]).reject is None
    assert negotiate({"origin": "http://b:1", "host": "b:1"}, {}, [], None, None).reject is None
