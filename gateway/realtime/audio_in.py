"""Audio in: one session's input buffer, its VAD, commits, and the transcriptions that fill committed user items.

`AudioInput` owns the input audio buffer (on the session's input timeline), the streaming VAD built from the
session's turn detection, the ordered queue of input ops, the item id announced at speech_started, the idle-timeout
clock, and the transcription tasks of committed audio. Appends, commits and clears run one at a time in arrival
order; the per-append work (base64 decode, resampling, silero VAD) runs in a worker thread, so the event loop only
routes events.

What it finds it reports through `TurnEvents`, in input order, on the event loop: speech started, a pause inside the
turn, the voice resumed, speech stopped, an item committed, the turn ended. It sends the `input_audio_buffer.*` and
`...input_audio_transcription.*` events itself; the conversation, the responses and the work done in a pause belong
to whoever implements `TurnEvents` (the session).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from audio.buffer import InputAudioBuffer
from audio.codecs import AudioError, b64decode, decode_audio, int16_to_float, parse_audio_format
from audio.resample import resample
from audio.stage import AudioStage
from audio.transcriber import TranscriptionError
from audio.vad import StreamingVAD, semantic_vad_silence_ms
from gateway.http_logprobs import transcript_entries
from gateway.realtime import protocol as p
from gateway.realtime import turn_detection
from gateway.realtime.conversation import Item
from gateway.realtime.trace import trace

log = logging.getLogger("rtserve.voice")

MAX_PENDING_OPS = 4096  # input events queued per session before events are refused
MAX_PENDING_CHARS = 48 * 1024 * 1024  # base64 audio queued per session (three maximal appends) before refusals
# A pause is reported only when the silence window goes on at least this long after it: with a shorter window the
# turn's end follows too soon for work started in the pause to come out ahead.
PAUSE_MARGIN_MS = 100
RECHECK_MS = 32  # a held pause is reported again each time its silence has grown by this much (a VAD window)

Span = tuple[int, int]  # ms on the input timeline


class TurnEvents(Protocol):
    """What the input side reports to its session, in input order, on the event loop."""

    def speech_started(self, interrupt: bool) -> None:
        """The user started speaking (speech_started is sent): drop work done for a pause and, with `interrupt`
        (turn detection's `interrupt_response`), stop the reply being given."""

    def paused(self, span: Span, audio_16k: np.ndarray) -> None:
        """A pause inside the turn: the turn may end at `span` = (speech start, silence start); `audio_16k` holds it."""

    def resumed(self) -> None:
        """The voice came back after a reported pause: the turn goes on."""

    def pause_held(self, span: Span, silence_ms: float, window_ms: int) -> None:
        """The reported pause has lasted `silence_ms`, at least the early-end policy's shortest silence
        (`turn_detection.Eagerness`), of the VAD's `window_ms`; reported again as it grows."""

    def speech_stopped(self, span: Span, early: bool) -> asyncio.Task | None:
        """The turn ended on `span` (speech_stopped is sent, its commit follows), `early` when the end-of-turn check
        ended it before the VAD's window. Returns the transcription of that span if one is already under way (started
        in the pause); otherwise the committed audio is transcribed."""

    def repair(self, item: Item) -> None:
        """Speech resumed soon after an early end that committed `item`: stop the reply to it (its next speech joins
        `item`, see `recommitted`)."""

    def recommitted(self, item: Item) -> None:
        """The speech after a repair was committed into `item` (no new item): announce the commit; the whole
        utterance's transcription follows."""

    def committed(self, item: Item) -> None:
        """Audio was committed as `item` (a user message whose `input_audio` transcript is still None): announce the
        commit and add the item to the conversation. Its transcription starts right after."""

    def turn_ended(self, create_response: bool) -> None:
        """A VAD commit (speech_stopped, idle timeout) closed a turn: respond if `create_response` and nothing else
        stops it."""


@dataclass(slots=True)
class EarlyEnd:
    """A turn the end-of-turn check ended early: its item and audio, kept while a repair may still join them."""
    item: Item
    audio_16k: np.ndarray
    end_ms: int  # the segment's end on the input timeline


def vad_from_config(turn: dict | None, position_ms: int) -> StreamingVAD | None:
    """The session's turn detection as a streaming VAD on the buffer's clock (None: manual commits)."""
    if turn is None:
        return None
    if turn["type"] == "semantic_vad":  # no semantic model here: eagerness picks the silence window
        vad = StreamingVAD(silence_duration_ms=semantic_vad_silence_ms(turn.get("eagerness")))
    else:
        threshold = min(max(float(turn["threshold"]), 0.01), 0.99)
        vad = StreamingVAD(threshold=threshold, prefix_padding_ms=turn["prefix_padding_ms"],
                           silence_duration_ms=turn["silence_duration_ms"])
    vad.reset(position_ms=position_ms)
    return vad


def audio_error(exc: AudioError) -> p.ProtocolError:
    return p.ProtocolError(exc.message, exc.code, exc.param)


class AudioInput:
    """One session's input audio. `config` is the session's `audio.input` (format, turn detection); `pause_ms`: the
    trailing silence after which a pause is reported (None: pauses are not reported); `logprobs`: whether transcription
    events carry their tokens' logprobs (the session's include)."""

    def __init__(self, config: dict, send: Callable[[dict], None], events: TurnEvents, stage: AudioStage,
                 name: str, pause_ms: int | None = None, logprobs: bool = False) -> None:
        self.send, self.events, self.stage, self.name, self.pause_ms = send, events, stage.start(), name, pause_ms
        self.buf = InputAudioBuffer(parse_audio_format(config["format"]))
        self.turn = config["turn_detection"]  # the turn detection in force for the audio being processed
        self.vad = vad_from_config(self.turn, 0)
        self.speech_item_id: str | None = None  # announced in speech_started, used by the item it commits
        self.idle_anchor_ms: int | None = None  # input timeline ms when the last reply stopped playing
        self.transcripts: dict[str, asyncio.Task] = {}
        # transcription events list their tokens' logprobs (session include: item.input_audio_transcription.logprobs)
        self.logprobs = logprobs
        self._ops: asyncio.Queue = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._running = False
        self._nested: list = []
        self._pending_chars = 0  # base64 audio queued, not yet decoded
        self._reported_pause: Span | None = None  # (worker thread) the pause last reported, while it lasts
        # (worker thread) the pause and its silence when last reported as held: first at the policy's shortest
        # silence, then again every RECHECK_MS while it lasts (the end-of-turn threshold falls as it grows)
        self._held_pause: tuple[Span, float] | None = None
        self.policy = turn_detection.policy(self.turn)  # early ends (None: the VAD's window only)
        self._early: EarlyEnd | None = None  # the last turn, if it ended early and may still be repaired
        self.joining: EarlyEnd | None = None  # a repaired turn, which the speech now going on continues

    @property
    def busy(self) -> bool:
        """Input ops are queued or running: later client events must queue behind them to keep their order."""
        return self._running or not self._ops.empty()

    @property
    def create_response(self) -> bool:
        """Turn detection answers each turn it ends (`create_response`); manual commits never do."""
        return bool(self.turn and self.turn.get("create_response", True))

    # ------------------------------------------------------------------------------------- ordered input ops
    def submit(self, op, event_id: str | None) -> None:
        """Queue an input op (a coroutine function); ops run one at a time in arrival order. An op submitted by the
        running op (a deferred handler) runs right after it, ahead of what arrived later."""
        if self._worker is not None and asyncio.current_task() is self._worker:
            self._nested.append((op, event_id))
            return
        if self._ops.qsize() >= MAX_PENDING_OPS:
            raise p.ProtocolError(f"Input audio is arriving faster than it can be processed ({MAX_PENDING_OPS} "
                                  "events queued); this event was dropped.", "input_audio_buffer_full", None)
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name=f"{self.name}-voice")
        self._ops.put_nowait((op, event_id))

    async def wait_transcripts(self) -> None:
        """The transcript is the user turn: a response waits for the transcriptions of committed audio."""
        pending = list(self.transcripts.values())
        if pending:
            await asyncio.wait(pending)

    async def _run(self) -> None:
        while True:
            self._nested.append(await self._ops.get())
            self._running = True
            while self._nested:
                await self._exec(*self._nested.pop(0))
            self._running = False

    async def _exec(self, op, event_id: str | None) -> None:
        try:
            await op()
        except AudioError as exc:
            self.send(p.error_event(audio_error(exc), event_id))
        except p.ProtocolError as exc:
            self.send(p.error_event(exc, event_id))
        except Exception as exc:  # a bug must not stop the session's input
            log.exception("session %s: audio input op failed", self.name)
            self.send(p.error_event(p.ProtocolError(f"Internal error: {exc}", None, None, "server_error"), event_id))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        for task in self.transcripts.values():
            task.cancel()
        self.transcripts.clear()

    # --------------------------------------------------------------------------------------------- the ops
    def configure(self, config: dict, logprobs: bool = False) -> None:
        """Follow session.update (`config` = the new `audio.input`; `logprobs`: whether the session's include asks for
        transcription logprobs) in order with the audio already queued."""
        async def op():
            self.logprobs = logprobs
            self.buf.set_format(parse_audio_format(config["format"]))
            if config["turn_detection"] != self.turn:
                self.turn = config["turn_detection"]
                self.vad = vad_from_config(self.turn, self.buf.timeline_ms)
                self.policy = turn_detection.policy(self.turn)
                self.speech_item_id = None
                self._forget_early_end()
        self.submit(op, None)

    def submit_append(self, audio: str, event_id: str | None) -> None:
        """Queue an append; the queued audio is capped in bytes too, so a flood cannot pile up memory."""
        if self._pending_chars + len(audio) > MAX_PENDING_CHARS:
            raise p.ProtocolError("Input audio is arriving faster than it can be processed; this append was dropped.",
                                  "input_audio_buffer_full", "audio")
        self._pending_chars += len(audio)

        async def op() -> None:
            self._pending_chars -= len(audio)
            await self.append(audio)
        self.submit(op, event_id)

    async def append(self, audio: str) -> None:
        results = await asyncio.to_thread(self._ingest, audio, self.vad, self.turn)
        for kind, value, seg in results:
            if kind == "speech_started":
                self._speech_started(value)
            elif kind == "speech_stopped":
                self._speech_stopped(value, seg)
            elif kind == "timeout":
                self._timeout(value, seg)
            elif kind == "paused":
                if self.joining is not None:  # a repaired turn: the whole utterance is what may be ending
                    seg = np.concatenate([self.joining.audio_16k, seg])
                self.events.paused(value, seg)
            elif kind == "pause_held":
                self.events.pause_held(*value)
            elif kind == "resumed":
                self.events.resumed()

    def _ingest(self, audio: str, vad: StreamingVAD | None, turn: dict | None) -> list:
        """Worker thread: decode + resample + VAD; VAD-ended segments leave the buffer here."""
        new = self.buf.append_b64(audio)
        if vad is None:
            return []
        out = []
        for ev in vad.feed(new):
            if ev.type == "speech_started":
                out.append(("speech_started", ev, None))
            else:
                out.append(("speech_stopped", ev, self.buf.commit_range(ev.audio_start_ms, ev.audio_end_ms)))
        if vad.speaking:
            out.extend(self._pause_events(vad))
        else:
            self._reported_pause = None
            idle = turn.get("idle_timeout_ms") if turn else None
            anchor = self.idle_anchor_ms
            if idle and anchor is not None and vad.position_ms >= anchor + idle:
                self.idle_anchor_ms = None
                seg = self.buf.commit_range(max(anchor, self.buf.start_ms), vad.position_ms)  # the silence held
                out.append(("timeout", (anchor, vad.position_ms), seg))
            self.buf.discard_before(vad.position_ms - vad.prefix_padding_ms)
        return out

    def _pause_events(self, vad: StreamingVAD) -> list:
        """Worker thread: a pause of `pause_ms` inside the turn is reported once, with the turn's audio up to it (if
        that pause becomes the end of the turn, speech_stopped comes with the same span); its end is reported too."""
        pause = vad.pause
        if pause is None:
            self._held_pause = None
            if self._reported_pause is None:
                return []
            self._reported_pause = None
            return [("resumed", None, None)]
        if self.pause_ms is None or vad.silence_duration_ms < self.pause_ms + PAUSE_MARGIN_MS \
                or pause.silence_ms < self.pause_ms:
            return []
        span = (pause.speech_start_ms, pause.silence_start_ms)
        policy = self.policy
        if span == self._reported_pause:  # held: an early end needs silero's silence (not only a quiet tail)
            if policy is not None and pause.confirmed and pause.silence_ms >= policy.min_silence_ms and (
                    self._held_pause is None or self._held_pause[0] != span or
                    pause.silence_ms >= self._held_pause[1] + RECHECK_MS):
                self._held_pause = (span, pause.silence_ms)
                return [("pause_held", (span, pause.silence_ms, vad.silence_duration_ms), None)]
            return []
        self._reported_pause = span
        held = self.buf.audio()
        lo = max(0, int(span[0] * 16) - int(self.buf.start_ms * 16))
        hi = max(lo, int(span[1] * 16) - int(self.buf.start_ms * 16))
        return [("paused", span, held[lo:hi].copy())]

    def end_turn_early(self, span: Span) -> None:
        """The end-of-turn check says the turn paused at `span` is over: end it now, in order with the audio queued,
        unless the voice came back (or the window ended it) meanwhile."""
        async def op() -> None:
            vad = self.vad
            pause = vad.pause if vad is not None else None
            if pause is None or not pause.confirmed or (pause.speech_start_ms, pause.silence_start_ms) != span:
                return
            ev = vad.force_stop()
            self._reported_pause = self._held_pause = None
            seg = await asyncio.to_thread(self.buf.commit_range, ev.audio_start_ms, ev.audio_end_ms)
            self._speech_stopped(ev, seg, early=True)
        self.submit(op, None)

    async def commit(self) -> None:
        seg = await asyncio.to_thread(self.buf.commit)
        if self.vad is not None:
            self.vad.reset(position_ms=self.buf.timeline_ms)
        item_id, self.speech_item_id = self.speech_item_id, None
        self._forget_early_end()
        self._commit(seg.audio_16k, item_id)

    async def clear(self) -> None:
        await asyncio.to_thread(self.buf.clear)
        if self.vad is not None:
            self.vad.reset(position_ms=self.buf.timeline_ms)
        self.speech_item_id = None
        self._forget_early_end()
        self.send({"type": "input_audio_buffer.cleared"})

    async def decode_parts(self, item: Item) -> dict[int, np.ndarray]:
        """conversation.item.create with `input_audio` content: each part's audio (the session's input format) as
        16 kHz samples, by part index; a part with bad audio raises before anything is added."""
        fmt = self.buf.format
        clips = {}
        for i, part in enumerate(item.content):
            if part["type"] == "input_audio" and part.get("audio") is not None and part.get("transcript") is None:
                clips[i] = await asyncio.to_thread(_decode_clip, part["audio"], fmt, f"item.content[{i}].audio")
        return clips

    def transcribe_parts(self, item: Item, clips: dict[int, np.ndarray]) -> None:
        for i, clip in clips.items():
            self._start_transcription(item, i, clip)

    # ------------------------------------------------------------------------------------------ VAD events
    def _speech_started(self, ev) -> None:
        early, self._early = self._early, None
        self.speech_item_id = p.new_id("item")
        self.idle_anchor_ms = None
        pad = self.vad.prefix_padding_ms if self.vad is not None else 0
        repaired = early is not None and ev.audio_start_ms + pad - early.end_ms <= turn_detection.REPAIR_GRACE_MS
        if repaired:
            # the user went on: the early end was false; this speech continues the same item
            self.joining, self.speech_item_id = early, early.item.id
            task = self.transcripts.pop(early.item.id, None)
            if task is not None:
                task.cancel()
        # speech_started first, as at a barge-in: then the cancelled reply's events
        self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ev.audio_start_ms,
                   "item_id": self.speech_item_id})
        if repaired:
            self.events.repair(early.item)
        self.events.speech_started(bool(self.turn and self.turn.get("interrupt_response", True)))

    def _speech_stopped(self, ev, seg, early: bool = False) -> None:
        trace(self.name, "speech_stopped", (ev.audio_end_ms, "early") if early else ev.audio_end_ms)
        item_id, self.speech_item_id = self.speech_item_id or p.new_id("item"), None
        self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ev.audio_end_ms,
                   "item_id": item_id})
        transcript = self.events.speech_stopped((ev.audio_start_ms, ev.audio_end_ms), early)
        joining, self.joining = self.joining, None
        if joining is not None:  # a repaired turn: the same item, transcribed again as one utterance
            audio = np.concatenate([joining.audio_16k, seg.audio_16k])
            item = joining.item
            self.events.recommitted(item)
            self._start_transcription(item, 0, audio, transcript)
        else:
            audio = seg.audio_16k
            item = self._commit(audio, item_id, transcript)
        self._early = EarlyEnd(item, audio, ev.audio_end_ms) if early else None
        self.events.turn_ended(self.create_response)

    def _timeout(self, span, seg) -> None:
        self._forget_early_end()
        item_id = p.new_id("item")
        self.send({"type": "input_audio_buffer.timeout_triggered", "audio_start_ms": span[0],
                   "audio_end_ms": span[1], "item_id": item_id})
        self._commit(seg.audio_16k, item_id)
        self.events.turn_ended(self.create_response)

    def _forget_early_end(self) -> None:
        """No repair any more (a manual commit or clear, new turn detection): a turn being joined keeps the
        transcript of its own audio."""
        joining, self._early, self.joining = self.joining, None, None
        if joining is not None:
            self._start_transcription(joining.item, 0, joining.audio_16k)

    def response_finished(self, audio_ms: int) -> None:
        """Start the idle clock when the reply's audio would have finished playing (idle_timeout_ms)."""
        if self.turn and self.turn.get("idle_timeout_ms"):
            self.idle_anchor_ms = self.buf.timeline_ms + audio_ms

    # ------------------------------------------------------------------------------------- commit/transcribe
    def _commit(self, audio_16k: np.ndarray, item_id: str | None, early: asyncio.Task | None = None) -> Item:
        item = Item(item_id or p.new_id("item"), "message", role="user",
                    content=[{"type": "input_audio", "transcript": None}])
        self.events.committed(item)
        self._start_transcription(item, 0, audio_16k, early)
        return item

    def _start_transcription(self, item: Item, index: int, audio_16k: np.ndarray,
                             early: asyncio.Task | None = None) -> None:
        task = asyncio.create_task(self._transcribe(item, index, audio_16k, early), name=f"{item.id}-transcribe")
        self.transcripts[item.id] = task
        task.add_done_callback(lambda t, key=item.id: self.transcripts.pop(key, None)
                               if self.transcripts.get(key) is t else None)

    async def _transcribe(self, item: Item, index: int, audio_16k: np.ndarray,
                          early: asyncio.Task | None = None) -> None:
        part = item.content[index]
        ids = {"item_id": item.id, "content_index": index}
        try:
            delta_type = "conversation.item.input_audio_transcription.delta"
            if early is not None:  # transcribed during the pause that ended the turn: same audio, same text
                text, logprobs = await early
                if text:
                    self.send(self._with_logprobs({"type": delta_type, **ids, "delta": text}, logprobs))
            else:
                stream = self.stage.start().transcriber.transcribe(audio_16k)
                async with contextlib.aclosing(stream):
                    async for delta in stream:
                        self.send(self._with_logprobs({"type": delta_type, **ids, "delta": delta},
                                                      stream.delta_logprobs))
                text, logprobs = stream.text or "", stream.logprobs
            part["transcript"] = text
            self.send(self._with_logprobs({"type": "conversation.item.input_audio_transcription.completed", **ids,
                                           "transcript": part["transcript"],
                                           "usage": {"type": "duration", "seconds": round(len(audio_16k) / 16000, 3)}},
                                          logprobs))
        except TranscriptionError as exc:
            part["transcript"] = ""
            self.send({"type": "conversation.item.input_audio_transcription.failed", **ids,
                       "error": {"type": "transcription_error", "code": exc.code, "message": str(exc),
                                 "param": None}})

    def _with_logprobs(self, event: dict, logprobs) -> dict:
        """A transcription event, with its tokens' `logprobs` when the session's include asks for them."""
        return event | {"logprobs": transcript_entries(logprobs)} if self.logprobs else event


def _decode_clip(audio: str, fmt, param: str) -> np.ndarray:
    """Base64 audio in the session's input format → 16 kHz float32."""
    samples = decode_audio(b64decode(audio, param), fmt, param)
    if 1000 * len(samples) / fmt.rate < 100:
        raise AudioError(f"{param} holds {1000 * len(samples) / fmt.rate:.1f} ms of audio; at least 100 ms is "
                         "needed", code="input_audio_buffer_commit_empty", param=param)
    return resample(int16_to_float(samples), fmt.rate, 16000)
