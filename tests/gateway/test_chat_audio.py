"""Spoken replies on /v1/chat/completions (gateway/chat_audio.py) through the official openai SDK, read with its own
types: `message.audio` not streamed, `delta.audio` streamed, an earlier spoken reply named by its id in the next turn,
and the requests a spoken reply cannot serve. The audio is decoded with soundfile and transcribed back by Whisper.

Greedy decoding: the spoken reply's transcript is the text reply of the same request without audio."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import soundfile as sf
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionAudio
from openai.types.chat.chat_completion_chunk import ChoiceDeltaAudio

from tests.gateway.realtime.client import wer
from tests.gateway.test_http_audio import settled, transcribe_back

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "system", "content": "Answer in one short sentence."},
       {"role": "user", "content": "What is the capital of France?"}]
SPOKEN = {"modalities": ["text", "audio"], "max_tokens": 24, "temperature": 0}


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, max_retries=0)


async def text_reply(server, messages=ASK) -> str:
    r = await client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    return r.choices[0].message.content


async def check_speech(server, audio: np.ndarray, rate: int, transcript: str) -> None:
    seconds = len(audio) / rate
    assert rate == 24_000 and 0.5 < seconds < 12.0 and np.abs(audio).max() > 0.05, (rate, seconds)
    heard = await transcribe_back(server, audio, rate)
    assert wer(transcript, heard) <= 0.34, (transcript, heard)   # piper samples its prosody: a word may go astray


async def test_spoken_reply_not_streamed_and_named_in_the_next_turn(server):
    text = await text_reply(server)
    c = client(server)
    r = await c.chat.completions.create(model=MODEL, messages=ASK, audio={"voice": "alloy", "format": "wav"}, **SPOKEN)
    message = r.choices[0].message
    assert isinstance(message.audio, ChatCompletionAudio) and message.content is None
    assert message.audio.transcript == text and message.audio.id.startswith("audio_")
    assert r.choices[0].finish_reason == "stop"
    audio, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    assert sf.info(io.BytesIO(base64.b64decode(message.audio.data))).format == "WAV"
    await check_speech(server, audio, rate, text)
    # the SDK's message, given back as is, stands for its transcript in the next turn
    follow = {"role": "user", "content": "And of Italy?"}
    named = await c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                            messages=[*ASK, message.model_dump(), follow])
    typed = await c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                            messages=[*ASK, {"role": "assistant", "content": text}, follow])
    assert named.usage.prompt_tokens == typed.usage.prompt_tokens
    assert named.choices[0].message.content == typed.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        await c.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            *ASK, {"role": "assistant", "audio": {"id": "audio_unknown"}}, follow])
    assert info.value.body["param"] == "messages[2].audio.id"
    await settled(server)
    await server.wait_idle(pinned_ok=True)


@pytest.mark.parametrize("fmt", ["pcm16", "mp3"])
async def test_spoken_reply_streamed(server, fmt):
    text = await text_reply(server)
    stream = await client(server).chat.completions.create(
        model=MODEL, messages=ASK, audio={"voice": "joe", "format": fmt}, stream=True,
        stream_options={"include_usage": True}, **SPOKEN)
    pieces, reasons, usage = [], [], None
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            assert not ch.delta.content
            if ch.delta.audio is not None:
                assert isinstance(ch.delta.audio, ChoiceDeltaAudio) and not reasons   # all audio before the end
                pieces.append(ch.delta.audio)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["stop"] and usage.completion_tokens > 0
    assert pieces[0].id.startswith("audio_") and pieces[0].transcript and all(a.id is None for a in pieces[1:])
    assert pieces[-1].model_dump(exclude_none=True).keys() == {"expires_at"}   # OpenAI's last audio delta
    assert "".join(a.transcript or "" for a in pieces) == text
    data = [a.data for a in pieces if a.data]
    assert len(data) > 1                                    # the audio went out in pieces
    body = b"".join(base64.b64decode(d) for d in data)
    if fmt == "pcm16":
        audio, rate = np.frombuffer(body, "<i2").astype(np.float32) / 32768.0, 24_000
    else:
        audio, rate = sf.read(io.BytesIO(body), dtype="float32")
    await check_speech(server, audio, rate, text)
    await settled(server)
    await server.wait_idle(pinned_ok=True)


async def test_requests_a_spoken_reply_cannot_serve_are_400(server):
    c = client(server)
    base = await settled(server)
    engine_base = await server.wait_idle(pinned_ok=True)
    cases = [  # (fields, param, code)
        ({"modalities": ["text", "audio"]}, "audio", "missing_required_parameter"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "invalid_value"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "aac"}}, "audio.format",
         "unsupported_value"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "ogg"}}, "audio.format",
         "invalid_value"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, "audio.format",
         "missing_required_parameter"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "nobody", "format": "wav"}}, "audio.voice",
         "invalid_value"),
        ({"modalities": ["text", "audio"], "audio": {"voice": 5, "format": "wav"}}, "audio.voice", "invalid_type"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "flac"}, "stream": True},
         "audio.format", "unsupported_value"),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}, "n": 2}, "n",
         "unsupported_value"),
    ]
    for fields, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
        err = info.value.body
        assert (err["param"], err["code"]) == (param, code), (fields, err)
    after = await settled(server)
    assert after["tts"]["requests"] == base["tts"]["requests"]
    assert (await server.wait_idle(pinned_ok=True))["num_steps"] == engine_base["num_steps"]
