"""Speech synthesis by deadline (gateway.voice.AudioStage): clauses due now go to the normal TTS threads, clauses not
needed yet to the low-priority background thread, and a queued clause that comes due moves to a normal thread. Real
piper synthesis; the assertions are on order and on which pool ran what, not on times."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from audio.transcriber import Transcriber
from audio.tts import BACKGROUND_NICE, TTSWorker
from gateway.voice import URGENT_S, AudioStage

LONG = ("This is a long paragraph that the background thread will take a while to speak, because it has many words "
        "in it, one after another, and then some more words after those, until it finally comes to an end.")


@pytest.fixture
async def stage():
    st = AudioStage(transcriber=Transcriber(), tts=TTSWorker(threads=2, background=1))
    await st.warmup()
    yield st
    st.close()


async def test_background_thread_runs_at_lower_priority():
    worker = TTSWorker(threads=1, background=1)

    def nice(_synth) -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert await worker._run(nice) == base
    assert await worker._run(nice, background=True) == min(19, base + BACKGROUND_NICE)
    worker.close()


async def test_clauses_due_now_overtake_later_ones(stage):
    loop = asyncio.get_running_loop()
    later = [asyncio.create_task(stage.speak(loop.time() + 30 + i, f"Later clause number {i} of this reply.",
                                             "pcm16", 1.0)) for i in range(3)]
    await asyncio.sleep(0)
    now = [asyncio.create_task(stage.speak(loop.time(), f"First words {i}.", "pcm16", 1.0)) for i in range(2)]
    done_order = []
    for t in later + now:
        t.add_done_callback(lambda t, name=("later" if t in later else "now"): done_order.append(name))
    results = await asyncio.gather(*later, *now)
    assert all(len(r) > 4800 for r in results)  # > 0.1 s of pcm16 each
    # the background thread speaks the later clauses one by one, the normal ones the urgent clauses at once
    assert done_order[:2] == ["now", "now"], done_order
    assert stage.speech_stats["background"] == 3 and stage.speech_stats["requests"] == 5
    assert stage.speech_queued == 0


async def test_a_clause_coming_due_moves_to_a_normal_thread(stage):
    loop = asyncio.get_running_loop()
    busy = asyncio.create_task(stage.speak(loop.time() + 60, LONG, "pcm16", 1.0))   # the background thread's
    await asyncio.sleep(0.05)
    soon = asyncio.create_task(stage.speak(loop.time() + URGENT_S + 0.15, "Needed soon.", "pcm16", 1.0))
    await asyncio.wait_for(soon, 30)
    assert not busy.done()  # not behind the long clause: a normal thread took it once it was due within URGENT_S
    assert stage.speech_stats["background"] == 0  # (counted when a synthesis ends; the long one has not)
    await busy
    assert stage.speech_stats["background"] == 1


async def test_cancelled_clauses_leave_the_queue(stage):
    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(stage.speak(loop.time() + 60 + i, f"Queued clause {i}.", "pcm16", 1.0))
             for i in range(5)]
    await asyncio.sleep(0.01)
    assert stage.speech_queued == 4  # the background thread took the first
    for t in tasks[1:]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert stage.speech_queued == 0 and len(tasks[0].result()) > 0
