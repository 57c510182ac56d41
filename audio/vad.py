"""Streaming server VAD on silero-vad (ONNX, shipped inside the ``silero-vad`` package).

The ONNX session (weights) is shared by every session of the process; each ``StreamingVAD`` owns
its RNN state and 64-sample context, passed in and out explicitly, so sessions never touch each
other's state.  Timestamps are milliseconds in the session's input-audio timeline (samples fed
since the session started), like OpenAI's ``audio_start_ms``/``audio_end_ms``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from importlib import resources

import numpy as np

SAMPLE_RATE = 16_000
WINDOW = 512  # samples per silero step at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous window that silero v5 prepends
_MS_PER_SAMPLE = 1000 / SAMPLE_RATE

# semantic_vad's longest silence per eagerness; the gateway's end-of-turn check (gateway/realtime/turn_detection.py)
# ends a turn that sounds and reads complete sooner
SEMANTIC_EAGERNESS_MS = {"low": 1200, "medium": 800, "high": 500, "auto": 800}
# Silero's speech probability stays high for a while after a voice really stops (its recurrent state decays), so a
# silence counted from silero's first quiet window starts late. When silero turns to silence, the run of windows just
# before it that were already TAIL_DB below the turn's loudest window (at most MAX_TAIL_MS of them) counts as
# silence too. With noise less than TAIL_DB under the voice no window qualifies, and silero's timing stands.
TAIL_DB = 40.0
MAX_TAIL_MS = 160
# The same quiet tail is a pause already (`StreamingVAD.pause`, unconfirmed) once it has lasted this long, two windows,
# before silero turns to silence: the work a pause starts (the transcription, the reply's prefill and its end-of-turn
# scores) starts that much sooner, and silero's silence, which only can end a turn, takes it over at the same start.
# A quiet stretch inside a word (a stop's closure) starts work that is dropped when the voice goes on; also waiting for
# silero's first doubt (its probability under 0.95) dropped most of those, and most of the gain (docs/benchmarks.md).
QUIET_PAUSE_MS = 64

_session = None
_session_lock = threading.Lock()


def _onnx_session():
    """The process-wide silero ONNX session (thread-safe ``run``), loaded offline once."""
    global _session
    with _session_lock:
        if _session is None:
            import onnxruntime

            path = resources.files("silero_vad.data").joinpath("silero_vad.onnx")
            opts = onnxruntime.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            _session = onnxruntime.InferenceSession(str(path), sess_options=opts,
                                                    providers=["CPUExecutionProvider"])
        return _session


def semantic_vad_silence_ms(eagerness: str | None) -> int:
    """Map ``semantic_vad.eagerness`` onto a silence duration for our energy-free silero VAD."""
    key = eagerness or "auto"
    if key not in SEMANTIC_EAGERNESS_MS:
        raise ValueError(f"eagerness must be one of {sorted(SEMANTIC_EAGERNESS_MS)}, got {eagerness!r}")
    return SEMANTIC_EAGERNESS_MS[key]


@dataclass(slots=True, frozen=True)
class VADEvent:
    """``speech_started`` (``audio_start_ms``) or ``speech_stopped`` (``audio_end_ms``).

    ``audio_start_ms`` already includes prefix padding.  A ``speech_stopped`` event carries the
    segment to commit: ``[audio_start_ms, audio_end_ms)`` of the input timeline.
    """

    type: str  # "speech_started" | "speech_stopped"
    audio_start_ms: int
    audio_end_ms: int | None = None


@dataclass(slots=True, frozen=True)
class Pause:
    """A silence inside an open speech segment that has not yet lasted the silence window (it may still become the
    turn's end). Milliseconds on the input timeline, like ``VADEvent``."""

    speech_start_ms: int  # where the open segment starts (prefix padding included)
    silence_start_ms: int  # where the silence began (the segment's end if the silence holds)
    silence_ms: float  # how long the silence has lasted so far
    confirmed: bool = True  # silero hears silence; False: only the voice's energy has fallen (QUIET_PAUSE_MS)


@dataclass(slots=True)
class StreamingVAD:
    """Per-session streaming VAD; feed 16 kHz float audio of any chunk size, get events back."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    neg_threshold: float | None = None  # hysteresis; default threshold − 0.15 like silero
    _state: np.ndarray = field(default_factory=lambda: np.zeros((2, 1, 128), np.float32), repr=False)
    _context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32), repr=False)
    _pending: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32), repr=False)
    _pos: int = 0  # samples consumed by the model so far (input timeline)
    _floor: int = 0  # segments never start before this sample (end of the last segment)
    _speech_start: int | None = None
    _silence_start: int | None = None
    _peak_energy: float = 0.0  # loudest window of the current speech (mean square)
    _quiet_since: int | None = None  # first of the trailing windows TAIL_DB below that peak
    last_prob: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {self.threshold}")
        if self.prefix_padding_ms < 0 or self.silence_duration_ms < 0:
            raise ValueError("prefix_padding_ms and silence_duration_ms must be >= 0")
        if self.neg_threshold is None:
            self.neg_threshold = max(self.threshold - 0.15, 0.01)

    @property
    def speaking(self) -> bool:
        return self._speech_start is not None

    @property
    def position_ms(self) -> int:
        """Milliseconds of audio the VAD has consumed."""
        return int(self._pos * _MS_PER_SAMPLE)

    @property
    def pause(self) -> Pause | None:
        """The trailing silence of the open speech segment, or None (no speech, or the voice is on): silero's, or
        before silero turns to silence, a quiet tail (TAIL_DB) of at least QUIET_PAUSE_MS, unconfirmed. Its start is
        where silero's silence will start if silero follows within MAX_TAIL_MS."""
        if self._speech_start is None:
            return None
        start, confirmed = self._silence_start, True
        if start is None:
            if self._quiet_since is None or self._pos - self._quiet_since < QUIET_PAUSE_MS * SAMPLE_RATE / 1000:
                return None
            start, confirmed = self._quiet_since, False  # (set inside the segment: never before its start)
        return Pause(self._ms(self._speech_start), self._ms(start), (self._pos - start) * _MS_PER_SAMPLE, confirmed)

    def reset(self, position_ms: int | None = None) -> None:
        """Forget state (e.g. after ``input_audio_buffer.clear``); keeps or moves the timeline."""
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._pending = np.zeros(0, np.float32)
        if position_ms is not None:
            self._pos = int(position_ms * SAMPLE_RATE / 1000)
        self._floor = self._pos
        self._speech_start = self._silence_start = self._quiet_since = None

    def _prob(self, window: np.ndarray) -> float:
        x = np.concatenate([self._context, window])[None, :]
        out, self._state = _onnx_session().run(
            None, {"input": x, "state": self._state, "sr": np.array(SAMPLE_RATE, dtype=np.int64)})
        self._context = window[-CONTEXT:]
        return float(out.reshape(-1)[0])

    def feed(self, audio_16k: np.ndarray) -> list[VADEvent]:
        """Consume audio; return the events it completes (usually none)."""
        x = np.asarray(audio_16k, dtype=np.float32).reshape(-1)
        buf = np.concatenate([self._pending, x]) if len(self._pending) else x
        events: list[VADEvent] = []
        silence = int(self.silence_duration_ms * SAMPLE_RATE / 1000)
        pad = int(self.prefix_padding_ms * SAMPLE_RATE / 1000)
        n = len(buf) // WINDOW
        quiet_ratio = 10.0 ** (-TAIL_DB / 10)
        max_tail = int(MAX_TAIL_MS * SAMPLE_RATE / 1000)
        for i in range(n):
            win = buf[i * WINDOW : (i + 1) * WINDOW]
            p = self.last_prob = self._prob(win)
            energy = float(np.dot(win, win)) / WINDOW
            start = self._pos
            self._pos += WINDOW
            if self._speech_start is None:
                if p >= self.threshold:
                    self._speech_start = max(start - pad, self._floor)
                    self._silence_start = self._quiet_since = None
                    self._peak_energy = energy
                    events.append(VADEvent("speech_started", self._ms(self._speech_start)))
                continue
            self._peak_energy = max(self._peak_energy, energy)
            if energy >= self._peak_energy * quiet_ratio:
                self._quiet_since = None
            elif self._quiet_since is None:
                self._quiet_since = start
            if p >= self.threshold:
                self._silence_start = None
            elif p < self.neg_threshold and self._silence_start is None:
                self._silence_start = start
                if self._quiet_since is not None:  # the voice had already stopped (see TAIL_DB)
                    self._silence_start = max(self._quiet_since, start - max_tail, self._speech_start)
            if self._silence_start is not None and self._pos - self._silence_start >= silence:
                end = self._silence_start
                events.append(VADEvent("speech_stopped", self._ms(self._speech_start), self._ms(end)))
                self._floor = end
                self._speech_start = self._silence_start = None
        self._pending = buf[n * WINDOW :].copy()
        return events

    def force_stop(self) -> VADEvent | None:
        """End an open speech segment now (idle timeout, session end)."""
        if self._speech_start is None:
            return None
        end = self._silence_start if self._silence_start is not None else self._pos
        ev = VADEvent("speech_stopped", self._ms(self._speech_start), self._ms(end))
        self._floor = end
        self._speech_start = self._silence_start = None
        return ev

    @staticmethod
    def _ms(sample: int) -> int:
        return int(round(sample * _MS_PER_SAMPLE))
