"""One Realtime WebSocket session: a state machine over (session config, conversation, active response).

Incoming events are handled one at a time, in order, by `_on_<event>` handlers; a handler either answers at once or
starts the single active response as a task. Every outgoing event goes through `send()`, which translates it for the
connection's dialect and puts it on a bounded queue drained by one writer task: the engine and other sessions never wait
for a slow client, and a client whose queue overflows (or whose socket stays blocked too long) is disconnected.

Audio (gateway/voice.py; a server without the audio stage answers audio events with `audio_unavailable`):
- `input_audio_buffer.*` and `input_audio` items go to the session's `VoiceInput` (ordered, VAD in a worker thread);
  a commit adds a user item with an `input_audio` part whose `transcript` the shared Whisper worker fills. A response
  waits for those transcripts: they are the user turn the LLM sees.
- Output: `_open_output()` picks the sink; `TextOutput` streams `response.output_text.*`, `AudioOutput` (when
  `output_modalities` is ["audio"]) streams the transcript and speaks it clause by clause.
- Barge-in: speech_started → `cancel_response("turn_detected")`; truncate cuts the assistant part to what was heard
  and rolls the session's token history back to match (`_rollback_history`), so the next prompt still extends it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from engine import SamplingParams
from engine.errors import EngineError, InvalidRequestError, PromptTooLongError
from gateway import protocol as p
from gateway import session_config as sc
from gateway.conversation import Conversation, Item, PromptRenderer, Rendered, parse_item, to_messages, \
    truncate_part
from gateway.handshake import Handshake
from gateway.metrics import LatencyTimer, Metrics
from gateway.voice import AudioOutput, AudioStage, Pregen, SpeechPlan, VoiceInput, output_format

log = logging.getLogger("rtserve.session")

REALTIME_PRIORITY = 0  # realtime turns run before HTTP batch requests (priority 1)


@dataclass(slots=True)
class SessionLimits:
    send_queue_max: int = 4096  # outgoing frames buffered per connection before the client counts as stalled
    send_timeout_s: float = 20.0  # one frame blocked this long on the socket → disconnect
    max_output_tokens: int = 4096


@dataclass(slots=True)
class ActiveResponse:
    id: str
    params: sc.ResponseParams
    request_id: str
    items: list[Item] | None  # the prompt's items when they are not the conversation (`input` given)
    output_modalities: list[str]
    task: asyncio.Task | None = None
    started: bool = False  # the task ran its first step (a task cancelled before that never runs its body)
    cancel_reason: str | None = None
    item: Item | None = None
    status: str = "in_progress"
    status_details: dict | None = None
    usage: dict | None = None
    output: Any = None  # the sink streaming this response (TextOutput | AudioOutput)

    @property
    def in_conversation(self) -> bool:
        return self.params.conversation == "auto"

    @property
    def extends_session(self) -> bool:
        """Whether this turn continues the session's append-only prompt (and may pin its blocks)."""
        return self.in_conversation and self.items is None


class TextOutput:
    """Streams an `output_text` part: content_part.added → output_text.delta* → output_text.done/content_part.done."""

    def __init__(self, session: "RealtimeSession", resp: ActiveResponse) -> None:
        self.session, self.resp = session, resp
        self.part = {"type": "output_text", "text": ""}
        resp.item.content.append(self.part)
        self._ids = {"response_id": resp.id, "item_id": resp.item.id, "output_index": 0, "content_index": 0}
        session.send({"type": "response.content_part.added", **self._ids, "part": {"type": "text", "text": ""}})

    def delta(self, text: str) -> None:
        self.part["text"] += text
        self.session.send({"type": "response.output_text.delta", **self._ids, "delta": text})

    def done(self) -> None:
        text = self.part["text"]
        self.session.send({"type": "response.output_text.done", **self._ids, "text": text})
        self.session.send({"type": "response.content_part.done", **self._ids, "part": {"type": "text", "text": text}})


class RealtimeSession:
    def __init__(self, ws: WebSocket, engine, renderer: PromptRenderer, metrics: Metrics, hs: Handshake,
                 limits: SessionLimits | None = None, audio: AudioStage | None = None) -> None:
        self.ws, self.engine, self.renderer, self.metrics, self.hs = ws, engine, renderer, metrics, hs
        self.limits = limits or SessionLimits()
        self.dialect = hs.dialect
        self.id = p.new_id("sess")
        self.config = sc.default_session(self.id, hs.model or engine.model_name)
        self.conversation = Conversation()
        self.active: ActiveResponse | None = None
        self.rendered: Rendered | None = None  # the append-only prompt state (last prompt + its answer)
        self.audio = audio
        self.tts = (lambda session, resp: AudioOutput(session, resp, audio)) if audio is not None else None
        self._voice: VoiceInput | None = None  # created on the first audio input (loads nothing before)
        self._intent_transcription = hs.intent == "transcription"
        self._last_turn: tuple[str, Rendered, list[int]] | None = None  # (item id, prompt, output ids)
        self.closed = asyncio.Event()
        self.close_reason: str | None = None
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(self.limits.send_queue_max)
        self._stop_ids = _stop_token_ids(engine.tokenizer)

    @property
    def transcribe_only(self) -> bool:
        """A transcription session (`?intent=transcription`, or GA `session.type: "transcription"`): committed audio
        is transcribed and no response is ever created."""
        return self._intent_transcription or self.config["type"] == "transcription"

    # ------------------------------------------------------------------------------------------- lifecycle
    async def run(self) -> None:
        """Serve the accepted connection until it closes; frees the engine request and pinned blocks on the way out."""
        self.metrics.sessions_active.inc()
        writer = asyncio.create_task(self._writer(), name=f"{self.id}-writer")
        reader = asyncio.create_task(self._reader(), name=f"{self.id}-reader")
        closer = asyncio.create_task(self.closed.wait())
        try:
            self.send({"type": "session.created", "session": sc.render(self.config, self.dialect)})
            if self.dialect == p.BETA:
                self.send({"type": "conversation.created",
                           "conversation": {"id": self.conversation.id, "object": "realtime.conversation"}})
            await asyncio.wait({writer, reader, closer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await self._teardown(reader, writer, closer)
            self.metrics.sessions_active.dec()

    async def _teardown(self, *tasks: asyncio.Task) -> None:
        if self._voice is not None:
            self._voice.close()
        resp = self.active
        if resp is not None and resp.task is not None:
            resp.task.cancel()
            with contextlib.suppress(BaseException):
                await resp.task
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=5.0)  # a send stuck on a dead socket must not hold the session open
        self.engine.release_session(self.id)
        if self.close_reason and self.close_reason != "client closed":
            log.info("session %s closed: %s", self.id, self.close_reason)

    def close(self, reason: str) -> None:
        if not self.closed.is_set():
            self.close_reason = reason
            self.closed.set()

    # --------------------------------------------------------------------------------------------- outgoing
    def send(self, event: dict) -> None:
        """Queue one GA-shaped server event (never blocks); a full queue means the client stopped reading."""
        if self.closed.is_set():
            return
        event = p.to_dialect({"event_id": p.new_id("event"), **event}, self.dialect)
        if event is None:
            return
        try:
            self._queue.put_nowait(p.dumps(event))
        except asyncio.QueueFull:
            self.close(f"client not reading: {self.limits.send_queue_max} events queued")

    async def _writer(self) -> None:
        while not self.closed.is_set():  # also the exit when a cancel was swallowed by a send finishing at once
            frame = await self._queue.get()
            try:
                await asyncio.wait_for(self.ws.send_text(frame), self.limits.send_timeout_s)
            except asyncio.TimeoutError:
                self.close(f"client not reading: a send blocked {self.limits.send_timeout_s:.0f} s")
                return
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.close("client closed")
                return

    # --------------------------------------------------------------------------------------------- incoming
    async def _reader(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                self.close("client closed")
                return
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            event: Any = None
            try:
                event = p.parse_frame(data)
                handler = self._handlers.get(event["type"])
                if handler is None:
                    raise p.ProtocolError(f"Invalid value: '{event['type'][:100]}'. Supported values are: "
                                          + ", ".join(f"'{t}'" for t in self._handlers) + ".", "invalid_value",
                                          "type")
                if self._voice is not None and self._voice.busy:  # keep client order behind queued audio work
                    self._voice.submit(_deferred(handler, self, event), p.client_event_id(event))
                else:
                    handler(self, event)
            except p.ProtocolError as err:
                self.send(p.error_event(err, p.client_event_id(event)))
            except Exception as exc:  # a bug must not end the session silently
                log.exception("session %s: handler failed", self.id)
                self.send(p.error_event(p.ProtocolError(f"Internal error: {exc}", None, None, "server_error"),
                                        p.client_event_id(event)))

    # --------------------------------------------------------------------------------------------- handlers
    def _on_session_update(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "session"}, "")
        update = p.get_dict(event, "session", "session", required=True)
        self.config = sc.apply_update(self.config, update, self.dialect)
        if self._voice is not None:
            self._voice.configure()
        self.send({"type": "session.updated", "session": sc.render(self.config, self.dialect)})

    def _on_item_create(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item", "previous_item_id"}, "")
        raw = p.get_dict(event, "item", "item", required=True)
        previous = p.get_str(event, "previous_item_id", "previous_item_id", nullable=True)
        item = parse_item(raw, "item")
        if self._check_audio_parts(item):
            voice = self.voice()
            voice.submit(lambda: voice.add_audio_item(item, previous), p.client_event_id(event))
        else:
            self.add_item(item, previous)

    def add_item(self, item: Item, previous_item_id: str | None = None) -> None:
        """Insert into the conversation and announce it (also the hook for committed audio)."""
        before = self.conversation.insert(item, previous_item_id)
        self.send({"type": "conversation.item.added", "previous_item_id": before, "item": item.to_dict()})
        self.send({"type": "conversation.item.done", "previous_item_id": before, "item": item.to_dict()})

    def _on_item_delete(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item_id"}, "")
        item_id = p.get_str(event, "item_id", "item_id", required=True)
        self._check_not_generating(item_id)
        self.conversation.delete(item_id)
        self.send({"type": "conversation.item.deleted", "item_id": item_id})

    def _on_item_retrieve(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item_id"}, "")
        item = self.conversation.get(p.get_str(event, "item_id", "item_id", required=True))
        self.send({"type": "conversation.item.retrieved", "item": item.to_dict(include_audio=True)})

    def _on_item_truncate(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item_id", "content_index", "audio_end_ms"}, "")
        item_id = p.get_str(event, "item_id", "item_id", required=True)
        index = p.get_int(event, "content_index", "content_index", required=True, lo=0)
        end_ms = p.get_int(event, "audio_end_ms", "audio_end_ms", required=True, lo=0)
        item = self.conversation.get(item_id)
        if item.type != "message" or item.role != "assistant":
            raise p.ProtocolError("Only assistant messages can be truncated.", "invalid_value", "item_id")
        resp = self.active
        if resp is not None and resp.item is item and resp.task is not None:
            # The item is still being generated: the client stopped playing it (barge-in). SDK clients send
            # response.cancel and the truncate back to back, before response.done; a bare truncate means the same.
            # Stop the reply (response.done, cancelled), then truncate what was generated up to there.
            self.cancel_response("client_cancelled")
            event_id = p.client_event_id(event)
            resp.task.add_done_callback(lambda _: self._truncate_after_response(item, index, end_ms, event_id))
            return
        self._truncate(item, index, end_ms)

    def _truncate_after_response(self, item: Item, index: int, end_ms: int, event_id) -> None:
        if self.closed.is_set():
            return
        try:
            self.conversation.get(item.id)
            self._truncate(item, index, end_ms)
        except p.ProtocolError as err:
            self.send(p.error_event(err, event_id))

    def _truncate(self, item: Item, index: int, end_ms: int) -> None:
        if index >= len(item.content):
            raise p.bad_value("content_index", index, f"an index below {len(item.content)}")
        item_id = item.id
        truncate_part(item, index, end_ms)
        self._rollback_history(item)
        self.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": index,
                   "audio_end_ms": end_ms})

    def _on_response_create(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "response"}, "")
        if self.active is not None:
            raise p.ProtocolError(f"Conversation already has an active response in progress: {self.active.id}. "
                                  "Wait until the response is finished before creating a new one.",
                                  "conversation_already_has_active_response", None)
        if self.transcribe_only:
            raise p.ProtocolError("This is a transcription session (intent=transcription or session.type "
                                  "\"transcription\"): it transcribes input audio and creates no responses.",
                                  "invalid_request", "type")
        self.start_response(event.get("response"))

    def start_response(self, raw: dict | None) -> ActiveResponse:
        """Create the single active response (response.create, or server VAD at the end of a turn)."""
        params = sc.response_params(self.config, raw, self.dialect)
        items = self._resolve_input(params.input) if params.input is not None else None
        modalities = params.output_modalities if self.tts is not None else ["text"]
        resp = ActiveResponse(p.new_id("resp"), params, request_id=None, items=items, output_modalities=modalities)
        resp.request_id = f"{self.id}-{resp.id}"
        self.active = resp
        self.send({"type": "response.created", "response": self._response_dict(resp)})
        self._send_rate_limits()
        resp.task = asyncio.create_task(self._run_response(resp), name=resp.id)
        return resp

    def _on_response_cancel(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "response_id"}, "")
        response_id = p.get_str(event, "response_id", "response_id", nullable=True)
        if self.active is None or (response_id and response_id != self.active.id):
            raise p.ProtocolError("Cancellation failed: no active response found.", "response_cancel_not_active",
                                  "response_id" if response_id else None)
        self.cancel_response("client_cancelled")

    def _on_audio_unavailable(self, event: dict) -> None:
        raise p.ProtocolError(f"{event['type']} is not available: this server runs without the audio stage.",
                              "audio_unavailable", "type")

    def _require_audio(self, event: dict) -> None:
        """Audio events on a server without the audio stage answer `audio_unavailable` before any field check."""
        if self.audio is None:
            self._on_audio_unavailable(event)

    def voice(self) -> VoiceInput:
        if self.audio is None:
            raise p.ProtocolError("Audio input is not available: this server runs without the audio stage.",
                                  "audio_unavailable", "type")
        if self._voice is None:
            self._voice = VoiceInput(self, self.audio)
        return self._voice

    def _on_append(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id", "audio"}, "")
        audio = p.get_str(event, "audio", "audio", required=True)
        if not audio:
            raise p.ProtocolError("audio is empty.", "invalid_value", "audio")
        self.voice().submit_append(audio, p.client_event_id(event))

    def _on_commit(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id"}, "")
        voice = self.voice()
        voice.submit(voice.commit, p.client_event_id(event))

    def _on_clear(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id"}, "")
        voice = self.voice()
        voice.submit(voice.clear, p.client_event_id(event))

    def _on_output_audio_clear(self, event: dict) -> None:
        """Stop the active response's audio (its text goes on); the client drops what it has not played."""
        self._require_audio(event)
        p.check_known(event, {"type", "event_id"}, "")
        resp = self.active
        if resp is None or not isinstance(resp.output, AudioOutput):
            raise p.ProtocolError("No response audio is being produced.", "response_audio_not_active", None)
        resp.output.mute()
        self.send({"type": "output_audio_buffer.cleared", "response_id": resp.id})

    _handlers = {
        "session.update": _on_session_update,
        "conversation.item.create": _on_item_create,
        "conversation.item.delete": _on_item_delete,
        "conversation.item.retrieve": _on_item_retrieve,
        "conversation.item.truncate": _on_item_truncate,
        "response.create": _on_response_create,
        "response.cancel": _on_response_cancel,
        "input_audio_buffer.append": _on_append,
        "input_audio_buffer.commit": _on_commit,
        "input_audio_buffer.clear": _on_clear,
        "output_audio_buffer.clear": _on_output_audio_clear,
    }

    # ------------------------------------------------------------------------------------------ helpers
    def cancel_response(self, reason: str) -> bool:
        """Cancel the active response (client_cancelled | turn_detected); its task sends response.done."""
        resp = self.active
        if resp is None or resp.cancel_reason is not None:
            return False
        resp.cancel_reason = reason
        resp.task.cancel()
        if not resp.started:  # cancelled in the same batch of events as its response.create
            resp.status = "cancelled"
            resp.status_details = {"type": "cancelled", "reason": reason}
            self._finish_response(resp, None, None, [], 0, 0)
        return True

    def _check_audio_parts(self, item: Item, param: str = "item") -> bool:
        """Whether the item has input audio to transcribe (the audio stage must exist and get the audio)."""
        needs = False
        for i, part in enumerate(item.content):
            if part["type"] != "input_audio" or part.get("transcript") is not None:
                continue
            if self.audio is None:
                raise p.ProtocolError("input_audio content needs the audio stage (not available); send "
                                      "input_text or a transcript.", "audio_unavailable", f"{param}.content[{i}]")
            if part.get("audio") is None:
                raise p.ProtocolError("input_audio content needs `audio` (base64 in the session's input format) "
                                      "or a `transcript`.", "missing_required_parameter",
                                      f"{param}.content[{i}].audio")
            needs = True
        return needs

    def _check_not_generating(self, item_id: str) -> None:
        if self.active is not None and self.active.item is not None and self.active.item.id == item_id:
            raise p.ProtocolError(f"Item {item_id} is still being generated.", "item_in_progress", "item_id")

    def _resolve_input(self, raw_items: list) -> list[Item]:
        items = []
        for i, raw in enumerate(raw_items):
            if isinstance(raw, dict) and raw.get("type") == "item_reference":
                items.append(self.conversation.get(p.get_str(raw, "id", f"response.input[{i}].id", required=True),
                                                   f"response.input[{i}].id"))
            else:
                item = parse_item(raw, f"response.input[{i}]")
                if self._check_audio_parts(item, f"response.input[{i}]"):
                    raise p.ProtocolError("input_audio in response.input needs a `transcript`; send the audio with "
                                          "conversation.item.create first.", "invalid_value",
                                          f"response.input[{i}]")
                items.append(item)
        return items

    def _send_rate_limits(self) -> None:
        """No quotas here: report the engine's capacity (sequences, KV tokens) as the limits clients pace by."""
        stats = self.engine.stats()
        args = getattr(getattr(self.engine, "engine", None), "args", None)
        page = stats.get("kv_page_size", 1)
        seqs = getattr(args, "max_num_seqs", 0)
        self.send({"type": "rate_limits.updated", "rate_limits": [
            {"name": "requests", "limit": seqs, "reset_seconds": 0.0,
             "remaining": max(0, seqs - stats.get("requests_running", 0) - stats.get("requests_waiting", 0))},
            {"name": "tokens", "limit": stats.get("kv_pages_total", 0) * page,
             "remaining": stats.get("kv_pages_free", 0) * page,
             "reset_seconds": 0.0}]})

    def _response_dict(self, resp: ActiveResponse) -> dict:
        return {"id": resp.id, "object": "realtime.response", "status": resp.status,
                "status_details": resp.status_details,
                "output": [resp.item.to_dict()] if resp.item is not None else [],
                "conversation_id": self.conversation.id if resp.in_conversation else None,
                "output_modalities": resp.output_modalities,
                "max_output_tokens": resp.params.max_output_tokens,
                "audio": {"output": {"format": self.config["audio"]["output"]["format"],
                                     "voice": resp.params.voice}},
                "metadata": resp.params.metadata, "usage": resp.usage}

    # ---------------------------------------------------------------------------------------- the response
    async def _build_prompt(self, resp: ActiveResponse) -> Rendered:
        items = list(resp.items if resp.items is not None else self.conversation.items)
        return await self._render(items, resp.params.instructions, resp.extends_session)

    async def _render(self, items: list[Item], instructions: str, extends_session: bool) -> Rendered:
        """Render the prompt (in a thread: templates and tokenizers are CPU work), dropping the oldest items while it
        does not fit the model (OpenAI's `truncation: auto`)."""
        previous = self.rendered if extends_session else None
        limit = self.engine.max_model_len - 1
        while True:
            prompt, _ = await asyncio.to_thread(self.renderer.render, to_messages(items, instructions), previous)
            if len(prompt.ids) < limit or len(items) <= 1 or self.config.get("truncation") == "disabled":
                return prompt
            items = items[1:]
            previous = None

    def _sampling(self, params: sc.ResponseParams, prompt: Rendered) -> SamplingParams:
        room = self.engine.max_model_len - len(prompt.ids)
        wanted = params.max_output_tokens
        max_tokens = min(room, self.limits.max_output_tokens if wanted == "inf" else wanted)
        if max_tokens < 1:
            raise PromptTooLongError(f"the conversation ({len(prompt.ids)} tokens) leaves no room to answer "
                                     f"within the model's {self.engine.max_model_len}-token context")
        return SamplingParams(max_tokens=max_tokens, temperature=params.temperature, stop_token_ids=self._stop_ids)

    async def pregenerate(self, transcript: str) -> Pregen | None:
        """Start decoding the reply to a turn that may be ending (server VAD pause): the prompt the response would
        render if `transcript` were committed now. Nothing is sent; a response adopts it only if its prompt and
        sampling turn out identical (see `_run_response`), otherwise it is aborted."""
        params = sc.response_params(self.config, None, self.dialect)
        pending = Item("pending", "message", role="user", content=[{"type": "input_audio", "transcript": transcript}])
        settled = [it for it in self.conversation.items  # this turn's item, if committed already, is `pending`
                   if not any(part.get("transcript", "") is None for part in it.content)]
        prompt = await self._render([*settled, pending], params.instructions, True)
        try:
            sampling = self._sampling(params, prompt)
        except PromptTooLongError:
            return None
        speech = None
        if self.tts is not None and params.output_modalities == ["audio"]:  # the reply will be spoken: start on it
            speech = SpeechPlan(self.audio, *output_format(self.config))
        return Pregen(self.engine, f"{self.id}-{p.new_id('pre')}", prompt, sampling, speech=speech,
                      priority=REALTIME_PRIORITY, cache_salt=self.hs.cache_salt, session_id=self.id)

    def _open_output(self, resp: ActiveResponse):
        """The sink that turns text deltas into events (audio integration: return a TTS sink when `self.tts`)."""
        if self.tts is not None and resp.output_modalities == ["audio"]:
            return self.tts(self, resp)
        return TextOutput(self, resp)

    async def _run_response(self, resp: ActiveResponse) -> None:
        resp.started = True
        finished, out_ids, n_prompt, n_cached = False, [], 0, 0
        prompt = None
        output = None
        try:
            if self._voice is not None and resp.items is None:  # the committed speech is this turn's prompt
                await self._voice.wait_transcripts()  # (commits sent before response.create already ran: see _reader)
            prompt = await self._build_prompt(resp)
            sampling = self._sampling(resp.params, prompt)
            pre = self._voice.take_pregen() if self._voice is not None else None
            if pre is not None and not (resp.extends_session and pre.matches(prompt, sampling)):
                pre.cancel()
                pre = None
            resp.item = Item(p.new_id("item"), "message", role="assistant", status="in_progress")
            self.send({"type": "response.output_item.added", "response_id": resp.id, "output_index": 0,
                       "item": resp.item.to_dict()})
            if resp.in_conversation:
                before = self.conversation.insert(resp.item)
                self.send({"type": "conversation.item.added", "previous_item_id": before,
                           "item": resp.item.to_dict()})
            output = resp.output = self._open_output(resp)
            loop = asyncio.get_running_loop()
            timer = LatencyTimer(self.metrics, "realtime", loop.time())
            if pre is not None:  # decoded during the pause that ended the turn: same prompt, same sampling
                self.audio.speculations["adopted"] += 1
                spoken = pre.take_speech(*((output.fmt, output.speed) if isinstance(output, AudioOutput)
                                           else (None, 0.0)))
                if spoken:
                    self.audio.speculations["spoken"] += len(spoken)
                    output.adopt(spoken)
                resp.request_id = pre.request_id
                gen = pre.stream()
            else:
                gen = self.engine.generate(resp.request_id, prompt.ids, sampling, priority=REALTIME_PRIORITY,
                                           cache_salt=self.hs.cache_salt,
                                           session_id=self.id if resp.extends_session else None)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    out_ids.extend(out.new_token_ids)
                    n_prompt, n_cached = out.num_prompt_tokens, out.num_cached_tokens
                    if out.text_delta:
                        timer.mark(loop.time())
                        output.delta(out.text_delta)
                    if out.finished:
                        finished = True
                        if out.finish_reason == "length":
                            resp.status = "incomplete"
                            resp.status_details = {"type": "incomplete", "reason": "max_output_tokens"}
                        elif out.finish_reason == "abort":
                            resp.status = "cancelled"
                            resp.status_details = {"type": "cancelled", "reason": "client_cancelled"}
                        else:
                            resp.status = "completed"
                            resp.status_details = None
            if isinstance(output, AudioOutput):
                await output.finish()  # the rest of the reply is spoken before response.done
        except asyncio.CancelledError:
            if isinstance(output, AudioOutput):
                output.cancel()
            if not finished:
                await self._abort(resp.request_id)
            if resp.cancel_reason is None:  # the session is closing: nobody to tell
                self.active = None
                raise
            resp.status = "cancelled"
            resp.status_details = {"type": "cancelled", "reason": resp.cancel_reason}
        except (PromptTooLongError, InvalidRequestError) as exc:
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "invalid_request_error",
                                                               "code": type(exc).__name__, "message": str(exc)}}
        except EngineError as exc:
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "server_error", "code": "engine_error",
                                                               "message": str(exc)}}
        except Exception as exc:
            log.exception("response %s failed", resp.id)
            resp.status = "failed"
            resp.status_details = {"type": "failed", "error": {"type": "server_error", "code": None,
                                                               "message": f"internal error: {exc}"}}
        self._finish_response(resp, prompt, output, out_ids, n_prompt, n_cached)

    async def _abort(self, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.shield(self.engine.abort(request_id))

    def _finish_response(self, resp: ActiveResponse, prompt: Rendered | None, output, out_ids: list[int],
                         n_prompt: int, n_cached: int) -> None:
        if resp.item is not None:
            resp.item.status = "completed" if resp.status == "completed" else "incomplete"
            if output is not None:
                output.done()
            item = resp.item.to_dict()
            self.send({"type": "response.output_item.done", "response_id": resp.id, "output_index": 0,
                       "item": item})
            if resp.in_conversation and resp.item.id in self.conversation:
                index = next(i for i, it in enumerate(self.conversation.items) if it.id == resp.item.id)
                before = self.conversation.items[index - 1].id if index else None
                self.send({"type": "conversation.item.done", "previous_item_id": before, "item": item})
        if resp.extends_session and prompt is not None and resp.item is not None:
            self.rendered = self.renderer.extend(prompt, out_ids)
            self._last_turn = (resp.item.id, prompt, list(out_ids))
        if self._voice is not None:
            self._voice.response_finished(int(output.audio_ms) if isinstance(output, AudioOutput) else 0)
        n_out = len(out_ids)
        resp.usage = {"total_tokens": n_prompt + n_out, "input_tokens": n_prompt, "output_tokens": n_out,
                      "input_token_details": {"text_tokens": n_prompt, "audio_tokens": 0, "image_tokens": 0,
                                              "cached_tokens": n_cached,
                                              "cached_tokens_details": {"text_tokens": n_cached,
                                                                        "audio_tokens": 0, "image_tokens": 0}},
                      "output_token_details": {"text_tokens": n_out, "audio_tokens": 0}}
        self.active = None
        self.send({"type": "response.done", "response": self._response_dict(resp)})

    def _rollback_history(self, item: Item) -> None:
        """After a truncate of the last answer: the token history keeps only the output tokens whose text is still in
        the item, so the next prompt extends it (prefix-cache hit up to the cut) instead of holding unheard text."""
        if self._last_turn is None or self._last_turn[0] != item.id:
            return  # older items: the next render no longer extends `rendered` and re-renders in full
        _, prompt, out_ids = self._last_turn
        kept = item.text()
        lo, hi = 0, len(out_ids)  # the longest k whose text is a prefix of what is kept
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if kept.startswith(self.renderer.decode(out_ids[:mid])):
                lo = mid
            else:
                hi = mid - 1
        self.rendered = Rendered(prompt.text + self.renderer.decode(out_ids[:lo]), prompt.ids + out_ids[:lo])
        self._last_turn = (item.id, prompt, out_ids[:lo])


def _deferred(handler, session: RealtimeSession, event: dict):
    async def op() -> None:
        handler(session, event)
    return op


def _stop_token_ids(tokenizer) -> list[int]:
    """EOS plus the chat template's end-of-turn token, so answers end where the template closes a message."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)
