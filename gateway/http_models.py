"""Request models of the OpenAI HTTP API (pydantic, as vLLM's protocol module): every field the openai SDK sends for
/v1/chat/completions and /v1/completions, plus vLLM's extra sampling and structured-output fields.

A body is parsed once, strictly (no "5" for 5, no 1 for true, no NaN or infinity), and unknown fields are refused as
OpenAI refuses them. `parse()` turns the first validation error into a `RequestValidationError` whose `param` is the
field's path as the client wrote it (`messages[0].content[1].text`) and whose message is our own text naming the
expected type or limit: no pydantic or Python text reaches a client.

Unions are tagged by the JSON kind of the value (`_by_kind`) or by a `type` / `role` field (`_by_field`), with tags that
start with "~" so that `_param()` can drop them from the error's location; a value of an unknown kind or tag goes to a
member that cannot match it, so the error lands on the field the client must fix (`messages[2].role`, `tools[0].type`).

Fields OpenAI defines that we do not implement (`logit_bias`, `best_of` > 1, `prediction`...) are accepted at
their neutral value and otherwise refused (`unsupported()`), never silently ignored. Advisory fields (`user`,
`metadata`, `store`, `service_tier`, the prompt-cache hints...) are type-checked and have no effect.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, create_model

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 16                 # stop sequences per request
MAX_CHOICES = 128             # choices per request: n, or a completion batch's prompts × n
MAX_STOP_CHARS = 1024         # characters per stop sequence
MAX_CACHE_SALT_CHARS = 1024
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule for function and schema names


# vLLM's extra request fields that rtserve does not implement: refused as unsupported rather than unknown. (`priority`
# is not taken from clients: HTTP requests always run behind realtime turns.)
VLLM_NOT_IMPLEMENTED = frozenset({
    "priority", "use_beam_search", "length_penalty", "best_of", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids", "bad_words",
    "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "guided_decoding_backend", "guided_whitespace_pattern",
    "guided_json_object", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "request_id",
    "kv_transfer_params", "vllm_xargs", "prompt_embeds", "response_format_schema", "thinking_token_budget",
})


class RequestValidationError(Exception):
    """A request body that does not follow the models; `param` is the field's path, `code` OpenAI's error code."""

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


def _kind(v: Any) -> str:
    """The JSON kind of a parsed value, as a union tag."""
    if v is None:
        return "~null"
    if isinstance(v, bool):
        return "~boolean"
    if isinstance(v, int):
        return "~integer"
    if isinstance(v, float):
        return "~number"
    if isinstance(v, str):
        return "~string"
    if isinstance(v, (list, tuple)):
        return "~array"
    if isinstance(v, (dict, BaseModel)):
        return "~object"
    return "~other"


def _by_kind(**members: Any) -> Any:
    """A union picked by the value's JSON kind (string=str, array=list[str], ...); another kind is an invalid_type
    error that names the kinds the field takes."""
    expected = " or ".join(JSON_NAMES[k] for k in members)
    tagged = tuple(Annotated[t, Tag(f"~{k}")] for k, t in members.items())
    return Annotated[Union[tagged], Discriminator(  # noqa: UP007 (a tuple of members)
        lambda v: _kind(v) if _kind(v)[1:] in members else None,
        custom_error_type="invalid_kind", custom_error_message=expected)]


def _by_field(field: str, members: dict[str, Any]) -> Any:
    """A union picked by a string field (`type`, `role`); any other value (or a non-object) goes to a fallback model
    whose Literal field fails, naming the allowed values."""
    fallback = create_model(f"Invalid_{field}", __config__=ConfigDict(extra="allow", strict=True),
                            **{field: (Literal[tuple(members)], ...)})
    tagged = tuple(Annotated[t, Tag(f"~{k}")] for k, t in members.items()) + (Annotated[fallback, Tag("~bad")],)

    def pick(v: Any) -> str:
        tag = v.get(field) if isinstance(v, dict) else getattr(v, field, None)
        return f"~{tag}" if isinstance(tag, str) and tag in members else "~bad"
    return Annotated[Union[tagged], Discriminator(pick)]  # noqa: UP007


JSON_NAMES = {"string": "a string", "array": "an array", "object": "an object", "integer": "an integer",
              "number": "a number", "boolean": "a boolean", "null": "null"}

# ---- content parts and messages ---------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["text"]
    text: str


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


class MediaPart(BaseModel):
    """image_url / input_audio / file parts: recognised, refused by `unsupported()`."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image_url", "input_audio", "file"]


UserPart = _by_field("type", {"text": TextPart, "image_url": MediaPart, "input_audio": MediaPart, "file": MediaPart})
AssistantPart = _by_field("type", {"text": TextPart, "refusal": RefusalPart})
TextOnlyPart = _by_field("type", {"text": TextPart})


class FunctionCall(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    arguments: str


class ToolCall(Strict):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: _by_kind(string=str, array=list[TextOnlyPart])
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: _by_kind(string=str, array=list[UserPart])
    name: str | None = None


class AssistantAudio(Strict):
    """A spoken reply named by its id; the other fields are what the SDK's own message objects carry back."""
    id: Annotated[str, Field(min_length=1, max_length=64)]
    data: str | None = None
    expires_at: int | None = None
    transcript: str | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: _by_kind(string=str, array=list[AssistantPart], null=None) = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    annotations: list[dict] | None = None     # what the SDK's own message objects carry back; not used
    audio: AssistantAudio | None = None       # an earlier spoken reply of this server (gateway/chat_audio.py)
    function_call: dict | None = None         # deprecated; refused when set


class ToolMessage(Strict):
    role: Literal["tool"]
    content: _by_kind(string=str, array=list[TextOnlyPart])
    tool_call_id: Annotated[str, Field(min_length=1)]


Message = _by_field("role", {"system": SystemMessage, "developer": SystemMessage, "user": UserMessage,
                             "assistant": AssistantMessage, "tool": ToolMessage})


def message_text(content: str | list | None) -> str:
    """A message's text: the string, or its text (and refusal) parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text if isinstance(p, TextPart) else p.refusal if isinstance(p, RefusalPart) else ""
                   for p in content)

# ---- tools, response_format, stream options ---------------------------------------------------------------------

class FunctionDefinition(Strict):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName | None = None
    name: str | None = None        # the Responses API's shape


class JSONSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict | None, Field(alias="schema")] = None
    strict: bool | None = None


class TextFormat(Strict):
    type: Literal["text"]


class JSONObjectFormat(Strict):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = _by_field("type", {"text": TextFormat, "json_object": JSONObjectFormat,
                                    "json_schema": JSONSchemaResponseFormat})


class VoiceId(Strict):
    id: str


class ChatAudioParam(Strict):
    """`audio` of a chat request: the spoken reply's voice and encoding (OpenAI's names)."""
    voice: _by_kind(string=str, object=VoiceId)
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None   # OpenAI's padding of deltas; we add none


Stop = _by_kind(string=Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                array=Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)],
                null=None)
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

# ---- requests ---------------------------------------------------------------------------------------------------

class SamplingFields(Strict):
    """What chat and completions share: sampling, stopping, streaming, and vLLM's extra fields."""
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # vLLM's extra fields
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None     # -1 and 0: off
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    ignore_eos: bool | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    structured_outputs: dict | None = None
    guided_json: _by_kind(object=dict, string=str, null=None) = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: _by_kind(string=Literal["none", "auto", "required"], object=NamedToolChoice, null=None) = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: ChatAudioParam | None = None
    prediction: dict | None = None
    functions: list[dict] | None = None
    function_call: _by_kind(string=str, object=dict, null=None) = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    moderation: dict | None = None

    @property
    def output_limit(self) -> tuple[int | None, str]:
        """The client's output cap and the field it came in (max_completion_tokens wins, as at OpenAI)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class CompletionRequest(SamplingFields):
    prompt: _by_kind(string=str, array=list[_by_kind(string=str, integer=Annotated[int, Field(ge=0)],
                                                       array=list[Annotated[int, Field(ge=0)]])])
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    echo: bool | None = None
    suffix: str | None = None

    @property
    def output_limit(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string or an array of token ids, or a batch (an array) of either. Each prompt gets `n`
        choices, indexed prompt by prompt (choice k * n + j is prompt k's sample j), as OpenAI and vLLM do."""
        p = self.prompt
        if not p:
            raise RequestValidationError("Invalid 'prompt': must not be empty.", "prompt", "invalid_value")
        if isinstance(p, str) or all(isinstance(t, int) for t in p):
            return [p]
        if not all(isinstance(x, (str, list)) for x in p):
            raise RequestValidationError("Invalid 'prompt': an array of token ids or an array of prompts, not a mix "
                                         "of both.", "prompt", "invalid_value")
        if len(p) * (self.n or 1) > MAX_CHOICES:
            raise RequestValidationError(f"Invalid 'prompt': at most {MAX_CHOICES} completions per request (prompts "
                                         f"× n), got {len(p)} × {self.n or 1}.", "prompt", "invalid_value")
        return list(p)

# ---- parsing and errors -----------------------------------------------------------------------------------------

def parse(model: type[SamplingFields], body: bytes) -> SamplingFields:
    """Validate a JSON body; raises RequestValidationError (the first error) with our message and the field path."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        raise _error(exc.errors(include_url=False, include_context=True)[0]) from None
    unsupported(req)
    return req


def unsupported(req: SamplingFields) -> None:
    """Refuse fields we accept only at their neutral value, and fields that contradict each other."""
    def refuse(param: str, why: str, code: str = "unsupported_value"):
        raise RequestValidationError(f"Unsupported value for '{param}': {why}.", param, code)

    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs and not req.logprobs:
            raise RequestValidationError("Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.",
                                         "top_logprobs", "invalid_value")
        _audio_output(req, refuse)
        for name in ("prediction", "functions", "function_call", "web_search_options"):
            if getattr(req, name) is not None:
                refuse(name, "not supported by this server")
        for i, m in enumerate(req.messages):
            if isinstance(m, UserMessage) and isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if isinstance(part, MediaPart):
                        refuse(f"messages[{i}].content[{j}].type", f"{part.type} parts are not supported over HTTP "
                                                                  f"yet; send text, or use the Realtime API for audio")
            if isinstance(m, AssistantMessage) and m.function_call is not None:
                refuse(f"messages[{i}].function_call", "not supported by this server")
    else:
        if req.best_of not in (None, 1):
            refuse("best_of", "only best_of=1 is supported")
        if req.echo:
            refuse("echo", "echoing the prompt is not supported")
        if req.suffix:
            refuse("suffix", "suffixes (insertion) are not supported")
    if req.logit_bias:
        refuse("logit_bias", "logit biases are not supported by this server")
    if req.stream_options is not None and not req.stream:
        raise RequestValidationError("Invalid 'stream_options': only allowed when 'stream' is true.",
                                     "stream_options", "invalid_value")


def _audio_output(req: ChatCompletionRequest, refuse) -> None:
    """`modalities` with "audio" and `audio` go together; what a spoken reply cannot be here is refused."""
    wants_audio = req.modalities is not None and "audio" in req.modalities
    if wants_audio and req.audio is None:
        raise RequestValidationError("Missing required parameter: 'audio' (the spoken reply's voice and format), "
                                     "required when 'modalities' includes \"audio\".", "audio",
                                     "missing_required_parameter")
    if req.audio is None:
        return
    if not wants_audio:
        raise RequestValidationError("Invalid 'audio': only allowed when 'modalities' includes \"audio\".", "audio",
                                     "invalid_value")
    if req.audio.format == "aac":
        refuse("audio.format", "aac cannot be encoded by this server; use wav, mp3, flac, opus or pcm16")
    if req.stream and req.audio.format == "flac":
        refuse("audio.format", "flac cannot be streamed (its header holds the total length); stream pcm16, wav, mp3 "
                               "or opus, or ask for flac without 'stream'")
    if req.n is not None and req.n > 1:
        refuse("n", "a spoken reply is one choice; n must be 1 with audio output")


def _param(loc: tuple) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not part.startswith("~"):
            out += f".{part}" if out else part
    return out or None


EXPECTED = {"string_type": "a string", "int_type": "an integer", "int_from_float": "an integer",
            "float_type": "a number", "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
            "model_type": "an object", "model_attributes_type": "an object", "none_required": "null",
            "is_instance_of": "an object"}
LIMITS = {"greater_than": "greater than {gt}", "greater_than_equal": "at least {ge}", "less_than": "less than {lt}",
          "less_than_equal": "at most {le}", "too_short": "at least {min_length} item(s) long",
          "too_long": "at most {max_length} items long", "string_too_short": "at least {min_length} character(s)",
          "string_too_long": "at most {max_length} characters", "string_pattern_mismatch": "a match of {pattern}",
          "literal_error": "one of {expected}"}


def _shown(v: Any) -> str:
    """A short JSON rendering of the client's value for a message."""
    try:
        text = orjson.dumps(v).decode()
    except TypeError:   # orjson writes no integer beyond 64 bits
        text = str(v) if isinstance(v, int) else "a value"
    return text if len(text) <= 40 else text[:37] + "..."


def _error(err: dict) -> RequestValidationError:
    kind, ctx, param = err["type"], err.get("ctx") or {}, _param(err["loc"])
    name = param or "body"
    if kind == "json_invalid":
        return RequestValidationError("The request body is not valid JSON.", None, "invalid_json")
    if kind == "model_type" and param is None:
        return RequestValidationError("The request body must be a JSON object.", None, "invalid_json")
    if kind == "missing":
        return RequestValidationError(f"Missing required parameter: '{name}'.", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        if param in VLLM_NOT_IMPLEMENTED:
            return RequestValidationError(f"Unsupported parameter: '{name}' (a vLLM extension) is not implemented by "
                                          f"this server.", param, "unsupported_parameter")
        return RequestValidationError(f"Unknown parameter: '{name}'.", param, "unknown_parameter")
    got = JSON_NAMES.get(_kind(err.get("input"))[1:], "another kind of value")
    if kind == "invalid_kind":
        return RequestValidationError(f"Invalid type for '{name}': expected {err['msg']}, but got {got} instead.",
                                      param, "invalid_type")
    if kind == "literal_error" and not isinstance(err.get("input"), str):   # every Literal here is of strings
        return RequestValidationError(f"Invalid type for '{name}': expected one of {ctx.get('expected')}, but got "
                                      f"{got} instead.", param, "invalid_type")
    if kind in EXPECTED:
        return RequestValidationError(f"Invalid type for '{name}': expected {EXPECTED[kind]}, but got {got} "
                                      f"instead.", param, "invalid_type")
    if kind == "finite_number":
        return RequestValidationError(f"Invalid value for '{name}': must be a finite number.", param, "invalid_value")
    if kind in LIMITS:
        try:
            limit = LIMITS[kind].format(**{k: str(v) for k, v in ctx.items()})
        except (KeyError, IndexError):
            limit = "within its allowed range"
        return RequestValidationError(f"Invalid value for '{name}': must be {limit}, got {_shown(err.get('input'))}.",
                                      param, "invalid_value")
    return RequestValidationError(f"Invalid value for '{name}'.", param, "invalid_value")
