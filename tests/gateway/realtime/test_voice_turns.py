"""Voice turns: truncation rolls the token history back to what was heard, barge-in cancels the active response,
eight concurrent voice sessions share (and batch) the Whisper encoder, clients that vanish leave nothing behind. Real
speech synthesized in the test."""
from __future__ import annotations

import asyncio
import base64

import httpx
import pytest

from tests.gateway.realtime.client import PCM16, QUESTION, VOICE_SESSION, check_plausible_speech, check_turn, \
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
        await raw.send({"type": "response.create", "response": {"temperature": 0}})
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
        await raw.send({"type": "conversation.item.retrieve", "item_id": item_id})
        kept = (await raw.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
        said = "".join(e["delta"] for e in raw.events if e["type"] == "response.output_audio_transcript.delta"
                       and e["item_id"] == item_id)
        assert said.startswith(kept) and len(kept) < len(said), (kept, said)
    await raw.ws.close()


async def chat_prompt_tokens(server, messages: list[dict]) -> int:
    """The prompt length of `messages` as the HTTP API renders them (the same model's chat template)."""
    async with httpx.AsyncClient(timeout=120) as h:
        r = await h.post(f"{server.base_url}/chat/completions",
                         json={"model": server.engine.model_name, "max_tokens": 1, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


async def test_truncate_rolls_back_history(server):
    """The listener heard the first half of a spoken reply: the item keeps about the first half of its words, and the
    next turn's prompt holds exactly those words as the assistant's turn."""
    instructions = "You are a helpful assistant. Answer in three sentences."
    raw = await open_voice(server, {**VOICE_SESSION, "max_output_tokens": 60, "instructions": instructions})
    await raw.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me about Paris."}]}})
    await raw.until("conversation.item.done")
    await raw.send({"type": "response.create", "response": {"temperature": 0}})  # greedy: the same reply every run
    events = await raw.until("response.done")
    first = events[-1]["response"]
    item_id = first["output"][0]["id"]
    audio, transcript, _ = response_audio(events, PCM16)
    cut_ms = len(audio) * 1000 // PCM16.rate // 2
    await raw.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                    "audio_end_ms": cut_ms})
    truncated = (await raw.until("conversation.item.truncated"))[-1]
    assert truncated["audio_end_ms"] == cut_ms
    await raw.send({"type": "conversation.item.retrieve", "item_id": item_id})
    kept = (await raw.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
    assert kept and transcript.startswith(kept) and len(kept) < len(transcript), (kept, transcript)
    # half the audio keeps about half the words: whole clauses heard and a share of the one playing, measured in
    # characters of the transcript (the voice speaks at a steady pace), so well inside a quarter either way
    assert 0.25 <= len(kept) / len(transcript) <= 0.75, (kept, transcript)
    # Next turn: the prompt holds what was heard and nothing after it, and still hits the prefix cache up to there.
    await raw.send({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Anything else?"}]}})
    await raw.until("conversation.item.done")
    await raw.send({"type": "response.create", "response": {"output_modalities": ["text"], "max_output_tokens": 8}})
    second = (await raw.until("response.done"))[-1]["response"]
    history = [{"role": "system", "content": instructions}, {"role": "user", "content": "Tell me about Paris."}]
    expected = await chat_prompt_tokens(server, history + [{"role": "assistant", "content": kept},
                                                           {"role": "user", "content": "Thanks. Anything else?"}])
    assert second["usage"]["input_tokens"] == expected, (second["usage"], expected)
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
    check_truncated_turn(events2, item_id, played_ms)
    check_turn(events + events2, on, off, offset_ms=len(story) / 48)
    await check_answered_and_kept_prefix(raw, before + events, events2, item_id, beta=False)


async def test_beta_barge_in_and_truncate(server):
    """The same barge-in in the beta dialect: speech over a spoken reply (`response.audio.delta`) cancels it with
    `turn_detected`; the client's truncate is answered with `conversation.item.truncated` and the item keeps what
    was heard; the new turn is answered."""
    raw = await open_voice(server, {"modalities": ["audio", "text"], "max_response_output_tokens": 150,
                                    "instructions": "You are a storyteller. Tell long, detailed stories."}, beta=True)
    await raw.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Tell me a long story about a dragon."}]}})
    await raw.until("conversation.item.created")
    await raw.send({"type": "response.create", "response": {"temperature": 0}})
    before = await raw.until("response.audio.delta")
    first_id = next(e for e in before if e["type"] == "response.created")["response"]["id"]
    pcm, on, off = utterance(QUESTION, PCM16)
    await raw.stream(pcm, PCM16)
    events = await raw.until("response.done")
    done = events[-1]["response"]
    assert done["id"] == first_id and done["status"] == "cancelled", done
    assert done["status_details"]["reason"] == "turn_detected"
    assert "input_audio_buffer.speech_started" in [e["type"] for e in events]
    played = sum(len(e["delta"]) * 3 // 4 for e in before + events if e["type"] == "response.audio.delta")
    played_ms = min(played * 1000 // 48000, 400)
    item_id = done["output"][0]["id"]
    await raw.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                    "audio_end_ms": played_ms})
    events2 = await raw.until("response.done")
    check_truncated_turn(events2, item_id, played_ms)
    check_turn(events + events2, on, off)
    await check_answered_and_kept_prefix(raw, before + events, events2, item_id, beta=True)


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


def check_truncated_turn(events: list[dict], item_id: str, played_ms: int) -> None:
    truncated = next(e for e in events if e["type"] == "conversation.item.truncated")
    assert truncated["item_id"] == item_id and truncated["audio_end_ms"] == played_ms


async def check_answered_and_kept_prefix(raw, cut_events: list[dict], events2: list[dict], item_id: str,
                                         beta: bool) -> None:
    """The new turn was answered with plausible speech, and the cut reply item keeps a strict prefix of what was
    streamed of it; closes the connection."""
    assert events2[-1]["response"]["status"] in ("completed", "incomplete")
    audio, transcript, _ = response_audio(events2, PCM16, beta=beta)
    check_plausible_speech(audio, transcript, PCM16)
    delta = "response.audio_transcript.delta" if beta else "response.output_audio_transcript.delta"
    full = "".join(e["delta"] for e in cut_events if e["type"] == delta)
    await raw.send({"type": "conversation.item.retrieve", "item_id": item_id})
    heard = (await raw.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
    assert len(heard) < len(full) and full.startswith(heard)
    await raw.ws.close()
