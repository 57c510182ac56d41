"""A semantic end of turn: end a turn at a short silence when it sounds and reads complete, not only after the VAD's
whole silence window.

At a pause of `Eagerness.min_silence_ms` inside a turn, two signals score the turn so far:
- the engine's P(end of turn | transcript): the logprob of the chat template's end-of-turn token right after the user's
  last word, jointly with the punctuation Whisper put before it, which the pause's speculative prefill
  (speculation.py) computes in its own forward pass (`SamplingParams.prompt_logprob_positions`); and from the same
  distribution, after the last word, P(a sentence ends there): its sentence-end tokens (".", "?", "!", the end-of-turn
  token) summed over its top logprobs (`SamplingParams.prompt_logprobs`), whatever Whisper wrote; both given that the
  user's last word is over (`at_word_end`);
- Smart Turn v3.2 (audio/smart_turn.py), P(complete) from the prosody of the last 8 s of audio.

`combine` turns them into one probability; Smart Turn is only asked where its score can change the outcome
(`audio_matters`). The eagerness's threshold falls as the pause's silence grows (re-checked
as it does): once the probability clears it, the turn ends there (an early end); otherwise it ends when the VAD's
window runs out, as before. Why this rule (docs/gateway.md, "Semantic end of turn"):
the text signal knows that "What is the capital of" is unfinished whatever the voice does, while Smart Turn hears
falling pitch, which synthetic voices put at the end of every phrase; so the text signal leads and can veto, and the
audio signal only moves a borderline text score. The joint text score also vetoes complete turns: a statement the
model expects more after ("I am feeling tired today."), or a misheard word ("who wrote Romito and Juliet", no "?").
So a second way ends a turn: both signals agree that a sentence can end here, P(sentence end) × Smart Turn, where
neither alone suffices (each fails on the other's cases: Whisper's invented endings on cut utterances sound unfinished,
and "What is the capital of" never reads as a sentence end). And a third, late in the window only: when Whisper is sure
of the sentence end it heard (`HEARD_SURE`), Smart Turn at a tenth of its weight (`LATE_AUDIO_WEIGHT`), which clears
the falling threshold only after ~500 ms of silence. The text model's veto reads the transcript, and where the
transcript is misheard ("What colors the sky?", P(sentence end) 0) or the model expects more after a finished
question ("How do I make pancakes?"), it would hold a turn that sounds and was heard finished to the window.

A turn that ended early and goes on within `REPAIR_GRACE_MS` is repaired (audio_in.py, session.py): the reply is
cancelled and the new speech joins the same user item.
"""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from audio.stage import AudioStage
from gateway.metrics import Metrics
from gateway.realtime.session_config import SERVER_VAD_EAGERNESS
from gateway.realtime.trace import trace

log = logging.getLogger("rtserve.voice")

Span = tuple[int, int]  # (speech start, silence start): ms on the input timeline


@dataclass(slots=True, frozen=True)
class Eagerness:
    """How soon a turn may end early. From `min_silence_ms` of silence on, a pause ends the turn when `combine`
    reaches the threshold, which falls as the silence grows: `threshold` at the shortest silence, linearly down to
    `floor` at the VAD's window (semantic_vad: `audio.vad.SEMANTIC_EAGERNESS_MS`; server_vad: its
    `silence_duration_ms`), where the turn ends whatever the scores say. A sure turn end is taken at once; a
    doubtful one only after a longer silence has made it likelier."""
    min_silence_ms: int
    threshold: float
    floor: float

    def threshold_at(self, silence_ms: float, window_ms: int) -> float:
        """The threshold after `silence_ms` of silence (the VAD's window being `window_ms`)."""
        span = max(1.0, window_ms - self.min_silence_ms)
        frac = min(1.0, max(0.0, (silence_ms - self.min_silence_ms) / span))
        return self.threshold + (self.floor - self.threshold) * frac


# Tuned on `rtserve bench turn`'s utterances, three dumps of their scores with piper's noise drawn anew
# (docs/benchmarks.md): the joint text score of a pause cut mid-clause stays far below a complete turn's, so a low floor
# is safe late in the window, and the veto (TEXT_VETO), not the threshold at the shortest silence, is what keeps those
# pauses from ending turns; a lower veto let them through, a lower threshold did not.
EAGERNESS = {"high": Eagerness(100, 0.1, 0.05), "medium": Eagerness(150, 0.15, 0.05),
             "auto": Eagerness(150, 0.15, 0.05), "low": Eagerness(250, 0.5, 0.1)}
TEXT_WEIGHT = 0.8  # the engine's signal's share of the combined probability; Smart Turn has the rest
TEXT_VETO = 0.05  # below this P(end of turn | transcript) no early end, whatever the audio says (but see HEARD_SURE)
# Whisper this sure of the sentence end it heard (`WhisperModel.heard_ending`) lets Smart Turn end the turn late on its
# own, at LATE_AUDIO_WEIGHT of its score: under every eagerness's threshold at its shortest silence (high's is reached
# only by a certain Smart Turn), so the turns it ends, it ends later in the window. Tuned on `rtserve bench turn`'s
# dumps (docs/benchmarks.md): a weight of 0.11 ended cut utterances that are questions themselves ("Can you explain
# how"), 0.1 none.
HEARD_SURE = 0.9
LATE_AUDIO_WEIGHT = 0.1
WORD_END_MIN = 0.1  # at_word_end raises a probability tenfold at most, when the model is sure the word goes on
REPAIR_GRACE_MS = 1000  # speech resuming this soon after an early end's segment end continues the same turn


def policy(turn: dict | None) -> Eagerness | None:
    """The session's early-end policy: semantic_vad's eagerness, or server_vad with `rtserve_eagerness` set; None
    keeps the fixed silence window."""
    if turn is None:
        return None
    if turn["type"] == "semantic_vad":
        return EAGERNESS[turn.get("eagerness") or "auto"]
    key = turn.get(SERVER_VAD_EAGERNESS)
    return EAGERNESS[key] if key else None


def sentence_end_probability(top_logprobs, sentence_end_ids: frozenset[int]) -> float:
    """P(a sentence ends after the user's words): the sentence-end tokens' share of the top (token id, logprob) pairs
    the prefill returned right after them (those outside the top count as 0)."""
    return min(1.0, sum(math.exp(lp) for tok, lp in top_logprobs if tok in sentence_end_ids))


def word_end_probability(top_logprobs, continuation_ids: frozenset[int]) -> float:
    """P(the user's last word ends where Whisper ended it), as the prefill reads it: 1 − the share of the top
    (token id, logprob) pairs right after it that would go on with the word (response.word_continuation_ids), no lower
    than WORD_END_MIN."""
    goes_on = sum(math.exp(lp) for tok, lp in top_logprobs if tok in continuation_ids)
    return max(WORD_END_MIN, 1.0 - goes_on)


def at_word_end(p: float | None, p_word_end: float | None) -> float | None:
    """`p`, the probability of something that follows the user's last word (the end-of-turn token, a sentence end),
    given that the word is over. Whisper heard a whole word and then silence, so the model's mass on the word going on
    ("Romeo and Juliet" -> "te") is no reason to doubt the end: without this, a name the model knows a longer
    spelling of reads as unfinished."""
    return p if p is None or p_word_end is None else min(1.0, p / p_word_end)


def combine(p_text: float | None, p_audio: float | None, p_sentence_end: float | None = None,
            p_heard: float | None = None) -> float:
    """P(the turn is over) from both signals: the text score weighted with the audio's, 0 without the text signal
    (audio alone ends no turn early: synthetic and flat voices fool it) or when the text vetoes; or, if higher, the
    two signals' agreement, P(sentence end) × P(audio complete). Both text scores are read from Whisper's transcript,
    so each counts only as far as Whisper heard its ending (`p_heard`, `WhisperModel.heard_ending`): an ending it
    guessed in the silence is no evidence that the turn is over. Where Whisper is sure of the sentence end it heard
    (`HEARD_SURE`), the audio alone counts too, at LATE_AUDIO_WEIGHT: enough to end a turn late in the window, not at
    the shortest silence (eagerness high, whose threshold starts at the weight, may end it soon after)."""
    late = LATE_AUDIO_WEIGHT * p_audio if p_audio is not None and p_heard is not None and p_heard >= HEARD_SURE \
        else 0.0
    if p_heard is not None:
        p_text = None if p_text is None else p_text * p_heard
        p_sentence_end = None if p_sentence_end is None else p_sentence_end * p_heard
    agree = max(p_sentence_end * p_audio if p_sentence_end is not None and p_audio is not None else 0.0, late)
    if p_text is None or p_text < TEXT_VETO:
        return agree
    if p_audio is None:
        return p_text
    return max(TEXT_WEIGHT * p_text + (1.0 - TEXT_WEIGHT) * p_audio, agree)


def audio_matters(p_text: float | None, policy: Eagerness, p_sentence_end: float | None = None,
                  p_heard: float | None = None) -> bool:
    """Whether Smart Turn's score can change when, or whether, a pause with these text scores ends the turn early:
    not when the combination clears the shortest silence's threshold whatever the audio says, and not when it stays
    below the floor whatever the audio says (the text vetoes and no sentence can end here, mostly). (`early_end_ms`
    falls as the probability rises, and `combine` rises with the audio's, so the two ends of the audio's range
    decide.) Most pauses are one of the two, and the Smart Turn call is skipped there."""
    most = combine(p_text, 1.0, p_sentence_end, p_heard)  # (the floor itself is reached only at the window)
    return combine(p_text, 0.0, p_sentence_end, p_heard) < policy.threshold and \
        (most > policy.floor or most >= policy.threshold)


def early_end_ms(p: float, policy: Eagerness, window_ms: int) -> float | None:
    """The shortest silence (ms) after which a pause whose combined probability is `p` ends the turn early (the
    falling threshold reaches `p`); None: not before the window."""
    if p >= policy.threshold:
        at = float(policy.min_silence_ms)
    elif p >= policy.floor and policy.threshold > policy.floor:
        at = policy.min_silence_ms + (policy.threshold - p) / (policy.threshold - policy.floor) * \
            max(1, window_ms - policy.min_silence_ms)
    else:
        return None
    return at if at < window_ms else None


@dataclass(slots=True)
class Verdict:
    span: Span
    p_text: float | None = None
    p_sentence_end: float | None = None
    p_heard: float | None = None
    p_audio: float | None = None
    text_done: bool = False
    audio_done: bool = False
    silence_ms: float = 0.0  # the pause's silence so far, once it has lasted the policy's shortest silence
    window_ms: int = 0  # the VAD's silence window, where the turn ends anyway
    checked: bool = False  # scored against the threshold at least once (counted once per pause)
    decided: bool = False  # ended the turn


class TurnDetector:
    """One session's end-of-turn checks. `start` at a pause (with the turn's audio so far), `text_scored` when the
    pause's prefill returns its end-of-turn logprob, `silence_reached` when the pause lasts the policy's shortest
    silence and again as it grows; once all three are in, `end_turn(span)` is called as soon as the combination
    clears the threshold for the silence so far. `drop` when the user goes on.

    Smart Turn runs only after the text score, and only where it can change the outcome (`audio_matters`): at most
    pauses the text alone settles it, and its call would take a CPU from Whisper and the prefill of the other
    sessions' turns ending at the same moment."""

    def __init__(self, stage: AudioStage, end_turn: Callable[[Span], None], name: str, metrics: Metrics) -> None:
        self.stage, self._end_turn, self.name, self.metrics = stage, end_turn, name, metrics
        self.policy: Eagerness | None = None
        self._verdict: Verdict | None = None
        self._audio_task: asyncio.Task | None = None
        self._audio: np.ndarray | None = None  # the pausing turn's audio, for Smart Turn if the text leaves it open

    def start(self, span: Span, audio_16k: np.ndarray, policy: Eagerness | None) -> None:
        self.drop()
        self.policy = policy
        if policy is None:
            return
        self._verdict = Verdict(span)
        self._audio = audio_16k

    async def _score_audio(self, verdict: Verdict, audio_16k: np.ndarray) -> None:
        try:
            verdict.p_audio = await self.stage.score_turn(audio_16k)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the text signal alone still decides
            log.exception("session %s: smart turn failed", self.name)
        verdict.audio_done = True
        self._decide(verdict)

    def text_scored(self, span: Span, logprob: float | None, p_sentence_end: float | None = None,
                    p_heard: float | None = None) -> None:
        """The pause's prefill scored the text: the end-of-turn logprob (None: not scored) and P(a sentence ends
        after the words); with Whisper's certainty of the transcript's ending (None: unknown)."""
        verdict = self._verdict
        if verdict is None or verdict.span != span:
            return
        verdict.p_text = math.exp(logprob) if logprob is not None else None
        verdict.p_sentence_end, verdict.p_heard = p_sentence_end, p_heard
        verdict.text_done = True
        if audio_matters(verdict.p_text, self.policy, p_sentence_end, p_heard):
            self.metrics.turn_audio_scores.inc()
            self._audio_task = asyncio.create_task(self._score_audio(verdict, self._audio),
                                                   name=f"{self.name}-smart-turn")
        else:
            verdict.audio_done = True
        self._audio = None
        self._decide(verdict)

    def silence_reached(self, span: Span, silence_ms: float, window_ms: int) -> None:
        """The pause at `span` has lasted `silence_ms` (at least the policy's shortest silence) of the VAD's
        `window_ms`; called again as it grows, each time a re-check against the lower threshold."""
        verdict = self._verdict
        if verdict is None or verdict.span != span:
            return
        verdict.silence_ms, verdict.window_ms = silence_ms, window_ms
        self._decide(verdict)

    def _decide(self, verdict: Verdict) -> None:
        if verdict is not self._verdict or verdict.decided or not (
                verdict.text_done and verdict.audio_done and verdict.silence_ms > 0):
            return
        p = combine(verdict.p_text, verdict.p_audio, verdict.p_sentence_end, verdict.p_heard)
        at = early_end_ms(p, self.policy, verdict.window_ms)
        end = at is not None and verdict.silence_ms >= at
        if not verdict.checked:
            verdict.checked = True
            self.metrics.turn_checks.inc()
        trace(self.name, "end of turn check",
              (verdict.span, verdict.silence_ms, verdict.p_text, verdict.p_sentence_end, verdict.p_heard,
               verdict.p_audio, p, end))
        if end:
            verdict.decided = True
            self._end_turn(verdict.span)

    def drop(self) -> None:
        self._verdict = self._audio = None
        if self._audio_task is not None:
            self._audio_task.cancel()
            self._audio_task = None
