"""``Transcriber``: one shared Whisper worker thread for all sessions, like an inference engine.

Sessions submit 16 kHz segments from the event loop. The worker runs Whisper's decoder with continuous batching:
between decoder steps it admits every segment that has arrived (log-mel + encoder for those at once, over the
longest one's length plus padding, not the full 30 s window), and they join the rows already decoding, so
transcriptions that start at different moments share their steps. Each row streams append-only text deltas back to
its request's asyncio queue.  Segments longer than 30 s are transcribed window by window (each window a row that
joins after the previous one ends).  A consumer that goes away (cancelled, ``aclose``, garbage collected) flags its
request, and the worker drops the row before the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

import kernels
from kernels import settings

from .whisper import SAMPLE_RATE, WINDOW_SAMPLES, TokenLogprob, WhisperModel, get_whisper

log = logging.getLogger(__name__)

MIN_SAMPLES = SAMPLE_RATE // 100  # 10 ms: anything shorter is not a segment


class TranscriptionError(RuntimeError):
    """A transcription request failed (bad input, model error, worker stopped)."""

    code = "transcription_failed"


@dataclass(slots=True)
class TranscriberStats:
    """What the worker has done; ``rtf`` = compute seconds per second of audio. ``batches`` / ``batch_sizes`` count
    encoder batches (segments admitted together); ``decode_rows`` / ``decode_steps`` is the mean decoder batch."""

    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    batches: int = 0
    max_batch: int = 0
    batch_sizes: Counter = field(default_factory=Counter)
    decode_steps: int = 0
    draft_tokens: int = 0  # drafts' tokens checked (`Transcriber.transcribe`'s draft), and those kept
    draft_accepted: int = 0
    decode_rows: int = 0
    max_decode_rows: int = 0
    encoder_seconds: float = 0.0
    decoder_seconds: float = 0.0
    audio_seconds: float = 0.0

    @property
    def rtf(self) -> float:
        return (self.encoder_seconds + self.decoder_seconds) / self.audio_seconds if self.audio_seconds else 0.0

    def snapshot(self) -> dict:
        return {
            "requests": self.requests, "completed": self.completed, "cancelled": self.cancelled,
            "failed": self.failed, "batches": self.batches, "max_batch": self.max_batch,
            "batch_sizes": dict(sorted(self.batch_sizes.items())),
            "decode_steps": self.decode_steps, "decode_rows": self.decode_rows,
            "max_decode_rows": self.max_decode_rows,
            "draft_tokens": self.draft_tokens, "draft_accepted": self.draft_accepted,
            "encoder_seconds": round(self.encoder_seconds, 4), "decoder_seconds": round(self.decoder_seconds, 4),
            "audio_seconds": round(self.audio_seconds, 3), "rtf": round(self.rtf, 4),
        }


@dataclass(slots=True, eq=False)
class _Request:
    id: int
    windows: list[np.ndarray]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    window: int = 0
    text_done: str = ""  # transcript of finished windows
    heard: float | None = None  # Whisper's certainty of the last window's ending (WhisperModel.heard_ending)
    draft: list | None = None  # tokens the transcript probably starts with (its first window's; Decoder.add)
    draft_out: list | None = None  # once done: a draft for the same speech continued (WhisperModel.draft_of)
    # the tokens decoded so far, every window's, with their logprobs (WhisperModel.token_logprobs); None once a loop
    # was cut back (Decoder.cut)
    logprobs: list[TokenLogprob] | None = field(default_factory=list)
    unsent: list[TokenLogprob] = field(default_factory=list)  # tokens taken whose text no delta has carried yet
    no_speech: list[float] = field(default_factory=list)  # per window decoded: Whisper's no-speech probability
    emitted: str = ""  # text already sent as deltas
    cancelled: bool = False
    finished: bool = False

    def send(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            self.cancelled = True


class TranscriptionStream:
    """Async iterator of append-only text deltas; ``text`` is the full transcript once done."""

    def __init__(self, req: _Request) -> None:
        self._req = req
        self.text: str | None = None
        self.heard: float | None = None  # once done: how sure Whisper was of the transcript's ending (None: unknown)
        # once done: a draft for a transcription of the same speech continued (`Transcriber.transcribe`'s `draft`)
        self.draft: list[int] | None = None
        # once done: the transcript's tokens with their logprobs (None: not known, a decoding loop was cut)
        self.logprobs: list[TokenLogprob] | None = None
        # the tokens of the delta last returned, with their logprobs (the text a token adds may come a delta later)
        self.delta_logprobs: list[TokenLogprob] = []
        # once done: per 30 s window, the probability Whisper gave <|nocaptions|> right after SOT (its
        # `no_speech_prob`; a window over the decoder's threshold ends with no text)
        self.no_speech_probs: list[float] = []

    def __aiter__(self) -> "TranscriptionStream":
        return self

    async def __anext__(self) -> str:
        if self.text is not None:
            raise StopAsyncIteration
        try:
            item = await self._req.queue.get()
        except BaseException:
            self._req.cancelled = True  # CancelledError and friends: drop the request
            raise
        if isinstance(item, BaseException):
            self.text = ""
            raise item
        if item[0] == "final":  # ("final", text, heard, draft, logprobs, no_speech_probs)
            _, self.text, self.heard, self.draft, self.logprobs, self.no_speech_probs = item
            raise StopAsyncIteration
        _, delta, self.delta_logprobs = item  # ("delta", text, its tokens' logprobs)
        return delta

    async def aclose(self) -> None:
        self._req.cancelled = True

    async def result(self) -> str:
        """Drain the deltas and return the full transcript."""
        async for _ in self:
            pass
        return self.text or ""

    def __del__(self) -> None:
        self._req.cancelled = True


class Transcriber:
    """Shared batched Whisper worker.  Create once per process; ``close()`` on shutdown."""

    def __init__(self, model: WhisperModel | None = None, max_batch: int = 16,
                 batch_wait_s: float = 0.0, threads: int | None = None) -> None:
        self._model = model
        # Intra-op threads ($RTSERVE_WHISPER_THREADS, default one): beside the LLM engine and the TTS threads on a
        # small CPU, a Whisper turn with two threads stalls at every parallel op waiting for the other thread; and a
        # second OpenMP team beside the engine's (more OpenMP threads than CPUs) makes libgomp throttle every team's
        # spin-waits, the engine's included, even while this one is idle (docs/benchmarks-history.md, Voice, "Tried
        # this session").
        self.threads = settings.integer("RTSERVE_WHISPER_THREADS") if threads is None else threads
        self.max_batch = max_batch
        # After an idle wake-up, wait this long for company. No wait by default: an encoder pass costs the same per clip
        # in a batch as alone (`rtserve bench whisper --batches`), and a segment arriving meanwhile is encoded right
        # after it and joins the rows decoding, so waiting would only delay the first one.
        self.batch_wait_s = batch_wait_s
        self.stats = TranscriberStats()
        self._pending: list[_Request] = []
        self._active: list[_Request] = []
        self._admitting: list[_Request] = []  # taken from _pending, being encoded: not yet in _active
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._closed = False
        self.loaded = threading.Event()  # set once the worker's model load ended (a failure is reported per request)
        self._thread = threading.Thread(target=self._run, name="rtserve-transcriber", daemon=True)
        self._thread.start()

    @property
    def model(self) -> WhisperModel:
        if self._model is None:
            self._model = get_whisper()
        return self._model

    # ---- public API (event loop side)
    def transcribe(self, audio_16k: np.ndarray, draft: list[int] | None = None) -> TranscriptionStream:
        """Queue a 16 kHz mono segment; iterate the result for deltas (call from the event loop). ``draft``: the
        tokens its transcript probably starts with (the ``draft`` of an earlier transcription of the same speech, cut
        shorter), which the decoder checks in one pass instead of a step per token; the transcript is the same."""
        audio = self._validate(audio_16k)
        if self._closed:
            raise TranscriptionError("transcriber is closed")
        windows = [audio[i : i + WINDOW_SAMPLES] for i in range(0, len(audio), WINDOW_SAMPLES)]
        if len(windows) > 1 and len(windows[-1]) < MIN_SAMPLES:
            windows.pop()
        req = _Request(next(self._ids), windows, asyncio.get_running_loop(), asyncio.Queue(),
                       draft=list(draft) if draft else None)
        with self._cv:
            self.stats.requests += 1
            self._pending.append(req)
            self._cv.notify()
        return TranscriptionStream(req)

    @property
    def inflight(self) -> int:
        """Requests queued, being encoded or being decoded (approximate: read without the worker's lock)."""
        return len(self._pending) + len(self._admitting) + len(self._active)

    async def transcribe_text(self, audio_16k: np.ndarray) -> str:
        return await self.transcribe(audio_16k).result()

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    @staticmethod
    def _validate(audio) -> np.ndarray:
        a = np.asarray(audio)
        if a.dtype == np.int16:
            a = a.astype(np.float32) / 32768.0
        if a.ndim != 1 or a.dtype.kind != "f":
            raise TranscriptionError(f"audio must be 1-D float32 (or int16) at 16 kHz, got {a.dtype} {a.shape}")
        if len(a) < MIN_SAMPLES:
            raise TranscriptionError(f"audio segment too short ({len(a)} samples at 16 kHz)")
        a = a.astype(np.float32)
        if not np.isfinite(a).all():
            raise TranscriptionError("audio contains NaN or infinite samples")
        return a

    # ---- worker thread
    def _run(self) -> None:
        kernels.set_thread_count(self.threads)
        try:
            self.model  # load at start-up, off the event loop
        except Exception:  # noqa: BLE001 - reported to each request by _admit
            log.exception("loading Whisper failed")
        finally:
            self.loaded.set()
        decoder = None
        while True:
            with self._cv:
                idle = not (self._pending or self._active)
                while not self._closed and not (self._pending or self._active):
                    self._cv.wait()
                if self._closed:
                    break
            if idle and self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)  # requests of one tick (several sessions) share an encoder batch
            with self._cv:
                room = self.max_batch - len(self._active)
                new, self._pending = self._pending[:room], self._pending[room:]
                self._admitting = new
            new = [r for r in new if not self._drop_if_cancelled(r)]
            for r in [r for r in self._active if r.cancelled]:
                self._drop_if_cancelled(r)
                decoder.drop(r)
                self._active.remove(r)
            try:
                if decoder is None:
                    decoder = self.model.decoder()
                if new:
                    self._admit(decoder, new)
            except Exception as exc:  # noqa: BLE001 - these requests learn of the failure; the rows decoding go on
                self._fail(new, exc)
            finally:
                self._admitting = []
            try:
                if self._active:
                    self._step(decoder)
            except Exception as exc:  # noqa: BLE001 - every request in the decoder learns of the failure
                self._fail(self._active, exc)
                self._active, decoder = [], None
        for r in self._active + self._pending:
            r.send(TranscriptionError("transcriber closed"))

    def _fail(self, requests: list[_Request], exc: Exception) -> None:
        log.error("transcription failed: %s", exc, exc_info=exc)
        for r in requests:
            self.stats.failed += 1
            r.cancelled = True
            r.send(TranscriptionError(f"transcription failed: {exc}"))

    def _drop_if_cancelled(self, r: _Request) -> bool:
        if r.cancelled and not r.finished:
            self.stats.cancelled += 1
        return r.cancelled

    def _admit(self, decoder, batch: list[_Request]) -> None:
        """Encode the next window of each request at once; its rows join the decoder."""
        model = self.model
        audios = [r.windows[r.window] for r in batch]
        t0 = time.perf_counter()
        enc = model.encode_clips(audios)
        self.stats.encoder_seconds += time.perf_counter() - t0
        self.stats.audio_seconds += sum(len(a) for a in audios) / SAMPLE_RATE
        self.stats.batches += 1
        self.stats.batch_sizes[len(batch)] += 1
        self.stats.max_batch = max(self.stats.max_batch, len(batch))
        drafts = [r.draft if r.window == 0 and len(r.windows) == 1 else None for r in batch]
        decoder.add(enc, batch, [model.max_tokens_for(len(a)) for a in audios], drafts=drafts)
        self._active += batch

    def _step(self, decoder) -> None:
        model = self.model
        t0 = time.perf_counter()
        rows = len(decoder.rows)
        checked, agreed = decoder.draft_tokens, decoder.draft_accepted
        produced = decoder.step()
        self.stats.draft_tokens += decoder.draft_tokens - checked
        self.stats.draft_accepted += decoder.draft_accepted - agreed
        self.stats.decoder_seconds += time.perf_counter() - t0
        self.stats.decode_steps += 1
        self.stats.decode_rows += rows
        self.stats.max_decode_rows = max(self.stats.max_decode_rows, rows)
        for r, p_none in decoder.no_speech.items():  # rows that read SOT (most produce no token in that step)
            r.no_speech.append(p_none)
        for r, tokens, done in produced:
            # the tokens the row took this step, with their logprobs: for the transcript's list, and for the delta
            # that will carry their text
            if r in decoder.cut:  # the tokens no longer line up with their logprobs
                r.logprobs = None
            elif taken := decoder.taken.get(r):
                new = model.token_logprobs(tokens[-len(taken):], taken)
                r.unsent += new
                if r.logprobs is not None:
                    r.logprobs += new
            text = r.text_done + model.detokenize(tokens)
            if done:
                r.text_done = text
                r.heard, r.draft_out = decoder.heard.get(r), model.draft_of(tokens)
                r.window += 1
                self._active.remove(r)
                if r.window < len(r.windows) and not r.cancelled:  # its next window joins at the next admission
                    with self._cv:
                        self._pending.insert(0, r)
                    self._stream(r, text, final=False)
                    continue
                if not r.cancelled:
                    r.finished = True
                    self.stats.completed += 1
                else:
                    self._drop_if_cancelled(r)
            self._stream(r, text, final=done)

    @staticmethod
    def _stream(r: _Request, text: str, final: bool) -> None:
        """Send the new suffix of ``text`` (append-only; waits out a half-decoded UTF-8 char)."""
        text = text.strip()  # trailing space is held back until the next word arrives
        if not final and text.endswith("\ufffd"):
            return
        if text.startswith(r.emitted) and len(text) > len(r.emitted):
            r.send(("delta", text[len(r.emitted) :], r.unsent))
            r.emitted, r.unsent = text, []
        if final:
            r.send(("final", text, r.heard, r.draft_out, r.logprobs, r.no_speech))
