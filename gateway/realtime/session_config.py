"""The session object: GA-shaped defaults, validated partial updates, beta flattening, response.create parameters.

The gateway keeps one GA-shaped dict per session. `session.update` validates into a copy and commits only when every
field is valid, so a bad update changes nothing. Beta clients send flat fields, mapped here to the GA shape.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from gateway.realtime import function_calls as fc
from gateway.realtime import protocol as p
from gateway.tools import ToolRequest

# Models the beta SDK's `Session.model` literal accepts; other names are left out of beta session objects.
BETA_MODELS = ("gpt-realtime", "gpt-realtime-2025-08-28", "gpt-4o-realtime-preview",
               "gpt-4o-realtime-preview-2024-10-01", "gpt-4o-realtime-preview-2024-12-17",
               "gpt-4o-realtime-preview-2025-06-03", "gpt-4o-mini-realtime-preview",
               "gpt-4o-mini-realtime-preview-2024-12-17")
DEFAULT_TEMPERATURE = 0.8
SERVER_VAD_DEFAULTS = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                       "create_response": True, "interrupt_response": True, "idle_timeout_ms": None}
SERVER_VAD_EAGERNESS = "rtserve_eagerness"  # rtserve's opt-in to the early end of turn (turn_detection.py)
SEMANTIC_VAD_DEFAULTS = {"type": "semantic_vad", "eagerness": "auto", "create_response": True,
                         "interrupt_response": True}

_READ_ONLY = {"id", "object", "expires_at", "client_secret"}
_GA_FIELDS = {"type", "model", "output_modalities", "instructions", "max_output_tokens", "audio", "tools",
              "tool_choice", "truncation", "tracing", "include", "prompt", "reasoning", "parallel_tool_calls"}
_BETA_FIELDS = {"type", "model", "modalities", "instructions", "voice", "input_audio_format", "output_audio_format",
                "input_audio_transcription", "input_audio_noise_reduction", "turn_detection", "tools", "tool_choice",
                "temperature", "max_response_output_tokens", "speed", "tracing", "include"}

# Null means "not set": a null field of session.update leaves the session's value, one of response.create takes the
# session's. Except where null is a value: the SDK documents null as "off" for turn detection, transcription, noise
# reduction and tracing; `include`, `prompt` and `reasoning` null clear them (LiveKit clears reasoning so).
_NULL_MEANS = {p.GA: frozenset({"audio.input.turn_detection", "audio.input.transcription",
                                 "audio.input.noise_reduction", "tracing", "include", "prompt", "reasoning"}),
               p.BETA: frozenset({"turn_detection", "input_audio_transcription", "input_audio_noise_reduction",
                                  "tracing", "include"})}
# Client data passed through as sent (JSON schemas, metadata, items): their nulls are content.
_SESSION_OPAQUE = frozenset({"tools[].parameters", "tools[].headers", "tracing.metadata", "prompt.variables"})
_RESPONSE_OPAQUE = frozenset({"tools[].parameters", "tools[].headers", "prompt.variables", "metadata", "input"})


def default_session(session_id: str, model: str) -> dict:
    """GA defaults. `output_modalities` is ["audio"] as in OpenAI's service; see session.py for the text build."""
    return {
        "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
        "output_modalities": ["audio"], "instructions": "", "max_output_tokens": "inf",
        "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 24000}, "transcription": None,
                      "noise_reduction": None, "turn_detection": dict(SERVER_VAD_DEFAULTS)},
            "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy", "speed": 1.0},
        },
        "tools": [], "tool_choice": "auto", "truncation": "auto", "tracing": None, "include": None,
        "temperature": DEFAULT_TEMPERATURE,  # beta-only knob, kept internally for both dialects
    }


def render(session: dict, dialect: str) -> dict:
    """The session object as sent in session.created / session.updated (`type` always present)."""
    if dialect == p.GA:
        return {k: v for k, v in session.items() if k != "temperature"}
    audio_in, audio_out = session["audio"]["input"], session["audio"]["output"]
    out = {"type": "realtime", "object": "realtime.session", "id": session["id"],
           "modalities": p.beta_modalities(session["output_modalities"]),
           "instructions": session["instructions"],
           "voice": audio_out["voice"] if isinstance(audio_out["voice"], str) else audio_out["voice"].get("id"),
           "input_audio_format": p.format_to_beta(audio_in["format"]),
           "output_audio_format": p.format_to_beta(audio_out["format"]),
           "input_audio_transcription": audio_in["transcription"],
           "input_audio_noise_reduction": audio_in["noise_reduction"],
           "turn_detection": audio_in["turn_detection"], "tools": session["tools"],
           "tool_choice": session["tool_choice"] if isinstance(session["tool_choice"], str) else "required",
           "temperature": session["temperature"], "max_response_output_tokens": session["max_output_tokens"],
           "speed": audio_out["speed"], "tracing": session["tracing"]}
    if session["model"] in BETA_MODELS:
        out["model"] = session["model"]
    return out


def apply_update(session: dict, update: Any, dialect: str) -> dict:
    """Validate `update` (the `session` field of session.update) and return the new session; raises ProtocolError."""
    if not isinstance(update, dict):
        raise p.wrong_type("session", "an object", update)
    # Top-level names are checked before the nulls go: a GA client's `turn_detection: null` (the beta name) must not
    # pass silently for "VAD off". Below, a null the SDK knows and rtserve does not (`noise_reduction.strength`) is
    # simply not set.
    p.check_known(update, (_BETA_FIELDS if dialect == p.BETA else _GA_FIELDS) | _READ_ONLY, "session")
    update = p.drop_nulls(update, _NULL_MEANS[dialect], _SESSION_OPAQUE)
    new = copy.deepcopy(session)
    if dialect == p.BETA:
        _apply_beta(new, update)
    else:
        _apply_ga(new, update)
    return new


def _apply_ga(s: dict, u: dict) -> None:
    if "type" in u:  # "transcription": the GA way to make this a transcription-only session
        s["type"] = p.check_choice(u["type"], "session.type", ("realtime", "transcription"))
    if (model := p.get_str(u, "model", "session.model")) is not None:
        s["model"] = model
    if (mods := p.get_list(u, "output_modalities", "session.output_modalities")) is not None:
        s["output_modalities"] = check_output_modalities(mods, "session.output_modalities")
    if (instr := p.get_str(u, "instructions", "session.instructions")) is not None:
        s["instructions"] = instr
    if (mot := p.get_max_tokens(u, "max_output_tokens", "session.max_output_tokens")) is not None:
        s["max_output_tokens"] = mot
    if (audio := p.get_dict(u, "audio", "session.audio")) is not None:
        p.check_known(audio, {"input", "output"}, "session.audio")
        if (ain := p.get_dict(audio, "input", "session.audio.input")) is not None:
            _apply_audio_input(s["audio"]["input"], ain, "session.audio.input")
        if (aout := p.get_dict(audio, "output", "session.audio.output")) is not None:
            _apply_audio_output(s["audio"]["output"], aout, "session.audio.output")
    _apply_common(s, u)
    fc.tool_request(s["tools"], s["tool_choice"], None, "session.tool_choice")  # a named tool_choice is a tool
    if "truncation" in u:
        s["truncation"] = check_truncation(u["truncation"], "session.truncation")
    for key in ("prompt", "reasoning", "parallel_tool_calls"):
        if key in u:
            s[key] = _OPTIONAL_CHECKS[key](u[key], "session." + key)


def _apply_beta(s: dict, u: dict) -> None:
    if "type" in u:
        p.check_choice(u["type"], "session.type", ("realtime",))
    if (model := p.get_str(u, "model", "session.model")) is not None:
        s["model"] = model
    if (mods := p.get_list(u, "modalities", "session.modalities")) is not None:
        if not mods or any(m not in ("text", "audio") for m in mods):
            raise p.bad_value("session.modalities", mods, '["text"] or ["audio", "text"]')
        s["output_modalities"] = ["audio"] if "audio" in mods else ["text"]
    if (instr := p.get_str(u, "instructions", "session.instructions")) is not None:
        s["instructions"] = instr
    if (mot := p.get_max_tokens(u, "max_response_output_tokens", "session.max_response_output_tokens")) is not None:
        s["max_output_tokens"] = mot
    if (temp := p.get_number(u, "temperature", "session.temperature", lo=0.6, hi=1.2)) is not None:
        s["temperature"] = temp
    ain, aout = s["audio"]["input"], s["audio"]["output"]
    if "input_audio_format" in u:
        ain["format"] = p.format_from_beta(u["input_audio_format"], "session.input_audio_format")
    if "output_audio_format" in u:
        aout["format"] = p.format_from_beta(u["output_audio_format"], "session.output_audio_format")
    mapped_in = {k2: u[k1] for k1, k2 in (("input_audio_transcription", "transcription"),
                                          ("input_audio_noise_reduction", "noise_reduction"),
                                          ("turn_detection", "turn_detection")) if k1 in u}
    _apply_audio_input(ain, mapped_in, "session")
    _apply_audio_output(aout, {k: u[k] for k in ("voice", "speed") if k in u}, "session")
    _apply_common(s, u)
    fc.tool_request(s["tools"], s["tool_choice"], None, "session.tool_choice")


def _apply_common(s: dict, u: dict) -> None:
    if "include" in u:
        s["include"] = check_include(u["include"], "session.include")
    if (tools := p.get_list(u, "tools", "session.tools")) is not None:
        s["tools"] = check_tools(tools, "session.tools")
    if "tool_choice" in u:
        s["tool_choice"] = check_tool_choice(u["tool_choice"], "session.tool_choice")
    if "tracing" in u:
        tracing = u["tracing"]
        if tracing is not None and tracing != "auto" and not isinstance(tracing, dict):
            raise p.bad_value("session.tracing", tracing, '"auto", an object or null')
        if isinstance(tracing, dict):
            p.check_known(tracing, {"workflow_name", "group_id", "metadata"}, "session.tracing")
            for key in ("workflow_name", "group_id"):
                p.get_str(tracing, key, f"session.tracing.{key}")
        s["tracing"] = tracing


def _apply_audio_input(ain: dict, u: dict, prefix: str) -> None:
    if prefix.endswith(".input"):
        p.check_known(u, {"format", "transcription", "noise_reduction", "turn_detection"}, prefix)
    if "format" in u:
        ain["format"] = p.check_format(u["format"], prefix + ".format")
    name = (lambda k: f"{prefix}.{k}") if prefix.endswith(".input") else (lambda k: {
        "transcription": "session.input_audio_transcription",
        "noise_reduction": "session.input_audio_noise_reduction", "turn_detection": "session.turn_detection"}[k])
    if "transcription" in u:
        tr = p.get_dict(u, "transcription", name("transcription"), nullable=True)
        if tr is not None:
            p.check_known(tr, {"model", "language", "prompt"}, name("transcription"))
            for key in ("model", "language", "prompt"):
                p.get_str(tr, key, f"{name('transcription')}.{key}", nullable=True)
        ain["transcription"] = tr
    if "noise_reduction" in u:
        nr = p.get_dict(u, "noise_reduction", name("noise_reduction"), nullable=True)
        if nr is not None:
            p.check_known(nr, {"type"}, name("noise_reduction"))
        if nr is not None and "type" in nr:
            p.check_choice(nr["type"], name("noise_reduction") + ".type", ("near_field", "far_field"))
        ain["noise_reduction"] = nr
    if "turn_detection" in u:
        ain["turn_detection"] = check_turn_detection(u["turn_detection"], name("turn_detection"))


def _apply_audio_output(aout: dict, u: dict, prefix: str) -> None:
    if prefix.endswith(".output"):
        p.check_known(u, {"format", "voice", "speed"}, prefix)
    if "format" in u:
        aout["format"] = p.check_format(u["format"], prefix + ".format")
    if "voice" in u:
        voice = u["voice"]
        if isinstance(voice, dict):
            p.check_known(voice, {"id"}, prefix + ".voice")
            p.get_str(voice, "id", prefix + ".voice.id", required=True)
        elif not isinstance(voice, str):
            raise p.wrong_type(prefix + ".voice", "a string", voice)
        aout["voice"] = voice
    if (speed := p.get_number(u, "speed", prefix + ".speed", lo=0.25, hi=1.5)) is not None:
        aout["speed"] = speed


def check_turn_detection(value: Any, param: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise p.wrong_type(param, "an object or null", value)
    kind = p.check_choice(value.get("type", "server_vad"), param + ".type", ("server_vad", "semantic_vad"))
    defaults = SERVER_VAD_DEFAULTS if kind == "server_vad" else SEMANTIC_VAD_DEFAULTS
    # rtserve's own field: server_vad opts in to the early end of turn with an eagerness (turn_detection.py)
    p.check_known(value, set(defaults) | ({SERVER_VAD_EAGERNESS} if kind == "server_vad" else set()), param)
    out = dict(defaults)
    if kind == "server_vad":
        if value.get(SERVER_VAD_EAGERNESS) is not None:
            out[SERVER_VAD_EAGERNESS] = p.check_choice(value[SERVER_VAD_EAGERNESS],
                                                       f"{param}.{SERVER_VAD_EAGERNESS}",
                                                       ("low", "medium", "high", "auto"))
        if (t := p.get_number(value, "threshold", param + ".threshold", lo=0.0, hi=1.0)) is not None:
            out["threshold"] = t
        for key in ("prefix_padding_ms", "silence_duration_ms"):
            if (ms := p.get_int(value, key, f"{param}.{key}", lo=0, hi=60_000)) is not None:
                out[key] = ms
        if value.get("idle_timeout_ms") is not None:
            out["idle_timeout_ms"] = p.get_int(value, "idle_timeout_ms", param + ".idle_timeout_ms", lo=0)
    else:
        if "eagerness" in value:
            out["eagerness"] = p.check_choice(value["eagerness"], param + ".eagerness",
                                              ("low", "medium", "high", "auto"))
    for key in ("create_response", "interrupt_response"):
        if key in value:
            if not isinstance(value[key], bool):
                raise p.wrong_type(f"{param}.{key}", "a boolean", value[key])
            out[key] = value[key]
    return out


def check_output_modalities(mods: list, param: str) -> list[str]:
    if mods not in (["text"], ["audio"]):
        raise p.bad_value(param, mods, '["text"] or ["audio"]')
    return list(mods)


def check_tools(tools: list, param: str) -> list[dict]:
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise p.wrong_type(f"{param}[{i}]", "an object", tool)
        kind = p.check_choice(tool.get("type", "function"), f"{param}[{i}].type", ("function", "mcp"))
        if kind == "function":
            p.check_known(tool, {"type", "name", "description", "parameters"}, f"{param}[{i}]")
            name = fc.check_name(p.get_str(tool, "name", f"{param}[{i}].name", required=True), f"{param}[{i}].name")
            if name in names:
                raise p.bad_value(f"{param}[{i}].name", name, "a name no other tool of the list has")
            names.add(name)
            p.get_str(tool, "description", f"{param}[{i}].description")
            if (schema := p.get_dict(tool, "parameters", f"{param}[{i}].parameters")) is not None:
                fc.check_schema(schema, f"{param}[{i}].parameters")
    return tools


def check_tool_choice(value: Any, param: str) -> str | dict:
    if isinstance(value, str):
        return p.check_choice(value, param, ("none", "auto", "required"))
    if isinstance(value, dict):
        kind = p.check_choice(value.get("type"), param + ".type", ("function", "mcp"))
        if kind == "function":
            p.check_known(value, {"type", "name"}, param)
            p.get_str(value, "name", param + ".name", required=True)
        else:
            p.check_known(value, {"type", "server_label", "name"}, param)
            p.get_str(value, "server_label", param + ".server_label", required=True)
            p.get_str(value, "name", param + ".name", nullable=True)
        return value
    raise p.wrong_type(param, "a string or an object", value)


def check_truncation(value: Any, param: str) -> str | dict:
    """`"auto"`, `"disabled"` or `{type: "retention_ratio", retention_ratio, token_limits?}`."""
    if isinstance(value, str):
        return p.check_choice(value, param, ("auto", "disabled"))
    if not isinstance(value, dict):
        raise p.wrong_type(param, "a string or an object", value)
    p.check_known(value, {"type", "retention_ratio", "token_limits"}, param)
    p.check_choice(value.get("type"), param + ".type", ("retention_ratio",))
    if p.get_number(value, "retention_ratio", param + ".retention_ratio", lo=0.0, hi=1.0) is None:
        raise p.missing(param + ".retention_ratio")
    if (limits := p.get_dict(value, "token_limits", param + ".token_limits")) is not None:
        p.check_known(limits, {"post_instructions"}, param + ".token_limits")
        p.get_int(limits, "post_instructions", param + ".token_limits.post_instructions", lo=0)
    return value


TRANSCRIPT_LOGPROBS = "item.input_audio_transcription.logprobs"  # include: transcriptions list their tokens' logprobs


def check_include(value: Any, param: str) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise p.wrong_type(param, "an array or null", value)
    for i, entry in enumerate(value):
        p.check_choice(entry, f"{param}[{i}]", (TRANSCRIPT_LOGPROBS,))
    return value


def check_prompt(value: Any, param: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise p.wrong_type(param, "an object or null", value)
    p.check_known(value, {"id", "variables", "version"}, param)
    p.get_str(value, "id", param + ".id", required=True)
    p.get_dict(value, "variables", param + ".variables", nullable=True)
    p.get_str(value, "version", param + ".version", nullable=True)
    return value


def check_reasoning(value: Any, param: str) -> dict | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise p.wrong_type(param, "an object or null", value)
    p.check_known(value, {"effort"}, param)
    if "effort" in value:
        p.check_choice(value["effort"], param + ".effort", ("minimal", "low", "medium", "high", "xhigh"))
    return value


def check_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise p.wrong_type(param, "a boolean", value)
    return value


_OPTIONAL_CHECKS = {"prompt": check_prompt, "reasoning": check_reasoning, "parallel_tool_calls": check_bool}


# -------------------------------------------------------------------------------------------- response.create

@dataclass(slots=True)
class ResponseParams:
    """One response's effective settings: the session's, overridden by the `response` object of response.create."""
    instructions: str
    output_modalities: list[str]
    max_output_tokens: int | str
    temperature: float
    conversation: str = "auto"  # "auto" | "none"
    input: list | None = None  # raw items / item_references (validated by the session against its conversation)
    metadata: dict | None = None
    voice: Any = None
    tools: ToolRequest = field(default_factory=ToolRequest)  # the function tools and tool_choice this response uses
    tools_param: str = "session.tools"  # where they came from, for errors found when the response runs
    tool_list: list = field(default_factory=list)  # as the client sent them (session.tools or response.tools)


def response_params(session: dict, raw: Any, dialect: str) -> ResponseParams:
    params = ResponseParams(instructions=session["instructions"],
                            output_modalities=list(session["output_modalities"]),
                            max_output_tokens=session["max_output_tokens"], temperature=session["temperature"],
                            voice=session["audio"]["output"]["voice"])
    params.tools = fc.tool_request(session["tools"], session["tool_choice"], session.get("parallel_tool_calls"),
                                   "session.tool_choice")
    params.tool_list = session["tools"]
    if raw is None:
        return params
    if not isinstance(raw, dict):
        raise p.wrong_type("response", "an object", raw)
    beta = dialect == p.BETA
    known = {"instructions", "tools", "tool_choice", "conversation", "metadata", "input", "prompt",
             "parallel_tool_calls", "reasoning", "temperature"}
    known |= ({"modalities", "voice", "output_audio_format", "max_response_output_tokens"} if beta
              else {"output_modalities", "audio", "max_output_tokens"})
    p.check_known(raw, known, "response")  # before the nulls go: a null of the other dialect's field is a mistake
    raw = p.drop_nulls(raw, frozenset(), _RESPONSE_OPAQUE)
    if (instr := p.get_str(raw, "instructions", "response.instructions")) is not None:
        params.instructions = instr
    if beta:
        if (mods := p.get_list(raw, "modalities", "response.modalities")) is not None:
            if not mods or any(m not in ("text", "audio") for m in mods):
                raise p.bad_value("response.modalities", mods, '["text"] or ["audio", "text"]')
            params.output_modalities = ["audio"] if "audio" in mods else ["text"]
        key = "max_response_output_tokens"
        if "voice" in raw:
            params.voice = p.get_str(raw, "voice", "response.voice")
        if "output_audio_format" in raw:
            p.format_from_beta(raw["output_audio_format"], "response.output_audio_format")
    else:
        if (mods := p.get_list(raw, "output_modalities", "response.output_modalities")) is not None:
            params.output_modalities = check_output_modalities(mods, "response.output_modalities")
        key = "max_output_tokens"
        if (audio := p.get_dict(raw, "audio", "response.audio")) is not None:
            p.check_known(audio, {"output"}, "response.audio")
            aout = dict(session["audio"]["output"])
            _apply_audio_output(aout, p.get_dict(audio, "output", "response.audio.output") or {},
                                "response.audio.output")
            params.voice = aout["voice"]
    if (mot := p.get_max_tokens(raw, key, "response." + key)) is not None:
        params.max_output_tokens = mot
    if (temp := p.get_number(raw, "temperature", "response.temperature", lo=0.0, hi=2.0)) is not None:
        params.temperature = temp
    tools, tool_choice = session["tools"], session["tool_choice"]
    if (listed := p.get_list(raw, "tools", "response.tools")) is not None:
        tools = params.tool_list = check_tools(listed, "response.tools")
        params.tools_param = "response.tools"
    if "tool_choice" in raw:
        tool_choice = check_tool_choice(raw["tool_choice"], "response.tool_choice")
    for key in ("prompt", "reasoning", "parallel_tool_calls"):
        if key in raw:
            _OPTIONAL_CHECKS[key](raw[key], "response." + key)
    if "tools" in raw or "tool_choice" in raw or "parallel_tool_calls" in raw:
        parallel = raw.get("parallel_tool_calls", session.get("parallel_tool_calls"))
        params.tools = fc.tool_request(tools, tool_choice, parallel,
                                       "response.tool_choice" if "tool_choice" in raw else params.tools_param)
    if (conv := p.get_str(raw, "conversation", "response.conversation", nullable=True)) is not None:
        params.conversation = p.check_choice(conv, "response.conversation", ("auto", "none"))
    params.input = p.get_list(raw, "input", "response.input", nullable=True)
    params.metadata = p.get_metadata(raw, "metadata", "response.metadata")
    return params
