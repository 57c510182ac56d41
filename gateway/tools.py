"""Tool calling for /v1/chat/completions: validation, the tool prompt, the call grammar and the call parser.

Call format (Hermes style, the one Qwen2.5 and the Hermes models are trained on):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>

Several calls (`parallel_tool_calls`, on by default) are separated by a newline.

Rendering. When the model's chat template renders `tools` itself (checked once by `PromptRenderer.takes_tools()`), the
definitions, assistant `tool_calls` and `tool` messages go to the template as OpenAI sends them. Otherwise (SmolLM2, our
default) the gateway renders them in a documented form of its own:
- the definitions, one JSON object per line inside `<tools></tools>`, and the call format are appended to the system
  message (or make one) — see `tool_prompt()`;
- an assistant message with `tool_calls` is its text followed by the calls in the call format above, exactly as the
  model emits them, so a later turn's prompt extends the earlier one;
- consecutive `tool` messages become one user turn of `<tool_response>…</tool_response>` blocks (as Qwen2.5's template
  does), each holding the tool's output.

`tool_choice` becomes a constraint on the engine's grammar-constrained decoding (an xgrammar structural tag; the
arguments of each tool follow its `parameters` schema):
- `required`: only calls, at least one (`tags_with_separator`, at_least_one);
- a named function: the same with that function only;
- `auto` (the default when tools are given): free text until the model writes `<tool_call>`, then a valid call is
  forced (`triggered_tags`); the model may also answer in text only;
- `none`: the tool definitions are not rendered and nothing is constrained or parsed: a plain text answer (earlier tool
  turns in the history are still rendered).
`parallel_tool_calls: false` stops the output after the first call.

Models whose template renders another call format get its grammar and parser instead (`--tool-call-parser`, detected
from the template; Llama 3.1's `llama3_json`): see "Tool-call formats that follow the model" below.
"""
from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import StructuredOutputsParams
from engine.errors import InvalidRequestError
from gateway.realtime import protocol as p

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _bad(param: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {param}: {why}", param=param)


@dataclass(slots=True)
class ToolRequest:
    """A request's validated tools and tool_choice."""
    tools: list[dict] = field(default_factory=list)   # {"name", "description", "parameters"} per tool
    choice: str = "none"                               # "none" | "auto" | "required" | "named"
    name: str | None = None                            # the forced function when choice == "named"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether tools are rendered, constrained and parsed."""
        return bool(self.tools) and self.choice != "none"

    def definitions(self) -> list[dict]:
        return [{"type": "function", "function": {k: v for k, v in t.items() if v is not None}} for t in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        if not self.active:
            return None
        tags = [{"type": "tag", "begin": f'{OPEN}{{"name": "{t["name"]}", "arguments": ',
                 # the engine compiles JSON-schema parts with fixed separators (", " and ": ")
                 "content": {"type": "json_schema", "json_schema": t["parameters"]},
                 "end": "}" + CLOSE}
                for t in self.tools if self.choice != "named" or t["name"] == self.name]
        if self.choice == "auto":
            fmt = {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": False,
                   "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                   "stop_after_first": not self.parallel}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


def parse_request(body: dict) -> ToolRequest:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; raises InvalidRequestError with `param`."""
    raw = body.get("tools")
    tools: list[dict] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad("tools", f"must be an array of tools, got {type(raw).__name__}")
        for i, t in enumerate(raw):
            at = f"tools[{i}]"
            if not isinstance(t, dict):
                raise _bad(at, "must be an object")
            if t.get("type") != "function":
                raise _bad(f"{at}.type", f"must be 'function', got {t.get('type')!r}")
            fn = t.get("function")
            if not isinstance(fn, dict):
                raise _bad(f"{at}.function", "must be an object with a name")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise _bad(f"{at}.function.name", f"must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
            if any(x["name"] == name for x in tools):
                raise _bad(f"{at}.function.name", f"duplicate tool name {name!r}")
            desc = fn.get("description")
            if desc is not None and not isinstance(desc, str):
                raise _bad(f"{at}.function.description", "must be a string")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise _bad(f"{at}.function.parameters", "must be a JSON Schema object")
            if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
                raise _bad(f"{at}.function.strict", "must be a boolean")
            tools.append({"name": name, "description": desc, "parameters": params or dict(EMPTY_PARAMETERS)})
    names = [t["name"] for t in tools]
    tc = body.get("tool_choice")
    name = None
    if tc is None:
        choice = "auto" if tools else "none"
    elif tc in ("none", "auto", "required"):
        choice = tc
    elif isinstance(tc, dict) and tc.get("type") == "function":
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tc.get("name")   # chat shape, or the Responses shape
        if name not in names:
            raise _bad("tool_choice", f"no tool named {name!r} in tools (have {names})")
        choice = "named"
    else:
        raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                                  "{'name': ...}}")
    if choice in ("auto", "required") and tc is not None and not tools:
        raise _bad("tool_choice", f"{choice!r} needs a non-empty tools array")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be a boolean")
    return ToolRequest(tools, choice, name, True if parallel is None else parallel)


async def check_schemas(req: ToolRequest,
                        compile_structured: Callable[[StructuredOutputsParams], Awaitable[None]]) -> None:
    """Compile each tool's `parameters` with the engine's grammar compiler (`AsyncEngine.compile_structured`, cached
    by schema), so a schema it cannot compile is a 400 naming that tool, not an error about the combined grammar."""
    for i, t in enumerate(req.tools):
        try:
            await compile_structured(StructuredOutputsParams(json=t["parameters"]))
        except InvalidRequestError as exc:
            why = str(exc).split(": ", 1)[-1]
            raise _bad(f"tools[{i}].function.parameters", why) from None


def tool_prompt(req: ToolRequest) -> str:
    """The tool instructions our own rendering adds to the system message."""
    defs = "\n".join(json.dumps(d, ensure_ascii=False) for d in req.definitions())
    return ("You may call one or more functions to help with the user's request. The functions you can call are "
            f"described by these JSON signatures:\n<tools>\n{defs}\n</tools>\n"
            "To call a function, reply with its name and arguments as a JSON object inside <tool_call></tool_call> "
            "tags:\n<tool_call>{\"name\": <function-name>, \"arguments\": <arguments-object>}</tool_call>")


def format_call(name: str, arguments: str) -> str:
    return f'{OPEN}{{"name": "{name}", "arguments": {arguments or "{}"}}}{CLOSE}'


def render(messages: list[dict], req: ToolRequest, native: bool) -> tuple[list[dict], list[dict] | None]:
    """Validated chat messages (role, content, tool_calls, tool_call_id) -> (template messages, template `tools`)."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):   # templates format the arguments themselves (Qwen2.5 with | tojson)
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out, (req.definitions() if req.active else None)
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(format_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if req.active:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tool_prompt(req)}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt(req)})
    return out, None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Splits the model's output, as it streams, into content and tool calls.

    `feed(delta)` returns events: ("content", text), ("call", index, id, name) when a call's name is known, and
    ("args", index, text) as its arguments arrive. Text that may be the start of `<tool_call>` is held back, so no
    markup reaches the content; the object's closing brace and `</tool_call>` are held back from the arguments.
    Content is trimmed: leading whitespace and whitespace around calls are dropped. The non-streaming response runs
    the same parser over the whole text, so both give the same calls."""

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False
        self.header = False
        self.sent = 0                 # argument characters of the open call already emitted
        self.pending_ws = ""
        self.content_started = False
        self.calls: list[dict] = []   # {"id", "name", "arguments"}; the last one is open while in_call

    def feed(self, delta: str) -> list[tuple]:
        self.buf += delta
        events: list[tuple] = []
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i >= 0:
                    self._text(self.buf[:i], events)
                    self.buf, self.in_call, self.header, self.pending_ws = self.buf[i + len(OPEN):], True, False, ""
                    continue
                keep = _partial_suffix(self.buf, OPEN)
                self._text(self.buf[:len(self.buf) - keep], events)
                self.buf = self.buf[len(self.buf) - keep:]
                return events
            if not self.header:
                m = _HEADER.match(self.buf)
                if m:
                    self._start(m.group(1), events)
                    self.buf, self.header, self.sent = self.buf[m.end():], True, 0
                    continue
                j = self.buf.find(CLOSE)
                if j < 0:
                    return events
                inner, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CLOSE):], False
                obj = _loads(inner)   # a call in another key order, or not a call at all
                if isinstance(obj, dict) and isinstance(obj.get("name"), str) and NAME_RE.match(obj["name"]):
                    args = obj.get("arguments", {})
                    self._start(obj["name"], events)
                    self._args(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), events)
                else:
                    self._text(OPEN + inner + CLOSE, events)
                continue
            j = self.buf.find(CLOSE)
            if j >= 0:
                args = self.buf[:j].rstrip()
                args = args[:-1] if args.endswith("}") else args   # the call object's own closing brace
                self._args(args[self.sent:], events)
                self.buf, self.in_call, self.header = self.buf[j + len(CLOSE):], False, False
                continue
            cut = self.buf.rfind("}")   # from the last brace on it may be the call's end
            if cut > self.sent:
                self._args(self.buf[self.sent:cut], events)
            return events

    def finish(self) -> list[tuple]:
        """Flush at the end of the output (a call cut by max_tokens keeps its partial arguments)."""
        events: list[tuple] = []
        if self.in_call and self.header:
            self._args(self.buf[self.sent:], events)
        elif self.in_call:
            self._text(OPEN + self.buf, events)
        else:
            self._text(self.buf, events)
        self.buf, self.in_call = "", False
        return events

    def _start(self, name: str, events: list) -> None:
        call = {"id": p.new_id("call"), "name": name, "arguments": ""}
        self.calls.append(call)
        events.append(("call", len(self.calls) - 1, call["id"], name))

    def _args(self, text: str, events: list) -> None:
        if text:
            self.calls[-1]["arguments"] += text
            events.append(("args", len(self.calls) - 1, text))
            self.sent += len(text)

    def _text(self, text: str, events: list) -> None:
        text = self.pending_ws + text
        if not self.content_started:
            text = text.lstrip()
        body = text.rstrip()
        self.pending_ws = text[len(body):]
        if body:
            events.append(("content", body))
            self.content_started = True


def finish(parser: ToolCallParser, cut: bool) -> list[tuple]:
    """The parser's last events. An output cut by its token limit drops the text the parser still holds back: that
    text is what may have become a call's markup (`<tool_`, or a call opened before its name), not reply text."""
    events = parser.finish()
    return [e for e in events if e[0] != "content"] if cut else events


def parse_output(text: str, parser: ToolCallParser | None = None, cut: bool = False) -> tuple[str | None, list[dict]]:
    """The whole output -> (content or None, OpenAI tool_calls); `parser` is a fresh one of the call format (hermes
    when not given); `cut`: the output ended at its token limit."""
    parser = parser or ToolCallParser()
    events = parser.feed(text) + finish(parser, cut)
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in parser.calls]
    return (content or None), calls


# --- Tool-call formats that follow the model (`--tool-call-parser`) ---------------------------------------------------
#
# hermes: the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format above (Qwen2.5, Hermes, and rtserve's
#   own tool prompt for templates that do not take tools, SmolLM2's among them).
# llama3_json: Llama 3.1's JSON call, `{"name": "get_weather", "parameters": {"city": "Paris"}}`, as its template
#   renders an assistant call and tells the model to answer; optionally after `<|python_tag|>`. Its template renders
#   one call per assistant turn (it raises on more), so the grammar allows one call whatever `parallel_tool_calls` says.
# Detected from the chat template when `--tool-call-parser` is not given, as vLLM users would pick it.

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
PYTHON_TAG = "<|python_tag|>"
LLAMA3_TRIGGER = '{"name": '


def detect_tool_call_parser(chat_template: str | None) -> str:
    """The call format a chat template renders: Llama 3.1's header tokens with a `"parameters"` object -> llama3_json;
    anything else (`<tool_call>` templates, templates that do not take tools) -> hermes."""
    text = chat_template or ""
    if "<|start_header_id|>" in text and '"parameters"' in text:
        return "llama3_json"
    return "hermes"


def resolve_tool_call_parser(requested: str | None, chat_template: str | None, takes_tools: bool) -> str:
    """`--tool-call-parser` as given, or detected from the template. A template that does not take tools gets rtserve's
    own tool prompt, whose format is hermes, so asking for another format there is a configuration error."""
    if requested is not None and requested not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {requested!r}")
    if not takes_tools:
        if requested not in (None, "hermes"):
            raise ValueError(f"--tool-call-parser {requested}: the chat template does not render tools, so rtserve "
                             "renders them with its own tool prompt, whose call format is hermes")
        return "hermes"
    return requested or detect_tool_call_parser(chat_template)


AUTO_TOOL_CHOICE_DISABLED = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                             "(this server runs with --no-enable-auto-tool-choice; send tool_choice 'required', "
                             "'none' or a named function)")


def check_auto_allowed(req: ToolRequest, enabled: bool) -> None:
    """vLLM's rule: without --enable-auto-tool-choice, `tool_choice: "auto"` (the default when tools are sent) is a
    400; required, named and none still work, because the grammar fixes their output."""
    if req.choice == "auto" and req.tools and not enabled:
        raise _bad("tool_choice", AUTO_TOOL_CHOICE_DISABLED)


def llama3_json_constraint(req: ToolRequest) -> StructuredOutputsParams | None:
    """The grammar of Llama 3.1's call (what xgrammar's own "llama" structural tag builds): one
    `{"name": "<tool>", "parameters": <its schema>}`. required / named: the whole output is that call; auto: text, or a
    call once the model writes `{"name": `."""
    if not req.active:
        return None
    tags = [{"type": "tag", "begin": f'{LLAMA3_TRIGGER}"{t["name"]}", "parameters": ',
             "content": {"type": "json_schema", "json_schema": t["parameters"]}, "end": "}"}
            for t in req.tools if req.choice != "named" or t["name"] == req.name]
    if req.choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [LLAMA3_TRIGGER], "tags": tags, "at_least_one": False,
               "stop_after_first": True}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "; ", "at_least_one": True,
               "stop_after_first": True}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


def tool_constraint(req: ToolRequest, parser: str) -> StructuredOutputsParams | None:
    """The grammar for `req` in the `parser` call format."""
    return llama3_json_constraint(req) if parser == "llama3_json" else req.constraint()


def new_tool_parser(parser: str) -> ToolCallParser:
    """A streaming parser of the `parser` call format (the same feed / finish / calls interface for both)."""
    return Llama3JsonToolParser() if parser == "llama3_json" else ToolCallParser()


_LLAMA3_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"(?:parameters|arguments)"\s*:\s*'
                            r'(?=\S)')


def _json_value_end(text: str, start: int, state: list) -> int:
    """Scan a JSON value from `start`; returns the index just past it, or -1 if `text` ends first. `state` =
    [depth, in_string, escaped] carries the scan across calls (the caller resumes at the returned scan position)."""
    depth, in_str, esc = state
    i = start
    while i < len(text):
        ch = text[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    state[:] = [0, False, False]
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif depth == 0 and ch in ",}]":   # a bare number / literal ends at the call object's next delimiter
            state[:] = [0, False, False]
            return i
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                state[:] = [0, False, False]
                return i + 1
        i += 1
    state[:] = [depth, in_str, esc]
    return -1


_LLAMA3_KEYS = ('"name"', '"parameters"', '"arguments"')


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1's calls, `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after `<|python_tag|>`,
    several separated by `;` (as vLLM's llama3_json parser reads them), streamed: text that may start a call is held
    back; once the name is known the arguments stream as they are scanned, up to the end of their JSON value (the call
    object's own closing brace is not part of them). Text before a call is content, as the auto grammar allows."""

    def __init__(self) -> None:
        super().__init__()
        self.scan = [0, False, False]   # _json_value_end's state over the open call's arguments
        self.pos = 0                    # scan position in buf
        self.closing = False            # arguments done; the call object's `}` is next
        self.after_call = False         # a call just closed: a `;` before the next one is dropped

    def feed(self, delta: str) -> list[tuple]:
        self.buf += delta
        events: list[tuple] = []
        while True:
            if self.closing:
                stripped = self.buf.lstrip()
                if not stripped:
                    return events
                self.buf = stripped[1:] if stripped[0] == "}" else stripped
                self.closing, self.in_call, self.after_call = False, False, True
                continue
            if not self.in_call:
                self.buf = self.buf.replace(PYTHON_TAG, "")
                if self.after_call:   # `;` between calls is no content
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return events
                    self.buf, self.after_call = self.buf.removeprefix(";"), False
                i, definite = self._call_start()
                if i is None:   # no call can start here: all but a possible partial `<|python_tag|>` is content
                    keep = _partial_suffix(self.buf, PYTHON_TAG)
                    self._text(self.buf[:len(self.buf) - keep], events)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return events
                self._text(self.buf[:i], events)
                self.buf = self.buf[i:]
                if not definite:   # `{` and the start of `"name"`: wait for more
                    return events
                self.in_call, self.header = True, False
                continue
            if not self.header:
                m = _LLAMA3_HEADER.match(self.buf)
                if m:
                    self._start(m.group(1), events)
                    self.buf, self.header, self.sent, self.pos = self.buf[m.end():], True, 0, 0
                    self.scan = [0, False, False]
                    continue
                end = _json_value_end(self.buf, 0, [0, False, False])
                if end < 0:
                    return events
                raw, self.buf, self.in_call = self.buf[:end], self.buf[end:], False
                obj = _loads(raw)
                if isinstance(obj, dict) and isinstance(obj.get("name"), str) and NAME_RE.match(obj["name"]):
                    args = obj.get("parameters", obj.get("arguments", {}))
                    self._start(obj["name"], events)
                    self._args(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), events)
                    self.after_call = True
                else:   # `{"name": ...}` that is not a call: content as written
                    self._text(raw, events)
                continue
            end = _json_value_end(self.buf, self.pos, self.scan)
            if end < 0:
                self._args(self.buf[self.sent:], events)
                self.pos = len(self.buf)
                return events
            self._args(self.buf[self.sent:end], events)
            self.buf, self.closing = self.buf[end:], True

    def _call_start(self) -> tuple[int | None, bool]:
        """Where a call object starts (`{` then one of its keys, whitespace allowed) and whether that is certain, or
        may start (the buffer ends inside that opening); (None, False) if neither. An object that turns out not to be
        a call goes back to the content as written."""
        i = self.buf.find("{")
        while i >= 0:
            rest = self.buf[i + 1:].lstrip()
            if any(rest.startswith(key) for key in _LLAMA3_KEYS):
                return i, True
            if any(key.startswith(rest) for key in _LLAMA3_KEYS):
                return i, False
            i = self.buf.find("{", i + 1)
        return None, False

    def finish(self) -> list[tuple]:
        events: list[tuple] = []
        if self.in_call and self.header and not self.closing:
            self._args(self.buf[self.sent:], events)
        elif self.in_call and not self.header:
            self._text(self.buf, events)
        elif not self.in_call:
            self._text(self.buf.replace(PYTHON_TAG, ""), events)
        self.buf, self.in_call, self.closing = "", False, False
        return events
