"""Voice over the Realtime session: real speech (piper / espeak-ng, synthesized in the test) in, Whisper transcripts,
spoken replies out, on the shared engine. Raw `websockets` clients and the official openai SDK; every server event is
validated against the SDK's pydantic union of its dialect.
"""
from __future__ import annotations

import asyncio
import base64
import re

import jiwer
import numpy as np
import orjson
import pytest
import websockets
from openai import AsyncOpenAI
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GAServerEvent
from pydantic import TypeAdapter

from audio.codecs import AudioFormat, decode_audio, encode_audio, float_to_int16
from audio.speech import espeak_speech, piper_speech, speech_bounds_ms

GA_EVENTS = TypeAdapter(GAServerEvent)
BETA_EVENTS = TypeAdapter(BetaServerEvent)
QUESTION = "what is the capital of france"
PCM16 = AudioFormat("pcm16", 24000)
ULAW = AudioFormat("pcmu", 8000)
VOICE_SESSION = {"type": "realtime", "max_output_tokens": 20,
                 "instructions": "You are a concise voice assistant. Answer in one short sentence."}

pytestmark = pytest.mark.slow


def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(ref: str, hyp: str) -> float:
    return jiwer.wer(normalize(ref), normalize(hyp) or "<empty>")


def utterance(text: str, fmt: AudioFormat = PCM16, lead_ms: int = 300, tail_ms: int = 1000,
              engine: str = "piper") -> tuple[bytes, float, float]:
    """Speech with silence around it, in `fmt` bytes; also where the voice starts and ends (ms of the clip)."""
    x = piper_speech(text, rate=fmt.rate) if engine == "piper" else espeak_speech(text, rate=fmt.rate)
    on, off = speech_bounds_ms(x, fmt.rate)
    lead, tail = np.zeros(fmt.rate * lead_ms // 1000, np.float32), np.zeros(fmt.rate * tail_ms // 1000, np.float32)
    clip = np.concatenate([lead, x, tail])
    return encode_audio(float_to_int16(clip), fmt), lead_ms + on, lead_ms + off


def chunks(raw: bytes, fmt: AudioFormat, sizes_ms=(20, 40, 60, 100, 80, 30)) -> list[str]:
    """Base64 appends of varying 20–100 ms sizes, like a microphone stream."""
    out, i, k = [], 0, 0
    per_ms = fmt.rate * fmt.bytes_per_sample // 1000
    while i < len(raw):
        n = sizes_ms[k % len(sizes_ms)] * per_ms
        out.append(base64.b64encode(raw[i:i + n]).decode())
        i, k = i + n, k + 1
    return out


class Raw:
    """A raw `websockets` client that validates every server event against the SDK union of its dialect."""

    def __init__(self, ws, adapter: TypeAdapter = GA_EVENTS):
        self.ws, self.adapter, self.events = ws, adapter, []

    async def send(self, event: dict) -> None:
        await self.ws.send(orjson.dumps(event).decode())

    async def recv(self, timeout: float = 120) -> dict:
        data = orjson.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        self.adapter.validate_python(data, strict=True)
        self.events.append(data)
        return data

    async def until(self, etype: str, timeout: float = 120) -> list[dict]:
        events = []
        while True:
            events.append(await self.recv(timeout))
            if events[-1]["type"] == etype:
                return events

    async def stream(self, raw: bytes, fmt: AudioFormat, pace: float = 0.0) -> None:
        """Append the audio in chunks; `pace` 1.0 sends in real time."""
        for b64 in chunks(raw, fmt):
            await self.send({"type": "input_audio_buffer.append", "audio": b64})
            if pace:
                await asyncio.sleep(pace * len(base64.b64decode(b64)) / (fmt.rate * fmt.bytes_per_sample))


async def open_voice(server, session: dict | None = None, beta: bool = False, query: str = "") -> Raw:
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    ws = await websockets.connect(server.realtime_url + query, max_size=None, additional_headers=headers)
    raw = Raw(ws, BETA_EVENTS if beta else GA_EVENTS)
    created = await raw.recv()
    assert created["type"] == "session.created"
    raw.session_id = created["session"]["id"]
    if beta:
        assert (await raw.recv())["type"] == "conversation.created"
    await raw.send({"type": "session.update", "session": session or VOICE_SESSION})
    assert (await raw.recv())["type"] == "session.updated"
    return raw


def response_audio(events: list[dict], fmt: AudioFormat, beta: bool = False) -> tuple[np.ndarray, str, list[str]]:
    """The decoded reply audio, its transcript (from .done) and the transcript deltas."""
    a_delta = "response.audio.delta" if beta else "response.output_audio.delta"
    t_delta = "response.audio_transcript.delta" if beta else "response.output_audio_transcript.delta"
    t_done = "response.audio_transcript.done" if beta else "response.output_audio_transcript.done"
    raw = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == a_delta)
    audio = decode_audio(raw, fmt)
    deltas = [e["delta"] for e in events if e["type"] == t_delta]
    done = [e["transcript"] for e in events if e["type"] == t_done]
    assert len(done) == 1 and done[0] == "".join(deltas)
    return audio, done[0], deltas


def check_plausible_speech(audio: np.ndarray, transcript: str, fmt: AudioFormat) -> None:
    """Audio of roughly the right length for its transcript, and not silence. The length is counted in spoken
    units: words, and numbers at least one unit each ("10,000,000" may be "ten million") and at most one per digit
    (the voice may read "10077.3115" digit by digit)."""
    seconds = len(audio) / fmt.rate
    fewest, most = (len(re.findall(words, transcript)) for words in (r"[^\W\d_]+|\d+", r"[^\W\d_]+|\d"))
    assert fewest >= 1 and 0.12 * fewest <= seconds <= 1.5 * most + 1.0, (seconds, transcript)
    assert np.abs(audio.astype(np.float32)).max() > 1000


def check_turn(events: list[dict], on_ms: float, off_ms: float, offset_ms: float = 0.0) -> dict:
    """speech_started/stopped offsets, committed, transcription (WER ≤ 20 %) before the response; returns the
    committed item's completed-transcription event."""
    types = [e["type"] for e in events]
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
    on_ms, off_ms = on_ms + offset_ms, off_ms + offset_ms  # the session's input timeline
    # audio_start_ms includes the 300 ms prefix padding; VAD windows are 32 ms.
    assert abs(started["audio_start_ms"] - max(offset_ms, on_ms - 300)) <= 150, (started, on_ms)
    assert off_ms - 150 <= stopped["audio_end_ms"] <= off_ms + 350, (stopped, off_ms)
    assert started["item_id"] == stopped["item_id"] == committed["item_id"]
    assert types.index("input_audio_buffer.speech_started") < types.index("input_audio_buffer.speech_stopped") \
        < types.index("input_audio_buffer.committed")
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    deltas = [e["delta"] for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"
              and e["item_id"] == committed["item_id"]]
    assert completed["item_id"] == committed["item_id"] and "".join(deltas) == completed["transcript"]
    assert wer(QUESTION, completed["transcript"]) <= 0.2, completed["transcript"]
    return completed


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
