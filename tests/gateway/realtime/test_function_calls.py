"""CallOutput without a model: a response's text split into its message item and function_call items, with the
event sequence OpenAI sends, every event valid against the SDK's types in both dialects (the model's own outputs are
covered end to end in test_tools.py; a text-then-call output is fed here because SmolLM2 rarely writes one)."""
from __future__ import annotations

import asyncio
import json

from gateway.realtime import protocol as p
from gateway.realtime import session_config as sc
from gateway.realtime.conversation import Conversation
from gateway.realtime.function_calls import CallOutput
from gateway.realtime.response import ActiveResponse, ResponseRunner, TextOutput
from tests.gateway.realtime.client import BETA_EVENTS, GA_EVENTS

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class Recorder:
    """The ResponseRunner methods CallOutput uses, run on a conversation and an event list (no engine)."""
    add_output_item = ResponseRunner.add_output_item
    close_output_item = ResponseRunner.close_output_item

    def __init__(self) -> None:
        self.conversation = Conversation()
        self.events: list[dict] = []

    def send(self, event: dict) -> None:
        self.events.append({"event_id": p.new_id("event"), **event})

    def open_sink(self, resp: ActiveResponse) -> TextOutput:
        return TextOutput(self.send, resp)


def run(text: str, status: str = "completed", step: int = 3) -> tuple[Recorder, ActiveResponse]:
    session = sc.default_session("sess_x", "m")
    session["tools"] = TOOLS
    params = sc.response_params(session, None, p.GA)
    resp = ActiveResponse(p.new_id("resp"), params, "r", None, ["text"])
    rec = Recorder()
    out = CallOutput(rec, resp)
    for i in range(0, len(text), step):   # in small pieces: tags and JSON split across deltas
        out.delta(text[i:i + step])
    resp.status = status   # set when the engine's output finishes, before finish() (as ResponseRunner does)
    asyncio.run(out.finish())
    out.done()
    for ev in rec.events:
        GA_EVENTS.validate_python(ev, strict=True)
        beta = p.to_dialect(ev, p.BETA)
        if beta is not None:
            BETA_EVENTS.validate_python(beta, strict=True)
    return rec, resp


def collapse(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_text_then_call_are_two_items_and_no_markup_reaches_the_text():
    rec, resp = run("Sure, let me check. " + CALL)
    assert collapse([e["type"] for e in rec.events]) == [
        "response.output_item.added", "conversation.item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done",
        "response.output_item.added", "conversation.item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "conversation.item.done"]
    message, call = resp.out_items
    assert message.content == [{"type": "output_text", "text": "Sure, let me check."}]
    assert (call.type, call.name, call.status, json.loads(call.arguments)) == \
        ("function_call", "get_weather", "completed", {"city": "Paris"})
    done = next(e for e in rec.events if e["type"] == "response.function_call_arguments.done")
    assert (done["output_index"], done["call_id"], done["arguments"]) == (1, call.call_id, call.arguments)
    assert [it.id for it in rec.conversation.items] == [message.id, call.id]


def test_calls_only_and_a_call_cut_short():
    rec, resp = run(CALL + "\n" + CALL)
    assert [(it.type, it.status) for it in resp.out_items] == [("function_call", "completed")] * 2
    assert not [e for e in rec.events if e["type"].startswith("response.content_part")]
    rec, resp = run(CALL[:-17], status="incomplete")   # max_output_tokens reached inside the arguments
    (call,) = resp.out_items
    assert call.status == "incomplete" and call.arguments == '{"city": "Par'
    assert [e["type"] for e in rec.events][-3:] == ["response.function_call_arguments.done",
                                                     "response.output_item.done", "conversation.item.done"]


def test_markup_cut_by_max_output_tokens_is_not_text():
    """A reply cut while it may be opening another call (`<tool_`, or `<tool_call>` before the name) ends with its
    calls only: the held-back markup never becomes a message; a reply that ends by itself keeps such a tail as text."""
    for tail in ("\n<tool_", '\n<tool_call>\n{"na'):
        rec, resp = run(CALL + tail, status="incomplete")
        assert [(it.type, it.status) for it in resp.out_items] == [("function_call", "completed")], tail
        assert not any(e["type"].startswith("response.output_text") for e in rec.events)
    rec, resp = run("Is 2 <", status="completed")
    assert resp.out_items[0].content == [{"type": "output_text", "text": "Is 2 <"}]
