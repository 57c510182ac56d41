"""The work done inside a pause: a turn that may be ending is transcribed, and its reply decoded (and, for spoken
replies, its first pieces synthesized) before the VAD's silence window says the turn is over. Nothing is sent.

`Speculation` owns one session's pause work: the transcription of the pausing turn (keyed by its span on the input
timeline), which span the turn really ended on, and the reply decoded ahead (`Pregen`). When the pause becomes the
turn's end, the committed item takes that transcript (`take_transcript`) and the response takes the reply
(`take_reply`), which it adopts only if its own prompt and sampling are identical. When the user goes on, all of it is
dropped: the engine request is aborted and queued synthesis cancelled.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Awaitable, Callable

import numpy as np

from audio.stage import AudioStage
from audio.tts import SpeechClock, SpeechJob
from gateway.realtime.audio_out import SpeechPlan, drop_speech, sentence_chunker
from gateway.realtime.trace import trace
from gateway.realtime.turn_detection import at_word_end, sentence_end_probability, word_end_probability

log = logging.getLogger("rtserve.voice")

# Trailing VAD silence after which the turn so far is transcribed ahead of speech_stopped. Shorter gives the reply a
# longer head start, but also starts more work (a transcription, a decode, syntheses) on pauses inside a sentence
# that is thrown away when the user goes on.
SPECULATE_AFTER_MS = 60
SPECULATIVE_PIECES = 2  # pieces of a pregenerated reply synthesized before the turn is known to have ended

Span = tuple[int, int]  # (speech start, silence start): ms on the input timeline


class Speculation:
    """One session's pause work. `pregenerate(transcript)` starts the reply the session would give to that transcript;
    `reply_wanted(turn_ended)` says whether an automatic response is (or, once the turn ended, still is) coming for
    it: a reply decoded ahead is kept only then."""

    def __init__(self, stage: AudioStage, pregenerate: Callable[[str], Awaitable["Pregen | None"]],
                 reply_wanted: Callable[[bool], bool], name: str,
                 end_of_turn_scored: Callable[[Span, float | None, float | None, float | None], None] | None = None
                 ) -> None:
        self.stage, self._pregenerate, self._reply_wanted, self.name = stage, pregenerate, reply_wanted, name
        # gets the prefill's end-of-turn logprob and P(sentence end) for the pausing span, and Whisper's certainty of
        # the transcript's ending
        self._scored = end_of_turn_scored
        self._pending: tuple[Span, asyncio.Task] | None = None  # the pausing turn's transcription
        # (speech start, tokens): what the next transcription of the turn that started there will probably start
        # with: the last one's transcript less its last word (`Transcriber.transcribe`'s draft). A turn paused and went
        # on, so its next pause's transcription checks those tokens in one pass instead of a decoder step each.
        self._draft: tuple[int, list[int]] | None = None
        self._ended: Span | None = None  # the span whose transcription became the committed turn's
        self.pregen: Pregen | None = None  # the reply to that turn, decoding ahead

    def start(self, span: Span, audio_16k: np.ndarray) -> None:
        """A pause (AudioInput's `paused` event): transcribe the turn up to it, then start on the reply."""
        self.drop()

        async def run() -> tuple[str, list | None]:
            trace(self.name, "speculate", span)
            stream = self.stage.start().transcriber.transcribe(audio_16k, draft=self._draft_for(span[0]))
            text, heard = await stream.result(), stream.heard
            self._keep_draft(span[0], stream.draft)
            trace(self.name, "speculative transcript", (text, heard))
            if text.strip() and self._wants_reply(span):  # the LLM starts on it too, still during the pause
                try:
                    pre = await self._pregenerate(text)
                except Exception:  # noqa: BLE001 - only an optimization: the response will generate normally
                    log.exception("session %s: pregeneration failed", self.name)
                    pre = None
                if pre is not None and self._wants_reply(span) and self.pregen is None:
                    self.pregen = pre
                    self.stage.speculations["pregenerated"] += 1
                    if self._scored is not None and pre.eot_positions:
                        pre.on_end_of_turn(lambda logprob, p_end: self._scored(span, logprob, p_end, heard))
                elif pre is not None:
                    pre.cancel()
            return text, stream.logprobs
        self._pending = (span, asyncio.create_task(run(), name=f"{self.name}-speculate"))
        self._ended = None
        self.stage.speculations["started"] += 1

    def _draft_for(self, start_ms: int) -> list[int] | None:
        return self._draft[1] if self._draft is not None and self._draft[0] == start_ms else None

    def _keep_draft(self, start_ms: int, draft: list[int] | None) -> None:
        """A transcription of the turn that started at `start_ms` ended: its draft stands for the turn's next ones
        (a longer one replaces a shorter)."""
        if draft and not (self._draft is not None and self._draft[0] == start_ms and len(self._draft[1]) > len(draft)):
            self._draft = (start_ms, draft)

    def _wants_reply(self, span: Span) -> bool:
        """The pausing turn `span` is still current (or ended on this pause) and will get an automatic response."""
        if self._pending is not None and self._pending[0] == span:
            return self._reply_wanted(False)
        return self._ended == span and self._reply_wanted(True)

    def take_transcript(self, span: Span) -> asyncio.Task | None:
        """The turn ended on `span` (speech_stopped): its transcription (a task for the transcript and its tokens'
        logprobs), if this pause started it; else nothing speculated fits, and all of it is dropped."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == span:
            self.stage.speculations["used"] += 1
            self._ended = span
            return pending[1]
        if pending is not None:
            pending[1].cancel()
        self.drop_reply()
        return None

    def take_reply(self) -> "Pregen | None":
        pre, self.pregen = self.pregen, None
        return pre

    def drop(self) -> None:
        """The user went on (or the session ends): nothing done for the pause is used."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None
        self._ended = None
        self.drop_reply()

    def drop_reply(self) -> None:
        if self.pregen is not None:
            self.pregen.cancel()
            self.pregen = None


class Pregen:
    """A reply decoded ahead, buffered until a response adopts it (`stream()` replays, then follows live) or it is
    cancelled (the engine request is aborted, speculative synthesis dropped).

    With a `SpeechPlan`, the text is cut into pieces exactly as `AudioOutput` will cut it and the first
    SPECULATIVE_PIECES are synthesized as soon as they are complete; the adopting `AudioOutput` takes them
    (`take_speech`) and sends their audio without waiting for TTS."""

    def __init__(self, engine, request_id: str, prompt, sampling, speech: SpeechPlan | None = None,
                 eot_positions: list[int] | None = None, sentence_end_ids: frozenset[int] = frozenset(),
                 continuation_ids: frozenset[int] = frozenset(), **kwargs) -> None:
        self.request_id, self.prompt, self.sampling = request_id, prompt, sampling
        # the prompt positions of the turn's end after the user's words (response.end_of_turn_positions), scored by
        # the prefill (sampling.prompt_logprob_positions); their joint logprob goes to `on_end_of_turn` callbacks,
        # with P(a sentence ends after the words): the `sentence_end_ids` among the top logprobs at the first of them
        # (sampling.prompt_logprobs); both given that the user's last word is over (turn_detection.at_word_end, from
        # the `continuation_ids` there)
        self.eot_positions = list(eot_positions or [])
        self.sentence_end_ids, self.continuation_ids = sentence_end_ids, continuation_ids
        self.eot_logprob: float | None = None
        self.p_sentence_end: float | None = None
        self._eot_known = not self.eot_positions
        self._eot_callbacks: list[Callable[[float | None, float | None], None]] = []
        self.outputs: list = []
        self.finished = False
        self.error: BaseException | None = None
        self._wake = asyncio.Event()
        self._plan, self._speaking = speech, speech is not None
        self._chunker = sentence_chunker() if speech is not None else None
        self.clock = SpeechClock()  # the speculative pieces' timeline, handed to the adopting response
        self.spoken: list[SpeechJob] = []  # the synthesis of the first pieces, in piece order
        if speech is not None:
            speech.stage.awaiting_first_piece[request_id] = time.monotonic()
        self._task = asyncio.create_task(self._pump(engine.generate(request_id, prompt.ids, sampling, **kwargs)),
                                         name=f"{request_id}-pregen")

    def on_end_of_turn(self, callback: Callable[[float | None, float | None], None]) -> None:
        """Call `callback(logprob, p_sentence_end)` with the end-of-turn token's logprob and P(a sentence ends after
        the words) (None: the prefill did not score them) as soon as the prefill is done, or now if it is."""
        if self._eot_known:
            callback(self.eot_logprob, self.p_sentence_end)
        else:
            self._eot_callbacks.append(callback)

    def _end_of_turn(self, logprob: float | None, p_sentence_end: float | None = None) -> None:
        if self._eot_known:
            return
        self._eot_known, self.eot_logprob, self.p_sentence_end = True, logprob, p_sentence_end
        callbacks, self._eot_callbacks = self._eot_callbacks, []
        for callback in callbacks:
            callback(logprob, p_sentence_end)

    def _scores(self, logprobs: dict, top: dict | None) -> tuple[float | None, float | None]:
        """The end-of-turn positions' joint logprob and P(a sentence ends right after the user's words), from the top
        logprobs at the first scored position; both given that the last word is over (None: not scored)."""
        joint = sum(logprobs[i] for i in self.eot_positions) if all(i in logprobs for i in self.eot_positions) \
            else None
        first = top.get(self.eot_positions[0]) if top and self.eot_positions else None
        if first is None:
            return joint, None
        p_word_end = word_end_probability(first, self.continuation_ids)
        # at_word_end in logprobs: divided by P(the word is over), no higher than 1
        joint = min(0.0, joint - math.log(p_word_end)) if joint is not None else None
        return joint, at_word_end(sentence_end_probability(first, self.sentence_end_ids), p_word_end)

    def _first_piece_done(self) -> None:
        if self._plan is not None:
            self._plan.stage.awaiting_first_piece.pop(self.request_id, None)

    def _say(self, pieces: list[str]) -> None:
        plan = self._plan
        for piece in pieces:
            if not self._speaking or len(self.spoken) >= SPECULATIVE_PIECES:
                self._speaking = False
                return
            trace(self.request_id, "speculative piece", piece)
            self.spoken.append(plan.stage.say(piece, plan.fmt, plan.speed, self.clock))
            self._first_piece_done()

    async def _pump(self, gen) -> None:
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if not self.outputs:
                        trace(self.request_id, "pregen first token")
                    self.outputs.append(out)
                    self._wake.set()
                    if out.prompt_logprobs is not None:
                        self._end_of_turn(*self._scores(out.prompt_logprobs, out.prompt_top_logprobs))
                    if self._speaking and out.text_delta:
                        self._say(self._chunker.push(out.text_delta))
                    if self._speaking and out.finished:
                        self._say(self._chunker.flush())
        except Exception as exc:  # noqa: BLE001 - re-raised to the adopting response
            self.error = exc
        finally:
            self.finished = True
            self._end_of_turn(None)
            self._first_piece_done()
            self._wake.set()

    def matches(self, prompt, sampling) -> bool:
        a, b = self.sampling, sampling
        return prompt.ids == self.prompt.ids and (a.max_tokens, a.temperature, a.stop_token_ids,
                                                  a.structured_outputs) == \
            (b.max_tokens, b.temperature, b.stop_token_ids, b.structured_outputs)

    async def stream(self):
        i = 0
        try:
            while True:
                if i < len(self.outputs):
                    i += 1
                    yield self.outputs[i - 1]
                    continue
                if self.finished:
                    if self.error is not None:
                        raise self.error
                    return
                self._wake.clear()
                await self._wake.wait()
        finally:
            self.cancel()

    def take_speech(self, fmt, speed: float) -> list[SpeechJob]:
        """Hand the speculative synthesis to the adopting response (if it speaks in the same format and speed) and
        stop synthesizing; what is not handed over is dropped."""
        self._speaking = False
        self._first_piece_done()  # the adopting response's own wait takes over
        spoken, self.spoken = self.spoken, []
        plan = self._plan
        if plan is not None and (plan.fmt, float(plan.speed)) == (fmt, float(speed)):
            return spoken
        drop_speech(spoken)
        return []

    def cancel(self) -> None:
        self._speaking = False
        self._first_piece_done()
        drop_speech(self.spoken)
        self.spoken = []
        if not self._task.done():
            self._task.cancel()
