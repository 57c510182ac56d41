"""OpenAI's audio endpoints over HTTP: POST /v1/audio/transcriptions and POST /v1/audio/speech.

Both run on the app's shared `AudioStage`, the same batched Whisper worker and TTS threads that Realtime sessions use:
an upload's windows join the decoder batch beside live turns, and speech steps go through the TTS deadline scheduler.

Transcriptions take a multipart form (`file`, `model`, `language`, `prompt`, `response_format`, `temperature`,
`stream`, `timestamp_granularities[]`, `include[]`). The file is read by soundfile (wav, flac, ogg, mp3, ...), or taken
as raw pcm16 little-endian mono when its content type is `audio/pcm` (`;rate=N`, default 24000, the Realtime default)
or its name ends in `.pcm` / `.raw`. Every check (size, decodable, rate, length) runs before anything is queued on the
stage. `include[]=logprobs` (response_format json) adds the transcript's tokens with the logprob the greedy decoder
chose each with (`logprobs`; streamed: each delta's tokens in `transcript.text.delta`, all of them in
`transcript.text.done`). Segments are Whisper's 30 s windows: our decoder suppresses timestamp tokens, so a window is
the finest timing we have; a segment's `tokens` and `avg_logprob` are its decoded tokens' ids and mean logprob, and
its `no_speech_prob` is Whisper's: the probability of <|nocaptions|> right after SOT. A window over the decoder's
threshold (Whisper's default, 0.6) has no text and no segment.

Speech takes a JSON body (`input`, `model`, `voice`, `response_format`, `speed`, `stream_format`, `instructions`).
The body streams as the TTS makes the audio (`stream_format` "audio": the encoded bytes, chunked; "sse":
`speech.audio.delta` events of base64 audio, then `speech.audio.done`). FLAC is the exception: its header holds the
total length, so a FLAC body is sent when it is complete.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import orjson
import soundfile as sf
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from audio.resample import resample
from audio.codecs import AudioFormat
from audio.transcriber import TranscriptionError, TranscriptionStream
from audio.tts import MAX_SPEED, MIN_SPEED, SpeechClock, TTSError
from audio.whisper import SAMPLE_RATE, WINDOW_SAMPLES
from gateway.http_api import HTTPError, endpoint, json_response, read_capped, unless_gone
from gateway.http_logprobs import transcript_entries

MAX_UPLOAD_BYTES = 25 * 1024 * 1024  # OpenAI's own limit for an audio upload
MAX_AUDIO_SECONDS = 300.0  # ten Whisper windows: longer audio would hold the shared worker for too long
MIN_AUDIO_SECONDS = 0.1  # Whisper needs at least a few frames; less is treated as empty
MIN_RATE, MAX_RATE = 8_000, 192_000
MAX_SPEECH_BODY_BYTES = 64 * 1024
MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit for `input`
SPEECH_RATE = 24_000  # OpenAI's pcm output: 24 kHz 16-bit mono little-endian
# A download takes audio faster than it plays: its later audio is due this many times sooner than a live listener's
# (audio.tts.SpeechClock), yet a Realtime reply's first audio is still made before it.
HTTP_SPEECH_PACE = 4.0

TRANSCRIPTION_MODELS = ("whisper-tiny.en", "whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
SPEECH_MODELS = ("piper-joe-us", "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
# One piper voice (joe-us); OpenAI's voice names are accepted for it, as Realtime sessions accept them.
VOICES = ("joe", "alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
          "marin", "cedar")
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TRANSCRIPTION_FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature", "stream",
                        "timestamp_granularities[]", "chunking_strategy", "include[]", "include"}
SPEECH_FIELDS = {"input", "model", "voice", "response_format", "speed", "stream_format", "instructions"}
RAW_PCM_TYPES = ("audio/pcm", "audio/l16", "audio/raw")


@dataclass(slots=True, frozen=True)
class SpeechFormat:
    """An output format for /v1/audio/speech: how soundfile writes it (None: raw pcm16) and its media type."""
    media_type: str
    container: str | None = None
    subtype: str | None = None
    streams: bool = True  # False: the header needs the total length, so the file is sent when complete
    drops_first_write: bool = False  # the first write is a header rewritten at close (mp3's LAME tag): leave it out
    header: bytes = b""  # sent before raw pcm16 (wav)


def streaming_wav_header(rate: int = SPEECH_RATE) -> bytes:
    """A WAV header for pcm16 mono of unknown length: the RIFF and data sizes are 0xFFFFFFFF ("to the end of the
    stream"), as OpenAI streams wav; readers take the samples up to the end of the body."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + \
        b"data" + struct.pack("<I", 0xFFFFFFFF)


SPEECH_FORMATS = {
    "pcm": SpeechFormat("audio/pcm"),
    "wav": SpeechFormat("audio/wav", header=streaming_wav_header()),
    "flac": SpeechFormat("audio/flac", "FLAC", "PCM_16", streams=False),
    "mp3": SpeechFormat("audio/mpeg", "MP3", "MPEG_LAYER_III", drops_first_write=True),
    "opus": SpeechFormat("audio/ogg", "OGG", "OPUS"),
}
UNWRITABLE_FORMATS = ("aac",)  # OpenAI offers it; libsndfile cannot write it


def _bad(message: str, param: str | None, code: str = "invalid_value", status: int = 400) -> HTTPError:
    return HTTPError(status, message, code, param)


def stage_of(request: Request):
    stage = request.app.state.audio
    if stage is None:
        raise HTTPError(404, "Audio is off on this server (started with --no-audio).", "audio_unavailable")
    return stage.start()


# ------------------------------------------------------------------------------------------------ transcriptions
@dataclass(slots=True)
class TranscriptionRequest:
    audio: np.ndarray  # float32 mono at 16 kHz
    duration: float
    response_format: str = "json"
    stream: bool = False
    logprobs: bool = False  # include[]=logprobs: the transcript's tokens with their logprobs


async def _form(request: Request):
    """The multipart form, from a body read under MAX_UPLOAD_BYTES (starlette parses it with python-multipart)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise _bad("This endpoint takes a multipart/form-data body with the audio in `file`.", None,
                   "invalid_request_error")
    body = await read_capped(request, MAX_UPLOAD_BYTES, f"this endpoint's limit of {MAX_UPLOAD_BYTES} bytes")
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(request.scope, replay).form(max_files=1, max_fields=32)
    except MultiPartException as exc:
        raise _bad(f"The multipart body could not be parsed: {exc.message}", None, "invalid_request_error") from None


def _form_str(form, name: str, default: str | None = None) -> str | None:
    value = form.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(f"Invalid type for '{name}': expected a string, but got a file instead.", name, "invalid_type")
    return value


def _bool(value: str | None, name: str) -> bool:
    if value is None:
        return False
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0", ""):
        return False
    raise _bad(f"Invalid value for '{name}': expected a boolean (true or false), got {value[:40]!r}.", name,
               "invalid_type")


def _raw_pcm_rate(content_type: str | None, filename: str | None) -> int | None:
    """The rate of a raw pcm16 upload (from `audio/pcm;rate=N`), or None when the file is a container."""
    ctype = (content_type or "").lower()
    base, _, params = ctype.partition(";")
    if base.strip() not in RAW_PCM_TYPES and not (filename or "").lower().endswith((".pcm", ".raw")):
        return None
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key == "rate":
            if not value.isdigit():
                raise _bad(f"Invalid rate in the file's content type {content_type!r}: expected an integer.", "file",
                           "invalid_audio_format")
            return int(value)
    return 24_000


def _check_length(seconds: float) -> None:
    if seconds > MAX_AUDIO_SECONDS:
        raise _bad(f"The audio is {seconds:.1f} s long; this server transcribes at most {MAX_AUDIO_SECONDS:.0f} s.",
                   "file", "audio_too_long")
    if seconds < MIN_AUDIO_SECONDS:
        raise _bad(f"The audio is empty (at least {MIN_AUDIO_SECONDS} s is needed).", "file", "audio_too_short")


def _check_rate(rate: int) -> None:
    if not MIN_RATE <= rate <= MAX_RATE:
        raise _bad(f"Unsupported sample rate {rate} Hz: expected {MIN_RATE} to {MAX_RATE}.", "file",
                   "invalid_audio_format")


def decode_upload(data: bytes, filename: str | None, content_type: str | None) -> tuple[np.ndarray, float]:
    """(worker thread) An uploaded file -> (float32 mono at 16 kHz, its duration in seconds); HTTPError if bad."""
    if not data:
        raise _bad("The uploaded file is empty.", "file", "audio_too_short")
    rate = _raw_pcm_rate(content_type, filename)
    if rate is not None:
        _check_rate(rate)
        if len(data) % 2:
            raise _bad("Raw pcm16 audio must have an even number of bytes.", "file", "invalid_audio_format")
        _check_length(len(data) / 2 / rate)
        audio = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    else:
        try:
            info = sf.info(io.BytesIO(data))
        except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
            raise _bad("The file could not be decoded as audio: send wav, flac, ogg or mp3, or raw pcm16 with the "
                       "content type audio/pcm;rate=N.", "file", "invalid_audio_format") from None
        rate = int(info.samplerate)
        _check_rate(rate)
        if info.frames > 0:  # a container that states its length: refuse long audio before decoding it
            _check_length(info.frames / rate)
        try:
            frames, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        except (sf.LibsndfileError, RuntimeError, TypeError, ValueError):
            raise _bad("The file's audio data could not be decoded.", "file", "invalid_audio_format") from None
        audio = frames.mean(axis=1, dtype=np.float32) if frames.shape[1] > 1 else frames[:, 0]
        _check_length(len(audio) / rate)
    if not np.isfinite(audio).all():
        raise _bad("The audio contains NaN or infinite samples.", "file", "invalid_audio_format")
    return resample(np.ascontiguousarray(audio, np.float32), rate, SAMPLE_RATE), len(audio) / rate


async def _transcription_request(request: Request) -> TranscriptionRequest:
    form = await _form(request)
    try:
        unknown = sorted(set(form.keys()) - TRANSCRIPTION_FIELDS)
        if unknown:
            raise _bad(f"Unknown parameter: '{unknown[0]}'.", unknown[0], "unknown_parameter")
        upload = form.get("file")
        if upload is None:
            raise _bad("Missing required parameter: 'file'.", "file", "missing_required_parameter")
        if isinstance(upload, str):
            raise _bad("Invalid type for 'file': expected a file upload, but got a string instead.", "file",
                       "invalid_type")
        model = _form_str(form, "model")
        if model is None:
            raise _bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
        if model not in TRANSCRIPTION_MODELS:
            raise _bad(f"The model '{model}' does not exist; transcription models here: "
                       f"{', '.join(TRANSCRIPTION_MODELS)} (all Whisper tiny.en).", "model", "model_not_found", 404)
        language = _form_str(form, "language")
        if language not in (None, "", "en"):
            raise _bad(f"Unsupported language {language[:20]!r}: the Whisper model here (tiny.en) transcribes "
                       f"English only ('en').", "language", "unsupported_value")
        fmt = _form_str(form, "response_format", "json")
        if fmt not in TRANSCRIPTION_FORMATS:
            raise _bad(f"Invalid value for 'response_format': must be one of {', '.join(TRANSCRIPTION_FORMATS)}, "
                       f"got {fmt[:40]!r}.", "response_format")
        stream = _bool(_form_str(form, "stream"), "stream")
        if stream and fmt not in ("json", "text"):
            raise _bad(f"Streaming ('stream': true) is for response_format json or text, not {fmt}.", "stream",
                       "unsupported_value")
        temperature = _form_str(form, "temperature")
        if temperature is not None:
            try:
                t = float(temperature)
            except ValueError:
                t = math.nan
            if not 0.0 <= t <= 1.0:
                raise _bad(f"Invalid value for 'temperature': must be a number from 0 to 1, got "
                           f"{temperature[:40]!r}.", "temperature")
        for g in form.getlist("timestamp_granularities[]"):
            if g != "segment":
                raise _bad(f"Unsupported timestamp granularity {str(g)[:20]!r}: only 'segment' (Whisper's 30 s "
                           f"windows) is available.", "timestamp_granularities[]", "unsupported_value")
        chunking = _form_str(form, "chunking_strategy")
        if chunking not in (None, "auto"):
            raise _bad("Only chunking_strategy 'auto' is supported.", "chunking_strategy", "unsupported_value")
        include = [str(v) for key in ("include[]", "include") for v in form.getlist(key)]
        for value in include:
            if value != "logprobs":
                raise _bad(f"Invalid value for 'include[]': only 'logprobs' is supported, got {value[:40]!r}.",
                           "include[]", "unsupported_value")
        if include and fmt != "json":
            raise _bad(f"'include[]': logprobs come with response_format json only, not {fmt}.", "include[]",
                       "unsupported_value")
        _form_str(form, "prompt")  # accepted (OpenAI clients send it); tiny.en's decoding here takes no prompt
        data = await upload.read()
        audio, duration = await asyncio.to_thread(decode_upload, data, upload.filename, upload.content_type)
    finally:
        await form.close()
    return TranscriptionRequest(audio, duration, fmt, stream, bool(include))


def _transcribe(request: Request, audio: np.ndarray) -> TranscriptionStream:
    try:
        return stage_of(request).transcriber.transcribe(audio)
    except TranscriptionError as exc:
        raise _bad(str(exc), "file", "invalid_audio_format") from None


async def _segments(request: Request, audio: np.ndarray) -> list[dict]:
    """Transcribe each 30 s window as its own row (they batch together); one segment per window with speech."""
    starts = [i for i in range(0, len(audio), WINDOW_SAMPLES) if i == 0 or len(audio) - i >= SAMPLE_RATE // 10]
    streams = [_transcribe(request, audio[i:i + WINDOW_SAMPLES]) for i in starts]
    try:
        texts = await asyncio.gather(*(s.result() for s in streams))
    finally:
        for s in streams:
            await s.aclose()
    segments = []
    for i, text, stream in zip(starts, texts, streams):
        text = text.strip()
        if not text:
            continue
        raw = text.encode()
        tokens = stream.logprobs or []
        segments.append({"id": len(segments), "seek": i * 100 // SAMPLE_RATE, "start": i / SAMPLE_RATE,
                         "end": min(len(audio), i + WINDOW_SAMPLES) / SAMPLE_RATE, "text": text,
                         "tokens": [t.id for t in tokens], "temperature": 0.0,
                         "avg_logprob": round(sum(t.logprob for t in tokens) / len(tokens), 5) if tokens else 0.0,
                         "compression_ratio": round(len(raw) / len(zlib.compress(raw)), 3),
                         "no_speech_prob": round(stream.no_speech_probs[0], 5)})  # (a window with text was decoded)
    return segments


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def subtitles(segments: list[dict], fmt: str) -> str:
    """SubRip (srt) or WebVTT (vtt) cues, one per segment."""
    sep = "," if fmt == "srt" else "."
    cues = [f"{_timestamp(s['start'], sep)} --> {_timestamp(s['end'], sep)}\n{s['text']}\n" for s in segments]
    if fmt == "srt":
        return "\n".join(f"{n}\n{cue}" for n, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)


def _sse(event: dict) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


async def _transcript_events(stream: TranscriptionStream, logprobs: bool):
    try:
        async for delta in stream:
            event = {"type": "transcript.text.delta", "delta": delta}
            yield _sse(event | {"logprobs": transcript_entries(stream.delta_logprobs)} if logprobs else event)
        done = {"type": "transcript.text.done", "text": stream.text or ""}
        yield _sse(done | {"logprobs": transcript_entries(stream.logprobs)} if logprobs else done)
    except TranscriptionError as exc:
        yield _sse({"type": "error", "error": {"message": str(exc), "type": "server_error", "param": None,
                                                "code": exc.code}})
    finally:
        await stream.aclose()


@endpoint
async def transcriptions(request: Request) -> Response:
    req = await _transcription_request(request)
    usage = {"type": "duration", "seconds": round(req.duration, 3)}
    if req.stream:
        return StreamingResponse(_transcript_events(_transcribe(request, req.audio), req.logprobs),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    if req.response_format in ("json", "text"):
        stream = _transcribe(request, req.audio)
        try:
            text = await unless_gone(request, stream.result())
        except TranscriptionError as exc:
            raise HTTPError(500, str(exc), exc.code, type="server_error") from None
        finally:
            await stream.aclose()
        if req.response_format == "text":
            return Response(text + "\n", media_type="text/plain")
        if req.logprobs:
            return json_response({"text": text, "logprobs": transcript_entries(stream.logprobs), "usage": usage})
        return json_response({"text": text, "usage": usage})
    try:
        segments = await unless_gone(request, _segments(request, req.audio))
    except TranscriptionError as exc:
        raise HTTPError(500, str(exc), exc.code, type="server_error") from None
    if req.response_format in ("srt", "vtt"):
        return Response(subtitles(segments, req.response_format), media_type="text/plain")
    return json_response({"task": "transcribe", "language": "english", "duration": round(req.duration, 3),
                          "text": " ".join(s["text"] for s in segments), "segments": segments, "usage": usage})


# ------------------------------------------------------------------------------------------------------- speech
@dataclass(slots=True)
class SpeechRequest:
    input: str
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"


def _speech_request(body: bytes) -> SpeechRequest:
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _bad("The request body is not valid JSON.", None, "invalid_json") from None
    if not isinstance(raw, dict):
        raise _bad("The request body must be a JSON object.", None, "invalid_json")
    unknown = sorted(set(raw) - SPEECH_FIELDS)
    if unknown:
        raise _bad(f"Unknown parameter: '{unknown[0]}'.", unknown[0], "unknown_parameter")
    for name in ("input", "model", "voice"):
        if raw.get(name) is None:
            raise _bad(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
    for name in ("input", "model", "response_format", "stream_format", "instructions"):
        if name in raw and raw[name] is not None and not isinstance(raw[name], str):
            raise _bad(f"Invalid type for '{name}': expected a string.", name, "invalid_type")
    text = raw["input"]
    if not text.strip():
        raise _bad("Invalid value for 'input': the text to speak is empty.", "input")
    if len(text) > MAX_SPEECH_INPUT_CHARS:
        raise _bad(f"Invalid value for 'input': must be at most {MAX_SPEECH_INPUT_CHARS} characters, got "
                   f"{len(text)}.", "input")
    if raw["model"] not in SPEECH_MODELS:
        raise _bad(f"The model '{raw['model'][:40]}' does not exist; speech models here: {', '.join(SPEECH_MODELS)} "
                   f"(all piper's joe-us voice).", "model", "model_not_found", 404)
    voice = raw["voice"]
    if isinstance(voice, dict) and set(voice) == {"id"}:
        voice = voice["id"]
    if not isinstance(voice, str):
        raise _bad("Invalid type for 'voice': expected a string or {\"id\": string}.", "voice", "invalid_type")
    if voice not in VOICES:
        raise _bad(f"Unknown voice {voice[:40]!r}: voices here are {', '.join(VOICES)} (OpenAI's names all speak "
                   f"with piper's joe-us voice).", "voice")
    fmt = raw.get("response_format") or "mp3"
    if fmt in UNWRITABLE_FORMATS:
        raise _bad(f"response_format '{fmt}' is not supported by this server: use one of "
                   f"{', '.join(SPEECH_FORMATS)}.", "response_format", "unsupported_value")
    if fmt not in SPEECH_FORMATS:
        raise _bad(f"Invalid value for 'response_format': must be one of {', '.join(SPEECH_FORMATS)}, got "
                   f"{fmt[:40]!r}.", "response_format")
    speed = raw.get("speed", 1.0)
    if speed is None:
        speed = 1.0
    if isinstance(speed, bool) or not isinstance(speed, (int, float)):
        raise _bad("Invalid type for 'speed': expected a number.", "speed", "invalid_type")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise _bad(f"Invalid value for 'speed': must be from {MIN_SPEED} to {MAX_SPEED}, got {speed}.", "speed")
    stream_format = raw.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise _bad(f"Invalid value for 'stream_format': must be 'audio' or 'sse', got {stream_format[:40]!r}.",
                   "stream_format")
    return SpeechRequest(text, fmt, float(speed), stream_format)


class EncodedSink:
    """The file soundfile writes into (its virtual I/O: read, write, seek, tell), handing out the bytes written since
    the last `take()`. A write landing in bytes already handed out (a header rewritten at close) cannot reach the
    client; the formats streamed here stay valid without it (see SpeechFormat)."""

    def __init__(self, drop_first_write: bool) -> None:
        self.buf, self.pos, self.sent = bytearray(), 0, 0
        self.drop_first_write = drop_first_write
        self.dropped = 0  # bytes of the left-out first write (offsets of later bytes shift by this much)

    def write(self, data) -> int:
        data = bytes(data)
        if self.drop_first_write:
            self.drop_first_write, self.dropped = False, len(data)
            self.pos += len(data)
            return len(data)
        at = self.pos - self.dropped
        if at >= 0:
            end = at + len(data)
            if end > len(self.buf):
                self.buf.extend(bytes(end - len(self.buf)))
            self.buf[at:end] = data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        size = len(self.buf) + self.dropped
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else size + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        at = max(0, self.pos - self.dropped)
        out = bytes(self.buf[at:] if n < 0 else self.buf[at:at + n])
        self.pos += len(out)
        return out

    def take(self) -> bytes:
        out = bytes(self.buf[self.sent:])
        self.sent = len(self.buf)
        return out


class SpeechEncoder:
    """pcm16 at SPEECH_RATE in, the response format's bytes out, chunk by chunk (`close()` returns the rest)."""

    def __init__(self, fmt: SpeechFormat) -> None:
        self.fmt = fmt
        self.sink = self.file = None
        self.header = fmt.header
        if fmt.container is not None:
            self.sink = EncodedSink(fmt.drops_first_write)
            self.file = sf.SoundFile(self.sink, "w", SPEECH_RATE, 1, fmt.subtype, format=fmt.container)

    def encode(self, pcm: bytes) -> bytes:
        if self.file is None:
            out, self.header = self.header + pcm, b""
            return out
        self.file.write(np.frombuffer(pcm, "<i2"))
        return self.sink.take() if self.fmt.streams else b""

    def discard(self) -> None:
        """Release the encoder (a response cut short never calls `close`)."""
        if self.file is not None and not self.file.closed:
            with contextlib.suppress(Exception):
                self.file.close()

    def close(self) -> bytes:
        if self.file is None:
            return b""
        self.file.close()
        if not self.fmt.streams:
            return bytes(self.sink.buf)
        return self.sink.take()


async def _speech_chunks(job, encoder: SpeechEncoder):
    """Encoded bytes as the TTS makes the audio; the job is dropped if the client goes away."""
    try:
        async for pcm in job.chunks():
            out = await asyncio.to_thread(encoder.encode, pcm)
            if out:
                yield out
        out = await asyncio.to_thread(encoder.close)
        if out:
            yield out
    finally:
        job.cancel()
        encoder.discard()


async def _speech_events(chunks):
    try:
        async for out in chunks:
            yield _sse({"type": "speech.audio.delta", "audio": base64.b64encode(out).decode("ascii")})
        yield _sse({"type": "speech.audio.done"})
    except TTSError as exc:
        yield _sse({"type": "error", "error": {"message": str(exc), "type": "server_error", "param": None,
                                                "code": exc.code}})
    finally:
        await chunks.aclose()


async def _first_then_rest(chunks):
    """Wait for the first chunk before answering, so a synthesis error is still an HTTP error, not a cut body."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = b""
    except TTSError as exc:
        await chunks.aclose()
        raise HTTPError(500, str(exc), exc.code, type="server_error") from None

    async def body():
        try:
            if first:
                yield first
            async for out in chunks:
                yield out
        finally:
            await chunks.aclose()
    return body()


@endpoint
async def speech(request: Request) -> Response:
    req = _speech_request(await read_capped(request, MAX_SPEECH_BODY_BYTES,
                                                       f"this endpoint's limit of {MAX_SPEECH_BODY_BYTES} bytes"))
    stage = stage_of(request)
    fmt = SPEECH_FORMATS[req.response_format]
    encoder = SpeechEncoder(fmt)
    job = stage.say(req.input, AudioFormat("pcm16", SPEECH_RATE), req.speed, SpeechClock(pace=HTTP_SPEECH_PACE))
    chunks = _speech_chunks(job, encoder)
    if req.stream_format == "sse":
        return StreamingResponse(_speech_events(chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return StreamingResponse(await _first_then_rest(chunks), media_type=fmt.media_type)


# ------------------------------------------------------------------------------------- chat input_audio parts
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "pcm16")  # OpenAI's are wav and mp3; pcm16 is 24 kHz raw


async def input_audio_to_text(request: Request, body: bytes) -> bytes:
    """A chat body whose user `input_audio` parts are replaced by text parts holding their transcripts (the shared
    Whisper worker; the parts are transcribed together), so the rest of the chat path sees text. Bodies that are not
    JSON objects are left to the request models to refuse."""
    if b'"input_audio"' not in body:
        return body
    try:
        raw = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    messages = raw.get("messages") if isinstance(raw, dict) else None
    if not isinstance(messages, list):
        return body
    parts, audios = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) and m.get("role") == "user" else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") == "input_audio":
                parts.append(part)
                audios.append(await _input_audio(part, f"messages[{i}].content[{j}]"))
    if not parts:
        return body
    streams = [_transcribe(request, a) for a in audios]
    try:
        texts = await asyncio.gather(*(s.result() for s in streams))
    except TranscriptionError as exc:
        raise HTTPError(500, str(exc), exc.code, type="server_error") from None
    finally:
        for s in streams:
            await s.aclose()
    for part, text in zip(parts, texts):
        part.clear()
        part.update({"type": "text", "text": text.strip()})
    return orjson.dumps(raw)


async def _input_audio(part: dict, param: str) -> np.ndarray:
    unknown = sorted(set(part) - {"type", "input_audio"})
    if unknown:
        raise _bad(f"Unknown parameter: '{param}.{unknown[0]}'.", f"{param}.{unknown[0]}", "unknown_parameter")
    spec, param = part.get("input_audio"), f"{param}.input_audio"
    if not isinstance(spec, dict):
        raise _bad(f"Invalid type for '{param}': expected an object with `data` and `format`.", param, "invalid_type")
    unknown = sorted(set(spec) - {"data", "format"})
    if unknown:
        raise _bad(f"Unknown parameter: '{param}.{unknown[0]}'.", f"{param}.{unknown[0]}", "unknown_parameter")
    fmt, data = spec.get("format"), spec.get("data")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise _bad(f"Invalid value for '{param}.format': must be one of {', '.join(INPUT_AUDIO_FORMATS)}, got "
                   f"{str(fmt)[:40]!r}.", f"{param}.format")
    if not isinstance(data, str):
        raise _bad(f"Invalid type for '{param}.data': expected a base64 string.", f"{param}.data", "invalid_type")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise _bad(f"Invalid value for '{param}.data': not valid base64.", f"{param}.data") from None
    try:
        audio, _ = await asyncio.to_thread(decode_upload, raw, f"audio.{'pcm' if fmt == 'pcm16' else fmt}", None)
    except HTTPError as exc:
        exc.param = f"{param}.data"
        raise
    return audio
