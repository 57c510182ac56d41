"""OpenAI HTTP API: /v1/models, /v1/chat/completions, /v1/completions (streaming SSE and not), /health.

HTTP requests are batch traffic: they run at priority 1, behind realtime turns.

Structured outputs: OpenAI's `response_format` (json_object, json_schema) and vLLM's extra fields (`structured_outputs`
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`) become
`SamplingParams.structured_outputs`, enforced by the engine's grammar-constrained decoding. A spec the grammar compiler
rejects is a 400 whose `param` names the field the client sent.

Tools: `tools` / `tool_choice` / `parallel_tool_calls` on chat (gateway/tools.py: the tool prompt, the call grammar,
the call parser); calls come back as `message.tool_calls` or streamed `delta.tool_calls`, finish_reason "tool_calls".
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine import SamplingParams, StructuredOutputsParams
from engine.errors import EngineError, InvalidRequestError, PromptTooLongError
from gateway import tools as tl
from gateway.realtime import protocol as p
from gateway.handshake import bearer_ok
from gateway.metrics import LatencyTimer

HTTP_PRIORITY = 1


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(err: HTTPError) -> Response:
    return json_response({"error": {"message": err.message, "type": err.type, "param": err.param,
                                    "code": err.code}}, err.status)


def _engine(request: Request):
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        raise HTTPError(503, "The model is still loading.", "model_loading", type="server_error")
    return engine


def _check_auth(request: Request) -> None:
    if not bearer_ok(request.headers, request.app.state.settings.api_key):
        raise HTTPError(401, "Incorrect or missing API key.", "invalid_api_key")


def endpoint(fn):
    """Auth + OpenAI-shaped errors for every API route."""
    async def wrapper(request: Request) -> Response:
        try:
            _check_auth(request)
            return await fn(request)
        except HTTPError as err:
            return error_response(err)
    wrapper.__name__ = fn.__name__
    return wrapper


async def health(request: Request) -> Response:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        return json_response({"status": "loading"}, 503)
    if not engine.healthy:   # stopped on a step fault no request could be blamed for
        return json_response({"status": "error", "error": engine.error}, 503)
    return json_response({"status": "ok", "model": engine.model_name})


@endpoint
async def models(request: Request) -> Response:
    engine = _engine(request)
    return json_response({"object": "list", "data": [
        {"id": engine.model_name, "object": "model", "created": request.app.state.started, "owned_by": "rtserve"}]})


async def _body(request: Request) -> dict:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise HTTPError(400, f"The request body is not valid JSON: {e}.", "invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "The request body must be a JSON object.", "invalid_json")
    return body


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}   # vLLM's older names for the structured_outputs fields


def _structured(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the body field it came from (for `param` in errors), or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise HTTPError(400, "response_format must be an object with a 'type' of text, json_object or "
                                 "json_schema.", "invalid_value", "response_format")
        kind = rf["type"]
        if kind == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise HTTPError(400, "response_format.json_schema must be an object with 'name' and 'schema'.",
                                "invalid_value", "response_format.json_schema")
            if not isinstance(js.get("name"), str) or not js["name"]:
                raise HTTPError(400, "response_format.json_schema.name must be a non-empty string.",
                                "invalid_value", "response_format.json_schema.name")
            if js.get("strict") is not None and not isinstance(js["strict"], bool):
                raise HTTPError(400, "response_format.json_schema.strict must be a boolean.", "invalid_type",
                                "response_format.json_schema.strict")
            schema = js.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise HTTPError(400, "response_format.json_schema.schema must be a JSON Schema object.",
                                "invalid_type", "response_format.json_schema.schema")
            so = StructuredOutputsParams(json=schema) if schema is not None else \
                StructuredOutputsParams(json_object=True)   # no schema: any JSON object
            found.append((so, "response_format.json_schema.schema"))
        elif kind != "text":
            raise HTTPError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}.",
                            "invalid_value", "response_format.type")
    try:
        if body.get("structured_outputs") is not None:
            found.append((StructuredOutputsParams.from_dict(body["structured_outputs"]), "structured_outputs"))
        for name, field in GUIDED_FIELDS.items():
            if body.get(name) is not None:
                found.append((StructuredOutputsParams.from_dict({field: body[name]}, prefix=name), name))
    except InvalidRequestError as exc:
        param = exc.param or "structured_outputs"
        if param.startswith("guided_") and "." in param:   # guided_json.json -> guided_json
            param = param.split(".", 1)[0]
        raise HTTPError(400, str(exc).replace(exc.param or "", param, 1), "invalid_value", param) from None
    if len(found) > 1:
        raise HTTPError(400, f"Set only one of response_format, structured_outputs and guided_*; got "
                             f"{' and '.join(src.split('.')[0] for _, src in found)}.", "invalid_value", found[1][1])
    return found[0] if found else (None, None)


def _structured_param(exc: InvalidRequestError, source: str | None) -> tuple[str, str | None]:
    """An engine error about structured_outputs.<kind>, told in terms of the field the client sent."""
    msg, param = str(exc), exc.param
    if source and param and param.startswith("structured_outputs"):
        if source != "structured_outputs":
            msg = msg.replace(param, source, 1)
            param = source
    return msg, param


def _sampling(body: dict, engine, prompt_len: int, structured: tuple[StructuredOutputsParams | None, str | None],
              tool_req: tl.ToolRequest | None = None) -> SamplingParams:
    """OpenAI body fields → SamplingParams; `max_tokens` defaults to what fits the context."""
    try:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        room = engine.max_model_len - prompt_len
        if room < 1:
            raise PromptTooLongError(f"the prompt ({prompt_len} tokens) does not fit the model's "
                                     f"{engine.max_model_len}-token context")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise HTTPError(400, "max_tokens must be a positive integer.", "invalid_value", "max_tokens")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if body.get("n", 1) != 1:
            raise HTTPError(400, "Only n=1 is supported.", "invalid_value", "n")
        kwargs = {"max_tokens": min(room, max_tokens or room),
                  "temperature": body.get("temperature", 1.0),
                  "top_p": body.get("top_p", 1.0), "seed": body.get("seed"), "stop": stop or None,
                  "frequency_penalty": body.get("frequency_penalty") or 0.0,
                  "presence_penalty": body.get("presence_penalty") or 0.0}
        for key in ("top_k", "min_p", "repetition_penalty", "ignore_eos"):  # vLLM's extra fields
            if key in body:
                kwargs[key] = body[key]
        kwargs["structured_outputs"], source = structured
        if tool_req is not None and tool_req.active:
            if source is not None:
                raise HTTPError(400, f"{source.split('.')[0]} cannot be combined with tools unless tool_choice is "
                                     f"'none'.", "invalid_value", source.split(".")[0])
            kwargs["structured_outputs"] = tool_req.constraint()
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except (InvalidRequestError, PromptTooLongError, TypeError, ValueError) as exc:
        raise HTTPError(400, str(exc), "invalid_value", getattr(exc, "param", None)) from None


def _chat_prompt(body: dict, renderer, tool_req: tl.ToolRequest) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty array.", "invalid_value", "messages")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise HTTPError(400, f"messages[{i}] needs a role of system, developer, user, assistant or tool.",
                            "invalid_value", f"messages[{i}].role")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise HTTPError(400, f"messages[{i}].content must be a string or an array of parts.",
                            "invalid_type", f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        flat.append({"role": role, "content": content, **_tool_fields(m, i, flat)})
    native = renderer.takes_tools()
    messages, template_tools = tl.render(flat, tool_req, native)
    return renderer.encode(renderer.template(messages, tools=template_tools))


def _tool_fields(m: dict, i: int, earlier: list[dict]) -> dict:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id` (which must answer an earlier call)."""
    if m["role"] == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise HTTPError(400, f"messages[{i}].tool_calls must be an array.", "invalid_type",
                            f"messages[{i}].tool_calls")
        for j, c in enumerate(calls):
            at = f"messages[{i}].tool_calls[{j}]"
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not isinstance(fn, dict):
                raise HTTPError(400, f"{at} must be an object with an id and a function.", "invalid_value", at)
            if not isinstance(fn.get("name"), str) or not tl.NAME_RE.match(fn["name"]):
                raise HTTPError(400, f"{at}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$.", "invalid_value",
                                f"{at}.function.name")
            if not isinstance(fn.get("arguments"), str):
                raise HTTPError(400, f"{at}.function.arguments must be a JSON string.", "invalid_type",
                                f"{at}.function.arguments")
        return {"tool_calls": [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                               for c in calls]} if calls else {}
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise HTTPError(400, f"messages[{i}] (role tool) needs a tool_call_id.", "invalid_value",
                            f"messages[{i}].tool_call_id")
        if not any(c["id"] == call_id for e in earlier for c in e.get("tool_calls", ())):
            raise HTTPError(400, f"messages[{i}].tool_call_id {call_id!r} answers no tool call of an earlier "
                                 f"assistant message.", "invalid_value", f"messages[{i}].tool_call_id")
        return {"tool_call_id": call_id}
    return {}


def _completion_prompt(body: dict, renderer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return renderer.encode(prompt) if prompt else []
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise HTTPError(400, "'prompt' must be a string or an array of token ids (one prompt).", "invalid_value",
                    "prompt")


@endpoint
async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


@endpoint
async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    engine = _engine(request)
    state = request.app.state
    body = await _body(request)
    tool_req = None
    if chat:
        try:
            tool_req = tl.parse_request(body)
            if tool_req.active:   # a schema the grammar compiler rejects is a 400 naming the tool
                await tl.check_schemas(tool_req, engine.compile_structured)
        except InvalidRequestError as exc:
            raise HTTPError(400, str(exc), "invalid_value", exc.param) from None
        prompt_ids = await asyncio.to_thread(_chat_prompt, body, state.renderer, tool_req)
    else:
        prompt_ids = await asyncio.to_thread(_completion_prompt, body, state.renderer)
    if not prompt_ids:
        raise HTTPError(400, "The prompt is empty.", "invalid_value", "prompt")
    structured = _structured(body)
    params = _sampling(body, engine, len(prompt_ids), structured, tool_req)
    parse_tools = tool_req is not None and tool_req.active
    rid = p.new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    model = body.get("model") or engine.model_name
    gen = engine.generate(rid, prompt_ids, params, priority=HTTP_PRIORITY, cache_salt=body.get("cache_salt"))
    timer = LatencyTimer(state.metrics, "http", asyncio.get_running_loop().time())
    try:  # surface prompt errors (raised before the first output) as HTTP 400, not a broken stream
        first = await anext(gen)
    except (PromptTooLongError, InvalidRequestError) as exc:
        msg, param = _structured_param(exc, "tools" if parse_tools else structured[1])
        raise HTTPError(400, msg, type(exc).__name__, param) from None
    except EngineError as exc:
        raise HTTPError(500, str(exc), "engine_error", type="server_error") from None
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_stream(gen, first, rid, created, model, chat, include_usage, timer,
                                         tl.ToolCallParser() if parse_tools else None),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    text, out, n_out = [], first, 0
    async with contextlib.aclosing(gen):
        while True:
            n_out += len(out.new_token_ids)
            if out.text_delta:
                timer.mark(asyncio.get_running_loop().time())
                text.append(out.text_delta)
            if out.finished:
                break
            out = await anext(gen)
    usage = _usage(out, n_out)
    reason = "length" if out.finish_reason == "length" else "stop"
    if chat:
        message = {"role": "assistant", "content": "".join(text)}
        if parse_tools:
            content, calls = tl.parse_output(message["content"])
            message["content"] = content if calls or content else ""
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return json_response({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                          "usage": usage})


def _usage(out, n_out: int) -> dict:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": out.num_prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


async def _stream(gen, first, rid: str, created: int, model: str, chat: bool, include_usage: bool, timer,
                  parser: tl.ToolCallParser | None = None):
    """SSE chunks; if the client goes away the generator is closed, which aborts the engine request. With a tool
    parser, text goes through it: content as `delta.content`, calls as `delta.tool_calls`."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | dict | None, reason: str | None, role: bool = False) -> bytes:
        if chat:
            d = {"role": "assistant", "content": ""} if role else \
                (delta if isinstance(delta, dict) else {"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return b"data: " + orjson.dumps(body) + b"\n\n"

    async with contextlib.aclosing(gen):
        if chat:
            yield chunk(None, None, role=True)
        out, n_out = first, 0
        while True:
            n_out += len(out.new_token_ids)
            reason = ("length" if out.finish_reason == "length" else "stop") if out.finished else None
            if out.text_delta:
                timer.mark(asyncio.get_running_loop().time())
            if parser is not None:
                events = parser.feed(out.text_delta or "") + (parser.finish() if out.finished else [])
                for delta in _tool_deltas(events):
                    yield chunk(delta, None)
                if reason:
                    yield chunk(None, "tool_calls" if parser.calls and reason == "stop" else reason)
            elif out.text_delta or reason:
                yield chunk(out.text_delta, reason)
            if out.finished:
                break
            out = await anext(gen)
        if include_usage:
            yield b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                            "choices": [], "usage": _usage(out, n_out)}) + b"\n\n"
        yield b"data: [DONE]\n\n"


def _tool_deltas(events: list[tuple]):
    """Parser events -> chat deltas: content as is; a call's index, id, type and name first, then its arguments."""
    for ev in events:
        if ev[0] == "content":
            yield {"content": ev[1]}
        elif ev[0] == "call":
            yield {"tool_calls": [{"index": ev[1], "id": ev[2], "type": "function",
                                   "function": {"name": ev[3], "arguments": ""}}]}
        else:
            yield {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}
