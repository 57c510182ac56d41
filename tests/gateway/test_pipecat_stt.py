"""pipecat's OpenAI STT service (`OpenAISTTService`, segmented: one /v1/audio/transcriptions request per utterance)
against the real server, with its probability metrics on: for GPT transcription models it asks for json with
`include[]=logprobs`, for Whisper models for verbose_json and reads the segments' `avg_logprob`. Both come back as a
`TranscriptionFrame` of the utterance carrying the server's logprobs (no ErrorFrame, no made-up certainty)."""
from __future__ import annotations

import io
import math
import wave

from pipecat.frames.frames import ErrorFrame, TranscriptionFrame
from pipecat.services.openai.stt import OpenAISTTService

from audio.codecs import float_to_int16
from tests.audio.speech import steady_piper_speech
from tests.gateway.realtime.client import wer

ASK = "What is the capital of France?"


def wav16k(text: str) -> bytes:
    """What pipecat's segmented STT hands `run_stt`: the utterance as a 16 kHz mono WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(float_to_int16(steady_piper_speech(text)).tobytes())
    return buf.getvalue()


async def test_pipecat_stt_with_probability_metrics(server):
    audio = wav16k(ASK)
    results = {}
    for model in ("gpt-4o-transcribe", "whisper-1"):
        service = OpenAISTTService(api_key="unused", base_url=server.base_url, include_prob_metrics=True,
                                   settings=OpenAISTTService.Settings(model=model))
        frames = [f async for f in service.run_stt(audio)]
        assert not [f for f in frames if isinstance(f, ErrorFrame)], frames
        [frame] = frames
        assert isinstance(frame, TranscriptionFrame) and wer(ASK, frame.text) <= 0.2, frame
        results[model] = frame.result
    logprobs = results["gpt-4o-transcribe"].logprobs
    assert logprobs and "".join(t.token for t in logprobs).strip() == results["gpt-4o-transcribe"].text
    [segment] = results["whisper-1"].segments
    mean = sum(t.logprob for t in logprobs) / len(logprobs)
    assert segment.avg_logprob < 0 and math.isclose(segment.avg_logprob, mean, abs_tol=1e-4)
