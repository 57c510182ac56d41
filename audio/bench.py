"""Audio stage micro-benchmarks: ``python -m audio.bench [--threads 2]``.

Whisper encoder + greedy decode at batch 1 and 8 (real-time factor), TTS seconds per sentence,
VAD and buffer cost per second of input audio.  Real speech, synthesized on the spot.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from .buffer import InputAudioBuffer
    from .codecs import b64encode, float_to_int16, pcm16_encode
    from .resample import resample
    from .speech import piper_speech
    from .tts import get_synthesizer
    from .vad import StreamingVAD
    from .whisper import WhisperModel

    sentences = ["What is the capital of France?",
                 "The quick brown fox jumps over the lazy dog, and then it runs into the forest.",
                 "Sure, I can help with that."]
    synth = get_synthesizer()
    synth.synthesize("Warm up.")
    for s in sentences:
        audio_s = len(synth.synthesize(s)) / synth.sample_rate
        t = _best(lambda: synth.synthesize(s), args.repeat)
        print(f"tts   {t * 1000:7.1f} ms for {audio_s:.2f} s of audio ({len(s.split())} words)  RTF {t / audio_s:.3f}")

    clip = piper_speech(sentences[1])
    x = np.concatenate([np.zeros(16000, np.float32), clip, np.zeros(16000, np.float32)])
    x = np.tile(x, 3)
    secs = len(x) / 16000

    def run_vad():
        v = StreamingVAD()
        for i in range(0, len(x), 640):
            v.feed(x[i : i + 640])

    run_vad()
    t = _best(run_vad, args.repeat)
    print(f"vad   {t / secs * 1000:7.2f} ms per second of audio (40 ms chunks)")
    pcm24 = float_to_int16(resample(x, 16000, 24000))
    frames = [b64encode(pcm16_encode(pcm24[i : i + 960])) for i in range(0, len(pcm24), 960)]

    def run_buf():
        b = InputAudioBuffer()
        for f in frames:
            b.append_b64(f)

    t = _best(run_buf, args.repeat)
    print(f"buf   {t / secs * 1000:7.2f} ms per second of audio (base64 decode + 24k->16k)")

    WhisperModel.load()  # converts into the cache on the very first run
    t0 = time.perf_counter()
    WhisperModel.load()
    print(f"whisper load from the safetensors cache {time.perf_counter() - t0:.2f} s (imports excluded)")
    for dtype in (torch.bfloat16, torch.float32):
        m = WhisperModel.load(dtype=dtype)
        m.transcribe([clip])
        for bs in (1, 8):
            clips = [clip] * bs
            audio_s = bs * len(clip) / 16000
            enc_t = dec_t = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                e = m.encode_clips(clips)
                t1 = time.perf_counter()
                toks = m.decode_greedy(e)
                t2 = time.perf_counter()
                enc_t, dec_t = min(enc_t, t1 - t0), min(dec_t, t2 - t1)
            print(f"whisper {str(dtype)[6:]:8s} batch {bs}: features+encoder {enc_t * 1000:7.1f} ms, "
                  f"decode {dec_t * 1000:7.1f} ms ({len(toks[0])} tokens); "
                  f"{audio_s:.1f} s audio -> RTF {(enc_t + dec_t) / audio_s:.3f}, "
                  f"per request {(enc_t + dec_t) / bs * 1000:.0f} ms")


if __name__ == "__main__":
    main()
