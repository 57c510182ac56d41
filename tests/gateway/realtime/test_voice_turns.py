"""Voice turns: truncation rolls the token history back to what was heard, barge-in cancels the active response,
eight concurrent voice sessions share (and batch) the Whisper encoder, a reply synthesized during a pause is dropped
when the user goes on and sent when the turn ends. Real speech synthesized in the test."""
from __future__ import annotations

import asyncio
import base64

import pytest

from tests.test_voice_realtime import PCM16, QUESTION, VOICE_SESSION, check_plausible_speech, check_turn, \
    open_voice, response_audio, utterance, wer

pytestmark = pytest.mark.slow


def block_size(server) -> int:
    return getattr(getattr(getattr(server.engine, "engine", None), "args", None), "block_size", 16)


async def test_truncate_while_the_reply_is_still_generated(server):
    """Barge-in as SDK clients do it: response.cancel and conversation.item.truncate back to back, before response.done
    (and a bare truncate, which means the same). The server stops the reply, sends response.done (cancelled), then
    truncates what was generated to what was heard; no error."""
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 150,
                                    "instructions": "You are a storyteller. Tell long stories, ten sentences or more."})
    for bare in (False, True):
        await raw.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}})
        await raw.until("conversation.item.done")
        await raw.send({"type": "response.create"})
        first = (await raw.until("response.output_audio.delta"))[-1]
        item_id = first["item_id"]
        heard_ms = len(base64.b64decode(first["delta"])) // 2 * 1000 // 24000 // 2
        if not bare:
            await raw.send({"type": "response.cancel"})
        await raw.send({"type": "conversation.item.truncate", "event_id": "cut", "item_id": item_id, "content_index": 0,
                        "audio_end_ms": heard_ms})
        events = await raw.until("conversation.item.truncated")
        assert not [e for e in events if e["type"] == "error"], events
        done = [e for e in events if e["type"] == "response.done"]
        assert len(done) == 1 and done[0]["response"]["status"] == "cancelled", done
        assert events[-1]["item_id"] == item_id and events[-1]["audio_end_ms"] == heard_ms
        session = server.app.state.sessions[raw.session_id]
        assert session.active is None and session.conversation.get(item_id).audio_ms[0] == heard_ms
    await raw.ws.close()


async def test_truncate_rolls_back_history(server):
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 60,
                                    "instructions": "You are a helpful assistant. Answer in three sentences."})
    await raw.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about Paris."}]}})
    await raw.until("conversation.item.done")
    await raw.send({"type": "response.create"})
    events = await raw.until("response.done")
    first = events[-1]["response"]
    item_id = first["output"][0]["id"]
    audio, transcript, _ = response_audio(events, PCM16)
    session = server.app.state.sessions[raw.session_id]
    marks = session.conversation.get(item_id).audio_marks[0]
    assert len(marks) >= 2, (marks, transcript)  # spoken in several clauses
    assert marks[-1][0] == len(audio) * 1000 // 24000 or abs(marks[-1][0] - len(audio) * 1000 / 24000) <= 2
    # The listener heard the first clause and half of the second.
    cut_ms = marks[0][0] + (marks[1][0] - marks[0][0]) // 2
    await raw.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                    "audio_end_ms": cut_ms})
    truncated = (await raw.until("conversation.item.truncated"))[-1]
    assert truncated["audio_end_ms"] == cut_ms
    await raw.send({"type": "conversation.item.retrieve", "item_id": item_id})
    kept = (await raw.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
    first_clause = transcript[:marks[0][1]].strip()
    assert kept.startswith(first_clause) and transcript.startswith(kept) and len(kept) < marks[1][1], \
        (kept, transcript, marks)
    unheard = transcript[len(kept):].strip()
    # Next turn: the prompt holds what was heard and nothing after it, and still hits the prefix cache up to there.
    await raw.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Anything else?"}]}})
    await raw.until("conversation.item.done")
    await raw.send({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 8}})
    second = (await raw.until("response.done"))[-1]["response"]
    prompt = session.rendered.text
    assert kept in prompt and "Thanks. Anything else?" in prompt
    after_kept = prompt[prompt.rindex(kept) + len(kept):].lstrip()
    assert unheard and not after_kept.startswith(unheard[:12]), (kept, unheard, prompt)  # the assistant turn ends there
    bs = block_size(server)
    assert second["usage"]["input_token_details"]["cached_tokens"] >= first["usage"]["input_tokens"] // bs * bs
    await raw.ws.close()


async def test_barge_in_cancels_active_response(server):
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 150,
                                    "instructions": "You are a storyteller. Tell long, detailed stories."})
    story, _, _ = utterance("tell me a long story about a dragon")
    await raw.stream(story, PCM16)
    before = await raw.until("response.output_audio.delta")
    first_id = next(e for e in before if e["type"] == "response.created")["response"]["id"]
    # The user talks over the reply (in real time, like a microphone).
    pcm, on, off = utterance(QUESTION, PCM16)
    talk = asyncio.create_task(raw.stream(pcm, PCM16, pace=1.0))
    events = await raw.until("response.done")
    types = [e["type"] for e in events]
    done = events[-1]["response"]
    assert done["id"] == first_id and done["status"] == "cancelled", done
    assert done["status_details"]["reason"] == "turn_detected"
    assert types.index("input_audio_buffer.speech_started") < len(types) - 1
    # The client stops playback and truncates the reply to what it played.
    played = sum(len(e["delta"]) * 3 // 4 for e in before + events if e["type"] == "response.output_audio.delta")
    played_ms = min(played * 1000 // 48000, 400)
    item_id = done["output"][0]["id"]
    await raw.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                    "audio_end_ms": played_ms})
    await talk
    events2 = await raw.until("response.done")
    truncated = next(e for e in events2 if e["type"] == "conversation.item.truncated")
    assert truncated["audio_end_ms"] == played_ms
    check_turn(events + events2, on, off, offset_ms=len(story) / 48)
    assert events2[-1]["response"]["status"] in ("completed", "incomplete")
    audio, transcript, _ = response_audio(events2, PCM16)
    check_plausible_speech(audio, transcript, PCM16)
    session = server.app.state.sessions[raw.session_id]
    full = "".join(e["delta"] for e in before + events if e["type"] == "response.output_audio_transcript.delta")
    heard = session.conversation.get(item_id).content[0]["transcript"]
    assert len(heard) < len(full) and full.startswith(heard)
    await raw.ws.close()


async def test_eight_concurrent_voice_sessions_batch_the_encoder(server):
    raws = [await open_voice(server) for _ in range(8)]
    stage = server.app.state.audio.start()
    before = dict(stage.transcriber.stats.batch_sizes)
    clips = [utterance(QUESTION, PCM16, engine="piper"), utterance(QUESTION, PCM16, engine="espeak")]
    # Everyone speaks at once, in real time: turns end together and their audio is encoded in shared batches.
    await asyncio.gather(*(raw.stream(clips[i % 2][0], PCM16, pace=1.0) for i, raw in enumerate(raws)))
    results = await asyncio.gather(*(raw.until("response.done") for raw in raws))
    for i, events in enumerate(results):
        _, on, off = clips[i % 2]
        completed = check_turn(events, on, off)
        assert wer(QUESTION, completed["transcript"]) <= 0.2
        assert events[-1]["response"]["status"] in ("completed", "incomplete")
        audio, transcript, _ = response_audio(events, PCM16)
        check_plausible_speech(audio, transcript, PCM16)
    after = stage.transcriber.stats.batch_sizes
    grew = {size: after[size] - before.get(size, 0) for size in after if after[size] > before.get(size, 0)}
    assert max(grew) > 1, grew  # the encoder ran batches of several sessions' audio
    for raw in raws:
        await raw.ws.close()
    # Nothing leaks: no transcription in flight, no KV block held once the sessions are gone.
    stats = await server.wait_idle()
    assert stats["kv_pages_used"] == 0 and stage.stats()["transcriptions_inflight"] == 0
    assert not server.app.state.sessions and not stage.awaiting_first_piece and not stage.first_audio_pending()


async def test_disconnects_leave_nothing_behind(server):
    """Clients that vanish mid-turn, mid-transcription or mid-reply: the engine request, the transcription, the queued
    speech and the session are all gone afterwards."""
    stage = server.app.state.audio.start()
    pcm, _, _ = utterance("tell me a long story about a dragon and a knight")
    # 1) gone while its reply is being spoken
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 120,
                                    "instructions": "You are a storyteller. Tell long, detailed stories."})
    await raw.stream(pcm, PCM16)
    await raw.until("response.output_audio.delta")
    await raw.ws.close()
    # 2) gone right after the end of its speech (transcription in flight) and 3) in the middle of speaking
    for cut in (len(pcm), len(pcm) // 2):
        raw = await open_voice(server)
        await raw.stream(pcm[:cut - cut % 2], PCM16)
        await raw.until("input_audio_buffer.speech_started")
        await raw.ws.close()
    for _ in range(200):
        stats = await server.wait_idle()
        busy = stage.stats()["transcriptions_inflight"] or stage.tts.pending
        if not busy and not server.app.state.sessions and stats["kv_pages_used"] == 0:
            break
        await asyncio.sleep(0.1)
    assert stats["kv_pages_used"] == 0 and stats["requests_running"] == 0
    assert stage.stats()["transcriptions_inflight"] == 0 and stage.tts.pending == 0
    assert not server.app.state.sessions and not stage.awaiting_first_piece


async def _held_speculation(server, session_id: str, after=None):
    """The pregenerated reply of a session holding a pause (its client stopped sending), once it finished decoding
    and synthesizing its first pieces; `after`: a previous one, still current until the server's VAD thread has
    caught up with the audio sent since."""
    session = server.app.state.sessions[session_id]
    for _ in range(1200):
        voice = session._voice
        pre = voice.pregen if voice is not None else None
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
    assert first._task.done() and not first.spoken and all(job.cancelled for job in dropped)
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
    assert not server.app.state.sessions
