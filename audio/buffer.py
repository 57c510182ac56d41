"""``InputAudioBuffer``: one session's uncommitted input audio, with the Realtime protocol's rules.

Appends arrive base64-encoded in the session format; we keep a 16 kHz float32 copy (what VAD and
Whisper want) and a millisecond timeline of everything appended since the session started, so VAD
offsets (``audio_start_ms``/``audio_end_ms``) and commits refer to the same clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .codecs import AudioError, AudioFormat, b64decode, decode_audio, int16_to_float, parse_audio_format
from .resample import StreamResampler

RATE = 16_000
MAX_APPEND_B64_CHARS = 15 * 1024 * 1024  # 15 MiB per input_audio_buffer.append event
MAX_BUFFER_MS = 15 * 60 * 1000
MIN_COMMIT_MS = 100


class AudioBufferError(AudioError):
    """A protocol rule of the input audio buffer was broken (typed ``code`` for the error event)."""


@dataclass(slots=True, frozen=True)
class CommittedAudio:
    """Audio handed to the conversation: 16 kHz float32 and where it sits on the input timeline."""

    audio_16k: np.ndarray
    audio_start_ms: int
    audio_end_ms: int

    @property
    def duration_ms(self) -> int:
        return self.audio_end_ms - self.audio_start_ms


@dataclass(slots=True)
class InputAudioBuffer:
    """Per-session input buffer (not thread-safe: one session drives it, off or on the loop)."""

    format: AudioFormat = field(default_factory=AudioFormat)
    max_ms: int = MAX_BUFFER_MS
    _resampler: StreamResampler = field(init=False, repr=False)
    _chunks: list[np.ndarray] = field(default_factory=list, repr=False)
    _samples: int = 0  # 16 kHz samples held in _chunks
    _base: int = 0  # timeline sample (16 kHz) of the first held sample
    _input_samples: int = 0  # samples at format.rate appended since the last commit/clear
    _timeline_in: int = 0  # samples at format.rate appended since the session started
    _timeline_base_ms: float = 0.0  # timeline ms at the last format change

    def __post_init__(self) -> None:
        self._resampler = StreamResampler(self.format.rate, RATE)

    # ---- timeline
    @property
    def timeline_ms(self) -> int:
        """Milliseconds of input audio appended since the session started."""
        return int(self._timeline_base_ms + 1000 * self._timeline_in / self.format.rate)

    @property
    def duration_ms(self) -> int:
        """Milliseconds of audio appended since the last commit/clear (the protocol's buffer)."""
        return int(1000 * self._input_samples / self.format.rate)

    def _exact_ms(self) -> float:
        return 1000 * self._input_samples / self.format.rate

    @property
    def start_ms(self) -> int:
        return int(1000 * self._base / RATE)

    def set_format(self, fmt: AudioFormat | dict | str | None) -> None:
        """Change the input format (``session.update``); buffered audio and the timeline are kept."""
        fmt = parse_audio_format(fmt)
        if fmt == self.format:
            return
        tail = self._resampler.flush()
        self._push(tail)
        self._timeline_base_ms += 1000 * self._timeline_in / self.format.rate
        self._timeline_in = 0
        self.format = fmt
        self._resampler = StreamResampler(fmt.rate, RATE)

    # ---- append
    def append_b64(self, audio: str) -> np.ndarray:
        """Decode one ``input_audio_buffer.append``; returns the new 16 kHz samples (for the VAD)."""
        if isinstance(audio, str) and len(audio) > MAX_APPEND_B64_CHARS:
            raise AudioBufferError(
                f"audio of one append is {len(audio)} base64 characters; the limit is 15 MiB",
                code="invalid_value", param="audio")
        return self.append_pcm(decode_audio(b64decode(audio), self.format))

    def append_pcm(self, samples: np.ndarray) -> np.ndarray:
        """Append int16 samples of the session format's rate; returns the new 16 kHz samples."""
        samples = np.asarray(samples)
        if samples.ndim != 1 or samples.dtype != np.int16:
            raise AudioBufferError(f"expected 1-D int16 samples, got {samples.dtype} {samples.shape}")
        add_ms = 1000 * len(samples) / self.format.rate
        if self._samples * 1000 / RATE + add_ms > self.max_ms:
            raise AudioBufferError(
                f"input audio buffer is full ({self.max_ms // 1000} s max); commit or clear it",
                code="input_audio_buffer_full", param="audio")
        self._input_samples += len(samples)
        self._timeline_in += len(samples)
        out = self._resampler.process(int16_to_float(samples))
        self._push(out)
        return out

    def _push(self, x: np.ndarray) -> None:
        if len(x):
            self._chunks.append(x)
            self._samples += len(x)

    # ---- read / commit
    def audio(self) -> np.ndarray:
        """All held 16 kHz audio (contiguous copy)."""
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0].copy() if self._chunks else np.zeros(0, np.float32)

    def commit(self) -> CommittedAudio:
        """Manual ``input_audio_buffer.commit``: everything held, if at least 100 ms."""
        if self._exact_ms() < MIN_COMMIT_MS:
            raise AudioBufferError(
                f"Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has {self._exact_ms():.2f}ms of audio.",
                code="input_audio_buffer_commit_empty")
        self._push(self._resampler.flush())
        start = self.start_ms
        audio = self.audio()
        self._drop_all()
        return CommittedAudio(audio, start, start + int(1000 * len(audio) / RATE))

    def commit_range(self, start_ms: int, end_ms: int) -> CommittedAudio:
        """VAD commit: the segment ``[start_ms, end_ms)``; audio up to ``end_ms`` leaves the buffer."""
        if end_ms < start_ms:
            raise AudioBufferError(f"segment end {end_ms} ms is before its start {start_ms} ms")
        held = self.audio()
        lo = max(0, int(start_ms * RATE / 1000) - self._base)
        hi = max(lo, min(len(held), int(end_ms * RATE / 1000) - self._base))
        seg = held[lo:hi].copy()
        rest = held[hi:]
        self._base += hi
        self._chunks = [rest] if len(rest) else []
        self._samples = len(rest)
        self._input_samples = int(round(len(rest) * self.format.rate / RATE))
        return CommittedAudio(seg, int(1000 * (self._base - (hi - lo)) / RATE), int(1000 * self._base / RATE))

    def discard_before(self, ms: int) -> None:
        """Drop held audio before ``ms`` (server VAD: silence older than the prefix padding)."""
        cut = int(ms * RATE / 1000) - self._base
        if cut <= 0 or not self._chunks:
            return
        held = self.audio()
        cut = min(cut, len(held))
        self._chunks = [held[cut:]] if cut < len(held) else []
        self._base += cut
        self._samples -= cut
        self._input_samples = max(0, self._input_samples - int(round(cut * self.format.rate / RATE)))

    def clear(self) -> None:
        """``input_audio_buffer.clear``: drop everything held (the timeline keeps running)."""
        self._push(self._resampler.flush())
        self._drop_all()

    def _drop_all(self) -> None:
        self._base += self._samples
        self._chunks.clear()
        self._samples = 0
        self._input_samples = 0
