"""Session audio formats: pcm16 (24 kHz mono LE, base64 in JSON) and G.711 µ-law / A-law (8 kHz).

Everything is vectorized numpy; G.711 follows ITU-T G.711 (the classic Sun ``g711.c`` segment
tables), so bytes interoperate with telephony stacks (Twilio etc.).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np


class AudioError(ValueError):
    """Base of audio input errors; ``code``/``param`` map onto a Realtime ``error`` event."""

    code = "invalid_value"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class AudioFormatError(AudioError):
    """Audio bytes or a format description that we cannot interpret."""

    code = "invalid_audio_format"


# --------------------------------------------------------------------------- formats

PCM16, PCMU, PCMA = "pcm16", "pcmu", "pcma"


@dataclass(slots=True, frozen=True)
class AudioFormat:
    """A session audio format: codec (``pcm16``/``pcmu``/``pcma``) and its sample rate."""

    codec: str = PCM16
    rate: int = 24_000

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.codec == PCM16 else 1

    def duration_ms(self, num_bytes: int) -> float:
        return 1000.0 * num_bytes / (self.bytes_per_sample * self.rate)

    def to_ga(self) -> dict[str, Any]:
        return {"type": "audio/pcm", "rate": self.rate} if self.codec == PCM16 else {"type": f"audio/{self.codec}"}

    def to_beta(self) -> str:
        return {PCM16: "pcm16", PCMU: "g711_ulaw", PCMA: "g711_alaw"}[self.codec]


DEFAULT_FORMAT = AudioFormat()
_BETA = {"pcm16": AudioFormat(PCM16, 24_000), "g711_ulaw": AudioFormat(PCMU, 8_000), "g711_alaw": AudioFormat(PCMA, 8_000)}
_GA = {"audio/pcm": PCM16, "audio/pcmu": PCMU, "audio/pcma": PCMA}


def parse_audio_format(fmt: Any, param: str = "audio.input.format") -> AudioFormat:
    """Map a GA (``{"type": "audio/pcm", "rate": 24000}``) or beta (``"g711_ulaw"``) format.

    ``None`` means the default (pcm16 @ 24 kHz).  Anything else raises ``AudioFormatError``.
    """
    if fmt is None:
        return DEFAULT_FORMAT
    if isinstance(fmt, AudioFormat):
        return fmt
    if isinstance(fmt, str):
        if fmt in _BETA:
            return _BETA[fmt]
        if fmt in _GA:  # a bare GA type string; be lenient
            return parse_audio_format({"type": fmt}, param)
        raise AudioFormatError(f"unsupported audio format {fmt!r}; expected one of {sorted(_BETA)}", param=param)
    if isinstance(fmt, dict):
        typ = fmt.get("type")
        if typ not in _GA:
            raise AudioFormatError(f"unsupported audio format type {typ!r}; expected one of {sorted(_GA)}",
                                   param=f"{param}.type")
        codec = _GA[typ]
        if codec == PCM16:
            rate = fmt.get("rate", 24_000)
            if rate != 24_000 or isinstance(rate, bool):
                raise AudioFormatError(f"audio/pcm supports rate 24000 only, got {rate!r}", param=f"{param}.rate")
            return AudioFormat(PCM16, 24_000)
        return AudioFormat(codec, 8_000)
    raise AudioFormatError(f"audio format must be a string or an object, got {type(fmt).__name__}", param=param)


# --------------------------------------------------------------------------- pcm16

def b64decode(data: str | bytes, param: str = "audio") -> bytes:
    """Strict base64 decode (no silently skipped characters)."""
    if not isinstance(data, (str, bytes)):
        raise AudioFormatError(f"audio must be a base64 string, got {type(data).__name__}", param=param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioFormatError(f"audio is not valid base64: {exc}", param=param) from None


def b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def pcm16_decode(raw: bytes, param: str = "audio") -> np.ndarray:
    """Little-endian 16-bit PCM bytes to ``int16`` samples."""
    if len(raw) % 2:
        raise AudioFormatError(f"pcm16 audio must have an even number of bytes, got {len(raw)}", param=param)
    return np.frombuffer(raw, dtype="<i2").astype(np.int16)


def pcm16_encode(samples: np.ndarray) -> bytes:
    return np.asarray(samples, dtype=np.int16).astype("<i2", copy=False).tobytes()


def int16_to_float(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int16).astype(np.float32) / 32768.0


def float_to_int16(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(np.asarray(x, dtype=np.float32) * 32768.0), -32768, 32767).astype(np.int16)


# --------------------------------------------------------------------------- G.711

_ULAW_BIAS = 0x84
_ULAW_CLIP = 8159  # on the 14-bit magnitude
_ULAW_SEG_END = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF], dtype=np.int32)


def ulaw_encode(samples: np.ndarray) -> np.ndarray:
    """int16 → G.711 µ-law bytes (uint8), on 14-bit input like the reference ``g711.c``."""
    pcm = np.asarray(samples, dtype=np.int16).astype(np.int32) >> 2
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    mag = np.minimum(np.abs(pcm), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    seg = np.searchsorted(_ULAW_SEG_END, mag, side="left")
    uval = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((mag >> np.minimum(seg + 1, 8)) & 0x0F))
    return ((uval ^ mask) & 0xFF).astype(np.uint8)


def ulaw_decode(data: bytes | np.ndarray) -> np.ndarray:
    """G.711 µ-law bytes → int16."""
    return _ULAW_TABLE[np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data]


def _ulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    exp, mant = (u >> 4) & 0x07, u & 0x0F
    mag = (((mant << 3) + _ULAW_BIAS) << exp) - _ULAW_BIAS
    return np.where(u & 0x80, -mag, mag).astype(np.int16)


_ALAW_SEG_END = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF], dtype=np.int32)


def alaw_encode(samples: np.ndarray) -> np.ndarray:
    """int16 → G.711 A-law bytes (uint8)."""
    pcm = np.asarray(samples, dtype=np.int16).astype(np.int32) >> 3  # 13-bit
    neg = pcm < 0
    mask = np.where(neg, 0x55, 0xD5)
    pcm = np.where(neg, -pcm - 1, pcm)
    seg = np.searchsorted(_ALAW_SEG_END, pcm, side="left")
    shift = np.where(seg < 2, 1, seg)
    aval = (np.minimum(seg, 7) << 4) | ((pcm >> np.minimum(shift, 7)) & 0x0F)
    aval = np.where(seg >= 8, 0x7F, aval)
    return ((aval ^ mask) & 0xFF).astype(np.uint8)


def alaw_decode(data: bytes | np.ndarray) -> np.ndarray:
    """G.711 A-law bytes → int16."""
    return _ALAW_TABLE[np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data]


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    t = (a & 0x0F) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, t + 0x108)
    t = np.where(seg > 1, t << np.maximum(seg - 1, 0), t)
    return np.where(a & 0x80, t, -t).astype(np.int16)


_ULAW_TABLE = _ulaw_table()
_ALAW_TABLE = _alaw_table()


# --------------------------------------------------------------------------- session helpers

def decode_audio(raw: bytes, fmt: AudioFormat, param: str = "audio") -> np.ndarray:
    """Bytes of a session format → int16 samples at ``fmt.rate``."""
    if fmt.codec == PCM16:
        return pcm16_decode(raw, param)
    if fmt.codec == PCMU:
        return ulaw_decode(raw)
    if fmt.codec == PCMA:
        return alaw_decode(raw)
    raise AudioFormatError(f"unknown codec {fmt.codec!r}", param=param)


def encode_audio(samples: np.ndarray, fmt: AudioFormat) -> bytes:
    """int16 samples (already at ``fmt.rate``) → bytes of the session format."""
    if fmt.codec == PCM16:
        return pcm16_encode(samples)
    if fmt.codec == PCMU:
        return ulaw_encode(samples).tobytes()
    if fmt.codec == PCMA:
        return alaw_encode(samples).tobytes()
    raise AudioFormatError(f"unknown codec {fmt.codec!r}")


def decode_b64_audio(data: str | bytes, fmt: AudioFormat, param: str = "audio") -> np.ndarray:
    """A base64 ``audio`` field of a session format → int16 samples at ``fmt.rate``."""
    return decode_audio(b64decode(data, param), fmt, param)


def encode_b64_audio(samples: np.ndarray, fmt: AudioFormat) -> str:
    return b64encode(encode_audio(samples, fmt))
