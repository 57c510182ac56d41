"""The server's log output: one handler on the root logger (text or JSON lines), API keys never in a log line, and
uvicorn's false alarm after a refused handshake dropped.

Everything goes through `logging` to stderr: rtserve's own loggers (`rtserve.*`), and uvicorn's, which propagate to the
root handler (the server runs uvicorn without a logging config of its own). `--log-format json` writes one JSON object
per line with stable keys (`time`, `level`, `logger`, `message`, plus the record's own fields, e.g. an access line's
`status` and `ttft_ms`) for log collectors.

A key can arrive in a URL (`?api-key=K`, which uvicorn writes into its access lines), in the browser subprotocol
(`openai-insecure-api-key.K`) or in an `Authorization` header (debug logs of the WebSocket library). The filter rewrites
each record's message and arguments in place, so uvicorn's own formatters (which unpack the arguments) keep working.
"""
from __future__ import annotations

import logging
import os
import re
import sys

_SECRET = re.compile(r"(?i)((?:[?&](?:api[-_]?key|key|access_token|token)=)|openai-insecure-api-key\.|bearer\s+)"
                     r"[^&\s\"',;)\]]+")
REDACTED = "[redacted]"
# uvicorn's sans-I/O WebSocket protocol never marks the handshake done after a denial response sent through the ASGI
# `websocket.http.response` extension, and so logs this ERROR for every properly refused handshake.
_DENIAL_NOISE = "ASGI callable returned without completing handshake."


def redact(text: str) -> str:
    return _SECRET.sub(lambda m: m.group(1) + REDACTED, text)


def _redact_value(value):
    return redact(value) if isinstance(value, str) else value


class RedactSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(_redact_value(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: _redact_value(v) for k, v in record.args.items()}
        return True


class DropDenialNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != _DENIAL_NOISE


# Loggers that write request lines; a filter on a logger sees only what is logged on it, so each gets its own.
_REQUEST_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "rtserve", "rtserve.session", "websockets",
                    "websockets.server")


LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"   # "INFO 12-01 21:04:33 rtserve: ready on ..."
TEXT_DATEFMT = "%m-%d %H:%M:%S"
JSON_KEYS = {"asctime": "time", "levelname": "level", "name": "logger"}


def configure(level: str = "info", fmt: str = "text") -> None:
    """One stderr handler on the root logger, in `fmt`; rtserve's loggers (and libraries') at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        # progress bars (a first GGUF conversion's) are not JSON lines
        os.environ.setdefault("TQDM_DISABLE", "1")

        handler.setFormatter(JsonFormatter("{asctime}{levelname}{name}{message}", style="{",
                                           rename_fields=JSON_KEYS, datefmt="%Y-%m-%dT%H:%M:%S%z"))
    elif fmt == "text":
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, TEXT_DATEFMT))
    else:
        raise ValueError(f"log format {fmt!r}: expected one of {LOG_FORMATS}")
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)   # Python warnings as log lines too, in the same format
    install()


def install() -> None:
    """Attach the filters to the request loggers and to the root logger's handlers (idempotent). Filters on loggers
    survive uvicorn's logging configuration, which replaces handlers but keeps filters."""
    for name in _REQUEST_LOGGERS:
        _add_once(logging.getLogger(name), RedactSecrets)
    _add_once(logging.getLogger("uvicorn.error"), DropDenialNoise)
    for handler in logging.getLogger().handlers:
        _add_once(handler, RedactSecrets)


def _add_once(target, kind: type[logging.Filter]) -> None:
    if not any(isinstance(f, kind) for f in target.filters):
        target.addFilter(kind())
