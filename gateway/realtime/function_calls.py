"""Function calling in Realtime sessions: the tools and tool_choice a response uses, their checks, and `CallOutput`,
the sink that turns the model's text into the response's message item and `function_call` items.

The prompt, the call grammar and the call parser are gateway/tools.py's (the same as /v1/chat/completions): a response
whose tools are active renders them into the prompt, decodes under the tool_choice constraint and streams its text
through `ToolCallParser`. Text goes to a message item (spoken when the response speaks: TTS only ever gets this part,
never a call); each call goes out as its own `function_call` item:

    response.output_item.added → conversation.item.added (beta: .created) → response.function_call_arguments.delta*
    → response.function_call_arguments.done (call_id, name, arguments) → response.output_item.done
    → conversation.item.done (GA)

and is part of `response.done`'s `output`. Text before a call is a message item of its own, closed when the call
starts (a spoken one keeps speaking and is closed at the end of the response).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jsonschema

from gateway import tools as tl
from gateway.realtime import protocol as p
from gateway.realtime.conversation import Item

if TYPE_CHECKING:
    from gateway.realtime.response import ActiveResponse, ResponseRunner


def check_name(name: str, param: str) -> str:
    if not tl.NAME_RE.match(name):
        raise p.bad_value(param, name, "a name matching ^[a-zA-Z0-9_-]{1,64}$")
    return name


def check_schema(schema: dict, param: str) -> None:
    """A tool's `parameters` must be a valid JSON Schema (checked against its metaschema here, at once; whether the
    grammar compiler takes it is checked when a response first uses it, see `ResponseRunner`)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(x) for x in exc.path)
        raise p.ProtocolError(f"Invalid JSON Schema in '{param}'{f' at {where}' if where else ''}: "
                              f"{exc.message[:200]}", "invalid_value", param) from None


def tool_request(tools: list[dict], tool_choice: Any, parallel: bool | None, choice_param: str) -> tl.ToolRequest:
    """Validated Realtime tools (flat: type, name, description, parameters) and tool_choice → a ToolRequest.
    MCP tools are not served here: they are kept in the session but never rendered."""
    funcs = [{"name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters") or dict(tl.EMPTY_PARAMETERS)}
             for t in tools if t.get("type", "function") == "function"]
    name = None
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") == "function":
            name = tool_choice["name"]
            if name not in [t["name"] for t in funcs]:
                raise p.ProtocolError(f"tool_choice names the function {name!r}, which is not among the tools "
                                      f"({[t['name'] for t in funcs]}).", "invalid_value", choice_param)
            choice = "named"
        else:
            choice = "auto"
    else:
        choice = tool_choice
    if not funcs:
        choice = "none"
    return tl.ToolRequest(funcs, choice, name, True if parallel is None else parallel)


def check_call_output(item: Item, earlier: list[Item], param: str) -> None:
    """A function_call_output must answer a function_call before it (as OpenAI checks)."""
    if item.type == "function_call_output" and not any(
            it.type == "function_call" and it.call_id == item.call_id for it in earlier):
        raise p.ProtocolError(f"No function_call item with call_id {item.call_id!r} in the conversation: a "
                              "function_call_output must answer a call.", "invalid_value", param + ".call_id")


class CallOutput:
    """A response's output when its tools are active: the parser splits the model's text into content and calls.
    Content goes to a message item, opened on the first content, through the runner's text or spoken sink (which
    becomes `resp.output`); each call is its own function_call item. Same interface as the sinks: `delta`, `finish`
    (end of the model's output), `cancel`, `done` (close what is still open)."""

    def __init__(self, runner: ResponseRunner, resp: ActiveResponse) -> None:
        self.runner, self.resp = runner, resp
        self.parser = tl.ToolCallParser()
        self.sink = None          # the message item's TextOutput | AudioOutput, while it is open
        self.call: Item | None = None   # the function_call item whose arguments are streaming

    def delta(self, text: str) -> None:
        self._handle(self.parser.feed(text))

    async def finish(self) -> None:
        # a call still open here was cut short: done() closes it; markup cut by max_output_tokens is not reply text
        self._handle(tl.finish(self.parser, cut=self.resp.status == "incomplete"), at_end=True)
        if hasattr(self.sink, "finish"):
            await self.sink.finish()   # the spoken text is heard before the response ends

    def cancel(self) -> None:
        if hasattr(self.sink, "cancel"):
            self.sink.cancel()

    def done(self) -> None:
        """End of the response: close the open call (incomplete: cut before its `</tool_call>`) and message."""
        if self.call is not None:
            self._close_call("incomplete")
        self._close_message("completed" if self.resp.status == "completed" else "incomplete")

    def _handle(self, events: list[tuple], at_end: bool = False) -> None:
        for ev in events:
            if ev[0] == "content":
                if self.call is not None:
                    self._close_call("completed")
                if self.sink is None:
                    item = Item(p.new_id("item"), "message", role="assistant", status="in_progress")
                    self.runner.add_output_item(self.resp, item)
                    self.resp.item = item
                    self.sink = self.resp.output = self.runner.open_sink(self.resp)
                self.sink.delta(ev[1])
            elif ev[0] == "call":
                if self.call is not None:
                    self._close_call("completed")
                if self.sink is not None and not hasattr(self.sink, "finish"):   # a text part is done here
                    self._close_message("completed")
                self.call = Item(p.new_id("item"), "function_call", status="in_progress", call_id=ev[2],
                                 name=ev[3], arguments="")
                self.runner.add_output_item(self.resp, self.call)
            else:
                self.call.arguments += ev[2]
                self.runner.send({"type": "response.function_call_arguments.delta", "response_id": self.resp.id,
                                  "item_id": self.call.id, "output_index": self.resp.out_items.index(self.call),
                                  "call_id": self.call.call_id, "delta": ev[2]})
        if self.call is not None and not self.parser.in_call and not at_end:   # its `</tool_call>` came
            self._close_call("completed")

    def _close_call(self, status: str) -> None:
        call, self.call = self.call, None
        self.runner.send({"type": "response.function_call_arguments.done", "response_id": self.resp.id,
                          "item_id": call.id, "output_index": self.resp.out_items.index(call),
                          "call_id": call.call_id, "name": call.name, "arguments": call.arguments})
        self.runner.close_output_item(self.resp, call, status)

    def _close_message(self, status: str) -> None:
        if self.sink is None:
            return
        sink, self.sink = self.sink, None
        sink.done()
        self.runner.close_output_item(self.resp, self.resp.item, status)
