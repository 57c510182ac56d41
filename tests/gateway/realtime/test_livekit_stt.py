"""LiveKit Agents' OpenAI STT plugin (livekit-plugins-openai `STT`, `use_realtime=True`) against the real server: a
Realtime transcription session (`?intent=transcription`, the model on the URL as it puts it for any host but
OpenAI's, then a GA `session.update` of type "transcription" with its server VAD) that the plugin streams audio
into and reads speech events from, as an `AgentSession` pipeline with a separate LLM and TTS uses it.

What is checked is what its stream gives an agent: start of speech, interim transcripts, a final transcript per
utterance (two utterances, two finals, in order), end of speech, and no error."""
from __future__ import annotations

import asyncio

from livekit import rtc
from livekit.agents import stt as agents_stt
from livekit.agents.utils import http_context
from livekit.plugins.openai import STT

from tests.gateway.realtime.client import utterance, wer

FIRST, SECOND = "What is the capital of France?", "Please turn off the kitchen lights."


async def test_livekit_stt_streams_final_transcripts(server):
    async with http_context.open():   # outside a job: the plugin's aiohttp session comes from here
        await stt_session(server)


async def stt_session(server) -> None:
    first, _, _ = utterance(FIRST, tail_ms=1000)
    second, _, _ = utterance(SECOND, lead_ms=0, tail_ms=1500)
    stt = STT(base_url=server.base_url, api_key="unused", model="gpt-4o-mini-transcribe", use_realtime=True)
    stream = stt.stream()
    events: list[agents_stt.SpeechEvent] = []

    async def read() -> None:
        async for ev in stream:
            events.append(ev)
            if sum(e.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT for e in events) == 2:
                return

    reader = asyncio.create_task(read())
    try:
        for pcm in (first, second):
            for i in range(0, len(pcm), 4800):   # 100 ms frames, in real time
                chunk = pcm[i:i + 4800]
                stream.push_frame(rtc.AudioFrame(chunk, 24000, 1, len(chunk) // 2))
                await asyncio.sleep(0.1)
        async with asyncio.timeout(120):
            await reader
    finally:
        reader.cancel()
        await stream.aclose()
        await stt.aclose()
    kinds = [e.type for e in events]
    finals = [e.alternatives[0].text for e in events if e.type == agents_stt.SpeechEventType.FINAL_TRANSCRIPT]
    assert wer(FIRST, finals[0]) <= 0.2 and wer(SECOND, finals[1]) <= 0.2, finals
    assert kinds[0] == agents_stt.SpeechEventType.START_OF_SPEECH, kinds
    assert agents_stt.SpeechEventType.INTERIM_TRANSCRIPT in kinds and agents_stt.SpeechEventType.END_OF_SPEECH in kinds
    await server.wait_idle()
