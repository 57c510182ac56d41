"""OpenAI HTTP API: /v1/models (and /v1/models/{model}), /v1/chat/completions, /v1/completions (streaming SSE and not), /health.

HTTP requests are batch traffic: they run at priority 1, behind realtime turns.

Requests are refused as early and as cheaply as possible, and never reach the engine unless every field is valid:
- by bytes: a body over `--max-request-bytes` is a 413, told by its Content-Length or while it is read;
- by the request models (gateway/http_models.py): a mistyped, out-of-range or unknown field is a 400 naming it;
- by characters: a prompt with more characters than `max_model_len` tokens of the longest vocabulary entry can hold
  is refused before the tokenizer sees it; otherwise it is tokenized on a worker thread, never on the event loop;
- by tokens: a prompt that leaves no room in the context, or a `max_tokens` beyond that room, is a 400 naming the limit
  (as vLLM answers; no silent clamp). Without `max_tokens` the output may fill the context.
A non-streaming request whose client disconnects is aborted, like a stream.

Structured outputs: OpenAI's `response_format` (json_object, json_schema) and vLLM's extra fields (`structured_outputs`
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`) become
`SamplingParams.structured_outputs`, enforced by the engine's grammar-constrained decoding. A spec the grammar compiler
rejects is a 400 whose `param` names the field the client sent.

Audio: chat's `input_audio` parts become their transcripts (gateway/audio_api.py); `modalities: ["text", "audio"]`
speaks the reply as `message.audio` / streamed `delta.audio` (gateway/chat_audio.py).

Tools: `tools` / `tool_choice` / `parallel_tool_calls` on chat (gateway/tools.py: the tool prompt, the call grammar,
the call parser); calls come back as `message.tool_calls` or streamed `delta.tool_calls`, finish_reason "tool_calls".

Model names: requests name one of the served names (--served-model-name; default the model's own), else a 404
`model_not_found`. `logprobs` come back in OpenAI's shapes (gateway/http_logprobs.py). `n` > 1 runs one engine request
per choice on the same prompt, the first alone until its first token so the others find the prompt in the prefix
cache. Sampling fields a request leaves out take the model's defaults (gateway/generation_config.py).

Any other path under /v1/ is a JSON 404 (405 for a method a served route does not take), not the web demo's answer.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import time
from typing import Any

import jinja2
import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Match, Route, WebSocketRoute

from audio.tts import TTSError
from engine import SamplingParams, StructuredOutputsParams
from engine.errors import EngineDeadError, EngineError, InvalidRequestError, PromptTooLongError
from gateway import memory
from gateway import http_logprobs as hl
from gateway import http_models as hm
from gateway import tools as tl
from gateway.realtime import protocol as p
from gateway.handshake import bearer_ok
from gateway.access_log import record_usage, request_timing
from gateway.metrics import LatencyTimer

HTTP_PRIORITY = 1
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
GREEDY_BELOW = 1e-5   # vLLM's rule: a smaller temperature overflows the logits it divides; it means greedy
ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected while its request was being served."""


class StreamCut(Exception):
    """The server is shutting down and its shutdown timeout is nearly over: a stream still running ends now."""


def json_response(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def error_response(err: HTTPError) -> Response:
    return json_response({"error": {"message": err.message, "type": err.type, "param": err.param,
                                    "code": err.code}}, err.status, err.headers)


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
        except ClientGone:   # nobody reads this; uvicorn drops it
            return Response(status_code=499)
    wrapper.__name__ = fn.__name__
    return wrapper


async def health(request: Request) -> Response:
    engine = getattr(request.app.state, "engine", None)
    if engine is None:
        if request.app.state.loading_error is not None:
            return json_response({"status": "error", "error": request.app.state.loading_error}, 503)
        return json_response({"status": "loading", "stage": request.app.state.loading_stage}, 503)
    replicas = engine.replica_health() if hasattr(engine, "replica_health") else None   # --data-parallel-size
    if not engine.healthy:   # stopped on a step fault no request could be blamed for (every replica, with several)
        body = {"status": "error", "error": engine.error}
        return json_response(body if replicas is None else {**body, "replicas": replicas}, 503)
    body = {"status": "ok", "model": request.app.state.served_model_names[0]}
    return json_response(body if replicas is None else {**body, "replicas": replicas})


def _model_card(request: Request, name: str) -> dict:
    return {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "rtserve"}


def audio_models(request: Request) -> dict[str, str]:
    """The audio models' names (none with --no-audio) -> the route that serves them."""
    if request.app.state.audio is None:
        return {}
    from gateway import audio_api   # (it builds on this module)
    return {**dict.fromkeys(audio_api.TRANSCRIPTION_MODELS, "/v1/audio/transcriptions"),
            **dict.fromkeys(audio_api.SPEECH_MODELS, "/v1/audio/speech")}


def served_model(request: Request, name: str, param: str | None = "model") -> str:
    """`name` if it is one of the names this server serves the model under (--served-model-name), else a 404."""
    _engine(request)
    if name not in request.app.state.served_model_names:
        route = audio_models(request).get(name)
        also = f" ({name} is an audio model: use {route})" if route else ""
        raise HTTPError(404, f"The model `{name}` does not exist; this server serves "
                             f"{', '.join(request.app.state.served_model_names)}{also}.", "model_not_found", param)
    return name


@endpoint
async def models(request: Request) -> Response:
    """The served model names, then the audio models' (Whisper's and piper's, under OpenAI's names too)."""
    _engine(request)
    names = [*request.app.state.served_model_names, *audio_models(request)]
    return json_response({"object": "list", "data": [_model_card(request, name) for name in names]})


@endpoint
async def model(request: Request) -> Response:
    """GET /v1/models/{model}: the SDK's `models.retrieve`."""
    name = request.path_params["model"]
    if name in audio_models(request):
        _engine(request)
        return json_response(_model_card(request, name))
    return json_response(_model_card(request, served_model(request, name, None)))


@endpoint
async def not_served(request: Request) -> Response:
    """Every other path under /v1/: 405 when a served route takes another method, else 404."""
    method, path = request.method, request.url.path
    for route in request.app.routes:
        if isinstance(route, WebSocketRoute) and route.matches({**request.scope, "type": "websocket"})[0] == \
                Match.FULL:
            raise HTTPError(426, f"{path} is a WebSocket endpoint (the Realtime API): connect with a WebSocket "
                                 f"client.", "upgrade_required")
        if isinstance(route, Route) and route.endpoint is not not_served and \
                route.matches(request.scope)[0] == Match.PARTIAL:
            allowed = ", ".join(sorted(route.methods or ()))
            raise HTTPError(405, f"{method} is not allowed on {path}; use {allowed}.", "method_not_allowed",
                            headers={"Allow": allowed})
    served = sorted(r.path for r in request.app.routes if isinstance(r, (Route, WebSocketRoute))
                    and r.path.startswith("/v1/") and r.endpoint is not not_served)
    raise HTTPError(404, f"{method} {path} is not served by rtserve; it serves {', '.join(served)}.", "not_found")


async def _read_body(request: Request) -> bytes:
    limit = request.app.state.settings.max_request_bytes
    return await read_capped(request, limit, f"this server's limit of {limit} bytes (--max-request-bytes)")


async def read_capped(request: Request, limit: int, what: str) -> bytes:
    """The body, refused with a 413 naming `what` as soon as its Content-Length or the bytes read so far pass `limit`;
    ClientGone if the client leaves while it is read."""
    too_large = HTTPError(413, f"The request body is larger than {what}.", "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                chunks.clear()
                if size >= memory.BIG_BYTES:   # what was read is free again
                    memory.release_soon()
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    """Return when the client disconnects (after the body is read, the ASGI server's next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, coro):
    """Await `coro`; if the client leaves first, cancel it (which aborts its engine request, or drops its Whisper
    rows) and raise ClientGone."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}   # vLLM's older names for the structured_outputs fields


def _structured(req: hm.SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the body field it came from (for `param` in errors), or (None, None)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = getattr(req, "response_format", None)
    if isinstance(rf, hm.JSONObjectFormat):
        found.append((StructuredOutputsParams(json_object=True), "response_format"))
    elif isinstance(rf, hm.JSONSchemaResponseFormat):
        schema = rf.json_schema.schema_
        so = StructuredOutputsParams(json=schema) if schema is not None else \
            StructuredOutputsParams(json_object=True)   # no schema: any JSON object
        found.append((so, "response_format.json_schema.schema"))
    try:
        if req.structured_outputs is not None:
            found.append((StructuredOutputsParams.from_dict(req.structured_outputs), "structured_outputs"))
        for name, field in GUIDED_FIELDS.items():
            if getattr(req, name) is not None:
                found.append((StructuredOutputsParams.from_dict({field: getattr(req, name)}, prefix=name), name))
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


def _sampling(req: hm.SamplingFields, engine, prompt_len: int,
              structured: tuple[StructuredOutputsParams | None, str | None],
              tool_req: tl.ToolRequest | None = None, tool_call_parser: str = "hermes",
              defaults: dict | None = None, prompt_param: str | None = None) -> SamplingParams:
    """A validated request -> SamplingParams for one prompt (`prompt_param` names it in errors); without a client cap
    the output may fill the rest of the context."""
    defaults = defaults or {}
    context = engine.max_model_len
    room = context - prompt_len
    prompt_param = prompt_param or ("messages" if isinstance(req, hm.ChatCompletionRequest) else "prompt")
    if room < 1:
        raise HTTPError(400, f"This model's maximum context length is {context} tokens; the prompt ({prompt_len} "
                             f"tokens) does not fit it with room for an output token.", "context_length_exceeded",
                        prompt_param)
    limit, field = req.output_limit
    if limit is not None and limit > room:
        raise HTTPError(400, f"'{field}' is too large: {limit}. This model's maximum context length is {context} "
                             f"tokens and your request has {prompt_len} input tokens ({limit} > {context} - "
                             f"{prompt_len}).", "invalid_value", field)
    if req.min_tokens and req.min_tokens > (limit or room):
        cap = f"'{field}' ({limit})" if limit else f"the room left in the context ({room} tokens)"
        raise HTTPError(400, f"Invalid 'min_tokens': must be at most {cap}, got {req.min_tokens}.", "invalid_value",
                        "min_tokens")
    temperature = req.temperature
    if temperature is not None and temperature < GREEDY_BELOW:
        temperature = 0.0
    kwargs = {"max_tokens": limit or room, "seed": req.seed,
              "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
              "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
              "ignore_eos": req.ignore_eos, "stop_token_ids": req.stop_token_ids, "min_tokens": req.min_tokens}
    # the model's defaults (--generation-config) fill what the client left out; the client's own value wins
    client = {"temperature": temperature, "top_p": req.top_p, "min_p": req.min_p,
              "top_k": -1 if req.top_k == 0 else req.top_k,   # vLLM: 0 and -1 both mean off
              "repetition_penalty": req.repetition_penalty}
    kwargs.update({k: defaults.get(k) if v is None else v for k, v in client.items()})
    kwargs["structured_outputs"], source = structured
    if tool_req is not None and tool_req.active:
        if source is not None:
            raise HTTPError(400, f"{source.split('.')[0]} cannot be combined with tools unless tool_choice is "
                                 f"'none'.", "invalid_value", source.split(".")[0])
        kwargs["structured_outputs"] = tl.tool_constraint(tool_req, tool_call_parser)
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except InvalidRequestError as exc:   # the models hold the same limits; this is a second line
        raise HTTPError(400, str(exc), "invalid_value", exc.param) from None


@functools.lru_cache(maxsize=8)
def _max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters: no token covers more characters of text than this (byte-level
    entries spell one byte per character, SentencePiece entries one character per character)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def _check_chars(chars: int, engine, param: str) -> None:
    """Refuse, before tokenizing, a prompt with more characters than the context can hold tokens of."""
    most = engine.max_model_len * _max_token_chars(engine.tokenizer)
    if chars > most:
        raise HTTPError(400, f"Invalid '{param}': the prompt is {chars} characters long and does not fit this "
                             f"model's maximum context length of {engine.max_model_len} tokens (which holds at most "
                             f"{most} characters).",
                        "context_length_exceeded", param)


def _chat_chars(req: hm.ChatCompletionRequest, tool_req: tl.ToolRequest) -> int:
    """The characters the chat prompt renders at least: message texts, earlier calls, tool definitions."""
    chars = sum(len(hm.message_text(m.content)) for m in req.messages)
    chars += sum(len(c.function.arguments) for m in req.messages if isinstance(m, hm.AssistantMessage)
                 for c in m.tool_calls or ())
    return chars + (len(orjson.dumps(tool_req.definitions())) if tool_req.active else 0)


def _tool_request(req: hm.ChatCompletionRequest) -> tl.ToolRequest:
    fields = {"tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools is not None else None,
              "tool_choice": req.tool_choice.model_dump(exclude_none=True)
              if isinstance(req.tool_choice, hm.NamedToolChoice) else req.tool_choice,
              "parallel_tool_calls": req.parallel_tool_calls}
    return tl.parse_request({k: v for k, v in fields.items() if v is not None})


def _chat_prompt(req: hm.ChatCompletionRequest, renderer, tool_req: tl.ToolRequest,
                 history: dict[int, str] | None = None) -> list[int]:
    """The rendered prompt; `history` holds the transcripts of earlier spoken replies, by message index."""
    flat = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        text = hm.message_text(m.content) or (history or {}).get(i, "")
        flat.append({"role": role, "content": text, **_tool_fields(m, i, flat)})
    native = renderer.takes_tools()
    messages, template_tools = tl.render(flat, tool_req, native)
    try:
        text = renderer.template(messages, tools=template_tools)
    except jinja2.TemplateError as exc:   # the template's own refusal, e.g. Llama 3.1's one call per assistant turn
        raise HTTPError(400, f"The chat template cannot render these messages: {exc}", "invalid_value",
                        "messages") from None
    return renderer.encode(text)


def _tool_fields(m, i: int, earlier: list[dict]) -> dict:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id` (which must answer an earlier call)."""
    if isinstance(m, hm.AssistantMessage) and m.tool_calls:
        return {"tool_calls": [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": c.function.arguments}}
                               for c in m.tool_calls]}
    if isinstance(m, hm.ToolMessage):
        if not any(c["id"] == m.tool_call_id for e in earlier for c in e.get("tool_calls", ())):
            raise HTTPError(400, f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                                 f"assistant message.", "invalid_value", f"messages[{i}].tool_call_id")
        return {"tool_call_id": m.tool_call_id}
    return {}


def _completion_prompts(prompts: list[str | list[int]], renderer) -> list[list[int]]:
    return [prompt if isinstance(prompt, list) else renderer.encode(prompt) if prompt else [] for prompt in prompts]


@endpoint
async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


@endpoint
async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    engine = _engine(request)
    state = request.app.state
    body = await _read_body(request)
    if chat:   # audio parts become their transcripts (imported here: audio_api builds on this module)
        from gateway import audio_api
        body = await audio_api.input_audio_to_text(request, body)
    try:
        req = hm.parse(hm.ChatCompletionRequest if chat else hm.CompletionRequest, body)
    except hm.RequestValidationError as exc:
        raise HTTPError(400, exc.message, exc.code, exc.param) from None
    served_model(request, req.model)
    tool_req = spoken = None
    history: dict[int, str] = {}
    if chat:   # a spoken reply and earlier spoken replies (imported here, as audio_api)
        from gateway import chat_audio
        spoken = chat_audio.ChatAudio.from_request(request, req)
        history = chat_audio.history_transcripts(request, req)
        try:
            tool_req = _tool_request(req)
            tl.check_auto_allowed(tool_req, state.settings.enable_auto_tool_choice)
            if tool_req.active:   # a schema the grammar compiler rejects is a 400 naming the tool
                await tl.check_schemas(tool_req, engine.compile_structured)
        except InvalidRequestError as exc:
            raise HTTPError(400, str(exc), "invalid_value", exc.param) from None
        _check_chars(_chat_chars(req, tool_req) + sum(map(len, history.values())), engine, "messages")
        batch = [await asyncio.to_thread(_chat_prompt, req, state.renderer, tool_req, history)]
        params_of = ["messages"]
    else:
        try:
            prompts = req.prompts()
        except hm.RequestValidationError as exc:
            raise HTTPError(400, exc.message, exc.code, exc.param) from None
        params_of = ["prompt"] if len(prompts) == 1 else [f"prompt[{k}]" for k in range(len(prompts))]
        for prompt, param in zip(prompts, params_of):
            if isinstance(prompt, str):
                _check_chars(len(prompt), engine, param)
        batch = await asyncio.to_thread(_completion_prompts, prompts, state.renderer)
    if len(body) >= memory.BIG_BYTES or sum(map(len, batch)) >= memory.BIG_PROMPT_TOKENS:   # (their copies are free
        memory.release_soon()                                                                # again)
    structured = _structured(req)
    prompt_params = []
    for prompt_ids, param in zip(batch, params_of):
        if not prompt_ids:
            raise HTTPError(400, "The prompt is empty.", "invalid_value", param)
        params = _sampling(req, engine, len(prompt_ids), structured, tool_req, state.tool_call_parser,
                           state.sampling_defaults, param)
        if req.logprobs:   # chat: a boolean with top_logprobs; completions: the number of top entries
            params.logprobs = (req.top_logprobs or 0) if chat else req.logprobs
        prompt_params.append((prompt_ids, params))
    parse_tools = tool_req is not None and tool_req.active
    rid = p.new_id("chatcmpl" if chat else "cmpl")
    created = int(time.time())
    model = req.model
    timer = LatencyTimer(state.metrics, "http", asyncio.get_running_loop().time(), request_timing(request))
    n = req.n or 1
    choices = await _start_choices(request, engine, rid, prompt_params, n, req.cache_salt,
                                   "tools" if parse_tools else structured[1])
    new_parser = (lambda: tl.new_tool_parser(state.tool_call_parser)) if parse_tools else None
    tokenizer = engine.tokenizer if req.logprobs else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(choices, n, rid, created, model, chat, include_usage, timer, new_parser,
                                         tokenizer, spoken, state.streams_cut),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        done = await unless_gone(request, _collect_all(choices, timer))
    except EngineError as exc:
        raise _engine_failure(exc) from None
    out_choices = []
    for i, (text, out, token_ids, logprobs) in enumerate(done):
        reason = "length" if out.finish_reason == "length" else "stop"
        if chat:
            message = {"role": "assistant", "content": text}
            if parse_tools:
                content, calls = tl.parse_output(message["content"], new_parser(), cut=reason == "length")
                message["content"] = content if calls or content else ""
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            if spoken is not None and message["content"]:
                message["audio"] = await _speak(request, spoken, message["content"])
                message["content"] = None
            lp = {"content": hl.chat_entries(tokenizer, token_ids, logprobs), "refusal": None} if tokenizer else None
            out_choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            lp = hl.completion_logprobs(tokenizer, token_ids, logprobs, 0)[0] if tokenizer else None
            out_choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
    usage = _usage([out for _, out, _, _ in done], [len(ids) for _, _, ids, _ in done], n)
    record_usage(timer.timing, usage)
    return json_response({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                          "model": model, "choices": out_choices, "usage": usage})


async def _speak(request: Request, spoken, text: str) -> dict:
    """A finished reply's `message.audio`: the whole file, spoken off the event loop (dropped if the client goes)."""
    reply = spoken.reply()
    try:
        data = await unless_gone(request, reply.whole(text))
    except TTSError as exc:
        raise HTTPError(500, "The spoken reply could not be synthesized.", exc.code, type="server_error") from None
    finally:
        reply.close()
    audio_id = p.new_id("audio")
    expires_at = spoken.remember(audio_id, text)
    return {"id": audio_id, "data": base64.b64encode(data).decode("ascii"), "expires_at": expires_at,
            "transcript": text}


def _engine_failure(exc: EngineError) -> HTTPError:
    """An engine failure, without its Python text: a stopped engine is a 503 (GET /health says why), a fault pinned on
    this request a 500."""
    if isinstance(exc, EngineDeadError):
        return HTTPError(503, "The engine is not running; GET /health says why.", "engine_unavailable",
                         type="server_error")
    return HTTPError(500, "The engine failed while serving this request.", "engine_error", type="server_error")


async def _start_choices(request: Request, engine, rid: str, prompts: list[tuple[list[int], SamplingParams]], n: int,
                         cache_salt: str | None, source: str | None) -> list[tuple]:
    """Start n engine requests for each (prompt ids, params); (generator, first output) for each, choice k * n + j
    being prompt k's sample j. Each prompt's first sample runs (beside the other prompts' first samples) until its
    first output, so that its prompt's full blocks are in the prefix cache when its other samples are admitted and
    they compute only what is left. A prompt error (raised before the first output) is a 400, not a broken stream."""
    choices: list[list] = []
    try:
        for i in range(len(prompts) * n):
            prompt_ids, params = prompts[i // n]
            j = i % n
            sp = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            choices.append([engine.generate(rid if i == 0 else f"{rid}-{i}", prompt_ids, sp, priority=HTTP_PRIORITY,
                                            cache_salt=cache_salt), None])
        await _firsts(request, [c for i, c in enumerate(choices) if i % n == 0])
        if n > 1:
            await _firsts(request, [c for i, c in enumerate(choices) if i % n])
    except BaseException as exc:
        for gen, _ in choices:   # abort the ones that started
            await gen.aclose()
        if isinstance(exc, (PromptTooLongError, InvalidRequestError)):
            msg, param = _structured_param(exc, source)
            raise HTTPError(400, msg, "context_length_exceeded" if isinstance(exc, PromptTooLongError)
                            else "invalid_value", param) from None
        if isinstance(exc, EngineError):
            raise _engine_failure(exc) from None
        raise
    return [tuple(c) for c in choices]


async def _firsts(request: Request, choices: list[list]) -> None:
    """Each [generator, None] gets its first output; on an error (or the client gone) the others' waits are
    cancelled before it is raised, so that their generators can be closed."""
    tasks = [asyncio.ensure_future(anext(gen)) for gen, _ in choices]
    try:
        firsts = await unless_gone(request, asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for c, first in zip(choices, firsts):
        c[1] = first


async def _collect_all(choices: list[tuple], timer) -> list[tuple]:
    """Every choice's whole output, side by side; if one fails or this is cancelled, all are aborted."""
    tasks = [asyncio.ensure_future(_collect(gen, first, timer if i == 0 else None))
             for i, (gen, first) in enumerate(choices)]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(gen, first, timer) -> tuple[str, Any, list[int], list]:
    """A non-streaming choice's whole output: (text, last output, output token ids, their logprobs). Closing the
    generator (this task cancelled) aborts the engine request."""
    text, out, token_ids, logprobs = [], first, [], []
    async with contextlib.aclosing(gen):
        while True:
            token_ids += out.new_token_ids
            logprobs += out.logprobs or ()
            if out.text_delta:
                if timer is not None:
                    timer.mark(asyncio.get_running_loop().time())
                text.append(out.text_delta)
            if out.finished:
                break
            out = await anext(gen)
    return "".join(text), out, token_ids, logprobs


def _usage(lasts: list, n_outs: list[int], n: int) -> dict:
    """OpenAI's usage for n choices of each prompt: each prompt counted once, the completions summed."""
    firsts = lasts[::n]
    prompt, completion = sum(f.num_prompt_tokens for f in firsts), sum(n_outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in firsts)}}


SPOKEN = -1   # the index _merged gives the spoken reply's audio


async def _merged(choices: list[tuple], audio=None, cut: asyncio.Event | None = None):
    """(index, output) from every choice's generator as they come, and (SPOKEN, encoded bytes) from `audio` (a spoken
    reply's generator) when given. Closing this closes them all, which aborts their engine requests and drops the
    speech; an error in one is raised here, and StreamCut once `cut` is set."""
    q: asyncio.Queue = asyncio.Queue()
    end = object()

    async def watch_cut() -> None:
        await cut.wait()
        q.put_nowait((SPOKEN, StreamCut()))

    async def pump_audio() -> None:
        try:
            async with contextlib.aclosing(audio):
                async for data in audio:
                    q.put_nowait((SPOKEN, data))
            q.put_nowait((SPOKEN, end))
        except Exception as exc:
            q.put_nowait((SPOKEN, exc))

    async def pump(i: int, gen, first) -> None:
        try:
            async with contextlib.aclosing(gen):
                out = first
                while True:
                    q.put_nowait((i, out))
                    if out.finished:
                        return
                    out = await anext(gen)
        except Exception as exc:
            q.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, gen, first)) for i, (gen, first) in enumerate(choices)]
    if audio is not None:
        tasks.append(asyncio.ensure_future(pump_audio()))
    left = len(tasks)
    if cut is not None:
        tasks.append(asyncio.ensure_future(watch_cut()))
    try:
        while left:
            i, out = await q.get()
            if isinstance(out, Exception):
                raise out
            if out is end:
                left -= 1
                continue
            left -= i != SPOKEN and out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(choices: list[tuple], n_per_prompt: int, rid: str, created: int, model: str, chat: bool,
                  include_usage: bool, timer, new_parser=None, tokenizer=None, spoken=None,
                  cut: asyncio.Event | None = None):
    """SSE chunks of the n choices, interleaved as they come; if the client goes away the generators are closed,
    which aborts the engine requests. With a tool parser, text goes through it: content as `delta.content`, calls as
    `delta.tool_calls`. With a tokenizer, each chunk carries its tokens' logprobs. With `spoken` (one choice), the
    content is spoken: `delta.audio` carries its transcript and the audio as it is made, and the finish_reason waits
    for the end of the audio (gateway/chat_audio.py). When `cut` is set (a shutdown about to time out), the stream ends
    with an `error` chunk and `[DONE]`, the body complete, and its engine requests are aborted."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    reply = spoken.reply() if spoken is not None else None
    audio_id = None

    def chunk(i: int, delta: str | dict | None, reason: str | None, role: bool = False, logprobs=None) -> bytes:
        if chat:
            d = {"role": "assistant", "content": ""} if role else \
                (delta if isinstance(delta, dict) else {"content": delta} if delta else {})
            choice = {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def audio_delta(**fields) -> dict:
        nonlocal audio_id
        if audio_id is None:   # the first audio delta names the reply
            audio_id = p.new_id("audio")
            fields = {"id": audio_id, **fields}
        return {"audio": fields}

    def spoken_delta(delta: str | dict | None) -> str | dict | None:
        """A content delta becomes the spoken reply's transcript (and goes to its speech)."""
        text = delta.get("content") if isinstance(delta, dict) else delta
        if reply is None or not text:
            return delta
        reply.feed(text)
        return audio_delta(transcript=text)

    n = len(choices)
    parsers = [new_parser() for _ in range(n)] if new_parser is not None else None
    lasts, n_outs, offsets = [None] * n, [0] * n, [0] * n
    held_reason = None   # the finish_reason, held back until the spoken reply's audio is out

    def choice_chunks(i: int, out) -> list[bytes]:
        nonlocal held_reason
        lasts[i] = out
        n_outs[i] += len(out.new_token_ids)
        reason = ("length" if out.finish_reason == "length" else "stop") if out.finished else None
        if out.text_delta and i == 0:
            timer.mark(asyncio.get_running_loop().time())
        logprobs = None
        if tokenizer is not None and out.logprobs:
            if chat:
                logprobs = {"content": hl.chat_entries(tokenizer, out.new_token_ids, out.logprobs), "refusal": None}
            else:
                logprobs, offsets[i] = hl.completion_logprobs(tokenizer, out.new_token_ids, out.logprobs, offsets[i])
        if parsers is None and reply is None:
            return [chunk(i, out.text_delta, reason, logprobs=logprobs)] \
                if out.text_delta or reason or logprobs is not None else []
        deltas: list[str | dict | None] = [out.text_delta] if out.text_delta else []
        if parsers is not None:
            parser = parsers[i]
            events = parser.feed(out.text_delta or "") + (tl.finish(parser, cut=out.finish_reason == "length")
                                                           if out.finished else [])
            deltas = list(_tool_deltas(events))
            if reason:
                reason = "tool_calls" if parser.calls and reason == "stop" else reason
        chunks = [chunk(i, spoken_delta(d), None, logprobs=logprobs if k == 0 else None) for k, d in enumerate(deltas)]
        if logprobs is not None and not deltas:   # tokens the parser holds back still have their logprobs
            chunks.append(chunk(i, None, None, logprobs=logprobs))
        if reason and reply is not None:
            held_reason = reason
            reply.finish()
        elif reason:
            chunks.append(chunk(i, None, reason))
        return chunks

    try:
        async with contextlib.aclosing(_merged(choices, reply.audio() if reply else None, cut)) as outputs:
            if chat:
                for i in range(n):
                    yield chunk(i, None, None, role=True)
            async for i, out in outputs:
                if i == SPOKEN:
                    yield chunk(0, audio_delta(data=base64.b64encode(out).decode("ascii")), None)
                    continue
                for c in choice_chunks(i, out):
                    yield c
    except (TTSError, StreamCut) as exc:   # the text so far went out; end the body in order
        message, code = ("The server is shutting down; this stream was cut at its shutdown timeout.",
                         "server_shutting_down") if isinstance(exc, StreamCut) else \
            ("The spoken reply could not be synthesized.", exc.code)
        yield b"data: " + orjson.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                                  "code": code}}) + b"\n\n"
        yield b"data: [DONE]\n\n"
        return
    finally:
        if reply is not None:
            reply.close()
    if reply is not None:
        if audio_id is not None:   # the last audio delta: only its expiry, as OpenAI ends one
            expires_at = spoken.remember(audio_id, reply.transcript)
            yield chunk(0, {"audio": {"expires_at": expires_at}}, None)
        yield chunk(0, None, held_reason)
    usage = _usage(lasts, n_outs, n_per_prompt)
    record_usage(timer.timing, usage)
    if include_usage:
        yield b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                        "choices": [], "usage": usage}) + b"\n\n"
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
