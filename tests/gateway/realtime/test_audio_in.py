"""Voice input rules: G.711 µ-law round trip (beta dialect), manual commits and the 100 ms minimum, bad audio input,
`input_audio` items, transcription-only sessions, idle timeout. Real speech synthesized in the test."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest

from audio.codecs import encode_audio
from tests.gateway.realtime.client import ALAW, PCM16, QUESTION, ULAW, VOICE_SESSION, check_plausible_speech, \
    check_turn, open_voice, response_audio, utterance, wer

pytestmark = pytest.mark.slow


async def expect_error(raw, event: dict, code: str, param: str | None = None) -> dict:
    await raw.send({**event, "event_id": "evt_bad"})
    ev = await raw.recv()
    assert ev["type"] == "error", ev
    err = ev["error"]
    assert (err["code"], err["param"], err["event_id"]) == (code, param, "evt_bad"), err
    return err


async def test_g711_ulaw_round_trip_beta(server):
    raw = await open_voice(server, {"modalities": ["audio", "text"], "input_audio_format": "g711_ulaw",
                                    "output_audio_format": "g711_ulaw", "max_response_output_tokens": 20,
                                    "instructions": VOICE_SESSION["instructions"]}, beta=True)
    ulaw, on, off = utterance(QUESTION, ULAW)
    await raw.stream(ulaw, ULAW)
    events = await raw.until("response.done")
    check_turn(events, on, off)
    assert events[-1]["response"]["modalities"] == ["audio", "text"]
    audio, transcript, _ = response_audio(events, ULAW, beta=True)
    check_plausible_speech(audio, transcript, ULAW)
    types = {e["type"] for e in events}
    assert "response.output_audio.delta" not in types and "conversation.item.created" in types
    await raw.ws.close()


async def test_manual_commit_min_duration_and_clear(server):
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"],
                                    "audio": {"input": {"turn_detection": None}}})
    await expect_error(raw, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
    short = encode_audio(np.zeros(24000 * 50 // 1000, np.int16), PCM16)  # 50 ms
    await raw.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(short).decode()})
    err = await expect_error(raw, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
    assert "100ms" in err["message"]
    await raw.send({"type": "input_audio_buffer.clear"})
    assert (await raw.recv())["type"] == "input_audio_buffer.cleared"
    pcm, _, _ = utterance(QUESTION, PCM16, tail_ms=300)
    await raw.stream(pcm, PCM16)
    await raw.send({"type": "input_audio_buffer.commit"})
    # sent at once: the response waits for the commit's transcript (greedy: the reply is not empty on any run)
    await raw.send({"type": "response.create", "response": {"temperature": 0}})
    events = await raw.until("response.done")
    types = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" not in types  # turn_detection null: no VAD
    assert types[0] == "input_audio_buffer.committed", types
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer(QUESTION, completed["transcript"]) <= 0.2
    assert types.index("conversation.item.input_audio_transcription.completed") < \
        types.index("response.output_item.added")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and events[-1]["response"]["status"] in ("completed", "incomplete")
    await raw.ws.close()


async def test_bad_audio_input_errors_and_session_goes_on(server):
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"],
                                    "audio": {"input": {"turn_detection": None}}})
    await expect_error(raw, {"type": "input_audio_buffer.append", "audio": "not base64 !!"},
                       "invalid_audio_format", "audio")
    await expect_error(raw, {"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()},
                       "invalid_audio_format", "audio")  # pcm16 needs an even byte count
    await expect_error(raw, {"type": "input_audio_buffer.append", "audio": 5}, "invalid_type", "audio")
    await expect_error(raw, {"type": "input_audio_buffer.append"}, "missing_required_parameter", "audio")
    await expect_error(raw, {"type": "session.update", "session": {"audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}}, "invalid_value", "session.audio.input.format.rate")
    await expect_error(raw, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio"}]}},
        "missing_required_parameter", "item.content[0].audio")
    await expect_error(raw, {"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "%%%"}]}},
        "invalid_audio_format", "item.content[0].audio")
    # Nothing bad was kept: the buffer is empty, the conversation has no item.
    await expect_error(raw, {"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty")
    session = server.app.state.sessions[raw.session_id]
    assert session.conversation.items == [] and session.audio_input().buf.duration_ms == 0
    # The buffer is capped (15 minutes): µ-law 8 kHz silence in 15 MiB appends hits the cap with an error.
    await raw.send({"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcmu"}}}}})
    assert (await raw.recv())["type"] == "session.updated"
    block = base64.b64encode(bytes([0xFF]) * (8000 * 600)).decode()  # 10 minutes of µ-law silence
    await raw.send({"type": "input_audio_buffer.append", "audio": block})
    await expect_error(raw, {"type": "input_audio_buffer.append", "audio": block}, "input_audio_buffer_full", "audio")
    assert session.audio_input().buf.duration_ms == 600_000
    await raw.send({"type": "input_audio_buffer.clear"})
    assert (await raw.recv())["type"] == "input_audio_buffer.cleared"
    assert session.audio_input().buf.duration_ms == 0
    # ... and the session still works: an input_audio item (µ-law now) is transcribed and answered.
    ulaw, _, _ = utterance(QUESTION, ULAW, tail_ms=200)
    part = {"type": "input_audio", "audio": base64.b64encode(ulaw).decode()}
    await raw.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [part]}})
    await raw.send({"type": "response.create"})
    events = await raw.until("response.done")
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer(QUESTION, completed["transcript"]) <= 0.2
    assert events[-1]["response"]["status"] in ("completed", "incomplete")
    await raw.ws.close()


async def transcribes_without_responding(raw) -> None:
    """A spoken turn is transcribed; no response starts, and response.create is refused."""
    pcm, on, off = utterance(QUESTION, PCM16)
    await raw.stream(pcm, PCM16)
    events = await raw.until("conversation.item.input_audio_transcription.completed")
    check_turn(events, on, off)
    await expect_error(raw, {"type": "response.create"}, "invalid_request", "type")
    assert not any(e["type"].startswith("response.") for e in raw.events)


async def test_transcription_only_session(server):
    raw = await open_voice(server, {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": "medium"}}}}, query="?intent=transcription")
    await transcribes_without_responding(raw)
    await raw.ws.close()


async def test_ga_transcription_session_type(server):
    """GA's other way to ask for transcription only: `session.type: "transcription"` on a plain connection. The
    session.updated object is the SDK's transcription-session variant; setting "realtime" again brings responses back."""
    raw = await open_voice(server, {"type": "transcription", "audio": {"input": {
        "transcription": {"model": "whisper-1"}, "turn_detection": {"type": "server_vad"}}}})
    assert raw.events[-1]["session"]["type"] == "transcription"
    await transcribes_without_responding(raw)
    await raw.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                          "max_output_tokens": 8}})
    assert (await raw.until("session.updated"))[-1]["session"]["type"] == "realtime"
    await raw.send({"type": "response.create"})
    assert (await raw.until("response.done"))[-1]["response"]["status"] in ("completed", "incomplete")
    await raw.ws.close()


async def test_idle_timeout_triggers_a_turn(server):
    turn = {"type": "server_vad", "idle_timeout_ms": 1500}
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"],
                                    "audio": {"input": {"turn_detection": turn}}})
    assert (raw.events[-1]["session"]["audio"]["input"]["turn_detection"]["idle_timeout_ms"]) == 1500
    pcm, _, _ = utterance(QUESTION, PCM16)
    await raw.stream(pcm, PCM16)
    await raw.until("response.done")
    silence = encode_audio(np.zeros(24000 * 2, np.int16), PCM16)  # 2 s of silence after the reply
    await raw.stream(silence, PCM16)
    events = await raw.until("response.done")
    timeout = next(e for e in events if e["type"] == "input_audio_buffer.timeout_triggered")
    assert timeout["audio_end_ms"] - timeout["audio_start_ms"] >= 1500
    assert not any(e["type"] == "input_audio_buffer.speech_started" for e in events)
    await raw.ws.close()


async def test_transcription_failure_is_reported_and_session_goes_on(server):
    """The shared Whisper worker is stopped (a real failure, not a stand-in): committed audio gets `.failed`, the
    session goes on; the next voice session starts a fresh worker."""
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"],
                                    "audio": {"input": {"turn_detection": None}}})
    pcm, _, _ = utterance(QUESTION, PCM16, tail_ms=200)
    await raw.stream(pcm, PCM16)
    stage = server.app.state.audio.start()
    stage.transcriber.close()
    try:
        await raw.send({"type": "input_audio_buffer.commit"})
        failed = (await raw.until("conversation.item.input_audio_transcription.failed"))[-1]
        assert failed["error"]["code"] == "transcription_failed" and failed["content_index"] == 0
        await raw.send({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}})
        await raw.send({"type": "response.create"})
        events = await raw.until("response.done")
        assert events[-1]["response"]["status"] in ("completed", "incomplete")
    finally:
        stage.transcriber = None  # the next use starts a fresh worker
    await raw.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    await raw.send({"type": "input_audio_buffer.commit"})
    completed = (await raw.until("conversation.item.input_audio_transcription.completed"))[-1]
    assert wer(QUESTION, completed["transcript"]) <= 0.2
    await raw.ws.close()


def quietest_frame_rms(audio: np.ndarray, rate: int) -> float:
    hop = rate // 50  # 20 ms
    n = len(audio) // hop
    return float(np.sqrt((audio[:n * hop].astype(np.float64).reshape(n, hop) ** 2).mean(axis=1)).min())


async def test_g711_alaw_round_trip_ga(server):
    """A-law in (`audio/pcma`) is transcribed as what was said; the spoken reply comes back as A-law: its pauses
    decode to near silence, which they would not under the other G.711 law (a few LSBs against hundreds)."""
    raw = await open_voice(server, {**VOICE_SESSION, "audio": {"input": {"format": {"type": "audio/pcma"}},
                                                               "output": {"format": {"type": "audio/pcma"}}}})
    audio_config = raw.events[-1]["session"]["audio"]
    assert audio_config["input"]["format"] == audio_config["output"]["format"] == {"type": "audio/pcma"}
    alaw, on, off = utterance(QUESTION, ALAW)
    await raw.stream(alaw, ALAW)
    events = await raw.until("response.done")
    check_turn(events, on, off)
    assert events[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    audio, transcript, _ = response_audio(events, ALAW)
    check_plausible_speech(audio, transcript, ALAW)
    assert quietest_frame_rms(audio, ALAW.rate) < 200
    await raw.ws.close()


async def test_create_response_false_waits_for_response_create(server):
    """turn_detection.create_response false: the turn is detected, committed and transcribed, and no response starts
    until the client asks for one."""
    turn = {"type": "server_vad", "create_response": False}
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"],
                                    "audio": {"input": {"turn_detection": turn}}})
    assert raw.events[-1]["session"]["audio"]["input"]["turn_detection"]["create_response"] is False
    pcm, on, off = utterance(QUESTION, PCM16)
    await raw.stream(pcm, PCM16)
    events = await raw.until("conversation.item.input_audio_transcription.completed")
    completed = check_turn(events, on, off)
    # a round trip after the turn's last event: anything the turn would have started was sent before its answer
    await raw.send({"type": "conversation.item.retrieve", "item_id": completed["item_id"]})
    events += await raw.until("conversation.item.retrieved")
    assert not [e["type"] for e in events if e["type"].startswith("response.")], [e["type"] for e in events]
    text, response, _ = await raw.respond({"temperature": 0})
    assert response["status"] in ("completed", "incomplete") and text
    await raw.ws.close()


async def test_interrupt_response_false_lets_the_reply_go_on(server):
    """turn_detection.interrupt_response false: the user speaks (and ends a turn) while a reply is generated; the
    reply is not cancelled by it. (The reply is greedy and far longer than the speech; the client cancels it.)"""
    turn = {"type": "server_vad", "interrupt_response": False}
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"], "max_output_tokens": "inf",
                                    "audio": {"input": {"turn_detection": turn}}})
    await raw.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "List the numbers from 1 to 500, separated by commas."}]}})
    await raw.until("conversation.item.done")
    await raw.send({"type": "response.create", "response": {"temperature": 0}})
    events = await raw.until("response.output_text.delta")
    pcm, on, off = utterance(QUESTION, PCM16)
    await raw.stream(pcm, PCM16)
    events += await raw.until("input_audio_buffer.committed")
    types = [e["type"] for e in events]
    assert "input_audio_buffer.speech_started" in types and "response.done" not in types, types
    await raw.send({"type": "response.cancel"})
    events += await raw.until("response.done")
    done = events[-1]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled", done
    await raw.ws.close()


def check_logprobs(events: list[dict]) -> dict:
    """The last transcription's events: the completed one's logprobs spell its transcript, each with a logprob and its
    bytes, and its deltas' logprobs are those same tokens, in order. Returns the completed event."""
    completed = events[-1]
    logprobs = completed["logprobs"]
    assert logprobs and "".join(t["token"] for t in logprobs).strip() == completed["transcript"], completed
    assert all(t["logprob"] <= 0.0 and bytes(t["bytes"]) == t["token"].encode() for t in logprobs)
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"
              and e["item_id"] == completed["item_id"]]
    assert deltas and [t for d in deltas for t in d["logprobs"]] == logprobs, deltas
    return completed


async def test_transcription_logprobs_on_request(server):
    """`include: ["item.input_audio_transcription.logprobs"]`: a completed transcription lists its tokens with the
    logprob Whisper chose each with, and its deltas the tokens they bring, whether the turn's end took the pause's
    transcription (semantic VAD, text session: one delta) or a commit started one (a delta as tokens come); with
    include cleared, none."""
    raw = await open_voice(server, {**VOICE_SESSION, "output_modalities": ["text"], "max_output_tokens": 4,
                                    "include": ["item.input_audio_transcription.logprobs"],
                                    "audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}})
    pcm, _, _ = utterance(QUESTION, PCM16, tail_ms=1000)
    await raw.stream(pcm, PCM16)
    completed = check_logprobs(await raw.until("conversation.item.input_audio_transcription.completed"))
    assert wer(QUESTION, completed["transcript"]) <= 0.2
    await raw.until("response.done")

    await raw.send({"type": "session.update", "session": {"type": "realtime",
                                                          "audio": {"input": {"turn_detection": None}}}})
    await raw.until("session.updated")
    pcm, _, _ = utterance(QUESTION, PCM16, tail_ms=300)
    await raw.stream(pcm, PCM16)
    await raw.send({"type": "input_audio_buffer.commit"})
    committed = check_logprobs(await raw.until("conversation.item.input_audio_transcription.completed"))

    await raw.send({"type": "session.update", "session": {"type": "realtime", "include": None}})
    await raw.until("session.updated")
    await raw.stream(pcm, PCM16)
    await raw.send({"type": "input_audio_buffer.commit"})
    events = await raw.until("conversation.item.input_audio_transcription.completed")
    plain = events[-1]
    assert plain["transcript"] == committed["transcript"] and plain.get("logprobs") is None
    assert all(e.get("logprobs") is None for e in events if e["type"].endswith("transcription.delta"))
    await raw.ws.close()


async def test_a_bulk_append_does_not_hold_up_another_sessions_stream(server):
    """Each session's appends run on the executor's threads, so while one session's append of minutes of audio is
    decoded, resampled and read by the VAD, another session's turn detection goes on."""
    session = {"type": "realtime", "output_modalities": ["text"], "audio": {"input": {
        "turn_detection": {"type": "server_vad", "create_response": False}}}}
    bulk, live = await open_voice(server, session), await open_voice(server, session)
    speech, _, _ = utterance(QUESTION, PCM16, tail_ms=240_000)  # 4 minutes: one append, under the frame limit
    arrived: dict[str, float] = {}

    async def first_speech_started(name: str, raw) -> None:
        while (await raw.recv())["type"] != "input_audio_buffer.speech_started":
            pass
        arrived[name] = asyncio.get_running_loop().time()

    waits = [asyncio.create_task(first_speech_started(n, r)) for n, r in (("bulk", bulk), ("live", live))]
    await bulk.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(speech).decode()})
    await live.stream(utterance(QUESTION, PCM16)[0], PCM16)  # 20-100 ms appends, as fast as they go
    await asyncio.gather(*waits)
    assert arrived["live"] < arrived["bulk"], arrived
    for raw in (bulk, live):
        await raw.ws.close()
