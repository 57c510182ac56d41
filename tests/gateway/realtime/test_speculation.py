"""Speculation inside a pause of a spoken turn: a reply synthesized during a pause is dropped when the user goes on
and sent when the turn ends. Real speech synthesized in the test."""
from __future__ import annotations

import asyncio

import pytest

from tests.gateway.realtime.client import PCM16, QUESTION, check_plausible_speech, open_voice, response_audio, \
    utterance, wer

pytestmark = pytest.mark.slow


async def _held_speculation(server, session_id: str, after=None):
    """The pregenerated reply of a session holding a pause (its client stopped sending), once it finished decoding
    and synthesizing its first pieces; `after`: a previous one, still current until the server's VAD thread has
    caught up with the audio sent since."""
    session = server.app.state.sessions[session_id]
    for _ in range(1200):
        speculation = session.speculation
        pre = speculation.pregen if speculation is not None else None
        if pre is not None and pre is not after and pre.finished and pre.spoken and \
                all(job.finished for job in pre.spoken):
            return pre
        await asyncio.sleep(0.05)
    raise AssertionError("no speculative reply was synthesized during the pause")


async def test_reply_spoken_during_the_pause_is_dropped_or_sent(server):
    """A pause inside a turn (longer than the speculation delay, shorter than the silence window) transcribes the turn,
    decodes its reply and synthesizes the reply's first pieces, and sends nothing. The client holds that pause (it
    stops sending, so the VAD's clock stops) until all of that is done. Then (1) the user goes on speaking: the engine
    request and the synthesis are dropped; (2) after the next such pause the turn ends: the reply's first audio is the
    audio synthesized during the pause."""
    stage = server.app.state.audio.start()
    before = set(server.app.state.sessions)   # (sessions other tests left open are theirs to answer for)
    pcm, _, _ = utterance(QUESTION, tail_ms=0)
    more, _, _ = utterance("and how many people live there", lead_ms=0, tail_ms=0)
    # 250 ms: past the speculation delay, before the 500 ms window (which counts from where the voice stopped, so up
    # to 160 ms of the voice's quiet tail count towards it too)
    pause = bytes(PCM16.rate * 2 * 250 // 1000)
    raw = await open_voice(server)
    await raw.stream(pcm + pause, PCM16)
    first = await _held_speculation(server, raw.session_id)
    dropped = list(first.spoken)
    await raw.stream(more + pause, PCM16)  # (1) the user goes on
    second = await _held_speculation(server, raw.session_id, after=first)
    assert first.finished and not first.spoken and all(job.cancelled for job in dropped)
    used, spoken = stage.speculations["spoken"], list(second.spoken)
    piece, synthesized = spoken[0].text, spoken[0].buffered()  # all of it: the job has finished
    await raw.stream(bytes(PCM16.rate * 2), PCM16)  # (2) a second of silence ends the turn
    events = await raw.until("response.done")
    types = [e["type"] for e in events]
    assert types.index("input_audio_buffer.speech_started") + 1 == types.index("input_audio_buffer.speech_stopped")
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer(f"{QUESTION} and how many people live there", completed["transcript"]) <= 0.2, completed["transcript"]
    assert events[-1]["response"]["status"] in ("completed", "incomplete")
    audio, transcript, _ = response_audio(events, PCM16)
    check_plausible_speech(audio, transcript, PCM16)
    # handed over to the response (second.spoken is empty now)
    assert transcript.startswith(piece) and audio.tobytes().startswith(synthesized)
    assert not second.spoken and stage.speculations["spoken"] > used
    await raw.ws.close()
    stats = await server.wait_idle()
    assert stats["requests_running"] == 0 and stats["kv_pages_used"] == 0
    assert set(server.app.state.sessions) == before   # this one left the registry
