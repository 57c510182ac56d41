"""Smart Turn v3.2: the probability that a speaker has finished their turn, from the sound of the last 8 s.

The model (a Whisper-tiny encoder with a classifier head, int8 ONNX, BSD-2) ships inside the `pipecat-ai` wheel,
which the Makefile installs with `--no-deps` next to the other model packages: it is found through the package's file
list and never imported, so none of pipecat's dependencies are needed. It listens to prosody (a falling pitch, a
drawn-out last syllable), not to words.

Its input is Whisper's log-mel spectrogram of exactly 8 s (80 mel bins, 800 frames), the clip's last 8 s with zeros
in front of a shorter one, normalized to zero mean and unit variance first. The features are computed here with
numpy, the same steps as `transformers.WhisperFeatureExtractor(chunk_length=8)` (whose per-frame Python loop costs
several model calls' worth of time); tests/audio/test_smart_turn.py checks the two agree.
"""
from __future__ import annotations

import importlib.metadata
import threading
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
WINDOW_S = 8
N_SAMPLES = SAMPLE_RATE * WINDOW_S
N_FFT = 400
HOP = 160
N_MELS = 80
MODEL_FILE = "smart-turn-v3.2-cpu.onnx"
PACKAGE = "pipecat-ai"

_session = None
_session_lock = threading.Lock()


def model_path() -> Path:
    """Where the installed `pipecat-ai` wheel put the ONNX file (no import of pipecat)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"Smart Turn needs the {PACKAGE} wheel: pip install --no-deps {PACKAGE}") from None
    for f in dist.files or ():
        if f.name == MODEL_FILE:
            return Path(dist.locate_file(f))
    raise RuntimeError(f"{PACKAGE} {dist.version} holds no {MODEL_FILE}")


def _onnx_session():
    """The process-wide ONNX session, one intra-op thread: its calls are short, and on a small CPU a thread pool
    would stall beside the engine, Whisper and piper."""
    global _session
    with _session_lock:
        if _session is None:
            import onnxruntime

            opts = onnxruntime.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            _session = onnxruntime.InferenceSession(str(model_path()), sess_options=opts,
                                                    providers=["CPUExecutionProvider"])
        return _session


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (linear below 1 kHz, logarithmic above), as Whisper's filterbank uses."""
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz < 1000.0, 3.0 * hz / 200.0, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) * 27.0 / np.log(6.4))


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15.0, 200.0 * mel / 3.0, 1000.0 * np.exp((mel - 15.0) * np.log(6.4) / 27.0))


def _mel_filters() -> np.ndarray:
    """[N_MELS, N_FFT // 2 + 1] triangles on the Slaney scale from 0 Hz to Nyquist, each scaled to unit area."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), N_MELS + 2))
    bins = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    rise = (bins[None, :] - edges[:-2, None]) / np.diff(edges)[:-1, None]
    fall = (edges[2:, None] - bins[None, :]) / np.diff(edges)[1:, None]
    tri = np.maximum(0.0, np.minimum(rise, fall))
    return (tri * (2.0 / (edges[2:] - edges[:-2]))[:, None]).astype(np.float32)


_FILTERS = _mel_filters()
_WINDOW = np.hanning(N_FFT + 1)[:-1].astype(np.float32)  # periodic Hann, as torch.hann_window


def features(audio_16k: np.ndarray) -> np.ndarray:
    """Whisper log-mel features [80, 800] of the clip's last 8 s (zeros in front of a shorter clip)."""
    x = np.asarray(audio_16k, dtype=np.float32).reshape(-1)[-N_SAMPLES:]
    x = np.pad(x, (N_SAMPLES - len(x), 0))
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    padded = np.pad(x, (N_FFT // 2, N_FFT // 2), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:-1]  # Whisper drops the last frame
    power = np.abs(np.fft.rfft(frames * _WINDOW, axis=-1)) ** 2
    log_spec = np.log10(np.maximum(_FILTERS @ power.T.astype(np.float32), 1e-10))
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


def score(audio_16k: np.ndarray) -> float:
    """P(the turn is complete) from the audio up to now (16 kHz float32; only the last 8 s count). Blocking: call it
    off the event loop (`AudioStage.score_turn`)."""
    out = _onnx_session().run(None, {"input_features": features(audio_16k)[None]})
    return float(np.asarray(out[0]).reshape(-1)[0])
