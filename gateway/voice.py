"""Voice: the audio stage wired into a Realtime session (speech in via VAD + Whisper, speech out via piper).

`AudioStage` holds the process-wide workers (one batched Whisper transcriber, two TTS threads), shared by every session
like the LLM engine. `VoiceInput` is one session's input side: appends, commits and clears go through one ordered
queue, and the per-append work (base64 decode, resampling, silero VAD) runs in a worker thread, so the event loop only
routes events. `AudioOutput` is the response sink for `output_modalities: ["audio"]`: LLM text is cut into clauses as
it streams and each clause is spoken while the LLM keeps decoding, so the first audio does not wait for the reply.
To shorten the end of a turn, a pause of SPECULATE_AFTER_MS already transcribes the turn, starts decoding its reply
(`Pregen`) and, for spoken replies, synthesizes the reply's first pieces as they are decoded; nothing is sent. All of
it is used only if that pause turns out to be the end of the turn (then, at speech_stopped, the response replays the
buffered text and sends the audio already synthesized at once), and dropped if the user goes on.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from audio.buffer import InputAudioBuffer
from audio.chunker import SentenceChunker
from audio.codecs import AudioError, b64decode, decode_audio, int16_to_float, parse_audio_format
from audio.resample import resample
from audio.transcriber import TranscriptionError, Transcriber
from audio.tts import SpeechClock, SpeechJob, TTSError, TTSWorker
from audio.vad import StreamingVAD, semantic_vad_silence_ms
from gateway import protocol as p
from gateway.conversation import Item

log = logging.getLogger("rtserve.voice")

SPECULATE_AFTER_MS = 60  # trailing VAD silence after which the turn's audio is transcribed ahead of speech_stopped
MAX_PENDING_OPS = 4096  # input events queued per session (~80 s of 20 ms appends) before events are refused
MAX_PENDING_CHARS = 48 * 1024 * 1024  # base64 audio queued per session (three maximal appends) before refusals
AUDIO_DELTA_MS = 200  # one response.output_audio.delta carries at most this much audio
FIRST_PIECE_MIN_WORDS = 2  # the first spoken piece ends at a clause boundary after this many words, or a sentence
FIRST_PIECE_MAX_WORDS = 4  # ... or, with no punctuation yet, at a word boundary after this many (first audio sooner)
SPECULATIVE_PIECES = 2  # pieces of a pregenerated reply synthesized before the turn is known to have ended
RUNNING_DRY_S = 0.6  # with less audio than this left to play and no piece pending, the next one is cut mid-sentence
FIRST_PIECE_URGENT_S = 2.0  # a reply decoding towards its first piece makes other audio wait (for at most this long)


@dataclass(slots=True)
class AudioStage:
    """Shared audio workers. Created cheaply; `start()` spawns them (Whisper loads in its own thread).

    Speech goes through the TTS worker's deadline scheduler in steps of a fraction of a second of audio: a reply's
    pieces share one `SpeechClock`, and whichever listener runs out of audio first is served next, so with many
    sessions replying at once each gets its first audio before anyone's later audio is made."""
    transcriber: Transcriber | None = None
    tts: TTSWorker | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    speculations: dict = field(default_factory=lambda: {"started": 0, "used": 0, "pregenerated": 0, "adopted": 0,
                                                         "spoken": 0})
    # replies (pregenerated or responding) whose first spoken piece is not cut yet: key -> when they started
    awaiting_first_piece: dict = field(default_factory=dict)

    def start(self) -> "AudioStage":
        with self._lock:
            if self.transcriber is None:
                self.transcriber = Transcriber()
            if self.tts is None:
                self.tts = TTSWorker(yield_to=self.first_audio_pending)
        return self

    def first_audio_pending(self) -> bool:
        """(any thread) Someone's first audio is on its way upstream of TTS: a turn being transcribed, or a reply
        decoding towards its first piece. Audio whose listener still has plenty to play waits meanwhile."""
        if self.transcriber is not None and self.transcriber.inflight > 0:
            return True
        now = time.monotonic()
        return any(now - t < FIRST_PIECE_URGENT_S for t in list(self.awaiting_first_piece.values()))

    async def warmup(self) -> None:
        """Load the TTS voice (and Whisper, already loading in its thread) before the first caller waits on it."""
        self.start()
        with contextlib.suppress(Exception):
            await self.tts.warmup()

    def say(self, text: str, fmt, speed: float, clock: SpeechClock) -> SpeechJob:
        """Queue `text` for synthesis as part of the reply timed by `clock`; read it with `job.chunks()`."""
        return self.start().tts.submit(text, fmt, speed, clock)

    def close(self) -> None:
        if self.transcriber is not None:
            self.transcriber.close()
        if self.tts is not None:
            self.tts.close()

    def stats(self) -> dict:
        tr = self.transcriber
        return {"transcriber": tr.stats.snapshot() if tr is not None else None,
                "transcriptions_inflight": tr.inflight if tr is not None else 0,
                "speculative_transcriptions": dict(self.speculations),
                "tts": dict(self.tts.stats) if self.tts is not None else {}}


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


def output_format(config: dict) -> tuple:
    """The session's spoken-reply format and speed (`audio.output`)."""
    aout = config["audio"]["output"]
    return parse_audio_format(aout["format"], "audio.output.format"), float(aout.get("speed") or 1.0)


def audio_error(exc: AudioError) -> p.ProtocolError:
    return p.ProtocolError(exc.message, exc.code, exc.param)


class VoiceInput:
    """One session's input audio: buffer, VAD, commits and the transcriptions that fill user items."""

    def __init__(self, session, stage: AudioStage) -> None:
        self.s, self.stage = session, stage.start()
        audio_in = session.config["audio"]["input"]
        self.buf = InputAudioBuffer(parse_audio_format(audio_in["format"]))
        self.turn = audio_in["turn_detection"]
        self.vad = vad_from_config(self.turn, 0)
        self.speech_item_id: str | None = None  # announced in speech_started, used by the item it commits
        self.idle_anchor_ms: int | None = None  # input timeline ms when the last reply stopped playing
        self.transcripts: dict[str, asyncio.Task] = {}
        self._ops: asyncio.Queue = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._running = False
        self._nested: list = []
        self._pending_chars = 0  # base64 audio queued, not yet decoded
        self._spec: tuple[tuple[int, int], asyncio.Task] | None = None  # speculative transcript of a pausing turn
        self._spec_taken: tuple[int, int] | None = None  # the segment whose speculation became the committed turn
        self.pregen: Pregen | None = None  # the reply to that turn, decoding ahead (see RealtimeSession.pregenerate)

    @property
    def busy(self) -> bool:
        """Input ops are queued or running: later client events must queue behind them to keep their order."""
        return self._running or not self._ops.empty()

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
            self._worker = asyncio.create_task(self._run(), name=f"{self.s.id}-voice")
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
            self.s.send(p.error_event(audio_error(exc), event_id))
        except p.ProtocolError as exc:
            self.s.send(p.error_event(exc, event_id))
        except Exception as exc:  # a bug must not stop the session's input
            log.exception("session %s: audio input op failed", self.s.id)
            self.s.send(p.error_event(p.ProtocolError(f"Internal error: {exc}", None, None, "server_error"),
                                      event_id))

    def close(self) -> None:
        self._drop_speculation()
        if self._worker is not None:
            self._worker.cancel()
        for task in self.transcripts.values():
            task.cancel()
        self.transcripts.clear()

    # --------------------------------------------------------------------------------------------- the ops
    def configure(self) -> None:
        """Follow session.update (format, turn detection) in order with the audio already queued."""
        audio_in = self.s.config["audio"]["input"]

        async def op():
            self.buf.set_format(parse_audio_format(audio_in["format"]))
            if audio_in["turn_detection"] != self.turn:
                self.turn = audio_in["turn_detection"]
                self.vad = vad_from_config(self.turn, self.buf.timeline_ms)
                self.speech_item_id = None
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
            elif kind == "speculate":
                self._speculate(value, seg)
            elif kind == "resumed":
                self._drop_speculation()

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
            out.extend(self._speculation(vad))
        else:
            idle = turn.get("idle_timeout_ms") if turn else None
            anchor = self.idle_anchor_ms
            if idle and anchor is not None and vad.position_ms >= anchor + idle:
                self.idle_anchor_ms = None
                seg = self.buf.commit_range(max(anchor, self.buf.start_ms), vad.position_ms)  # the silence held
                out.append(("timeout", (anchor, vad.position_ms), seg))
            self.buf.discard_before(vad.position_ms - vad.prefix_padding_ms)
        return out

    def _speculation(self, vad: StreamingVAD) -> list:
        """Worker thread: a pause of SPECULATE_AFTER_MS inside a turn → transcribe the turn so far now; if the pause
        becomes the end of the turn (speech_stopped on the same segment), that transcript is ready sooner.
        Reads the VAD's trailing-silence state (`_speech_start`, `_silence_start`: samples on the input timeline)."""
        silence_ms = vad.silence_duration_ms
        start, quiet = vad._speech_start, vad._silence_start
        if quiet is None:
            return [("resumed", None, None)] if self._spec is not None else []
        if silence_ms < SPECULATE_AFTER_MS + 100 or (vad._pos - quiet) * 1000 < SPECULATE_AFTER_MS * 16000:
            return []
        key = (vad._ms(start), vad._ms(quiet))
        if self._spec is not None and self._spec[0] == key:
            return []
        held = self.buf.audio()
        lo = max(0, int(key[0] * 16) - int(self.buf.start_ms * 16))
        hi = max(lo, int(key[1] * 16) - int(self.buf.start_ms * 16))
        return [("speculate", key, held[lo:hi].copy())]

    def _speculate(self, key: tuple[int, int], audio: np.ndarray) -> None:
        self._drop_speculation()

        async def run() -> str:
            _trace(self.s.id, "speculate", key)
            text = await self.stage.start().transcriber.transcribe_text(audio)
            _trace(self.s.id, "speculative transcript", text)
            if text.strip() and self._wants_reply(key):  # the LLM starts on it too, still during the pause
                try:
                    pre = await self.s.pregenerate(text)
                except Exception:  # noqa: BLE001 - only an optimization: the response will generate normally
                    log.exception("session %s: pregeneration failed", self.s.id)
                    pre = None
                if pre is not None and self._wants_reply(key) and self.pregen is None:
                    self.pregen = pre
                    self.stage.speculations["pregenerated"] += 1
                elif pre is not None:
                    pre.cancel()
            return text
        self._spec = (key, asyncio.create_task(run(), name=f"{self.s.id}-speculate"))
        self._spec_taken = None
        self.stage.speculations["started"] += 1

    def _wants_reply(self, key: tuple[int, int]) -> bool:
        """The pausing turn `key` is still current and will get an automatic response."""
        current = (self._spec is not None and self._spec[0] == key and self.s.active is None) or \
            (self._spec_taken == key and self.s.active is not None and self.s.active.item is None)
        return current and bool(self.turn and self.turn.get("create_response", True)) and not self.s.transcribe_only

    def _drop_speculation(self) -> None:
        if self._spec is not None:
            self._spec[1].cancel()
            self._spec = None
        self._spec_taken = None
        self._drop_pregen()

    def _drop_pregen(self) -> None:
        if self.pregen is not None:
            self.pregen.cancel()
            self.pregen = None

    def take_pregen(self) -> "Pregen | None":
        pre, self.pregen = self.pregen, None
        return pre

    def _take_speculation(self, key: tuple[int, int]) -> asyncio.Task | None:
        spec, self._spec = self._spec, None
        if spec is not None and spec[0] == key:
            self.stage.speculations["used"] += 1
            self._spec_taken = key
            return spec[1]
        if spec is not None:
            spec[1].cancel()
        self._drop_pregen()
        return None

    async def commit(self) -> None:
        seg = await asyncio.to_thread(self.buf.commit)
        if self.vad is not None:
            self.vad.reset(position_ms=self.buf.timeline_ms)
        item_id, self.speech_item_id = self.speech_item_id, None
        self._commit(seg.audio_16k, item_id)

    async def clear(self) -> None:
        await asyncio.to_thread(self.buf.clear)
        if self.vad is not None:
            self.vad.reset(position_ms=self.buf.timeline_ms)
        self.speech_item_id = None
        self.s.send({"type": "input_audio_buffer.cleared"})

    async def add_audio_item(self, item: Item, previous_item_id: str | None) -> None:
        """conversation.item.create with `input_audio` content: decode each part's audio, then transcribe it."""
        fmt = self.buf.format
        clips = {}
        for i, part in enumerate(item.content):
            if part["type"] == "input_audio" and part.get("audio") is not None and part.get("transcript") is None:
                clips[i] = await asyncio.to_thread(_decode_clip, part["audio"], fmt, f"item.content[{i}].audio")
        self.s.add_item(item, previous_item_id)
        for i, clip in clips.items():
            self._start_transcription(item, i, clip)

    # ------------------------------------------------------------------------------------------ VAD events
    def _speech_started(self, ev) -> None:
        self._drop_speculation()
        self.speech_item_id = p.new_id("item")
        self.idle_anchor_ms = None
        self.s.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ev.audio_start_ms,
                     "item_id": self.speech_item_id})
        if self.turn and self.turn.get("interrupt_response", True) and self.s.active is not None:
            self.s.cancel_response("turn_detected")

    def _speech_stopped(self, ev, seg) -> None:
        _trace(self.s.id, "speech_stopped", ev.audio_end_ms)
        item_id, self.speech_item_id = self.speech_item_id or p.new_id("item"), None
        self.s.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ev.audio_end_ms,
                     "item_id": item_id})
        self._commit(seg.audio_16k, item_id, self._take_speculation((ev.audio_start_ms, ev.audio_end_ms)))
        if not self._auto_respond():
            self._drop_pregen()

    def _timeout(self, span, seg) -> None:
        item_id = p.new_id("item")
        self.s.send({"type": "input_audio_buffer.timeout_triggered", "audio_start_ms": span[0],
                     "audio_end_ms": span[1], "item_id": item_id})
        self._commit(seg.audio_16k, item_id)
        self._auto_respond()

    def _auto_respond(self) -> bool:
        if self.turn and self.turn.get("create_response", True) and not self.s.transcribe_only \
                and self.s.active is None:
            self.s.start_response(None)
            return True
        return False

    def response_finished(self, audio_ms: int) -> None:
        """Start the idle clock when the reply's audio would have finished playing (idle_timeout_ms)."""
        if self.turn and self.turn.get("idle_timeout_ms"):
            self.idle_anchor_ms = self.buf.timeline_ms + audio_ms

    # ------------------------------------------------------------------------------------- commit/transcribe
    def _commit(self, audio_16k: np.ndarray, item_id: str | None, early: asyncio.Task | None = None) -> None:
        item = Item(item_id or p.new_id("item"), "message", role="user",
                    content=[{"type": "input_audio", "transcript": None}])
        previous = self.s.conversation.items[-1].id if self.s.conversation.items else None
        self.s.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item.id})
        self.s.add_item(item)
        self._start_transcription(item, 0, audio_16k, early)

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
            if early is not None:  # transcribed during the pause that ended the turn: same audio, same text
                text = await early
                if text:
                    self.s.send({"type": "conversation.item.input_audio_transcription.delta", **ids, "delta": text})
            else:
                stream = self.stage.start().transcriber.transcribe(audio_16k)
                async with contextlib.aclosing(stream):
                    async for delta in stream:
                        self.s.send({"type": "conversation.item.input_audio_transcription.delta", **ids,
                                     "delta": delta})
                text = stream.text or ""
            part["transcript"] = text
            self.s.send({"type": "conversation.item.input_audio_transcription.completed", **ids,
                         "transcript": part["transcript"],
                         "usage": {"type": "duration", "seconds": round(len(audio_16k) / 16000, 3)}})
        except TranscriptionError as exc:
            part["transcript"] = ""
            self.s.send({"type": "conversation.item.input_audio_transcription.failed", **ids,
                         "error": {"type": "transcription_error", "code": exc.code, "message": str(exc),
                                   "param": None}})


def _decode_clip(audio: str, fmt, param: str) -> np.ndarray:
    """Base64 audio in the session's input format → 16 kHz float32."""
    samples = decode_audio(b64decode(audio, param), fmt, param)
    if 1000 * len(samples) / fmt.rate < 100:
        raise AudioError(f"{param} holds {1000 * len(samples) / fmt.rate:.1f} ms of audio; at least 100 ms is "
                         "needed", code="input_audio_buffer_commit_empty", param=param)
    return resample(int16_to_float(samples), fmt.rate, 16000)


@dataclass(slots=True)
class SpeechPlan:
    """How a pregenerated reply would be spoken: the stage and the session's output format and speed."""
    stage: AudioStage
    fmt: object
    speed: float


class Pregen:
    """A reply decoded ahead, buffered until a response adopts it (`stream()` replays, then follows live) or it is
    cancelled (the engine request is aborted, speculative synthesis dropped).

    With a `SpeechPlan`, the text is cut into pieces exactly as `AudioOutput` will cut it and the first
    SPECULATIVE_PIECES are synthesized as soon as they are complete; the adopting `AudioOutput` takes them
    (`take_speech`) and sends their audio without waiting for TTS."""

    def __init__(self, engine, request_id: str, prompt, sampling, speech: SpeechPlan | None = None,
                 **kwargs) -> None:
        self.request_id, self.prompt, self.sampling = request_id, prompt, sampling
        self.outputs: list = []
        self.finished = False
        self.error: BaseException | None = None
        self._wake = asyncio.Event()
        self._plan, self._speaking = speech, speech is not None
        self._chunker = _chunker() if speech is not None else None
        self.clock = SpeechClock()  # the speculative pieces' timeline, handed to the adopting response
        self.spoken: list[SpeechJob] = []  # the synthesis of the first pieces, in piece order
        if speech is not None:
            speech.stage.awaiting_first_piece[request_id] = time.monotonic()
        self._task = asyncio.create_task(self._pump(engine.generate(request_id, prompt.ids, sampling, **kwargs)),
                                         name=f"{request_id}-pregen")

    def _first_piece_done(self) -> None:
        if self._plan is not None:
            self._plan.stage.awaiting_first_piece.pop(self.request_id, None)

    def _say(self, pieces: list[str]) -> None:
        plan = self._plan
        for piece in pieces:
            if not self._speaking or len(self.spoken) >= SPECULATIVE_PIECES:
                self._speaking = False
                return
            _trace(self.request_id, "speculative piece", piece)
            self.spoken.append(plan.stage.say(piece, plan.fmt, plan.speed, self.clock))
            self._first_piece_done()

    async def _pump(self, gen) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if not self.outputs:
                        _trace(self.request_id, "pregen first token")
                    self.outputs.append(out)
                    self._wake.set()
                    if self._speaking and out.text_delta:
                        self._say(self._chunker.push(out.text_delta))
                    if self._speaking and out.finished:
                        self._say(self._chunker.flush())
        except Exception as exc:  # noqa: BLE001 - re-raised to the adopting response
            self.error = exc
        finally:
            self.finished = True
            self._first_piece_done()
            self._wake.set()

    def matches(self, prompt, sampling) -> bool:
        a, b = self.sampling, sampling
        return prompt.ids == self.prompt.ids and (a.max_tokens, a.temperature, a.stop_token_ids) == \
            (b.max_tokens, b.temperature, b.stop_token_ids)

    async def stream(self):
        i = 0
        try:
            while True:
                if i < len(self.outputs):
                    i += 1
                    yield self.outputs[i - 1]
                    continue
                if self.finished:
                    if self.error is not None:
                        raise self.error
                    return
                self._wake.clear()
                await self._wake.wait()
        finally:
            self.cancel()

    def take_speech(self, fmt, speed: float) -> list[SpeechJob]:
        """Hand the speculative synthesis to the adopting response (if it speaks in the same format and speed) and
        stop synthesizing; what is not handed over is dropped."""
        self._speaking = False
        self._first_piece_done()  # the adopting response's own wait takes over
        spoken, self.spoken = self.spoken, []
        plan = self._plan
        if plan is not None and (plan.fmt, float(plan.speed)) == (fmt, float(speed)):
            return spoken
        _drop(spoken)
        return []

    def cancel(self) -> None:
        self._speaking = False
        self._first_piece_done()
        _drop(self.spoken)
        self.spoken = []
        if not self._task.done():
            self._task.cancel()


def _chunker() -> SentenceChunker:
    """How replies are cut for speech; a pregenerated reply and the response adopting it must cut alike."""
    return SentenceChunker(first_min_words=FIRST_PIECE_MIN_WORDS, first_max_words=FIRST_PIECE_MAX_WORDS)


def _trace(what: str, event: str, detail=None) -> None:
    """Debug timeline of a turn's speculation (`--log-level debug`)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("trace %.3f %s %s %s", time.perf_counter(), what, event, "" if detail is None else repr(detail))


def _drop(spoken: list[SpeechJob]) -> None:
    for job in spoken:
        job.cancel()  # the rest of its synthesis is skipped; a step already running finishes on its thread, unused


class AudioOutput:
    """Response sink for audio: transcript deltas as the LLM streams, audio deltas as clauses are spoken.

    `marks` pairs the audio played so far (ms) with how much of the transcript it covers, so truncation at
    `audio_end_ms` keeps exactly the clauses heard (and a proportional share of the clause being played).
    """

    def __init__(self, session, resp, stage: AudioStage) -> None:
        self.s, self.resp, self.stage = session, resp, stage.start()
        self.fmt, self.speed = output_format(session.config)
        self.part = {"type": "output_audio", "transcript": ""}
        resp.item.content.append(self.part)
        self.index = len(resp.item.content) - 1
        self.marks: list[tuple[int, int]] = []
        resp.item.audio_marks[self.index] = self.marks
        resp.item.audio_ms[self.index] = 0
        self.audio_ms = 0.0
        self.first_audio_at: float | None = None
        self.muted = False
        self._chunker = _chunker()
        self._prespoken: list[SpeechJob] = []  # synthesized during the pause (Pregen.take_speech)
        self.clock = SpeechClock()
        self._search = 0
        self._pieces: asyncio.Queue = asyncio.Queue()
        self._busy = False  # a piece is being synthesized and sent
        self._ids = {"response_id": resp.id, "item_id": resp.item.id, "output_index": 0, "content_index": self.index}
        session.send({"type": "response.content_part.added", **self._ids,
                      "part": {"type": "audio", "transcript": ""}})
        self.stage.awaiting_first_piece[resp.id] = time.monotonic()
        self._task = asyncio.create_task(self._speak(), name=f"{resp.id}-tts")

    def delta(self, text: str) -> None:
        self.part["transcript"] += text
        self.s.send({"type": "response.output_audio_transcript.delta", **self._ids, "delta": text})
        for piece in self._chunker.push(text):
            self._queue(piece)
        self._cut_if_running_dry()

    def _cut_if_running_dry(self) -> None:
        if self._running_dry():
            for piece in self._chunker.cut_now():
                _trace(f"{self.s.id}-{self.resp.id}", "piece cut early", piece)
                self._queue(piece)

    def _running_dry(self) -> bool:
        """All audio queued so far has been sent and its listener has less than RUNNING_DRY_S of it left to play:
        waiting for the sentence to end would leave a silence (the LLM is slower than the speech)."""
        if self.first_audio_at is None or self._busy or not self._pieces.empty() or self._prespoken:
            return False  # (pieces synthesized during the pause are cut like the pregenerated reply cut them)
        left = self.first_audio_at + self.audio_ms / 1000 - asyncio.get_running_loop().time()
        return left < RUNNING_DRY_S

    def _queue(self, piece: str) -> None:
        _trace(f"{self.s.id}-{self.resp.id}", "piece", piece)
        text = self.part["transcript"]
        at = text.find(piece, self._search)
        self._search = at + len(piece) if at >= 0 else len(text)
        self._pieces.put_nowait((piece, self._search))

    async def finish(self) -> None:
        """The LLM is done: speak the rest and wait for the last audio."""
        for piece in self._chunker.flush():
            self._queue(piece)
        self._pieces.put_nowait(None)
        await self._task

    def adopt(self, spoken: list[SpeechJob]) -> None:
        """Use the synthesis of a pregenerated reply's first pieces (same text, format and speed) and their clock."""
        self._prespoken = list(spoken)
        if spoken:
            self.clock = spoken[0].clock
            self._first_piece_done()

    def _first_piece_done(self) -> None:
        self.stage.awaiting_first_piece.pop(self.resp.id, None)

    def _drop_prespoken(self) -> None:
        _drop(self._prespoken)
        self._prespoken = []

    def cancel(self) -> None:
        self._first_piece_done()
        self._drop_prespoken()
        self._task.cancel()

    def mute(self) -> None:
        """output_audio_buffer.clear: stop producing audio for this response (the text goes on)."""
        self.muted = True
        self.cancel()

    async def _speak(self) -> None:
        try:
            await self._speak_pieces()
        finally:
            self._first_piece_done()
            self._drop_prespoken()

    async def _speak_pieces(self) -> None:
        step = max(2, int(self.fmt.rate * self.fmt.bytes_per_sample * AUDIO_DELTA_MS / 1000))
        while (job := await self._pieces.get()) is not None:
            piece, chars = job
            self._busy = True
            if self._prespoken and self._prespoken[0].text == piece:  # synthesized during the pause
                speech = self._prespoken.pop(0)
            else:
                self._drop_prespoken()  # (pieces are cut identically, so this only happens if the text differs)
                speech = self.stage.say(piece, self.fmt, self.speed, self.clock)
            self._first_piece_done()
            start_ms, mark = self.audio_ms, None
            try:
                async for raw in speech.chunks():
                    if mark is None:
                        _trace(f"{self.s.id}-{self.resp.id}", "piece audio", f"{self.audio_ms:.0f} ms")
                    if self.first_audio_at is None:
                        _trace(f"{self.s.id}-{self.resp.id}", "first audio", piece)
                        self.first_audio_at = asyncio.get_running_loop().time()
                    for i in range(0, len(raw), step):
                        self.s.send({"type": "response.output_audio.delta", **self._ids,
                                     "delta": base64.b64encode(raw[i:i + step]).decode("ascii")})
                    self.audio_ms += self.fmt.duration_ms(len(raw))
                    self.resp.item.audio_ms[self.index] = int(self.audio_ms)
                    # the piece's end as known so far (its sentences' lengths come before their audio), so a
                    # truncation inside the piece keeps a proportional share of its text
                    mark = self._mark(mark, (int(max(self.audio_ms, start_ms + speech.expected_ms)), chars))
            except (TTSError, AudioError) as exc:
                log.warning("response %s: TTS failed for %r: %s", self.resp.id, piece[:40], exc)
            finally:
                speech.cancel()
            if mark is not None:
                self._mark(mark, (int(self.audio_ms), chars))
            self._busy = False
            self._cut_if_running_dry()

    def _mark(self, old: tuple | None, new: tuple[int, int]) -> tuple[int, int]:
        if old is not None and self.marks and self.marks[-1] == old:
            self.marks[-1] = new
        else:
            self.marks.append(new)
        return new

    def done(self) -> None:
        self._first_piece_done()
        self._drop_prespoken()
        if not self._task.done():
            self._task.cancel()
        transcript = self.part["transcript"]
        self.s.send({"type": "response.output_audio.done", **self._ids})
        self.s.send({"type": "response.output_audio_transcript.done", **self._ids, "transcript": transcript})
        self.s.send({"type": "response.content_part.done", **self._ids,
                     "part": {"type": "audio", "transcript": transcript}})
