"""pipecat's OpenAI TTS service (`OpenAITTSService`: one streamed /v1/audio/speech request per sentence, pcm at 24 kHz)
in a pipecat pipeline against the real server: a `TTSSpeakFrame` comes out as `TTSAudioRawFrame`s of 24 kHz speech
that Whisper reads back as the text, between pipecat's started and stopped frames, with no ErrorFrame; the `speed`
setting is honoured (the same text at 1.5× is shorter)."""
from __future__ import annotations

import asyncio
import io

import numpy as np
import soundfile as sf
from openai import AsyncOpenAI
from pipecat.frames.frames import EndFrame, ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame, TTSStartedFrame, \
    TTSStoppedFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

from tests.gateway.realtime.client import wer

SAY = "The weather in London is cloudy, with a chance of rain this afternoon."
RATE = 24_000


async def speak(server, text: str, speed: float | None = None) -> list:
    """The frames pipecat's TTS service sends down its pipeline for `text`, up to its TTSStoppedFrame."""
    service = OpenAITTSService(api_key="unused", base_url=server.base_url,
                               settings=OpenAITTSService.Settings(model="tts-1", voice="alloy", speed=speed))
    down: asyncio.Queue = asyncio.Queue()
    worker = PipelineWorker(Pipeline([service, QueuedFrameProcessor(queue=down,
                                                                    queue_direction=FrameDirection.DOWNSTREAM)]),
                            cancel_on_idle_timeout=False, params=PipelineParams(audio_out_sample_rate=RATE))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    frames = []
    try:
        await worker.queue_frame(TTSSpeakFrame(text))
        async with asyncio.timeout(120):
            while not any(isinstance(f, (TTSStoppedFrame, ErrorFrame)) for f in frames):
                frames.append(await down.get())
    finally:
        await worker.queue_frame(EndFrame())
        async with asyncio.timeout(30):
            await run
    assert not [f for f in frames if isinstance(f, ErrorFrame)], frames
    return frames


async def heard(server, pcm: bytes) -> str:
    """The server's Whisper on 24 kHz pcm16 (as a WAV upload)."""
    buf = io.BytesIO()
    sf.write(buf, np.frombuffer(pcm, np.int16), RATE, format="WAV", subtype="PCM_16")
    client = AsyncOpenAI(api_key="unused", base_url=server.base_url)
    return (await client.audio.transcriptions.create(model="whisper-1", file=("tts.wav", buf.getvalue()))).text


async def test_pipecat_tts_speaks_the_text(server):
    frames = await speak(server, SAY)
    kinds = [type(f) for f in frames]
    audio = [f for f in frames if isinstance(f, TTSAudioRawFrame)]
    assert TTSStartedFrame in kinds and kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame), kinds
    assert audio and all(f.sample_rate == RATE and f.num_channels == 1 for f in audio)
    pcm = b"".join(f.audio for f in audio)
    assert 1.5 < len(pcm) / 2 / RATE < 6.0  # a sentence's worth of speech
    assert wer(SAY, await heard(server, pcm)) <= 0.2
    faster = b"".join(f.audio for f in await speak(server, SAY, speed=1.5) if isinstance(f, TTSAudioRawFrame))
    assert 0.55 < len(faster) / len(pcm) < 0.8, (len(faster), len(pcm))
    await server.wait_idle()
