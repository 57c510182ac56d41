"""Conversation items and their rendering into prompt token ids.

Items are stored GA-shaped. The renderer keeps each session's prompt append-only: a new turn re-renders the whole
conversation through the model's chat template, and when the previous rendering (prompt + generated answer) is a prefix
of the new text, only the new suffix is tokenized and appended to the previous token ids. The engine's prefix cache then
finds every earlier block and prefills only the new turn. Anything that rewrites history (delete, truncate, insert in the
middle, other instructions) falls back to a full re-render and the cache reuses the longest still-valid prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway import tools as tl
from gateway.realtime import protocol as p

MAX_ITEM_ID_LEN = 64

_USER_PARTS = ("input_text", "input_audio")
_SYSTEM_PARTS = ("input_text",)
_ASSISTANT_PARTS = ("output_text", "output_audio", "text", "audio")  # beta spells the assistant parts text/audio


@dataclass(slots=True)
class Item:
    """One conversation item, GA-shaped. `audio_ms[i]` is how much audio content part i holds (for truncate)."""
    id: str
    type: str  # "message" | "function_call" | "function_call_output"
    role: str | None = None
    content: list[dict] = field(default_factory=list)
    status: str = "completed"
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    audio_ms: dict[int, int] = field(default_factory=dict)
    audio_marks: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # (audio ms, transcript chars)

    def to_dict(self, include_audio: bool = False) -> dict:
        out: dict[str, Any] = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "message":
            out["role"] = self.role
            out["content"] = [part if include_audio or "audio" not in part else
                              {k: v for k, v in part.items() if k != "audio"} for part in self.content]
        elif self.type == "function_call":
            out.update(call_id=self.call_id, name=self.name, arguments=self.arguments)
        else:
            out.update(call_id=self.call_id, output=self.output)
        return out

    def text(self) -> str:
        """What the model sees of this item: texts and transcripts of its parts."""
        return "".join(part.get("text") or part.get("transcript") or "" for part in self.content)


def parse_item(raw: Any, param: str = "item") -> Item:
    """A client-supplied item (conversation.item.create or response.input) → Item; raises ProtocolError."""
    if not isinstance(raw, dict):
        raise p.wrong_type(param, "an object", raw)
    p.check_known(raw, {"id", "type", "object", "status", "role", "content", "call_id", "name", "arguments",
                        "output"}, param)
    item_id = p.get_str(raw, "id", param + ".id", nullable=True) or p.new_id("item")
    if len(item_id) > MAX_ITEM_ID_LEN:
        raise p.bad_value(param + ".id", item_id, f"at most {MAX_ITEM_ID_LEN} characters")
    kind = p.check_choice(raw.get("type", "message"), param + ".type",
                          ("message", "function_call", "function_call_output"))
    if "object" in raw:
        p.check_choice(raw["object"], param + ".object", ("realtime.item",))
    if "status" in raw:
        p.check_choice(raw["status"], param + ".status", ("completed", "incomplete", "in_progress"))
    if kind == "function_call":
        return Item(item_id, kind, call_id=p.get_str(raw, "call_id", param + ".call_id") or p.new_id("call"),
                    name=p.get_str(raw, "name", param + ".name", required=True),
                    arguments=p.get_str(raw, "arguments", param + ".arguments") or "")
    if kind == "function_call_output":
        return Item(item_id, kind, call_id=p.get_str(raw, "call_id", param + ".call_id", required=True),
                    output=p.get_str(raw, "output", param + ".output", required=True))
    role = p.check_choice(p.get_str(raw, "role", param + ".role", required=True), param + ".role",
                          ("user", "assistant", "system"))
    content = p.get_list(raw, "content", param + ".content")
    if content is None:
        raise p.missing(param + ".content")
    allowed = {"user": _USER_PARTS, "system": _SYSTEM_PARTS, "assistant": _ASSISTANT_PARTS}[role]
    parts = [_parse_part(part, f"{param}.content[{i}]", allowed) for i, part in enumerate(content)]
    return Item(item_id, "message", role=role, content=parts)


def _parse_part(part: Any, param: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(part, dict):
        raise p.wrong_type(param, "an object", part)
    ptype = p.check_choice(part.get("type"), param + ".type", allowed)
    ptype = {"text": "output_text", "audio": "output_audio"}.get(ptype, ptype)
    if ptype in ("input_text", "output_text"):
        p.check_known(part, {"type", "text"}, param)
        return {"type": ptype, "text": p.get_str(part, "text", param + ".text", required=True)}
    p.check_known(part, {"type", "audio", "transcript", "format"}, param)
    out = {"type": ptype}
    if (audio := p.get_str(part, "audio", param + ".audio", nullable=True)) is not None:
        out["audio"] = audio
    transcript = p.get_str(part, "transcript", param + ".transcript", nullable=True)
    out["transcript"] = transcript
    return out


# What an id that names no item is refused with, per client event: OpenAI's codes, which clients key on (pipecat fails
# its retrieve_conversation_item future on item_retrieve_invalid_item_id and takes any other error as fatal to the
# connection; openai-agents and others treat the delete and truncate ones as harmless races).
MISSING_ITEM = {
    "retrieve": ("item_retrieve_invalid_item_id", "Error retrieving item: the item with id '{}' does not exist."),
    "delete": ("item_delete_invalid_item_id", "Error deleting item: the item with id '{}' does not exist."),
    "truncate": ("item_truncate_invalid_item_id", "Error truncating item: the item with id '{}' does not exist."),
    "create": ("item_create_invalid_previous_item_id",
               "Error adding item: the previous item with id '{}' does not exist."),
    "reference": ("item_not_found", "Error reading response.input: the item with id '{}' does not exist."),
}


class Conversation:
    """The ordered items of the default conversation (`conv_…`)."""

    def __init__(self) -> None:
        self.id = p.new_id("conv")
        self.items: list[Item] = []

    def __contains__(self, item_id: str) -> bool:
        return any(it.id == item_id for it in self.items)

    def get(self, item_id: str, op: str, param: str = "item_id") -> Item:
        """The item `item_id` names, for the client event `op` (a key of MISSING_ITEM, which says how to refuse an
        id that names none)."""
        for item in self.items:
            if item.id == item_id:
                return item
        code, message = MISSING_ITEM[op]
        raise p.ProtocolError(message.format(item_id), code, param)

    def insert(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Append, insert first ("root"), or insert after `previous_item_id`; returns the id now before `item`."""
        if item.id in self:
            raise p.ProtocolError(f"Item with id {item.id} already exists in the conversation.",
                                  "item_id_already_exists", "item.id")
        if previous_item_id is None:
            index = len(self.items)
        elif previous_item_id == "root":
            index = 0
        else:
            self.get(previous_item_id, "create", "previous_item_id")
            index = next(i for i, it in enumerate(self.items) if it.id == previous_item_id) + 1
        self.items.insert(index, item)
        return self.items[index - 1].id if index > 0 else None

    def delete(self, item_id: str) -> None:
        self.items.remove(self.get(item_id, "delete"))


def truncate_part(item: Item, content_index: int, audio_end_ms: int) -> None:
    """Drop what the listener did not hear of an assistant part.

    Audio parts keep `audio_end_ms` of audio and the matching share of the transcript (cut at a word boundary); the
    audio stage may store finer timings and replace this. A text-only part was never played, so it stays whole.
    """
    part = item.content[content_index]
    if part["type"] != "output_audio":
        return
    total = item.audio_ms.get(content_index, 0)
    if audio_end_ms > total:
        raise p.ProtocolError(f"audio_end_ms {audio_end_ms} is longer than the audio ({total} ms).",
                              "invalid_value", "audio_end_ms")
    transcript = part.get("transcript") or ""
    marks = item.audio_marks.get(content_index)
    if marks:  # spoken clause by clause: keep the clauses heard, a share of the one playing
        lo_ms, lo_chars, keep = 0, 0, None
        for ms, chars in marks:
            if audio_end_ms >= ms:
                lo_ms, lo_chars = ms, chars
                continue
            keep = lo_chars + (chars - lo_chars) * (audio_end_ms - lo_ms) // max(1, ms - lo_ms)
            break
        floor = lo_chars
        keep = lo_chars if keep is None else keep
        item.audio_marks[content_index] = [m for m in marks if m[0] <= audio_end_ms]
    else:
        keep = len(transcript) * audio_end_ms // total if total else 0
        floor = 0
    cut = transcript[:keep]
    if keep < len(transcript) and not transcript[keep].isspace() and " " in cut[floor:]:
        cut = cut[:cut.rfind(" ")]  # never end on half a word
    elif keep < len(transcript) and not transcript[keep].isspace():
        cut = cut[:floor]
    part["transcript"] = cut.rstrip()
    part.pop("audio", None)
    item.audio_ms[content_index] = audio_end_ms


def to_messages(items: list[Item], instructions: str) -> list[dict]:
    """Chat messages in OpenAI's chat shape. Empty instructions send no system message, so the template adds its own
    default (SmolLM2 does) the same way on every turn — the rendering stays a prefix of the next one. A function_call
    item is an assistant `tool_calls` entry (joined to the assistant message before it: text, then calls, as the
    model wrote them) and a function_call_output a `tool` message; `gateway.tools.render` then renders them the
    template's way (for templates without tools: the `<tool_call>` the model emitted and a `<tool_response>`)."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item.type == "message":
            messages.append({"role": item.role, "content": item.text()})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output or ""})
    # response.create before any item and without instructions: chat templates refuse an empty conversation, so the
    # model answers an empty user turn (it speaks first, as OpenAI's models do)
    return messages or [{"role": "user", "content": ""}]


@dataclass(slots=True)
class Rendered:
    """A prompt as text and the exact token ids sent to the engine (not necessarily the canonical tokenization)."""
    text: str = ""
    ids: list[int] = field(default_factory=list)


class PromptRenderer:
    """Chat template + tokenizer, shared by every session and HTTP request and safe to call from many threads at once:
    no lock, so one client's huge prompt never holds up another's turn.

    A fast tokenizer is called through its Rust backend (`tokenizers.Tokenizer`), which is never reconfigured here, so
    concurrent calls only ever share it. `encode_batch` lets go of the GIL while it runs (`encode` holds it to the end),
    so a long tokenization in a worker thread leaves the event loop and the other threads running. The chat template
    is a compiled Jinja template, which renders concurrently."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self._takes_tools: bool | None = None
        self._max_token_chars: int | None = None

    def encode(self, text: str) -> list[int]:
        if self._backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def takes_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (Qwen2.5, Llama 3.1, Hermes do; SmolLM2's ignores them):
        checked once by rendering a probe tool and looking for its name."""
        if self._takes_tools is None:
            probe = [{"type": "function", "function": {"name": "rtserve_probe_tool", "description": "probe",
                                                       "parameters": {"type": "object", "properties": {}}}}]
            try:
                text = self.template([{"role": "user", "content": "hi"}], tools=probe)
            except Exception:   # a template that raises on tools does not take them
                text = ""
            self._takes_tools = "rtserve_probe_tool" in text
        return self._takes_tools

    def render(self, messages: list[dict], previous: Rendered | None = None,
               tools: tl.ToolRequest | None = None) -> tuple[Rendered, bool]:
        """Render `messages` (with `tools` when active: the template's own way or our tool prompt in the system
        message, so they are rendered once, ahead of the history); returns the prompt and whether it extends
        `previous` (append-only) or was re-rendered."""
        return self.tokenize(self.render_text(messages, tools), previous)

    def render_text(self, messages: list[dict], tools: tl.ToolRequest | None = None) -> str:
        """The prompt text of `messages` (see `render`), not tokenized."""
        if tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages, template_tools = tl.render(messages, tools or tl.ToolRequest(), self.takes_tools())
        else:
            template_tools = None
        return self.template(messages, template_tools)

    def tokenize(self, text: str, previous: Rendered | None = None) -> tuple[Rendered, bool]:
        """`text` as a prompt: only its suffix is tokenized when `previous` is a prefix of it (append-only); returns
        the prompt and whether it extends `previous`."""
        if previous is not None and previous.text and text.startswith(previous.text):
            return Rendered(text, previous.ids + self.encode(text[len(previous.text):])), True
        return Rendered(text, self.encode(text)), False

    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: no token covers more characters of text than this, so a text
        longer than the context times this cannot fit and need not be tokenized to know it."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1) or 1
        return self._max_token_chars

    def decode(self, ids: list[int]) -> str:
        """Exactly the text of `ids` (special tokens kept, no clean-up), as the template will see it again."""
        if self._backend is None:
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._backend.decode(ids, skip_special_tokens=False)

    def extend(self, prompt: Rendered, output_ids: list[int]) -> Rendered:
        """The state after a turn: the prompt plus the generated ids (with their stop token, if any)."""
        return Rendered(prompt.text + self.decode(output_ids), prompt.ids + list(output_ids))
