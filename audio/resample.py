"""Resampling between the rates we meet (8, 16, 22.05, 24 kHz).

One-shot ``resample`` for whole clips (TTS output, tests) with libsoxr, and ``StreamResampler`` for chunked audio
(the input buffer, TTS streams): a polyphase FIR that keeps its state across chunks, so chunk borders leave no clicks,
and that hands every sample over as soon as its filter has the input it needs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import soxr
from numpy.lib.stride_tricks import as_strided, sliding_window_view

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


# StreamResampler's filter: a Kaiser-windowed sinc whose passband ends PASSBAND of the way to the lower rate's Nyquist
# frequency, with STOPBAND_DB of rejection past it. Its length (and so the lookahead, half of it) follows from the
# transition band (Kaiser's formula): a few milliseconds of input.
PASSBAND = 0.9
STOPBAND_DB = 70.0


@functools.cache
def _polyphase(src: int, dst: int) -> tuple[np.ndarray, int, int, int]:
    """(taps [up, k + 1], k, up, down) for src -> dst: the lowpass runs at the common rate src * up = dst * down; row p
    holds the taps of the outputs of phase p, oldest input first, with the gain `up` of zero-stuffing."""
    g = math.gcd(src, dst)
    up, down = dst // g, src // g
    edge = 0.5 * min(src, dst)                         # the lower rate's Nyquist frequency, Hz
    width = (1.0 - PASSBAND) * edge                    # transition band, Hz
    beta = 0.1102 * (STOPBAND_DB - 8.7)                # Kaiser's beta for that rejection
    per_input = (STOPBAND_DB - 7.95) / (14.36 * width / src)   # Kaiser's length, in input samples
    k = 2 * math.ceil(per_input / 2)
    n = up * k + 1                                      # odd: the centre tap sits on a sample
    t = (np.arange(n) - up * k / 2) / up                # tap times, in input samples
    cutoff = (PASSBAND + 1.0) / 2 * edge / src          # mid-transition, cycles per input sample
    h = 2 * cutoff * np.sinc(2 * cutoff * t) * np.kaiser(n, beta)
    h *= up / h.sum()                                   # unit gain at DC after zero-stuffing by `up`
    taps = np.zeros((up, k + 1))
    padded = np.concatenate([h, np.zeros(up)])
    for phase in range(up):
        taps[phase] = padded[phase::up][: k + 1][::-1]   # oldest input first, as a window of the input reads
    return taps.astype(np.float32), k, up, down


@dataclass(slots=True)
class StreamResampler:
    """Chunked resampling with state kept between chunks, so chunk borders leave no clicks: a polyphase FIR
    (Kaiser-windowed sinc, linear phase), computed with numpy.

    Why not ``soxr.ResampleStream``: it hands its output over in blocks, holding back tens of milliseconds of a stream
    at times (docs/benchmarks-history.md, "A streaming resampler that holds nothing back"), and that wait sits between
    a user's last word and the VAD that hears the silence after it. This filter holds back only half its length
    (``lookahead_ms``: a few ms), and its output sample m is the input at time m / dst, as the one-shot ``resample``
    aligns it. ``flush()`` returns the tail (the input followed by silence) and resets."""

    src: int
    dst: int
    dtype: str = "float32"
    _hist: np.ndarray = field(init=False, repr=False)  # the input not yet behind every pending output's filter
    _hist_start: int = field(default=0, init=False, repr=False)  # absolute index of _hist[0]
    _n_out: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "int16"):
            raise ValueError(f"dtype must be float32 or int16, got {self.dtype}")
        _check(np.zeros(0, np.float32), self.src, self.dst)
        self._reset()

    def _reset(self) -> None:
        k = 0 if self.src == self.dst else _polyphase(self.src, self.dst)[1]
        self._hist = np.zeros(k, np.float32)   # silence before the stream begins
        self._hist_start, self._n_out = -k, 0

    @property
    def _n_in(self) -> int:
        """Input samples taken so far: the history ends at the newest."""
        return self._hist_start + len(self._hist)

    @property
    def lookahead_ms(self) -> float:
        """How far the output lags the input: half the filter."""
        return 0.0 if self.src == self.dst else 1000 * _polyphase(self.src, self.dst)[1] / 2 / self.src

    def process(self, chunk: np.ndarray) -> np.ndarray:
        x = _check(chunk, self.src, self.dst)
        if self.src == self.dst:
            return x.astype(self.dtype, copy=True)
        x = x.astype(np.float32, copy=False)  # int16 input stays in its own scale, as its output does
        self._hist = np.concatenate([self._hist, x])
        return self._emit(self._n_in)

    def flush(self) -> np.ndarray:
        """Drain the filter (end of a segment); the next ``process`` starts fresh."""
        if self.src == self.dst or self._n_in == 0:
            self._reset()
            return np.zeros(0, dtype=self.dtype)
        _, k, up, down = _polyphase(self.src, self.dst)
        n_in = self._n_in
        self._hist = np.concatenate([self._hist, np.zeros(k // 2 + 1, np.float32)])  # silence after the end
        tail = self._emit(n_in + k // 2 + 1, total=-(-n_in * up // down))
        self._reset()
        return tail

    def _emit(self, available: int, total: int | None = None) -> np.ndarray:
        """Every output sample whose filter reaches no further than input `available` (and, with `total`, no more
        than that many in all)."""
        taps, k, up, down = _polyphase(self.src, self.dst)
        centre = up * k // 2
        # output m needs inputs up to (m * down + centre) // up
        last = (available * up - centre - 1) // down  # the last m with (m * down + centre) // up < available
        end = last + 1 if total is None else min(last + 1, total)
        n = max(end, self._n_out) - self._n_out
        y = np.empty(n, np.float32)
        if n and up <= 8:   # few phases (24 or 48 -> 16 kHz, 8 -> 16): one matrix-vector product per phase
            # outputs r, r + up, r + 2·up, ... share a phase, and their windows start `down` inputs apart: a strided
            # view of the history, which np.dot reads in place (no gathered copy of the windows)
            step = self._hist.strides[0]
            for r in range(min(up, n)):
                pos = (self._n_out + r) * down + centre
                view = as_strided(self._hist[pos // up - k - self._hist_start:], (len(range(r, n, up)), k + 1),
                                  (down * step, step), writeable=False)
                y[r::up] = np.dot(view, taps[pos % up])
        elif n:             # 22.05 kHz: a phase per output, nearly
            pos = np.arange(self._n_out, self._n_out + n) * down + centre
            windows = sliding_window_view(self._hist, k + 1)   # windows[i] = inputs i .. i + k (a view)
            y[:] = np.einsum("ij,ij->i", windows[pos // up - k - self._hist_start], taps[pos % up])
        self._n_out += n
        keep_from = max(self._hist_start, (self._n_out * down + centre) // up - k)   # the next output's oldest input
        self._hist = self._hist[keep_from - self._hist_start:]
        self._hist_start = keep_from
        if self.dtype == "int16":
            return np.clip(np.round(y), -32768, 32767).astype(np.int16)
        return y
