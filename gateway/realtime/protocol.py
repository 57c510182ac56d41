"""OpenAI Realtime wire format: ids, client-event validation, error events, GA↔beta names.

Everything inside the gateway is GA-shaped; the beta dialect is a translation applied at the edge (`to_dialect` for
server events, `session_from_beta` / `response_params_from_beta` for client payloads), so the session state machine
never branches on the dialect.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Any

import orjson

GA = "ga"
BETA = "beta"

# One client frame may carry 15 MiB of audio (base64 grows it by 4/3); anything above this is answered with an error.
MAX_FRAME_BYTES = 16 * 1024 * 1024 + 4096 * 1024
# Deepest nesting accepted in a client event: client values are echoed in server events (session.updated, errors) and
# orjson refuses to serialize past 255 levels, so a deeper value would make every later echo of the session fail.
MAX_DEPTH = 128

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """OpenAI-style id: `prefix_` + 22 random base62 characters (sess_, conv_, item_, resp_, call_, event_)."""
    return prefix + "_" + "".join(secrets.choice(_ALPHABET) for _ in range(22))


def dumps(event: dict) -> str:
    return orjson.dumps(event).decode()


# ---------------------------------------------------------------------------------------------------------- errors

@dataclass(slots=True)
class ProtocolError(Exception):
    """A client mistake; answered with one `error` event, the session goes on."""
    message: str
    code: str | None = "invalid_value"
    param: str | None = None
    type: str = "invalid_request_error"
    event_id: str | None = None  # the offending client event's id, when known before the event parsed


def error_event(err: ProtocolError, client_event_id: str | None = None) -> dict:
    return {"type": "error", "event_id": new_id("event"),
            "error": {"type": err.type, "code": err.code, "message": err.message, "param": err.param,
                      "event_id": client_event_id or err.event_id}}


def missing(param: str) -> ProtocolError:
    return ProtocolError(f"Missing required parameter: '{param}'.", "missing_required_parameter", param)


def wrong_type(param: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)}.",
                         "invalid_type", param)


def bad_value(param: str, value: Any, allowed: str) -> ProtocolError:
    shown = orjson.dumps(value).decode()[:100] if not isinstance(value, bytes) else "<bytes>"
    return ProtocolError(f"Invalid value for '{param}': {shown}. Expected {allowed}.", "invalid_value", param)


def unknown_param(param: str) -> ProtocolError:
    return ProtocolError(f"Unknown parameter: '{param}'.", "unknown_parameter", param)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------------------------------------ field checkers

def _get(obj: dict, key: str, param: str, kind: type, kind_name: str, required: bool, nullable: bool):
    """The shared rule of the typed getters: absent → None (or `missing`), null only when nullable, else the type."""
    if key not in obj:
        if required:
            raise missing(param)
        return None
    value = obj[key]
    if value is None and nullable:
        return None
    if not isinstance(value, kind):
        raise wrong_type(param, kind_name, value)
    return value


def get_str(obj: dict, key: str, param: str, *, required: bool = False, nullable: bool = False) -> str | None:
    return _get(obj, key, param, str, "a string", required, nullable)


def get_int(obj: dict, key: str, param: str, *, required: bool = False, lo: int | None = None,
            hi: int | None = None) -> int | None:
    if key not in obj:
        if required:
            raise missing(param)
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(param, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_value(param, value, f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
    return value


def get_number(obj: dict, key: str, param: str, *, lo: float, hi: float) -> float | None:
    if key not in obj:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(param, "a number", value)
    if not lo <= value <= hi:
        raise bad_value(param, value, f"a number in [{lo}, {hi}]")
    return float(value)


def get_dict(obj: dict, key: str, param: str, *, required: bool = False, nullable: bool = False) -> dict | None:
    return _get(obj, key, param, dict, "an object", required, nullable)


def get_list(obj: dict, key: str, param: str, *, nullable: bool = False) -> list | None:
    return _get(obj, key, param, list, "an array", False, nullable)


def check_choice(value: Any, param: str, choices: tuple) -> Any:
    if value not in choices:
        raise bad_value(param, value, "one of " + ", ".join(repr(c) for c in choices))
    return value


def check_known(obj: dict, known: set[str] | frozenset[str], prefix: str) -> None:
    for key in obj:
        if key not in known:
            raise unknown_param(f"{prefix}.{key}" if prefix else key)


def get_max_tokens(obj: dict, key: str, param: str) -> int | str | None:
    """`max_output_tokens`: 1–4096 or "inf"."""
    if key not in obj:
        return None
    value = obj[key]
    if value == "inf":
        return "inf"
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(param, 'an integer or "inf"', value)
    if not 1 <= value <= 4096:
        raise bad_value(param, value, 'an integer in [1, 4096] or "inf"')
    return value


def drop_nulls(value: Any, keep: frozenset[str], opaque: frozenset[str], path: str = "") -> Any:
    """A copy of a client object without its null members: in the Realtime API a null field means "not set", as the
    SDK's types allow (LiveKit's plugin sends `instructions: null` on every reply). `keep` names the paths where null
    means something (`turn_detection: null` turns VAD off); `opaque` the client data inside which nothing is touched
    (a JSON schema's `"default": null` is part of the schema). Paths are dotted, `[]` standing for a list element."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            sub = f"{path}.{k}" if path else k
            if v is None and sub not in keep:
                continue
            out[k] = v if sub in opaque else drop_nulls(v, keep, opaque, sub)
        return out
    if isinstance(value, list):
        return [drop_nulls(v, keep, opaque, path + "[]") for v in value]
    return value


def get_metadata(obj: dict, key: str, param: str) -> dict | None:
    meta = get_dict(obj, key, param, nullable=True)
    if meta is None:
        return None
    if len(meta) > 16:
        raise bad_value(param, "…", "at most 16 keys")
    for k, v in meta.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise bad_value(f"{param}.{k}", v, "string values of at most 512 characters and keys of at most 64")
    return meta


# -------------------------------------------------------------------------------------------------- client frames

def parse_frame(data: str | bytes) -> dict:
    """One client frame → an event dict with a string `type`; anything else raises ProtocolError."""
    if len(data) > MAX_FRAME_BYTES:
        try:  # still name the offending event when it parses
            eid = client_event_id(orjson.loads(data))
        except orjson.JSONDecodeError:
            eid = None
        raise ProtocolError(f"Event is too large ({len(data)} bytes; the limit is {MAX_FRAME_BYTES}).",
                            "event_too_large", None, event_id=eid)
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"The event is not valid JSON: {e}.", "invalid_json", None) from None
    if not isinstance(event, dict):
        raise ProtocolError("The event must be a JSON object.", "invalid_json", None)
    eid = event.get("event_id")
    if eid is not None and not isinstance(eid, str):
        raise wrong_type("event_id", "a string", eid)
    if too_deep(event, MAX_DEPTH):
        raise ProtocolError(f"The event is nested too deeply (the limit is {MAX_DEPTH} levels).", "invalid_value",
                            None, event_id=eid)
    etype = event.get("type")
    err = missing("type") if etype is None else None if isinstance(etype, str) else wrong_type("type", "a string",
                                                                                               etype)
    if err is not None:
        err.event_id = eid
        raise err
    return event


def too_deep(value: Any, limit: int) -> bool:
    """Whether objects/arrays nest more than `limit` levels (iterative: no recursion on hostile input)."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def client_event_id(event: Any) -> str | None:
    eid = event.get("event_id") if isinstance(event, dict) else None
    return eid if isinstance(eid, str) else None


# ---------------------------------------------------------------------------------------------- GA → beta (server)

_BETA_TYPES = {
    "conversation.item.added": "conversation.item.created",
    "response.output_text.delta": "response.text.delta",
    "response.output_text.done": "response.text.done",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
}
_BETA_DROP = {"conversation.item.done", "input_audio_buffer.timeout_triggered"}  # beta has no such events
_BETA_CONTENT = {"output_text": "text", "output_audio": "audio"}


def beta_item(item: dict) -> dict:
    content = item.get("content")
    if not content:
        return item
    return {**item, "content": [{**p, "type": _BETA_CONTENT.get(p.get("type"), p.get("type"))} for p in content]}


def beta_modalities(output_modalities: list[str] | None) -> list[str]:
    return ["audio", "text"] if output_modalities and "audio" in output_modalities else ["text"]


def beta_response(resp: dict) -> dict:
    out = {k: v for k, v in resp.items() if k not in ("output_modalities", "audio")}
    out["modalities"] = beta_modalities(resp.get("output_modalities"))
    out["output"] = [beta_item(i) for i in resp.get("output") or []]
    audio_out = (resp.get("audio") or {}).get("output") or {}
    if isinstance(audio_out.get("voice"), str):
        out["voice"] = audio_out["voice"]
    if audio_out.get("format"):
        out["output_audio_format"] = format_to_beta(audio_out["format"])
    return out


def to_dialect(event: dict, dialect: str) -> dict | None:
    """Translate a GA server event for the connection's dialect; None means "not sent in this dialect"."""
    if dialect == GA:
        return event
    etype = event["type"]
    if etype in _BETA_DROP:
        return None
    out = dict(event)
    out["type"] = _BETA_TYPES.get(etype, etype)
    if "item" in out and isinstance(out["item"], dict):
        out["item"] = beta_item(out["item"])
    if "response" in out and isinstance(out["response"], dict):
        out["response"] = beta_response(out["response"])
    return out


# ----------------------------------------------------------------------------------------------- audio formats

_BETA_FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24000}, "g711_ulaw": {"type": "audio/pcmu"},
                 "g711_alaw": {"type": "audio/pcma"}}


def format_to_beta(fmt: dict) -> str:
    return {"audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}.get(fmt.get("type"), "pcm16")


def format_from_beta(value: Any, param: str) -> dict:
    if not isinstance(value, str):
        raise wrong_type(param, "a string", value)
    if value not in _BETA_FORMATS:
        raise bad_value(param, value, "one of 'pcm16', 'g711_ulaw', 'g711_alaw'")
    return dict(_BETA_FORMATS[value])


def check_format(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise wrong_type(param, "an object", value)
    check_known(value, {"type", "rate"}, param)
    ftype = check_choice(value.get("type", "audio/pcm"), param + ".type", ("audio/pcm", "audio/pcmu", "audio/pcma"))
    if ftype == "audio/pcm":
        rate = value.get("rate", 24000)
        if rate != 24000:
            raise bad_value(param + ".rate", rate, "24000")
        return {"type": "audio/pcm", "rate": 24000}
    return {"type": ftype}
