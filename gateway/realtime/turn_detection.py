"""A semantic end of turn: end a turn at a short silence when it sounds and reads complete, not only after the VAD's
whole silence window.

At a pause of `Eagerness.min_silence_ms` inside a turn, two signals score the turn so far:
- the engine's P(end of turn | transcript): the logprob of the chat template's end-of-turn token right after the user's
  last word, which the pause's speculative prefill (speculation.py) computes in its own forward pass
  (`SamplingParams.prompt_logprob_positions`);
- Smart Turn v3.2 (audio/smart_turn.py), P(complete) from the prosody of the last 8 s of audio.

`combine` turns them into one probability; at or above the eagerness's threshold the turn ends there (an early end),
otherwise it ends when the VAD's window runs out, as before. Why this rule (docs/gateway.md, "Semantic end of turn"):
the text signal knows that "What is the capital of" is unfinished whatever the voice does, while Smart Turn hears
falling pitch, which synthetic voices put at the end of every phrase; so the text signal leads and can veto, and the
audio signal only moves a borderline text score.

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
    """How soon a turn may end early: after `min_silence_ms` of silence, when `combine` reaches `threshold`. The
    VAD's window (semantic_vad: `audio.vad.SEMANTIC_EAGERNESS_MS`; server_vad: its `silence_duration_ms`) is the
    longest wait."""
    min_silence_ms: int
    threshold: float


EAGERNESS = {"high": Eagerness(150, 0.35), "medium": Eagerness(200, 0.5), "auto": Eagerness(200, 0.5),
             "low": Eagerness(250, 0.7)}
TEXT_WEIGHT = 0.8  # the engine's signal's share of the combined probability; Smart Turn has the rest
TEXT_VETO = 0.1  # below this P(end of turn | transcript) no early end, whatever the audio says
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


def combine(p_text: float | None, p_audio: float | None) -> float:
    """P(the turn is over) from both signals; 0 without the text signal (audio alone ends no turn early: synthetic and
    flat voices fool it) or when the text vetoes."""
    if p_text is None or p_text < TEXT_VETO:
        return 0.0
    if p_audio is None:
        return p_text
    return TEXT_WEIGHT * p_text + (1.0 - TEXT_WEIGHT) * p_audio


@dataclass(slots=True)
class Verdict:
    span: Span
    p_text: float | None = None
    p_audio: float | None = None
    text_done: bool = False
    audio_done: bool = False
    silence_reached: bool = False
    decided: bool = False


class TurnDetector:
    """One session's end-of-turn checks. `start` at a pause (with the turn's audio so far), `text_scored` when the
    pause's prefill returns its end-of-turn logprob, `silence_reached` when the pause lasts the policy's shortest
    silence; once all three are in, `end_turn(span)` is called if the combination clears the threshold. `drop` when
    the user goes on."""

    def __init__(self, stage: AudioStage, end_turn: Callable[[Span], None], name: str, metrics: Metrics) -> None:
        self.stage, self._end_turn, self.name, self.metrics = stage, end_turn, name, metrics
        self.policy: Eagerness | None = None
        self._verdict: Verdict | None = None
        self._audio_task: asyncio.Task | None = None

    def start(self, span: Span, audio_16k: np.ndarray, policy: Eagerness | None) -> None:
        self.drop()
        self.policy = policy
        if policy is None:
            return
        self._verdict = Verdict(span)
        self._audio_task = asyncio.create_task(self._score_audio(self._verdict, audio_16k),
                                               name=f"{self.name}-smart-turn")

    async def _score_audio(self, verdict: Verdict, audio_16k: np.ndarray) -> None:
        try:
            verdict.p_audio = await self.stage.score_turn(audio_16k)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the text signal alone still decides
            log.exception("session %s: smart turn failed", self.name)
        verdict.audio_done = True
        self._decide(verdict)

    def text_scored(self, span: Span, logprob: float | None) -> None:
        verdict = self._verdict
        if verdict is None or verdict.span != span:
            return
        verdict.p_text = math.exp(logprob) if logprob is not None else None
        verdict.text_done = True
        self._decide(verdict)

    def silence_reached(self, span: Span) -> None:
        verdict = self._verdict
        if verdict is None or verdict.span != span:
            return
        verdict.silence_reached = True
        self._decide(verdict)

    def _decide(self, verdict: Verdict) -> None:
        if verdict is not self._verdict or verdict.decided or not (
                verdict.text_done and verdict.audio_done and verdict.silence_reached):
            return
        verdict.decided = True
        p = combine(verdict.p_text, verdict.p_audio)
        end = p >= self.policy.threshold
        self.metrics.turn_checks.inc()
        trace(self.name, "end of turn check", (verdict.span, verdict.p_text, verdict.p_audio, p, end))
        if end:
            self._end_turn(verdict.span)

    def drop(self) -> None:
        self._verdict = None
        if self._audio_task is not None:
            self._audio_task.cancel()
            self._audio_task = None
