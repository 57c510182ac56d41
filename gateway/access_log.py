"""One access line per HTTP request, written when its response has ended: client, method, path, status and duration,
and for the generation routes the time to first token and the token counts (as llama-server prints one per request).

The middleware puts a `RequestTiming` in the request's state; a route that generates fills in its first token and its
usage (`LatencyTimer` marks the first token, `record_usage` the counts). The path is logged without its query string,
which may carry an API key. The line replaces uvicorn's own access line, which has no timings.

Every response carries an `x-request-id` header, as OpenAI's do (the openai SDK exposes it as `_request_id`, and
clients log it with their errors): the client's own `x-request-id` when it sent a short printable one (as vLLM
echoes it), else a new `req_` id. The access line carries it as `request_id`.
"""
from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import dataclass

log = logging.getLogger("rtserve.access")
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")   # echoed as it came; anything else gets an id of ours


def request_id(scope) -> bytes:
    """The id a request's response names: the client's `x-request-id` if it is a plain token, else a new one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _CLIENT_REQUEST_ID.fullmatch(value):
            return value
    return b"req_" + uuid.uuid4().hex.encode()


@dataclass(slots=True)
class RequestTiming:
    start: float   # event-loop time the request arrived
    first_token: float | None = None   # loop time of the first generated text sent
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def request_timing(request) -> RequestTiming | None:
    """The timing record of a starlette request (None outside the middleware, e.g. an app embedded without it)."""
    return request.scope.get("state", {}).get("timing")


def record_usage(timing: RequestTiming | None, usage: dict | None) -> None:
    if timing is not None and usage:
        timing.prompt_tokens = usage.get("prompt_tokens")
        timing.completion_tokens = usage.get("completion_tokens")


class AccessLog:
    """Pure ASGI middleware (a streamed response is timed to its last chunk, which BaseHTTPMiddleware cannot do)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        timing = RequestTiming(loop.time())
        scope.setdefault("state", {})["timing"] = timing
        rid = request_id(scope)
        status = None

        async def send_timed(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        except BaseException:
            # uvicorn answers an exception with a 500; a cancelled request (client gone) had no answer: nginx's 499
            status = status or 500
            raise
        finally:
            if log.isEnabledFor(logging.INFO):
                _log_line(scope, status or 499, timing, loop.time(), rid.decode())


def _log_line(scope, status: int, timing: RequestTiming, end: float, rid: str) -> None:
    client = scope.get("client")
    fields = {"request_id": rid, "client": f"{client[0]}:{client[1]}" if client else None, "method": scope["method"],
              "path": scope["path"], "status": status, "duration_ms": round((end - timing.start) * 1000, 1),
              "ttft_ms": None if timing.first_token is None else round((timing.first_token - timing.start) * 1000, 1),
              "prompt_tokens": timing.prompt_tokens, "completion_tokens": timing.completion_tokens}
    text = f'{fields["client"] or "-"} "{fields["method"]} {fields["path"]}" {status} {fields["duration_ms"]:.1f} ms'
    if fields["ttft_ms"] is not None:
        text += f', TTFT {fields["ttft_ms"]:.1f} ms'
    if timing.prompt_tokens is not None:
        text += f", {timing.prompt_tokens} prompt + {timing.completion_tokens} completion tokens"
    log.info(text, extra=fields)
