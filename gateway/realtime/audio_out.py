"""Spoken output: the response sink that speaks a reply as it streams, and how replies are cut into pieces.

`AudioOutput` owns one response's `output_audio` part while it is produced: the transcript, the queue of pieces
waiting for speech, the reply's `SpeechClock`, the audio sent so far and the (audio ms, transcript chars) marks that
truncation reads. `SpeechPlan` says how a reply decoded ahead (speculation.Pregen) would be spoken, and
`sentence_chunker()` is the one cut both use, so pieces synthesized during a pause are the response's own pieces.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from dataclasses import dataclass
from typing import Callable

from audio.chunker import SentenceChunker
from audio.codecs import AudioError, parse_audio_format
from audio.stage import AudioStage
from audio.tts import SpeechClock, SpeechJob, TTSError
from gateway.realtime.trace import trace

log = logging.getLogger("rtserve.voice")

AUDIO_DELTA_MS = 200  # one response.output_audio.delta carries at most this much audio
FIRST_PIECE_MIN_WORDS = 2  # the first spoken piece ends at a clause boundary after this many words, or a sentence
FIRST_PIECE_MAX_WORDS = 4  # ... or, with no punctuation yet, at a word boundary after this many (first audio sooner)
RUNNING_DRY_S = 0.6  # with less audio than this left to play and no piece pending, the next one is cut mid-sentence


def output_format(config: dict) -> tuple:
    """The session's spoken-reply format and speed (`audio.output`)."""
    aout = config["audio"]["output"]
    return parse_audio_format(aout["format"], "audio.output.format"), float(aout.get("speed") or 1.0)


def sentence_chunker() -> SentenceChunker:
    """How replies are cut for speech; a pregenerated reply and the response adopting it must cut alike."""
    return SentenceChunker(first_min_words=FIRST_PIECE_MIN_WORDS, first_max_words=FIRST_PIECE_MAX_WORDS)


def drop_speech(spoken: list[SpeechJob]) -> None:
    for job in spoken:
        job.cancel()  # the rest of its synthesis is skipped; a step already running finishes on its thread, unused


@dataclass(slots=True)
class SpeechPlan:
    """How a pregenerated reply would be spoken: the stage and the session's output format and speed."""
    stage: AudioStage
    fmt: object
    speed: float


class AudioOutput:
    """Response sink for audio: transcript deltas as the LLM streams, audio deltas as clauses are spoken.

    `marks` pairs the audio played so far (ms) with how much of the transcript it covers, so truncation at
    `audio_end_ms` keeps exactly the clauses heard (and a proportional share of the clause being played).
    """

    def __init__(self, send: Callable[[dict], None], resp, stage: AudioStage, fmt, speed: float, name: str) -> None:
        self.send, self.resp, self.stage = send, resp, stage.start()
        self.fmt, self.speed, self.name = fmt, speed, name
        self.part = {"type": "output_audio", "transcript": ""}
        resp.item.content.append(self.part)
        self.index = len(resp.item.content) - 1
        self.marks: list[tuple[int, int]] = []
        resp.item.audio_marks[self.index] = self.marks
        resp.item.audio_ms[self.index] = 0
        self.audio_ms = 0.0
        self.first_audio_at: float | None = None
        self.muted = False
        self._chunker = sentence_chunker()
        self._prespoken: list[SpeechJob] = []  # synthesized during the pause (Pregen.take_speech)
        self.clock = SpeechClock()
        self._search = 0
        self._pieces: asyncio.Queue = asyncio.Queue()
        self._busy = False  # a piece is being synthesized and sent
        self._ids = {"response_id": resp.id, "item_id": resp.item.id, "output_index": resp.out_items.index(resp.item),
                     "content_index": self.index}
        send({"type": "response.content_part.added", **self._ids, "part": {"type": "audio", "transcript": ""}})
        self.stage.awaiting_first_piece[resp.id] = time.monotonic()
        self._task = asyncio.create_task(self._speak(), name=f"{resp.id}-tts")

    def delta(self, text: str) -> None:
        self.part["transcript"] += text
        self.send({"type": "response.output_audio_transcript.delta", **self._ids, "delta": text})
        for piece in self._chunker.push(text):
            self._queue(piece)
        self._cut_if_running_dry()

    def _cut_if_running_dry(self) -> None:
        if self._running_dry():
            for piece in self._chunker.cut_now():
                trace(self.name, "piece cut early", piece)
                self._queue(piece)

    def _running_dry(self) -> bool:
        """All audio queued so far has been sent and its listener has less than RUNNING_DRY_S of it left to play:
        waiting for the sentence to end would leave a silence (the LLM is slower than the speech)."""
        if self.first_audio_at is None or self._busy or not self._pieces.empty() or self._prespoken:
            return False  # (pieces synthesized during the pause are cut like the pregenerated reply cut them)
        left = self.first_audio_at + self.audio_ms / 1000 - asyncio.get_running_loop().time()
        return left < RUNNING_DRY_S

    def _queue(self, piece: str) -> None:
        trace(self.name, "piece", piece)
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
        drop_speech(self._prespoken)
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
                        trace(self.name, "piece audio", f"{self.audio_ms:.0f} ms")
                    if self.first_audio_at is None:
                        trace(self.name, "first audio", piece)
                        self.first_audio_at = asyncio.get_running_loop().time()
                    for i in range(0, len(raw), step):
                        self.send({"type": "response.output_audio.delta", **self._ids,
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
        self.send({"type": "response.output_audio.done", **self._ids})
        self.send({"type": "response.output_audio_transcript.done", **self._ids, "transcript": transcript})
        self.send({"type": "response.content_part.done", **self._ids,
                   "part": {"type": "audio", "transcript": transcript}})
