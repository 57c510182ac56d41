"""The audio stage: the process-wide audio workers every Realtime session shares, like the LLM engine.

It owns one batched Whisper transcriber and the TTS worker's synthesis threads, the speculation counters reported in
/metrics, and the set of replies still waiting for their first spoken piece (which the TTS scheduler yields to).
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from audio import smart_turn
from audio.transcriber import Transcriber
from audio.tts import SpeechClock, SpeechJob, TTSWorker

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
    # Smart Turn calls, one at a time on one thread: each is short, and parallel calls would only compete for the
    # cores the engine, Whisper and piper need
    _turn_pool: ThreadPoolExecutor | None = None
    _scoring: int = 0  # Smart Turn calls queued or running

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
        return self.reply_awaited()

    def reply_awaited(self) -> bool:
        """(any thread; cheap, never blocks) A reply is decoding towards its first spoken piece, which a user (or a
        pause that may be a turn's end) waits on: the LLM engine may take every CPU the stage is not using."""
        now = time.monotonic()
        return any(now - t < FIRST_PIECE_URGENT_S for t in list(self.awaiting_first_piece.values()))

    def busy(self) -> bool:
        """(any thread; cheap, never blocks) The stage is computing: a transcription queued or decoding, a synthesis
        step running, a turn being scored. What the LLM engine yields a CPU to (`AsyncEngine.share_cpus_with`)."""
        tr, tts = self.transcriber, self.tts
        return self._scoring > 0 or (tr is not None and tr.inflight > 0) or (tts is not None and tts.busy)

    async def warmup(self) -> None:
        """Load the TTS voice and Smart Turn, and wait for Whisper (loading in its thread), before the first caller
        waits on them: Smart Turn's first call builds its ONNX session, which would otherwise fall on the first turn
        that pauses, beside that turn's transcription. After this the stage's models are all in memory."""
        self.start()
        with contextlib.suppress(Exception):
            await self.tts.warmup()
        with contextlib.suppress(Exception):  # without the pipecat-ai wheel each call fails alike, and is logged
            await self.score_turn(np.zeros(smart_turn.SAMPLE_RATE, np.float32))
        await asyncio.to_thread(self.transcriber.loaded.wait)

    def say(self, text: str, fmt, speed: float, clock: SpeechClock) -> SpeechJob:
        """Queue `text` for synthesis as part of the reply timed by `clock`; read it with `job.chunks()`."""
        return self.start().tts.submit(text, fmt, speed, clock)

    async def score_turn(self, audio_16k: np.ndarray) -> float:
        """Smart Turn's P(the turn is complete) for the audio up to a pause (`audio.smart_turn.score`)."""
        with self._lock:
            if self._turn_pool is None:
                self._turn_pool = ThreadPoolExecutor(1, thread_name_prefix="rtserve-smart-turn")
        self._scoring += 1  # (event loop only)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._turn_pool, smart_turn.score, audio_16k)
        finally:
            self._scoring -= 1

    def close(self) -> None:
        if self._turn_pool is not None:
            self._turn_pool.shutdown(wait=False, cancel_futures=True)
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
