"""WebSocket handshake: subprotocol choice, dialect, authentication, origin check.

Rules (docs/gateway.md, Connecting): echo `realtime` only when the client offered it and select nothing otherwise (the
Python SDK offers none and fails if one comes back; Chrome fails if it offered one and none is echoed). With an API key
configured, a client authenticates by `Authorization: Bearer K`, the `openai-insecure-api-key.K` subprotocol (browsers),
or `?api-key=K` (old relays).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.realtime import protocol as p

KEY_PREFIX = "openai-insecure-api-key."
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


@dataclass(slots=True)
class Handshake:
    """What a connection negotiated; `reject` is (HTTP status, message) when it must be refused."""
    subprotocol: str | None = None
    dialect: str = p.GA
    model: str | None = None
    intent: str | None = None
    cache_salt: str | None = None
    reject: tuple[int, str] | None = None


def negotiate(headers, query, offered: list[str], api_key: str | None,
              allowed_origins: list[str] | None) -> Handshake:
    """`headers` and `query` are case-insensitive / plain mappings from the request; `offered` the subprotocols."""
    hs = Handshake(subprotocol="realtime" if "realtime" in offered else None,
                   model=query.get("model") or None, intent=query.get("intent") or None,
                   cache_salt=query.get("cache_salt") or headers.get("x-rtserve-cache-salt") or None)
    beta_header = "realtime=v1" in (headers.get("openai-beta") or "").replace(" ", "").split(",")
    hs.dialect = p.BETA if beta_header or BETA_SUBPROTOCOL in offered else p.GA
    if not origin_allowed(headers.get("origin"), headers.get("host"), allowed_origins):
        hs.reject = (403, f"Origin {headers.get('origin')} is not allowed.")
    elif api_key and not authenticated(headers, query, offered, api_key):
        hs.reject = (401, "Incorrect or missing API key.")
    return hs


def authenticated(headers, query, offered: list[str], api_key: str) -> bool:
    candidates = []
    auth = headers.get("authorization") or ""
    if auth[:7].lower() == "bearer ":
        candidates.append(auth[7:].strip())
    candidates += [proto[len(KEY_PREFIX):] for proto in offered if proto.startswith(KEY_PREFIX)]
    if query.get("api-key"):
        candidates.append(query["api-key"])
    return any(hmac.compare_digest(c.encode(), api_key.encode()) for c in candidates)


def bearer_ok(headers, api_key: str | None) -> bool:
    """HTTP API auth: `Authorization: Bearer K` when a key is configured."""
    if not api_key:
        return True
    auth = headers.get("authorization") or ""
    return auth[:7].lower() == "bearer " and hmac.compare_digest(auth[7:].strip().encode(), api_key.encode())


def origin_allowed(origin: str | None, host: str | None, allowed: list[str] | None) -> bool:
    """No Origin (not a browser) and same-origin pages are always fine; others must be listed (or `*`)."""
    if not origin:
        return True
    if allowed and ("*" in allowed or origin.rstrip("/") in allowed):
        return True
    return bool(host) and urlsplit(origin).netloc == host
