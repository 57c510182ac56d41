"""Real speech on demand (espeak-ng and piper), for tests, benchmarks and warm-ups.

Nothing here is recorded: the audio is synthesized when asked, so tests exercise real speech
without shipping audio files.
"""

from __future__ import annotations

import io
import shutil
import subprocess

import numpy as np
import soundfile as sf

from .resample import resample


def espeak_speech(text: str, rate: int = 16_000, voice: str = "en-us", wpm: int = 160) -> np.ndarray:
    """float32 mono speech from the ``espeak-ng`` binary (``apt-get install espeak-ng``)."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (make system-deps)")
    wav = subprocess.run([exe, "-v", voice, "-s", str(wpm), "--stdout", text],
                         capture_output=True, check=True, timeout=60).stdout
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    return resample(x, sr, rate)


def piper_speech(text: str, rate: int = 16_000, speed: float = 1.0) -> np.ndarray:
    """float32 mono speech from piper with the joe-us voice."""
    from .tts import get_synthesizer

    synth = get_synthesizer()
    return resample(synth.synthesize(text, speed).astype(np.float32) / 32768.0, synth.sample_rate, rate)


def speech_bounds_ms(x: np.ndarray, rate: int = 16_000, rel: float = 0.01) -> tuple[float, float]:
    """Where the voice is in a clip: first/last 10 ms frame above ``rel`` of the peak RMS.

    −40 dB by default, so soft fricatives at the end of a word still count as speech.
    """
    hop = rate // 100
    n = len(x) // hop
    rms = np.sqrt((x[: n * hop].reshape(n, hop) ** 2).mean(axis=1))
    on = np.nonzero(rms > rel * rms.max())[0]
    return on[0] * 10.0, (on[-1] + 1) * 10.0
