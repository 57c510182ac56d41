"""Host and Origin checks on every HTTP request and WebSocket handshake: a web page must not drive the server.

DNS rebinding: a page on `http://evil.example:8000` re-points its own name at 127.0.0.1, and the browser then sends
`Host: evil.example:8000` and `Origin: http://evil.example:8000` to the local server, which passes any same-origin
rule. Such a request always carries a DNS name the attacker controls, so the server accepts a `Host` only if it is
 - an IP address literal (a page can only be same-origin with an IP literal by being served from that address),
 - `localhost` or a `*.localhost` name (browsers resolve those to loopback themselves, never through DNS),
 - a name the server listens on or was told (`--host NAME`, the machine's own hostname when bound to all interfaces,
   `--allowed-hosts`, where `*.example.com` covers subdomains and `*` turns the check off).
A request without `Host` (HTTP/1.0, not a browser) passes.

Origin: a browser request whose `Origin` is neither the server's own origin nor listed in `--allowed-origins` is
refused, over HTTP as well as WebSocket: without it, any page could POST to the API (a CORS "simple" request needs no
preflight) and run up the server's compute. Requests without `Origin` (SDKs, curl) pass. CORS headers are added by
starlette's CORSMiddleware inside this one, only for the listed origins.

Refusals are 403 with an OpenAI-shaped error body (over WebSocket, as the handshake's HTTP denial response), logged
once at info with the reason.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.handshake import origin_allowed

log = logging.getLogger("rtserve")

_ALL_INTERFACES = ("0.0.0.0", "::", "")


def default_allowed_hosts(listen_host: str) -> list[str]:
    """The names besides IP literals and localhost that `--host` implies: the name itself, or, bound to all
    interfaces, the machine's hostname (its `.local` mDNS name too)."""
    if listen_host in _ALL_INTERFACES:
        name = socket.gethostname().lower()
        return [name, f"{name}.local"] if name else []
    return [] if _is_ip(listen_host) else [listen_host.lower()]


def host_allowed(host: str | None, allowed: list[str] | None) -> bool:
    if not host:
        return True
    try:
        name = urlsplit("//" + host).hostname
    except ValueError:
        return False
    if not name:
        return False
    if _is_ip(name) or name == "localhost" or name.endswith(".localhost"):
        return True
    for pattern in allowed or ():
        pattern = pattern.lower()
        if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


class HostOriginGuard:
    """Pure ASGI middleware (WebSocket scopes included, which starlette's TrustedHostMiddleware answers with a plain
    400 and no reason, and without the IP-literal rule)."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str] | None = None,
                 allowed_origins: list[str] | None = None) -> None:
        self.app, self.allowed_hosts, self.allowed_origins = app, allowed_hosts, allowed_origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host, origin = headers.get("host"), headers.get("origin")
        if not host_allowed(host, self.allowed_hosts):
            return await self._refuse(scope, send, f"Host {host} is not allowed (--allowed-hosts).",
                                      "host_not_allowed")
        if not origin_allowed(origin, host, self.allowed_origins):
            return await self._refuse(scope, send, f"Origin {origin} is not allowed (--allowed-origins).",
                                      "origin_not_allowed")
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, message: str, code: str) -> None:
        client = scope.get("client") or ("-", 0)
        kind = "WebSocket" if scope["type"] == "websocket" else scope.get("method", "HTTP")
        log.info("refused %s %s from %s:%s: %s", kind, scope.get("path"), client[0], client[1], message)
        body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}})
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        prefix = ""
        if scope["type"] == "websocket":
            if "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})  # the server says 403
                return
            prefix = "websocket."
        await send({"type": prefix + "http.response.start", "status": 403, "headers": headers})
        await send({"type": prefix + "http.response.body", "body": body})
