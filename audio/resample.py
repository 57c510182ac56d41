"""Resampling between the rates we meet (8, 16, 22.05, 24 kHz) with libsoxr.

One-shot ``resample`` for whole clips (TTS output, tests) and ``StreamResampler`` for chunked
input, which keeps filter state across chunks so chunk borders leave no clicks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import soxr

RATES = (8_000, 16_000, 22_050, 24_000)
_DTYPES = (np.float32, np.int16)


def _check(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    if src <= 0 or dst <= 0:
        raise ValueError(f"sample rates must be positive, got {src} -> {dst}")
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"expected mono 1-D audio, got shape {x.shape}")
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    if x.dtype.type not in _DTYPES:
        raise ValueError(f"audio must be float32 or int16, got {x.dtype}")
    return x


def resample(x: np.ndarray, src: int, dst: int, quality: str = "HQ") -> np.ndarray:
    """Resample mono ``float32`` or ``int16`` audio; the dtype is kept."""
    x = _check(x, src, dst)
    if src == dst or len(x) == 0:
        return x.copy()
    return soxr.resample(x, src, dst, quality=quality)


@dataclass(slots=True)
class StreamResampler:
    """Chunked resampling with state kept between chunks (``soxr.ResampleStream``).

    Output lags input by the filter delay (a few ms); ``flush()`` returns the tail and resets.
    """

    src: int
    dst: int
    dtype: str = "float32"
    quality: str = "HQ"
    _stream: soxr.ResampleStream | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "int16"):
            raise ValueError(f"dtype must be float32 or int16, got {self.dtype}")
        self._stream = self._new()

    def _new(self) -> soxr.ResampleStream | None:
        if self.src == self.dst:
            return None
        return soxr.ResampleStream(self.src, self.dst, 1, dtype=self.dtype, quality=self.quality)

    def process(self, chunk: np.ndarray) -> np.ndarray:
        x = _check(chunk, self.src, self.dst).astype(self.dtype, copy=False)
        if self._stream is None:
            return x.copy()
        return self._stream.resample_chunk(x, last=False)

    def flush(self) -> np.ndarray:
        """Drain the filter (end of a segment); the next ``process`` starts fresh."""
        if self._stream is None:
            return np.zeros(0, dtype=self.dtype)
        tail = self._stream.resample_chunk(np.zeros(0, dtype=self.dtype), last=True)
        self._stream = self._new()
        return tail
