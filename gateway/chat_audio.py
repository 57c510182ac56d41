"""Spoken replies on /v1/chat/completions: `modalities: ["text", "audio"]` with `audio: {voice, format}`, as OpenAI's
audio chat models answer.

The reply's text is cut into pieces as it streams (the Realtime cut, gateway/realtime/audio_out.py) and each piece is
spoken by the shared TTS worker (audio.stage), off the event loop, the pieces of one reply sharing one `SpeechClock`.
The audio is encoded in the asked format by the speech endpoint's encoder (gateway/audio_api.py).

- Not streamed: `message.audio` = {id, data (base64 of the whole file), expires_at, transcript}, `message.content`
  null.
- Streamed: `delta.audio` pieces as OpenAI sends them: {id, transcript} first, then {transcript} and {data} (base64 of
  the next bytes of the file) as they come, and a last {expires_at}; the finish_reason chunk follows.

An assistant message that carries `audio: {id}` of an earlier spoken reply stands for that reply's transcript (OpenAI's
multi-turn audio); the server remembers the transcripts of its recent spoken replies (`SpokenReplies`) until their
`expires_at`.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from audio.codecs import AudioFormat
from audio.tts import SpeechClock, SpeechJob
from gateway.audio_api import (HTTP_SPEECH_PACE, SPEECH_FORMATS, SPEECH_RATE, VOICES, SpeechEncoder, SpeechFormat,
                               stage_of)
from gateway.http_api import HTTPError
from gateway.http_models import AssistantMessage, ChatCompletionRequest, VoiceId
from gateway.realtime.audio_out import sentence_chunker

PCM16 = AudioFormat("pcm16", SPEECH_RATE)
REPLY_TTL_S = 3600            # how long a spoken reply's transcript can be referred to by its audio id
MAX_REMEMBERED_REPLIES = 4096  # the oldest are forgotten first past this many

# A whole file per response: wav and mp3 get their real headers (sizes, LAME tag), written when the audio is complete.
WHOLE_FORMATS = {
    "wav": SpeechFormat("audio/wav", "WAV", "PCM_16", streams=False),
    "mp3": SpeechFormat("audio/mpeg", "MP3", "MPEG_LAYER_III", streams=False),
    "flac": SPEECH_FORMATS["flac"],
    "opus": SpeechFormat("audio/ogg", "OGG", "OPUS", streams=False),
    "pcm16": SPEECH_FORMATS["pcm"],
}
# Streamed: the speech endpoint's streamable encodings (a wav whose sizes say "to the end", mp3 without its LAME tag).
STREAMED_FORMATS = {"wav": SPEECH_FORMATS["wav"], "mp3": SPEECH_FORMATS["mp3"], "opus": SPEECH_FORMATS["opus"],
                    "pcm16": SPEECH_FORMATS["pcm"]}


@dataclass(slots=True)
class SpokenReplies:
    """The transcripts of recent spoken replies by audio id, so a later request's assistant message can name one."""
    ttl_s: float = REPLY_TTL_S
    max_items: int = MAX_REMEMBERED_REPLIES
    items: collections.OrderedDict = field(default_factory=collections.OrderedDict)   # id -> (expires_at, transcript)

    def remember(self, audio_id: str, transcript: str) -> int:
        """Keep a reply's transcript under its audio id; returns when it expires (Unix seconds)."""
        now = time.time()
        while self.items and (len(self.items) >= self.max_items or next(iter(self.items.values()))[0] <= now):
            self.items.popitem(last=False)
        expires_at = int(now + self.ttl_s)
        self.items[audio_id] = (expires_at, transcript)
        return expires_at

    def transcript(self, audio_id: str) -> str | None:
        found = self.items.get(audio_id)
        return found[1] if found is not None and found[0] > time.time() else None


def spoken_replies(app) -> SpokenReplies:
    replies = getattr(app.state, "spoken_replies", None)
    if replies is None:
        replies = app.state.spoken_replies = SpokenReplies()
    return replies


def history_transcripts(request, req: ChatCompletionRequest) -> dict[int, str]:
    """The transcripts that assistant messages with `audio: {id}` (and no text) stand for, by message index; a 400
    for an id this server does not remember."""
    out = {}
    for i, m in enumerate(req.messages):
        if isinstance(m, AssistantMessage) and m.audio is not None:
            text = spoken_replies(request.app).transcript(m.audio.id)
            if text is None:
                raise HTTPError(400, f"Invalid 'messages[{i}].audio.id': {m.audio.id[:40]!r} is no spoken reply of "
                                     f"this server, or it has expired.", "invalid_value", f"messages[{i}].audio.id")
            out[i] = text
    return out


@dataclass(slots=True)
class ChatAudio:
    """What a request asked its spoken reply to be: a voice (all speak piper's voice) and an encoding; where its
    transcript is remembered."""
    stage: object
    fmt: SpeechFormat
    replies: SpokenReplies

    @classmethod
    def from_request(cls, request, req: ChatCompletionRequest) -> ChatAudio | None:
        """None for a text-only request; a 400 for a voice we do not have (the request models checked the rest)."""
        if req.audio is None:
            return None
        voice = req.audio.voice.id if isinstance(req.audio.voice, VoiceId) else req.audio.voice
        if voice not in VOICES:
            raise HTTPError(400, f"Invalid value for 'audio.voice': unknown voice {voice[:40]!r}; voices here are "
                                 f"{', '.join(VOICES)} (OpenAI's names all speak with piper's joe-us voice).",
                            "invalid_value", "audio.voice")
        table = STREAMED_FORMATS if req.stream else WHOLE_FORMATS
        return cls(stage_of(request), table[req.audio.format], spoken_replies(request.app))

    def reply(self) -> SpokenReply:
        return SpokenReply(self.stage, self.fmt)

    def remember(self, audio_id: str, transcript: str) -> int:
        return self.replies.remember(audio_id, transcript)


class SpokenReply:
    """One reply's speech: text in as it streams (`feed`, then `finish`), the encoded audio out in order (`audio()`).
    `close()` drops whatever is not spoken yet."""

    def __init__(self, stage, fmt: SpeechFormat) -> None:
        self.stage = stage
        self.encoder = SpeechEncoder(fmt)
        self.clock = SpeechClock(pace=HTTP_SPEECH_PACE)
        self.chunker = sentence_chunker()
        self.jobs: asyncio.Queue[SpeechJob | None] = asyncio.Queue()
        self.submitted: list[SpeechJob] = []
        self.transcript = ""

    def feed(self, text: str) -> None:
        self.transcript += text
        for piece in self.chunker.push(text):
            self._say(piece)

    def finish(self) -> None:
        for piece in self.chunker.flush():
            self._say(piece)
        self.jobs.put_nowait(None)

    def _say(self, piece: str) -> None:
        job = self.stage.say(piece, PCM16, 1.0, self.clock)
        self.submitted.append(job)
        self.jobs.put_nowait(job)

    async def audio(self):
        """The encoded bytes as they are made, up to the end of the file (after `finish`)."""
        try:
            while (job := await self.jobs.get()) is not None:
                async for pcm in job.chunks():
                    out = await asyncio.to_thread(self.encoder.encode, pcm)
                    if out:
                        yield out
            out = await asyncio.to_thread(self.encoder.close)
            if out:
                yield out
        finally:
            self.close()

    async def whole(self, text: str) -> bytes:
        """The whole file for `text` (a reply that is not streamed)."""
        self.feed(text)
        self.finish()
        return b"".join([out async for out in self.audio()])

    def close(self) -> None:
        for job in self.submitted:
            job.cancel()
        self.encoder.discard()
