"""Test speech that is the same on every run.

Piper samples its latent noise and its phoneme durations (`noise_scale`, `noise_w`) inside its ONNX graph, with no
seed to set, so `audio.speech.piper_speech` differs from call to call. Tests that assert on what Whisper hears use
this voice instead: the same piper voice with both noise scales at 0 (the mean prosody), a fixed clip per text.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

from audio.resample import resample

_lock = threading.Lock()


@functools.cache
def _synthesizer():
    from audio.tts import Synthesizer

    return Synthesizer.load()  # its own instance: the server's TTS threads use the shared one


def steady_piper_speech(text: str, rate: int = 16_000, speed: float = 1.0) -> np.ndarray:
    """float32 mono speech at `rate`: piper's joe-us voice, noise scales 0, sentences back to back."""
    from audio.tts import GAIN

    with _lock:
        synth = _synthesizer()
        voice, length = synth.voice, (synth.voice.config.length_scale or 1.0) / speed
        parts = []
        for phonemes in voice.phonemize(text):
            if not phonemes:
                continue
            ids = voice.phonemes_to_ids(phonemes)
            feed = {"input": np.array([ids], np.int64), "input_lengths": np.array([len(ids)], np.int64),
                    "scales": np.array([0.0, length, 0.0], np.float32)}
            out = synth.encoder.run(None, feed)[0]
            if synth.vocoder is not None:
                out = synth.vocoder.run(None, {synth.vocoder.get_inputs()[0].name: out})[0]
            parts.append(out.reshape(-1))
    audio = np.clip(np.concatenate(parts) * GAIN, -1.0, 1.0).astype(np.float32)
    return resample(audio, synth.sample_rate, rate)
