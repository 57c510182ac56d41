"""Voice over the Realtime session: real speech (piper / espeak-ng, synthesized in the test) in, Whisper transcripts,
spoken replies out, on the shared engine. Raw `websockets` clients and the official openai SDK; every server event is
validated against the SDK's pydantic union of its dialect.
"""
from __future__ import annotations

import asyncio

import orjson
import pytest
from openai import AsyncOpenAI

from tests.gateway.realtime.client import GA_EVENTS, PCM16, QUESTION, VOICE_SESSION, check_plausible_speech, \
    check_turn, chunks, open_voice, response_audio, utterance

pytestmark = pytest.mark.slow


async def test_spoken_question_server_vad_raw(server):
    raw = await open_voice(server)
    pcm, on, off = utterance(QUESTION)
    await raw.stream(pcm, PCM16)
    events = await raw.until("response.done")
    completed = check_turn(events, on, off)
    types = [e["type"] for e in events]
    # The prompt waited for the transcript: it is the user turn.
    assert types.index("conversation.item.input_audio_transcription.completed") < \
        types.index("response.output_item.added")
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete") and done["output_modalities"] == ["audio"]
    audio, transcript, deltas = response_audio(events, PCM16)
    assert len(deltas) > 1 and transcript.strip()
    check_plausible_speech(audio, transcript, PCM16)
    part = done["output"][0]["content"][0]
    assert part == {"type": "output_audio", "transcript": transcript}
    added = next(e for e in events if e["type"] == "response.content_part.added")
    assert added["part"]["type"] == "audio"
    # The first audio delta came before the reply was finished (clause by clause, not the whole reply).
    first_audio = types.index("response.output_audio.delta")
    assert first_audio < types.index("response.output_audio_transcript.done")
    # The conversation holds the transcript as the user's words.
    await raw.send({"type": "conversation.item.retrieve", "item_id": completed["item_id"]})
    got = await raw.until("conversation.item.retrieved")
    assert got[-1]["item"]["content"][0]["transcript"] == completed["transcript"]
    await raw.ws.close()


async def test_spoken_question_openai_sdk(server):
    client = AsyncOpenAI(api_key="unused", base_url=server.base_url, websocket_base_url=server.ws_base_url)
    pcm, on, off = utterance(QUESTION, engine="espeak")
    events = []
    async with client.realtime.connect(model="gpt-realtime") as conn:
        await conn.session.update(session=VOICE_SESSION)
        for b64 in chunks(pcm, PCM16):
            await conn.input_audio_buffer.append(audio=b64)
        while True:
            raw = await asyncio.wait_for(conn.recv_bytes(), 120)
            data = orjson.loads(raw)
            parsed = conn.parse_event(raw)
            assert parsed.type == data["type"]
            GA_EVENTS.validate_python(data, strict=True)
            events.append(data)
            if data["type"] == "response.done":
                break
    check_turn(events, on, off)
    audio, transcript, _ = response_audio(events, PCM16)
    check_plausible_speech(audio, transcript, PCM16)
