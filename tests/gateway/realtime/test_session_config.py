"""Session updates (no engine): partial and atomic, both dialects, every rendered session valid for the SDK."""
from __future__ import annotations

import collections.abc
import copy
import types
import typing

import pydantic
import pytest
import typing_extensions as te
from openai.types import realtime
from openai.types.beta.realtime import response_create_event as beta_create
from openai.types.beta.realtime import response_create_event_param as beta_create_param
from openai.types.beta.realtime import session_update_event as beta_update
from openai.types.beta.realtime import session_update_event_param as beta_update_param

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


# ------------------------------------------------------------------------------------ null means "not set"
# The fields come from walking the SDK's own request types (the pydantic models clients dump, as LiveKit does with
# `exclude_unset`, and the *Param TypedDicts), not from a list kept here: a field a new SDK makes nullable is tested.

_MISSING = object()
# Values the server needs where the SDK's types leave a field optional (a function tool without a name is refused).
_SAMPLES = {"name": "lookup", "server_label": "srv", "id": "pmpt_1", "retention_ratio": 0.5, "anchor": "created_at"}
# Null fields whose absence is refused too: a function tool needs its name (OpenAI's service refuses it as well).
_NEEDED = {"tools[].name"}
# Where the SDK documents null as a value ("off"), in the GA-shaped session that both dialects share.
_NULL_IS_A_VALUE = {p.GA: {"audio.input.turn_detection": "audio.input.turn_detection",
                           "audio.input.transcription": "audio.input.transcription",
                           "audio.input.noise_reduction": "audio.input.noise_reduction",
                           "tracing": "tracing", "include": "include", "prompt": "prompt", "reasoning": "reasoning"},
                    p.BETA: {"turn_detection": "audio.input.turn_detection",
                             "input_audio_transcription": "audio.input.transcription",
                             "input_audio_noise_reduction": "audio.input.noise_reduction",
                             "tracing": "tracing", "include": "include"}}


def _members(t) -> list:
    while typing.get_origin(t) in (typing.Annotated, te.Required, te.NotRequired):
        t = typing.get_args(t)[0]
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(t) for m in _members(a)]
    return [t]


def _fields(t) -> dict | None:
    if isinstance(t, type) and issubclass(t, pydantic.BaseModel):
        return {k: f.annotation for k, f in t.model_fields.items()}
    if te.is_typeddict(t):
        return typing.get_type_hints(t, include_extras=True)
    return None


def _element(t):
    """The element type of a list / Iterable annotation, else None."""
    if typing.get_origin(t) in (list, collections.abc.Iterable, collections.abc.Sequence):
        return typing.get_args(t)[0]
    return None


def nullable_paths(root, skip: tuple[str, ...] = ()) -> set[str]:
    """Every path below `root` (a pydantic model or a TypedDict) whose annotation admits None."""
    out: set[str] = set()

    def walk(t, path: str, depth: int) -> None:
        for m in _members(t):
            if (elem := _element(m)) is not None:
                walk(elem, path + "[]", depth + 1)
            elif (fs := _fields(m)) is not None and depth < 8:
                for key, ann in fs.items():
                    sub = f"{path}.{key}" if path else key
                    if type(None) in _members(ann):
                        out.add(sub)
                    if sub not in skip:
                        walk(ann, sub, depth + 1)

    walk(root, "", 0)
    return out


def _sample(t, name: str):
    for m in _members(t):
        if m is type(None):
            continue
        if typing.get_origin(m) is typing.Literal:
            return typing.get_args(m)[0]
        if _fields(m) is not None:
            return _minimal(m)
        if _element(m) is not None:
            return []
        return {str: _SAMPLES.get(name, "x"), float: _SAMPLES.get(name, 0.5), int: 1, bool: True}.get(m, "x")
    raise AssertionError(f"no sample for {name}: {t}")


def _minimal(model) -> dict:
    """The required fields of a pydantic model, plus the name a function tool needs."""
    out = {k: _sample(f.annotation, k) for k, f in model.model_fields.items() if f.is_required()}
    if "name" in model.model_fields and "server_label" not in model.model_fields and "parameters" in model.model_fields:
        out["name"] = _SAMPLES["name"]
    return out


def with_null(root, path: str):
    """The smallest object of `root`'s type (a pydantic model) carrying null at `path`, and the same object without
    the field; each level picks the union member that has the next field and fills that member's required fields."""
    def build(t, segs: list[str]):
        if not segs:
            return None
        if segs[0] == "[]":
            elem = next(e for m in _members(t) if (e := _element(m)) is not None)
            return [build(elem, segs[1:])]
        has = [m for m in _members(t) if (_fields(m) or {}).get(segs[0]) is not None]
        # the member where the field is nullable (`tool_choice.name` is for MCP, not for a function)
        model = next((m for m in has if len(segs) > 1 or type(None) in _members(_fields(m)[segs[0]])), has[0])
        obj = _minimal(model)
        obj[segs[0]] = build(model.model_fields[segs[0]].annotation, segs[1:])
        return obj

    segs = path.replace("[]", ".[]").split(".")
    full = build(root, segs)
    absent = copy.deepcopy(full)
    parent = absent
    for seg in segs[:-1]:
        parent = parent[0] if seg == "[]" else parent[seg]
    del parent[segs[-1]]
    return full, absent


def _lookup(obj, path: str):
    for seg in path.split("."):
        if not isinstance(obj, dict) or seg not in obj:
            return _MISSING
        obj = obj[seg]
    return obj


def _non_default_session() -> dict:
    """A session whose every setting differs from the default, so "null resets it" cannot pass for "null leaves it"."""
    return sc.apply_update(sc.default_session("sess_x", "SmolLM2"), {
        "type": "realtime", "instructions": "Be brief.", "max_output_tokens": 50, "output_modalities": ["text"],
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "transcription": {"model": "whisper-1"},
                            "noise_reduction": {"type": "near_field"},
                            "turn_detection": {"type": "semantic_vad", "eagerness": "low"}},
                  "output": {"format": {"type": "audio/pcma"}, "voice": "marin", "speed": 1.2}},
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
        "tool_choice": "required", "truncation": "disabled", "tracing": "auto",
        "include": ["item.input_audio_transcription.logprobs"], "prompt": {"id": "pmpt_1"},
        "reasoning": {"effort": "low"}, "parallel_tool_calls": False}, p.GA) | {"temperature": 0.9}


_GA_SESSION = (realtime.RealtimeSessionCreateRequest, realtime.RealtimeSessionCreateRequestParam)
_GA_TRANSCRIPTION = (realtime.RealtimeTranscriptionSessionCreateRequest,
                     realtime.RealtimeTranscriptionSessionCreateRequestParam)
_BETA_SESSION = (beta_update.Session, beta_update_param.Session)
_GA_RESPONSE = (realtime.RealtimeResponseCreateParams, realtime.RealtimeResponseCreateParamsParam)
_BETA_RESPONSE = (beta_create.Response, beta_create_param.Response)


def _cases(dialect: str, roots: tuple) -> list:
    skip = ("input",)  # response.input holds conversation items, validated as items, not as settings
    paths = set().union(*(nullable_paths(r, skip) for r in roots))
    return [pytest.param(dialect, roots[0], path, id=f"{dialect}-{roots[0].__name__}-{path.replace('[]', '*')}")
            for path in sorted(paths)]


def _outcome(fn):
    try:
        return fn()
    except p.ProtocolError as e:
        return (e.code, e.param)


@pytest.mark.parametrize("dialect, root, path", _cases(p.GA, _GA_SESSION) + _cases(p.GA, _GA_TRANSCRIPTION)
                         + _cases(p.BETA, _BETA_SESSION))
def test_session_update_null_means_not_set(dialect, root, path):
    base = _non_default_session()
    full, absent = with_null(root, path)
    got = _outcome(lambda: sc.apply_update(base, full, dialect))
    if path in _NEEDED:  # the same error as when the field is left out
        assert got == _outcome(lambda: sc.apply_update(base, absent, dialect))
        assert got[0] == "missing_required_parameter"
        return
    assert isinstance(got, dict), f"session.update with {path}: null refused: {got}"
    if path in _NULL_IS_A_VALUE[dialect]:  # "off": the field is null in the session whatever it was
        assert _lookup(got, _NULL_IS_A_VALUE[dialect][path]) is None
        assert _lookup(base, _NULL_IS_A_VALUE[dialect][path]) is not None
    else:  # the same session as when the field is left out
        assert got == sc.apply_update(base, absent, dialect)
    events = GA_EVENTS if dialect == p.GA else BETA_EVENTS
    events.validate_python(session_event(got, dialect), strict=True)


@pytest.mark.parametrize("dialect, root, path", _cases(p.GA, _GA_RESPONSE) + _cases(p.BETA, _BETA_RESPONSE))
def test_response_create_null_takes_the_session_value(dialect, root, path):
    base = _non_default_session()
    full, absent = with_null(root, path)
    got = _outcome(lambda: sc.response_params(base, full, dialect))
    if path in _NEEDED:
        assert got == _outcome(lambda: sc.response_params(base, absent, dialect))
        assert got[0] == "missing_required_parameter"
        return
    assert isinstance(got, sc.ResponseParams), f"response.create with {path}: null refused: {got}"
    assert got == sc.response_params(base, absent, dialect)


def test_nulls_in_client_data_are_kept():
    # A JSON schema's null default, tracing metadata and conversation items are the client's data, not settings.
    base = _non_default_session()
    schema = {"type": "object", "properties": {"unit": {"type": ["string", "null"], "default": None}}}
    got = sc.apply_update(base, {"type": "realtime", "instructions": None, "tracing": {"metadata": {"k": None}},
                                 "tools": [{"type": "function", "name": "f", "description": None,
                                            "parameters": schema}]}, p.GA)
    assert got["tools"] == [{"type": "function", "name": "f", "parameters": schema}]
    assert got["tracing"] == {"metadata": {"k": None}} and got["instructions"] == "Be brief."
    GA_EVENTS.validate_python(session_event(got, p.GA), strict=True)
    item = {"type": "message", "role": "user", "id": None, "content": [{"type": "input_text", "text": "hi"}]}
    params = sc.response_params(base, {"instructions": None, "input": [item], "metadata": {"k": "v"}}, p.GA)
    assert params.input == [item] and params.instructions == "Be brief." and params.metadata == {"k": "v"}


def test_null_for_the_other_dialects_field_is_still_refused():
    # `turn_detection: null` is "VAD off" in beta; in a GA session it would pass silently for nothing.
    base = _non_default_session()
    for update, dialect in (({"turn_detection": None}, p.GA), ({"audio": None}, p.BETA)):
        with pytest.raises(p.ProtocolError) as info:
            sc.apply_update(base, update, dialect)
        assert info.value.code == "unknown_parameter"
    with pytest.raises(p.ProtocolError) as info:
        sc.response_params(base, {"modalities": None}, p.GA)
    assert info.value.code == "unknown_parameter"
    assert sc.apply_update(base, {"turn_detection": None}, p.BETA)["audio"]["input"]["turn_detection"] is None
