"""Test clients of the Realtime WebSocket: a raw `websockets` client that validates every server event against the
openai SDK's pydantic union of its dialect, the speech the voice tests send, and the checks they share.

Test speech is piper's with its noise scales at 0 (`tests.audio.speech.steady_piper_speech`): the same clip on every
run, so a transcript assertion cannot pass on one draw of piper's noise and fail on another.
"""
from __future__ import annotations

import asyncio
import base64
import re

import jiwer
import numpy as np
import orjson
import websockets
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GAServerEvent
from pydantic import TypeAdapter

from audio.codecs import AudioFormat, decode_audio, encode_audio, float_to_int16
from audio.speech import espeak_speech, speech_bounds_ms
from tests.audio.speech import steady_piper_speech

GA_EVENTS = TypeAdapter(GAServerEvent)
BETA_EVENTS = TypeAdapter(BetaServerEvent)
ID_PREFIX = {"resp": re.compile(r"^resp_[A-Za-z0-9]{22}$"), "item": re.compile(r"^item_[A-Za-z0-9]{22}$"),
             "event": re.compile(r"^event_[A-Za-z0-9]{22}$")}

QUESTION = "what is the capital of france"
PCM16 = AudioFormat("pcm16", 24000)
ULAW = AudioFormat("pcmu", 8000)
ALAW = AudioFormat("pcma", 8000)
VOICE_SESSION = {"type": "realtime", "max_output_tokens": 20,
                 "instructions": "You are a concise voice assistant. Answer in one short sentence."}


class Raw:
    """A raw `websockets` client that validates every server event against the SDK union of its dialect and keeps
    every event it received in `events`."""

    def __init__(self, ws, adapter: TypeAdapter = GA_EVENTS):
        self.ws, self.adapter, self.events = ws, adapter, []
        self.session_id: str | None = None

    async def send(self, event: dict | str | bytes) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else orjson.dumps(event).decode())

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

    async def say(self, text: str, **item) -> dict:
        """A user text message; returns its `conversation.item.done` (GA)."""
        await self.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **item}})
        return (await self.until("conversation.item.done"))[-1]

    async def respond(self, response: dict | None = None) -> tuple[str, dict, list[dict]]:
        """response.create; the reply's text, the final response object and every event up to `response.done`."""
        await self.send({"type": "response.create", **({"response": response} if response else {})})
        events = await self.until("response.done")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        return text, events[-1]["response"], events

    async def stream(self, raw: bytes, fmt: AudioFormat, pace: float = 0.0) -> None:
        """Append the audio in chunks; `pace` 1.0 sends in real time."""
        for b64 in chunks(raw, fmt):
            await self.send({"type": "input_audio_buffer.append", "audio": b64})
            if pace:
                await asyncio.sleep(pace * len(base64.b64decode(b64)) / (fmt.rate * fmt.bytes_per_sample))


async def open_raw(server, max_output_tokens: int | str = 16, instructions: str | None = None, url: str | None = None,
                   **kw) -> Raw:
    """A GA text session (output_modalities ["text"])."""
    ws = await websockets.connect(url or server.realtime_url, max_size=None, **kw)
    raw = Raw(ws)
    created = await raw.recv()
    assert created["type"] == "session.created"
    raw.session_id = created["session"]["id"]
    session = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": max_output_tokens}
    if instructions is not None:
        session["instructions"] = instructions
    await raw.send({"type": "session.update", "session": session})
    assert (await raw.recv())["type"] == "session.updated"
    return raw


async def open_voice(server, session: dict | None = None, beta: bool = False, query: str = "") -> Raw:
    """A session of either dialect, updated with `session` (default VOICE_SESSION: spoken replies)."""
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


async def expect_error(raw: Raw, event: dict | str | bytes, code: str, param: str | None,
                       event_id: str | None) -> dict:
    """Send one bad event; the very next event must be one `error` naming it."""
    await raw.send(event)
    ev = await raw.recv()
    assert ev["type"] == "error", ev
    err = ev["error"]
    assert (err["code"], err["param"], err["event_id"]) == (code, param, event_id), err
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


# ------------------------------------------------------------------------------------------------------------ speech
def normalize(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(ref: str, hyp: str) -> float:
    return jiwer.wer(normalize(ref), normalize(hyp) or "<empty>")


def utterance(text: str, fmt: AudioFormat = PCM16, lead_ms: int = 300, tail_ms: int = 1000,
              engine: str = "piper") -> tuple[bytes, float, float]:
    """Speech with silence around it, in `fmt` bytes; also where the voice starts and ends (ms of the clip)."""
    x = steady_piper_speech(text, rate=fmt.rate) if engine == "piper" else espeak_speech(text, rate=fmt.rate)
    on, off = speech_bounds_ms(x, fmt.rate)
    lead, tail = np.zeros(fmt.rate * lead_ms // 1000, np.float32), np.zeros(fmt.rate * tail_ms // 1000, np.float32)
    clip = np.concatenate([lead, x, tail])
    return encode_audio(float_to_int16(clip), fmt), lead_ms + on, lead_ms + off


async def send_speech(session, pcm: bytes) -> None:
    """pcm16 24 kHz audio into an openai-agents RealtimeSession, in 100 ms appends, as a microphone sends them."""
    for i in range(0, len(pcm), 4800):
        await session.send_audio(pcm[i:i + 4800])


def chunks(raw: bytes, fmt: AudioFormat, sizes_ms=(20, 40, 60, 100, 80, 30)) -> list[str]:
    """Base64 appends of varying 20–100 ms sizes, like a microphone stream."""
    out, i, k = [], 0, 0
    per_ms = fmt.rate * fmt.bytes_per_sample // 1000
    while i < len(raw):
        n = sizes_ms[k % len(sizes_ms)] * per_ms
        out.append(base64.b64encode(raw[i:i + n]).decode())
        i, k = i + n, k + 1
    return out


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


def check_turn(events: list[dict], on_ms: float, off_ms: float, offset_ms: float = 0.0,
               question: str = QUESTION) -> dict:
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
    assert wer(question, completed["transcript"]) <= 0.2, completed["transcript"]
    return completed
