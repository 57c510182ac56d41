"""/v1/audio/transcriptions and /v1/audio/speech through the official openai SDK, on the shared Whisper and TTS workers.

Uploads are piper's steady voice (tests/audio/speech.py: the same clip every run); transcripts are compared loosely
(word error rate), as the Realtime voice tests do. Speech is decoded with soundfile and transcribed back."""
from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import openai
import orjson
import pytest
import soundfile as sf
from openai import AsyncOpenAI
from openai.types.audio import (Transcription, TranscriptionTextDeltaEvent, TranscriptionTextDoneEvent,
                                TranscriptionVerbose)

from audio.codecs import float_to_int16
from gateway.audio_api import MAX_AUDIO_SECONDS
from tests.audio.speech import steady_piper_speech
from tests.gateway.realtime.client import PCM16, QUESTION, check_turn, open_voice, utterance, wer

SENTENCES = ["what is the capital of france", "the quick brown fox jumps over the lazy dog",
             "please turn off the kitchen lights", "tomorrow will be sunny and warm"]
MORE_SENTENCES = ["the train leaves the station at noon", "my brother plays the piano every evening",
                  "we bought fresh bread at the market"]
SPOKEN = "The capital of France is Paris."
# for the round trips through every output format: long enough that one misheard word moves the error rate little
SPOKEN_LONG = "The weather is warm and sunny today, so we will walk to the park after lunch."


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url, max_retries=0)


def encoded(text: str, container: str, subtype: str | None = None, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, steady_piper_speech(text, rate), rate, format=container, subtype=subtype)
    return buf.getvalue()


def wav_of(x: np.ndarray, rate: int = 16_000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV")
    return buf.getvalue()


def stage_stats(server) -> dict:
    return server.app.state.audio.start().stats()   # started: a test may run before any other used the stage


def tts_pending(server) -> int:
    return server.app.state.audio.tts.pending if server.app.state.audio.tts is not None else 0


async def settled(server) -> dict:
    """The stage once nothing is queued or running in it (a stream's last step may still be finishing)."""
    for _ in range(200):
        s = stage_stats(server)
        if s["transcriptions_inflight"] == 0 and tts_pending(server) == 0:
            return s
        await asyncio.sleep(0.05)
    raise AssertionError(f"the audio stage did not settle: {stage_stats(server)}, tts pending {tts_pending(server)}")


@pytest.mark.parametrize("name,container,subtype,mime", [
    ("q.wav", "WAV", None, "audio/wav"), ("q.flac", "FLAC", None, "audio/flac"),
    ("q.ogg", "OGG", "VORBIS", "audio/ogg"), ("q.mp3", "MP3", None, "audio/mpeg")])
async def test_transcription_of_each_container(server, name, container, subtype, mime):
    out = await client(server).audio.transcriptions.create(
        model="whisper-1", file=(name, encoded(QUESTION, container, subtype), mime))
    assert isinstance(out, Transcription) and wer(QUESTION, out.text) <= 0.2, out.text
    assert out.usage.type == "duration" and 1.0 < out.usage.seconds < 4.0


async def test_transcription_of_raw_pcm(server):
    pcm24 = float_to_int16(steady_piper_speech(QUESTION, 24_000)).tobytes()
    out = await client(server).audio.transcriptions.create(model="whisper-1", file=("q.pcm", pcm24, "audio/pcm"))
    assert wer(QUESTION, out.text) <= 0.2, out.text
    pcm16k = float_to_int16(steady_piper_speech(QUESTION, 16_000)).tobytes()
    out = await client(server).audio.transcriptions.create(model="whisper-1",
                                                           file=("q", pcm16k, "audio/pcm;rate=16000"))
    assert wer(QUESTION, out.text) <= 0.2, out.text


async def test_transcription_response_formats(server):
    c, wav = client(server), encoded(QUESTION, "WAV")
    text = await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav), response_format="text")
    assert isinstance(text, str) and wer(QUESTION, text) <= 0.2, text
    verbose = await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav),
                                                  response_format="verbose_json", timestamp_granularities=["segment"])
    assert isinstance(verbose, TranscriptionVerbose) and verbose.language == "english"
    assert wer(QUESTION, verbose.text) <= 0.2 and len(verbose.segments) == 1
    seg = verbose.segments[0]
    assert seg.start == 0.0 and seg.end == pytest.approx(verbose.duration) and seg.text == verbose.text
    srt = await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav), response_format="srt")
    lines = srt.strip().split("\n")
    assert lines[0] == "1" and lines[1].startswith("00:00:00,000 --> 00:00:0") and wer(QUESTION, lines[2]) <= 0.2
    vtt = await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav), response_format="vtt")
    lines = vtt.strip().split("\n")
    assert lines[0] == "WEBVTT" and lines[2].startswith("00:00:00.000 --> 00:00:0") and wer(QUESTION, lines[3]) <= 0.2


async def test_long_upload_has_a_segment_per_window(server):
    text = " ".join(SENTENCES * 3) + "."
    x = steady_piper_speech(text)
    clip = np.concatenate([x, np.zeros(max(0, 31 * 16_000 - len(x)), np.float32), x])  # two windows of speech
    verbose = await client(server).audio.transcriptions.create(
        model="whisper-1", file=("long.wav", wav_of(clip)), response_format="verbose_json")
    assert [(s.start, s.id) for s in verbose.segments] == [(0.0, 0), (30.0, 1)], verbose.segments
    assert verbose.segments[1].end == pytest.approx(len(clip) / 16_000, abs=1e-3)
    assert wer(" ".join(SENTENCES * 3), verbose.segments[0].text) <= 0.2
    assert all(0.0 < s.no_speech_prob < 0.6 for s in verbose.segments), verbose.segments
    # one transcript of both windows: its logprobs are both windows' tokens, in order
    whole = await client(server).audio.transcriptions.create(
        model="whisper-1", file=("long.wav", wav_of(clip)), include=["logprobs"])
    check_logprobs(whole.logprobs, whole.text)
    assert len(whole.logprobs) == sum(len(s.tokens) for s in verbose.segments)


def check_logprobs(logprobs, text: str) -> None:
    """The tokens of `logprobs` spell `text` (up to the spaces around it), each a probability's log with its bytes."""
    assert logprobs and "".join(t.token for t in logprobs).strip() == text.strip(), (logprobs, text)
    assert all(t.logprob <= 0.0 and bytes(int(b) for b in t.bytes) == t.token.encode() for t in logprobs)


async def test_transcription_logprobs(server):
    """include[]=logprobs: the transcript's tokens with the logprob Whisper chose each with, as OpenAI lists them
    (json, and in the streamed done event); a verbose segment carries its tokens' ids and their mean logprob."""
    c = client(server)
    wav = encoded(QUESTION, "WAV")
    plain = await c.audio.transcriptions.create(model="gpt-4o-transcribe", file=("q.wav", wav), include=["logprobs"])
    assert wer(QUESTION, plain.text) <= 0.2
    check_logprobs(plain.logprobs, plain.text)
    assert (await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav))).logprobs is None
    stream = await c.audio.transcriptions.create(model="gpt-4o-transcribe", file=("q.wav", wav), stream=True,
                                                 include=["logprobs"])
    events = [e async for e in stream]
    done = events[-1]
    assert isinstance(done, TranscriptionTextDoneEvent) and done.text == plain.text
    check_logprobs(done.logprobs, done.text)
    assert [t.logprob for t in done.logprobs] == [t.logprob for t in plain.logprobs]
    # each delta carries the tokens whose text it brings: together, the done event's
    deltas = [e for e in events if isinstance(e, TranscriptionTextDeltaEvent)]
    assert len(deltas) > 1 and [t.token for d in deltas for t in d.logprobs] == [t.token for t in done.logprobs]
    verbose = await c.audio.transcriptions.create(model="whisper-1", file=("q.wav", wav),
                                                  response_format="verbose_json")
    [seg] = verbose.segments
    assert len(seg.tokens) == len(plain.logprobs) and all(0 <= t < 50257 for t in seg.tokens)
    assert seg.avg_logprob == pytest.approx(sum(t.logprob for t in plain.logprobs) / len(plain.logprobs), abs=1e-4)
    assert 0.0 < seg.no_speech_prob < 0.1, seg  # Whisper's own, for a clear question


async def test_transcription_stream(server):
    stream = await client(server).audio.transcriptions.create(
        model="whisper-1", file=("q.wav", encoded(SENTENCES[1], "WAV")), stream=True)
    events = [e async for e in stream]
    deltas = [e for e in events if isinstance(e, TranscriptionTextDeltaEvent)]
    assert len(deltas) > 1 and isinstance(events[-1], TranscriptionTextDoneEvent)
    assert "".join(d.delta for d in deltas).strip() == events[-1].text.strip()
    assert wer(SENTENCES[1], events[-1].text) <= 0.2, events[-1].text
    await settled(server)


def decode(body: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(body, "<i2").astype(np.float32) / 32768.0, 24_000
    return sf.read(io.BytesIO(body), dtype="float32")


async def transcribe_back(server, audio: np.ndarray, rate: int) -> str:
    out = await client(server).audio.transcriptions.create(model="whisper-1", file=("a.wav", wav_of(audio, rate)))
    return out.text


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
async def test_speech_each_format(server, fmt):
    async with client(server).audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=SPOKEN_LONG, response_format=fmt) as resp:
        assert resp.status_code == 200
        body = b"".join([chunk async for chunk in resp.iter_bytes()])
    audio, rate = decode(body, fmt)
    assert rate == 24_000 and 2.0 < len(audio) / rate < 9.0 and np.abs(audio).max() > 0.05
    heard = await transcribe_back(server, audio, rate)
    assert wer(SPOKEN_LONG, heard) <= 0.34, heard   # piper samples its prosody: a word may go astray
    await settled(server)


async def test_speech_sse_streams_pieces_as_they_are_made(server):
    text = "The capital of France is Paris. It is a large city with many old bridges and famous museums."
    async with httpx.AsyncClient(timeout=120) as h:
        r = await h.post(f"{server.base_url}/audio/speech", json={
            "model": "gpt-4o-mini-tts", "voice": "joe", "input": text, "response_format": "pcm",
            "stream_format": "sse", "speed": 1.25})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [orjson.loads(block[len("data: "):]) for block in r.text.strip().split("\n\n")]
    assert events[-1] == {"type": "speech.audio.done"}
    deltas = [e for e in events[:-1] if e["type"] == "speech.audio.delta"]
    assert len(deltas) == len(events) - 1 and len(deltas) > 2   # audio went out piece by piece
    audio, rate = decode(b"".join(base64.b64decode(e["audio"]) for e in deltas), "pcm")
    assert 2.0 < len(audio) / rate < 8.0
    assert wer(text, await transcribe_back(server, audio, rate)) <= 0.34


async def test_bad_audio_requests_are_400_and_leave_nothing_queued(server):
    c = client(server)
    base = await settled(server)
    silence_too_long = np.zeros(int((MAX_AUDIO_SECONDS + 1) * 8_000), np.int16).tobytes()
    uploads = [  # (file, extra fields, status, param, code)
        (("x.wav", b"RIFF not really audio"), {}, 400, "file", "invalid_audio_format"),
        (("x.wav", b""), {}, 400, "file", "audio_too_short"),
        (("x.wav", wav_of(np.zeros(320, np.float32))), {}, 400, "file", "audio_too_short"),
        (("x.pcm", silence_too_long, "audio/pcm;rate=8000"), {}, 400, "file", "audio_too_long"),
        (("x.pcm", b"\0" * 3201, "audio/pcm"), {}, 400, "file", "invalid_audio_format"),
        (("x.pcm", b"\0" * 3200, "audio/pcm;rate=1000"), {}, 400, "file", "invalid_audio_format"),
        (("q.wav", encoded(QUESTION, "WAV")), {"language": "fr"}, 400, "language", "unsupported_value"),
        (("q.wav", encoded(QUESTION, "WAV")), {"response_format": "xml"}, 400, "response_format", "invalid_value"),
        (("q.wav", encoded(QUESTION, "WAV")), {"response_format": "srt", "stream": True}, 400, "stream",
         "unsupported_value"),
        (("q.wav", encoded(QUESTION, "WAV")), {"temperature": 3}, 400, "temperature", "invalid_value"),
        (("q.wav", encoded(QUESTION, "WAV")), {"extra_body": {"colour": "red"}}, 400, "colour", "unknown_parameter"),
        (("q.wav", encoded(QUESTION, "WAV")), {"model": "whisper-large"}, 404, "model", "model_not_found"),
        (("q.wav", encoded(QUESTION, "WAV")), {"include": ["logprobs"], "response_format": "text"}, 400,
         "include[]", "unsupported_value"),
        (("q.wav", encoded(QUESTION, "WAV")), {"include": ["segments"]}, 400, "include[]", "unsupported_value"),
    ]
    for file, extra, status, param, code in uploads:
        kw = {"model": "whisper-1", **extra}
        with pytest.raises(openai.APIStatusError) as info:
            await c.audio.transcriptions.create(file=file, **kw)
        err = info.value.body
        assert (info.value.status_code, err["param"], err["code"]) == (status, param, code), (extra, err)
        assert err["type"] == "invalid_request_error" and "Traceback" not in err["message"]
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(f"{server.base_url}/audio/transcriptions", json={"model": "whisper-1"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("This endpoint takes a multipart")
        r = await h.post(f"{server.base_url}/audio/transcriptions", files={"model": (None, "whisper-1")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file", r.text
    speech = [  # (fields, status, param, code)
        ({"response_format": "aac"}, 400, "response_format", "unsupported_value"),
        ({"response_format": "ogg"}, 400, "response_format", "invalid_value"),
        ({"voice": "hal9000"}, 400, "voice", "invalid_value"),
        ({"speed": 5}, 400, "speed", "invalid_value"),
        ({"speed": "fast"}, 400, "speed", "invalid_type"),
        ({"input": "   "}, 400, "input", "invalid_value"),
        ({"input": "x" * 5000}, 400, "input", "invalid_value"),
        ({"stream_format": "chunks"}, 400, "stream_format", "invalid_value"),
        ({"model": "tts-9"}, 404, "model", "model_not_found"),
        ({"extra_body": {"pitch": 2}}, 400, "pitch", "unknown_parameter"),
    ]
    for extra, status, param, code in speech:
        kw = {"model": "tts-1", "voice": "alloy", "input": SPOKEN, **extra}
        with pytest.raises(openai.APIStatusError) as info:
            async with c.audio.speech.with_streaming_response.create(**kw) as resp:
                await resp.read()
        err = info.value.body
        assert (info.value.status_code, err["param"], err["code"]) == (status, param, code), (extra, err)
    after = await settled(server)
    assert after["transcriber"]["requests"] == base["transcriber"]["requests"]   # nothing reached the worker
    assert after["tts"]["steps"] == base["tts"]["steps"]


async def test_uploads_share_whisper_with_live_voice_sessions(server):
    """Issue 22's load: 8 uploads at once beside 2 live voice turns, all on the one Whisper worker. Every upload is
    transcribed as well as the Realtime path transcribes speech: the upload of the voice turns' question scores a word
    error rate no worse than theirs, and each upload's is within the Realtime tests' bound. Nothing is left in flight
    after."""
    base = await settled(server)
    engine_base = await server.wait_idle()
    voices = [await open_voice(server) for _ in range(2)]
    pcm, on, off = utterance(QUESTION)
    sentences = [QUESTION, *SENTENCES, *MORE_SENTENCES]
    clips = [encoded(s, "WAV") for s in sentences]

    async def voice_turn(raw):
        await raw.stream(pcm, PCM16)
        return await raw.until("response.done")

    async def upload(i: int):
        return await client(server).audio.transcriptions.create(model="whisper-1", file=(f"{i}.wav", clips[i]))

    results = await asyncio.gather(*(voice_turn(raw) for raw in voices), *(upload(i) for i in range(len(clips))))
    turns, outs = results[:len(voices)], results[len(voices):]
    realtime_wer = max(wer(QUESTION, check_turn(events, on, off)["transcript"]) for events in turns)
    assert wer(QUESTION, outs[0].text) <= realtime_wer, (outs[0].text, realtime_wer)
    for sentence, out in zip(sentences, outs):
        assert wer(sentence, out.text) <= 0.2, (sentence, out.text)
    for raw in voices:
        await raw.ws.close()
    after = await settled(server)
    new = {k: after["transcriber"][k] - base["transcriber"][k]
           for k in ("requests", "completed", "cancelled", "failed")}
    # nothing is left in flight: the uploads and the turns were transcribed, and a transcription started in a pause the
    # voice went on after (a quiet stretch inside a word, audio.vad.QUIET_PAUSE_MS) was cancelled
    assert new["requests"] == new["completed"] + new["cancelled"] and new["failed"] == 0, new
    assert new["completed"] >= len(clips) + len(voices), new
    s = await server.wait_idle()
    assert s["kv_pages_used"] <= engine_base["kv_pages_used"]
    metrics = server.metrics_text()
    assert "rtserve_transcriptions_inflight 0.0" in metrics and "rtserve_requests_running 0.0" in metrics


async def test_chat_with_input_audio_is_answered_from_its_transcript(server):
    wav = base64.b64encode(encoded(QUESTION, "WAV")).decode()
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}]}]
    c = client(server)
    spoken = await c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=24, temperature=0)
    typed = await c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0, messages=[
        messages[0], {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}])
    # the transcript is the user's text: greedy decoding answers the spoken question as it answers the typed one
    assert spoken.choices[0].message.content == typed.choices[0].message.content
    assert spoken.usage.prompt_tokens == typed.usage.prompt_tokens
    bad = [({"data": "%%% not base64", "format": "wav"}, "messages[0].content[0].input_audio.data", "invalid_value"),
           ({"data": base64.b64encode(b"junk" * 100).decode(), "format": "wav"},
            "messages[0].content[0].input_audio.data", "invalid_audio_format"),
           ({"data": wav, "format": "aac"}, "messages[0].content[0].input_audio.format", "invalid_value")]
    base = await settled(server)
    for spec, param, code in bad:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "input_audio", "input_audio": spec}]}])
        assert (info.value.body["param"], info.value.body["code"]) == (param, code), info.value.body
    assert (await settled(server))["transcriber"]["requests"] == base["transcriber"]["requests"]
    await server.wait_idle()


async def test_speech_client_leaving_mid_stream_drops_the_job(server):
    base = await settled(server)
    text = " ".join(["The quick brown fox jumps over the lazy dog and runs far away into the green woods."] * 20)
    async with httpx.AsyncClient(timeout=120) as h:
        async with h.stream("POST", f"{server.base_url}/audio/speech", json={
                "model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}) as r:
            assert r.status_code == 200
            first = await r.aiter_bytes().__anext__()
            assert first
    # the job is dropped (at 4x real time its rest would take far longer than `settled` waits) and never completes
    after = await settled(server)
    assert after["tts"]["requests"] == base["tts"]["requests"]
