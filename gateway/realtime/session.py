"""One Realtime WebSocket session: the connection's state and its event handlers.

The session owns the connection's state: the session config, the conversation, the single active response, the
prompt history the engine has seen, the outgoing queue, and (created on the first audio input) its `AudioInput` and
`Speculation`. Incoming events are handled one at a time, in order, by `_on_<event>` handlers; a handler either
answers at once or starts the active response as a task run by `ResponseRunner`. Every outgoing event goes through
`send()`, which translates it for the connection's dialect and puts it on a bounded queue drained by one writer task:
the engine and other sessions never wait for a slow client, and a client whose queue overflows (or whose socket stays
blocked too long) is disconnected.

A voice turn flows one way (a server without the audio stage answers audio events with `audio_unavailable`):
audio_in (buffer, VAD, commits) → turn events, which this session handles (`TurnEvents`: barge-in, pause work in
speculation, the committed item, the automatic response) → the transcript, which the response waits for → response →
text or audio_out. Truncate cuts the assistant part to what was heard and rolls the prompt history back to match, so
the next prompt still extends it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from audio.stage import AudioStage
from gateway import memory
from gateway.handshake import Handshake
from gateway.metrics import Metrics
from gateway.realtime import function_calls as fc
from gateway.realtime import limits as lim
from gateway.realtime import protocol as p
from gateway.realtime import session_config as sc
from gateway.realtime.audio_in import AudioInput, Span
from gateway.realtime.audio_out import AudioOutput
from gateway.realtime.conversation import Conversation, Item, PromptRenderer, parse_item, truncate_part
from gateway.realtime.response import ActiveResponse, PromptHistory, ResponseRunner, cancelled_details
from gateway.realtime.speculation import SPECULATE_AFTER_MS, Pregen, Speculation
from gateway.realtime.turn_detection import TurnDetector

log = logging.getLogger("rtserve.session")


SHUTDOWN = "server_shutdown"  # the cancel reason of responses cut by a server shutdown


@dataclass(slots=True)
class SessionLimits:
    send_queue_max: int = 4096  # outgoing frames buffered per connection before the client counts as stalled
    # ... and their bytes: a few large frames (retrieves of big items) must not pile up either
    send_queue_max_bytes: int = 32 * 1024 * 1024
    send_timeout_s: float = 20.0  # one frame blocked this long on the socket → disconnect
    max_output_tokens: int = 4096
    max_item_bytes: int = lim.MAX_ITEM_BYTES
    max_conversation_items: int = lim.MAX_CONVERSATION_ITEMS
    max_conversation_bytes: int = lim.MAX_CONVERSATION_BYTES


class RealtimeSession:
    def __init__(self, ws: WebSocket, engine, renderer: PromptRenderer, metrics: Metrics, hs: Handshake,
                 limits: SessionLimits | None = None, audio: AudioStage | None = None) -> None:
        self.ws, self.engine, self.metrics, self.hs = ws, engine, metrics, hs
        self.limits = limits or SessionLimits()
        self.dialect = hs.dialect
        self.id = p.new_id("sess")
        self.config = sc.default_session(self.id, hs.model or engine.model_name)
        self.conversation = Conversation()
        self.active: ActiveResponse | None = None
        self.history = PromptHistory()  # the append-only prompt state (last prompt + its answer)
        self.audio = audio
        self.audio_in: AudioInput | None = None  # created on the first audio input (loads nothing before)
        self.speculation: Speculation | None = None  # (with audio_in) the work done inside a pause
        self.turn_detector: TurnDetector | None = None  # (with audio_in) the early end-of-turn checks
        self.responses = ResponseRunner(engine=engine, renderer=renderer, metrics=metrics, send=self.send,
                                        conversation=self.conversation, history=self.history,
                                        config=lambda: self.config, dialect=self.dialect, stage=audio,
                                        session_id=self.id, cache_salt=hs.cache_salt,
                                        max_output_tokens=self.limits.max_output_tokens)
        self._intent_transcription = hs.intent == "transcription"
        self.closed = asyncio.Event()
        self.close_reason: str | None = None
        self.close_code = 1008    # the WebSocket close code when the server ends the session
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(self.limits.send_queue_max)
        self._queued_bytes = 0  # characters of the frames in `_queue` (JSON: nearly all one byte each)
        self.draining = False  # the server is shutting down: no new response starts

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
        if self.speculation is not None:
            self.speculation.drop()
            self.turn_detector.drop()
        if self.audio_in is not None:
            self.audio_in.close()
        resp = self.active
        if resp is not None and resp.task is not None:
            resp.task.cancel()
            with contextlib.suppress(BaseException):
                await resp.task
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=5.0)  # a send stuck on a dead socket must not hold the session open
        self.engine.release_session(self.id)
        # the session's memory goes now, not when the garbage collector breaks the session's reference cycles
        held = self._queued_bytes + sum(lim.item_bytes(it) for it in self.conversation.items)
        self.conversation.items.clear()
        self.history.last = None
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_bytes = 0
        if held >= memory.BIG_BYTES:
            memory.release_soon()
        if self.close_reason and self.close_reason != "client closed":
            log.info("session %s closed: %s", self.id, self.close_reason)

    async def end_on_engine_fault(self, message: str) -> None:
        """The engine replica that held this session's KV is gone: the response in flight ends (failed, it got
        EngineDeadError), then an `error` event (server_error), then the session closes (code 1011)."""
        resp = self.active
        if resp is not None and resp.task is not None:
            await asyncio.wait({resp.task}, timeout=5.0)
        self.send(p.error_event(p.ProtocolError(message, "engine_unavailable", None, "server_error")))
        flushed = asyncio.create_task(self._queue.join())
        gone = asyncio.create_task(self.closed.wait())
        await asyncio.wait({flushed, gone}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        flushed.cancel()
        gone.cancel()
        self.close_code = 1011
        self.close(message)

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
        frame = p.dumps(event)
        if self._queued_bytes and self._queued_bytes + len(frame) > self.limits.send_queue_max_bytes:
            # (an empty queue takes any one frame: the bound is the cap plus one event)
            self.close(f"client not reading: {self._queued_bytes + len(frame)} bytes queued")
            return
        try:
            self._queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.close(f"client not reading: {self.limits.send_queue_max} events queued")
            return
        self._queued_bytes += len(frame)

    async def _writer(self) -> None:
        while not self.closed.is_set():  # also the exit when a cancel was swallowed by a send finishing at once
            frame = await self._queue.get()
            self._queued_bytes -= len(frame)
            try:
                await asyncio.wait_for(self.ws.send_text(frame), self.limits.send_timeout_s)
            except asyncio.TimeoutError:
                self.close(f"client not reading: a send blocked {self.limits.send_timeout_s:.0f} s")
                return
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.close("client closed")
                return
            finally:
                self._queue.task_done()

    async def drain(self) -> None:
        """Server shutdown: the response in flight ends with `response.done` (cancelled), and everything queued is
        written, before the server closes the socket. Returns early if the client goes away."""
        self.draining = True
        resp = self.active
        if resp is not None:
            self.cancel_response(SHUTDOWN)  # (a no-op when the client cancelled it already: its done is coming)
            if resp.task is not None:
                await asyncio.wait({resp.task})
        flushed = asyncio.create_task(self._queue.join())
        closed = asyncio.create_task(self.closed.wait())
        try:
            await asyncio.wait({flushed, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            flushed.cancel()
            closed.cancel()

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
                if self.audio_in is not None and self.audio_in.busy:  # keep client order behind queued audio work
                    self.audio_in.submit(_deferred(handler, self, event), p.client_event_id(event))
                else:
                    handler(self, event)
            except p.ProtocolError as err:
                self.send(p.error_event(err, p.client_event_id(event)))
            except Exception as exc:  # a bug must not end the session silently
                log.exception("session %s: handler failed", self.id)
                self.send(p.error_event(p.ProtocolError(f"Internal error: {exc}", None, None, "server_error"),
                                        p.client_event_id(event)))
            if len(data) >= memory.BIG_BYTES:  # a big frame (stored, refused or answered) leaves its copies free
                message = data = event = None
                memory.release_soon()

    # --------------------------------------------------------------------------------------------- handlers
    def _on_session_update(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "session"}, "")
        update = p.get_dict(event, "session", "session", required=True)
        self.config = sc.apply_update(self.config, update, self.dialect)
        if self.audio_in is not None:
            self.audio_in.configure(self.config["audio"]["input"], self._transcript_logprobs())
        self.send({"type": "session.updated", "session": sc.render(self.config, self.dialect)})

    def _transcript_logprobs(self) -> bool:
        return sc.TRANSCRIPT_LOGPROBS in (self.config.get("include") or ())

    def _on_item_create(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item", "previous_item_id"}, "")
        raw = p.get_dict(event, "item", "item", required=True)
        previous = p.get_str(event, "previous_item_id", "previous_item_id", nullable=True)
        item = parse_item(raw, "item")
        self._check_room(item, "item")
        fc.check_call_output(item, self.conversation.items, "item")
        if not self._check_audio_parts(item):
            self.add_item(item, previous)
            return
        audio_in = self.audio_input()

        async def op() -> None:  # decode (a bad clip adds nothing), add, then transcribe
            clips = await audio_in.decode_parts(item)
            self.add_item(item, previous)
            audio_in.transcribe_parts(item, clips)
        audio_in.submit(op, p.client_event_id(event))

    def add_item(self, item: Item, previous_item_id: str | None = None) -> None:
        """Insert into the conversation and announce it."""
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
        item = self.conversation.get(p.get_str(event, "item_id", "item_id", required=True), "retrieve")
        self.send({"type": "conversation.item.retrieved", "item": item.to_dict(include_audio=True)})

    def _on_item_truncate(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "item_id", "content_index", "audio_end_ms"}, "")
        item_id = p.get_str(event, "item_id", "item_id", required=True)
        index = p.get_int(event, "content_index", "content_index", required=True, lo=0)
        end_ms = p.get_int(event, "audio_end_ms", "audio_end_ms", required=True, lo=0)
        item = self.conversation.get(item_id, "truncate")
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
            self.conversation.get(item.id, "truncate")
            self._truncate(item, index, end_ms)
        except p.ProtocolError as err:
            self.send(p.error_event(err, event_id))

    def _truncate(self, item: Item, index: int, end_ms: int) -> None:
        if index >= len(item.content):
            raise p.bad_value("content_index", index, f"an index below {len(item.content)}")
        item_id = item.id
        truncate_part(item, index, end_ms)
        self.history.rollback(item)
        self.send({"type": "conversation.item.truncated", "item_id": item_id, "content_index": index,
                   "audio_end_ms": end_ms})

    def _on_response_create(self, event: dict) -> None:
        p.check_known(event, {"type", "event_id", "response"}, "")
        if self.active is not None:
            raise p.ProtocolError(f"Conversation already has an active response in progress: {self.active.id}. "
                                  "Wait until the response is finished before creating a new one.",
                                  "conversation_already_has_active_response", None)
        if self.draining:
            raise p.ProtocolError("The server is shutting down.", "server_shutting_down", None, "server_error")
        if self.transcribe_only:
            raise p.ProtocolError("This is a transcription session (intent=transcription or session.type "
                                  "\"transcription\"): it transcribes input audio and creates no responses.",
                                  "invalid_request", "type")
        self.start_response(event.get("response"))

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

    def _on_append(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id", "audio"}, "")
        audio = p.get_str(event, "audio", "audio", required=True)
        if not audio:
            raise p.ProtocolError("audio is empty.", "invalid_value", "audio")
        self.audio_input().submit_append(audio, p.client_event_id(event))

    def _on_commit(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id"}, "")
        audio_in = self.audio_input()
        audio_in.submit(audio_in.commit, p.client_event_id(event))

    def _on_clear(self, event: dict) -> None:
        self._require_audio(event)
        p.check_known(event, {"type", "event_id"}, "")
        audio_in = self.audio_input()
        audio_in.submit(audio_in.clear, p.client_event_id(event))

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

    # ------------------------------------------------------------------------- turn events (from AudioInput)
    def speech_started(self, interrupt: bool) -> None:
        self.speculation.drop()
        self.turn_detector.drop()
        if interrupt and self.active is not None:
            self.cancel_response("turn_detected")

    def paused(self, span: Span, audio_16k: np.ndarray) -> None:
        self.speculation.start(span, audio_16k)
        self.turn_detector.start(span, audio_16k, self.audio_in.policy)

    def pause_held(self, span: Span, silence_ms: float, window_ms: int) -> None:
        self.turn_detector.silence_reached(span, silence_ms, window_ms)

    def resumed(self) -> None:
        self.speculation.drop()
        self.turn_detector.drop()

    def speech_stopped(self, span: Span, early: bool) -> asyncio.Task | None:
        self.turn_detector.drop()
        if early:
            self.metrics.turn_early_ends.inc()
        return self.speculation.take_transcript(span)

    def committed(self, item: Item) -> None:
        previous = self.conversation.items[-1].id if self.conversation.items else None
        self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item.id})
        self.add_item(item)

    def repair(self, item: Item) -> None:
        """A turn ended early, and the user went on: the reply to it stops at once (as a barge-in) and leaves the
        conversation, so the turn, once its speech is joined to `item`, is answered afresh as a whole. Its items are
        deleted after its response.done: clients take the cancelled response's done events as updates of its items,
        and would add back an item those name after its deletion."""
        self.metrics.turn_repairs.inc()
        self.cancel_response("turn_detected")
        if self.active is not None:  # its task sends response.done
            self.active.repaired = item
        else:
            self._drop_reply(item)

    def _drop_reply(self, item: Item) -> None:
        """Delete every item after `item` but user ones: the reply to a repaired turn."""
        if item.id not in self.conversation:
            return
        items = self.conversation.items
        for later in items[next(i for i, it in enumerate(items) if it.id == item.id) + 1:]:
            if later.role != "user":
                self.conversation.delete(later.id)
                self.send({"type": "conversation.item.deleted", "item_id": later.id})

    def recommitted(self, item: Item) -> None:
        if item.id not in self.conversation:  # deleted by the client meanwhile: it is a new item again
            self.committed(item)
            return
        items = self.conversation.items
        index = next(i for i, it in enumerate(items) if it.id == item.id)
        self.send({"type": "input_audio_buffer.committed", "previous_item_id": items[index - 1].id if index else None,
                   "item_id": item.id})

    def _end_turn_early(self, span: Span) -> None:
        self.audio_in.end_turn_early(span)

    async def _pregenerate(self, transcript: str) -> Pregen | None:
        joining = self.audio_in.joining
        return await self.responses.pregenerate(transcript, score_end_of_turn=self.audio_in.policy is not None,
                                                replaces=joining.item.id if joining is not None else None)

    def turn_ended(self, create_response: bool) -> None:
        if create_response and not self.transcribe_only and self.active is None and not self.draining:
            self.start_response(None)
        else:
            self.speculation.drop_reply()

    def _reply_wanted(self, turn_ended: bool) -> bool:
        """(for Speculation) An automatic response is coming for the pausing turn: none is active yet, or, once the
        turn ended, the active one has not rendered its prompt yet."""
        active = self.active
        waiting = (active is not None and not active.rendered) if turn_ended else active is None
        return waiting and self.audio_in.create_response and not self.transcribe_only

    # ------------------------------------------------------------------------------------------ responses
    def start_response(self, raw: dict | None) -> ActiveResponse:
        """Create the single active response (response.create, or server VAD at the end of a turn)."""
        params = sc.response_params(self.config, raw, self.dialect)
        items = self._resolve_input(params.input) if params.input is not None else None
        modalities = params.output_modalities if self.audio is not None else ["text"]
        resp = ActiveResponse(p.new_id("resp"), params, request_id=None, items=items, output_modalities=modalities)
        resp.request_id = f"{self.id}-{resp.id}"
        self.active = resp
        self.responses.announce(resp)
        resp.task = asyncio.create_task(self._respond(resp), name=resp.id)
        return resp

    async def _respond(self, resp: ActiveResponse) -> None:
        try:
            await self.responses.run(resp, self.audio_in, self.speculation)
        except asyncio.CancelledError:  # the session is closing: nobody to tell
            self.active = None
            raise
        self._response_over(resp)

    def cancel_response(self, reason: str) -> bool:
        """Cancel the active response (client_cancelled | turn_detected); its task sends response.done."""
        resp = self.active
        if resp is None or resp.cancel_reason is not None:
            return False
        resp.cancel_reason = reason
        resp.task.cancel()
        if not resp.started:  # cancelled in the same batch of events as its response.create
            resp.status = "cancelled"
            resp.status_details = cancelled_details(reason)
            self.responses.finish(resp, None, None, [], 0, 0)
            self._response_over(resp)
        return True

    def _response_over(self, resp: ActiveResponse) -> None:
        if self.audio_in is not None:
            self.audio_in.response_finished(resp.audio_ms)
        self.active = None
        self.responses.send_done(resp)
        if resp.repaired is not None:
            self._drop_reply(resp.repaired)

    # ------------------------------------------------------------------------------------------ helpers
    def audio_input(self) -> AudioInput:
        """The session's input side, created on first use (with the pause work it reports to)."""
        if self.audio is None:
            raise p.ProtocolError("Audio input is not available: this server runs without the audio stage.",
                                  "audio_unavailable", "type")
        if self.audio_in is None:
            self.turn_detector = TurnDetector(self.audio, self._end_turn_early, self.id, self.metrics)
            self.speculation = Speculation(self.audio, self._pregenerate, self._reply_wanted, self.id,
                                           end_of_turn_scored=self.turn_detector.text_scored)
            self.audio_in = AudioInput(self.config["audio"]["input"], self.send, self, self.audio, self.id,
                                       pause_ms=SPECULATE_AFTER_MS, logprobs=self._transcript_logprobs())
        return self.audio_in

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

    def _check_room(self, item: Item, param: str) -> None:
        """The memory caps on what a client stores: one item, and the whole conversation (realtime/limits.py)."""
        size = lim.check_item(item, param, self.limits.max_item_bytes)
        lim.check_room(self.conversation, size, param, self.limits.max_conversation_items,
                       self.limits.max_conversation_bytes)

    def _check_not_generating(self, item_id: str) -> None:
        if self.active is not None and self.active.item is not None and self.active.item.id == item_id:
            raise p.ProtocolError(f"Item {item_id} is still being generated.", "item_in_progress", "item_id")

    def _resolve_input(self, raw_items: list) -> list[Item]:
        items = []
        for i, raw in enumerate(raw_items):
            if isinstance(raw, dict) and raw.get("type") == "item_reference":
                items.append(self.conversation.get(p.get_str(raw, "id", f"response.input[{i}].id", required=True),
                                                   "reference", f"response.input[{i}].id"))
            else:
                item = parse_item(raw, f"response.input[{i}]")
                lim.check_item(item, f"response.input[{i}]", self.limits.max_item_bytes)
                fc.check_call_output(item, [*self.conversation.items, *items], f"response.input[{i}]")
                if self._check_audio_parts(item, f"response.input[{i}]"):
                    raise p.ProtocolError("input_audio in response.input needs a `transcript`; send the audio with "
                                          "conversation.item.create first.", "invalid_value",
                                          f"response.input[{i}]")
                items.append(item)
        return items


def _deferred(handler, session: RealtimeSession, event: dict):
    async def op() -> None:
        handler(session, event)
    return op
