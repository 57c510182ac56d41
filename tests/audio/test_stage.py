"""The audio stage at rest: its workers (Whisper's thread, the TTS threads, and whatever pools they started) take no
CPU while nobody speaks, so a server with the audio stage on serves text as fast as one without it."""
from __future__ import annotations

import asyncio
import os
import threading
import time

from audio import smart_turn
from audio.stage import AudioStage
from audio.tts import SpeechClock
from tests.audio.speech import steady_piper_speech

TICK = os.sysconf("SC_CLK_TCK")
IDLE_S = 1.0
# An idle worker blocks on its condition variable and takes no CPU at all; a loop that polls or a thread pool that spins
# takes a visible share of a core. 2 % of one core leaves room for the clock tick's rounding (one tick is 1 %).
MAX_IDLE_SHARE = 0.02


def _cpu_seconds(tids: set[int]) -> float:
    total = 0.0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:   # the thread ended: it takes no CPU either
            continue
        total += (int(fields[11]) + int(fields[12])) / TICK   # utime + stime
    return total


async def test_idle_audio_workers_take_no_cpu():
    before = set(map(int, os.listdir("/proc/self/task")))
    stage = AudioStage()
    try:
        await stage.warmup()
        assert smart_turn._session is not None   # loaded by the warmup, not by the first turn that pauses
        assert stage.transcriber.loaded.is_set()   # and Whisper, loading in its thread, was waited for
        # work once through both workers, so every pool they use exists and has run
        text = await stage.transcriber.transcribe_text(steady_piper_speech("The stage is at rest now."))
        assert "rest" in text.lower()
        audio = await stage.say("Nobody speaks.", "pcm16", 1.0, SpeechClock(paced=False)).read()
        assert len(audio) > 0
        workers = set(map(int, os.listdir("/proc/self/task"))) - before
        assert workers   # the transcriber and TTS threads at least
        start = _cpu_seconds(workers)
        time.sleep(IDLE_S)   # blocking this loop: nothing of the stage waits on it
        used = _cpu_seconds(workers) - start
        assert used <= MAX_IDLE_SHARE * IDLE_S, f"idle audio workers took {used:.3f} CPU-s in {IDLE_S} s"
        assert not stage.busy()   # so the LLM engine has all its threads back (AsyncEngine.share_cpus_with)
        assert not stage.reply_awaited()
        stage.awaiting_first_piece["resp_1"] = time.monotonic()   # a reply decoding towards its first piece
        assert stage.reply_awaited() and stage.first_audio_pending() and not stage.busy()
        stage.awaiting_first_piece.pop("resp_1")
    finally:
        stage.close()


async def test_busy_while_transcribing_synthesizing_or_scoring():
    """What the LLM engine yields a CPU to: each kind of the stage's work, seen as busy while it runs."""
    stage = AudioStage()
    try:
        await stage.warmup()
        speech = steady_piper_speech("Is the stage busy now?")
        assert not stage.busy()
        stream = stage.transcriber.transcribe(speech)
        assert stage.busy()   # queued counts, before the worker picks it up
        await stream.result()
        assert not stage.busy()

        seen, done = [], threading.Event()

        def sample() -> None:   # off the event loop, so a slow loop cannot miss the steps
            while not done.is_set():
                seen.append(stage.busy())
                time.sleep(0.002)
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            await stage.say("A sentence long enough to take a few synthesis steps of the vocoder.", "pcm16", 1.0,
                            SpeechClock(paced=False)).read()
        finally:
            done.set()
            sampler.join()
        assert any(seen) and not stage.busy()

        scoring = asyncio.ensure_future(stage.score_turn(speech))
        await asyncio.sleep(0)
        assert stage.busy()
        assert 0.0 <= await scoring <= 1.0
        assert not stage.busy()
    finally:
        stage.close()
