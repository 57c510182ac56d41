"""The semantic end of turn (gateway/realtime/turn_detection.py) with the real models: Whisper, the engine's own
prefill, Smart Turn. The client stops sending in the middle of a pause, so the VAD's silence window can never run out:
a turn that ends there ended early. Real speech synthesized in the test (piper, noise scales 0)."""
from __future__ import annotations

import asyncio
import math

import pytest

from audio.stage import AudioStage
from audio.vad import SEMANTIC_EAGERNESS_MS
from gateway.metrics import Metrics
from gateway.realtime.turn_detection import EAGERNESS, TurnDetector
from tests.audio.speech import steady_piper_speech

from tests.gateway.realtime.client import PCM16, check_turn, expect_error, normalize, open_voice, send_speech, \
    utterance, wer

pytestmark = pytest.mark.slow

SESSION = {"type": "realtime", "output_modalities": ["text"], "max_output_tokens": 16,
           "instructions": "You are a concise voice assistant. Answer in one short sentence.",
           "audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "medium"}}}}
WINDOW_MS = SEMANTIC_EAGERNESS_MS["medium"]
PAUSE_MS = 450  # past the medium eagerness's shortest silence, well short of its 800 ms window


def counter(server, name: str) -> float:
    return next(float(line.split()[-1]) for line in server.metrics_text().splitlines()
                if line.startswith(f"rtserve_turn_{name}_total "))


async def checked(server, before: float) -> None:
    """Wait until the server has scored the held pause (its end-of-turn check ran)."""
    for _ in range(2400):
        if counter(server, "end_checks") > before:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the pause was never scored")


async def test_smart_turn_is_asked_only_where_the_text_leaves_the_end_open():
    """The detector on a real audio stage: a sure text score ends the turn at the shortest silence with no Smart Turn
    call; a borderline one asks Smart Turn (the real model) and the check waits for its score, which ends it."""
    stage, metrics, ended = AudioStage(), Metrics(lambda: None), []
    detector = TurnDetector(stage, ended.append, "test", metrics)
    policy, window = EAGERNESS["medium"], 800
    speech = steady_piper_speech("Can you help me with my homework?")
    audio_scores = lambda: metrics.registry.get_sample_value("rtserve_turn_audio_scores_total")  # noqa: E731
    try:
        sure = (0, 2000)
        detector.start(sure, speech, policy)
        detector.text_scored(sure, math.log(0.9))
        detector.silence_reached(sure, policy.min_silence_ms, window)
        assert ended == [sure] and audio_scores() == 0
        borderline = (3000, 5000)
        detector.start(borderline, speech, policy)
        detector.text_scored(borderline, math.log(0.12))  # 0.8 × 0.12 < 0.15 <= 0.8 × 0.12 + 0.2
        detector.silence_reached(borderline, policy.min_silence_ms, window)
        assert ended == [sure] and audio_scores() == 1  # waiting for Smart Turn
        for _ in range(200):
            if len(ended) == 2:
                break
            await asyncio.sleep(0.05)
        assert ended == [sure, borderline]  # a complete question: Smart Turn's score lifts it over the threshold
    finally:
        detector.drop()
        stage.close()


async def prefill_scores(engine, text: str, request_id: str, continuation_ids: frozenset[int] = frozenset()
                         ) -> tuple[float, float]:
    """The pause's text scores for `text` as a voice session's prefill returns them (the real engine, through `Pregen`):
    P(end of turn) jointly with Whisper's punctuation, and P(a sentence ends after the words)."""
    from types import SimpleNamespace

    from engine import SamplingParams
    from gateway.realtime.response import SENTENCE_END_TOP, end_of_turn_positions, sentence_end_ids, stop_token_ids
    from gateway.realtime.speculation import Pregen

    tok = engine.tokenizer
    stops = stop_token_ids(tok)
    prompt = tok.apply_chat_template([{"role": "system", "content": SESSION["instructions"]},
                                      {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    positions = end_of_turn_positions(ids, stops, tok.decode)
    sampling = SamplingParams(max_tokens=1, temperature=0, prompt_logprob_positions=positions,
                              prompt_logprobs=SENTENCE_END_TOP)
    scored = asyncio.get_running_loop().create_future()
    pre = Pregen(engine, request_id, SimpleNamespace(ids=ids), sampling, eot_positions=positions,
                 sentence_end_ids=sentence_end_ids(tok, tuple(stops)), continuation_ids=continuation_ids)
    pre.on_end_of_turn(lambda logprob, p_end: scored.done() or scored.set_result((logprob, p_end)))
    logprob, p_end = await asyncio.wait_for(scored, 60)
    pre.cancel()
    return math.exp(logprob), p_end


async def test_the_prefill_says_where_a_sentence_can_end(server):
    """The pause's prefill returns, beside the end-of-turn logprob, P(a sentence ends after the words) from the top
    logprobs of the same position (the real engine): "who painted the Mona Lisa" (no "?", as Whisper wrote it for a
    complete question in `rtserve bench turn`) is vetoed by the joint text score but reads as a sentence that can end;
    "What is the capital of" reads as neither."""
    from gateway.realtime.response import sentence_end_ids, stop_token_ids
    from gateway.realtime.turn_detection import TEXT_VETO

    engine, policy = server.engine, EAGERNESS["medium"]
    tok = engine.tokenizer
    ends = sentence_end_ids(tok, tuple(stop_token_ids(tok)))
    assert {tok.convert_tokens_to_ids(t) for t in ("?", ".", "!", "<|im_end|>")} <= ends
    got = {}
    for text in ("who painted the Mona Lisa", "What is the capital of"):
        got[text] = await prefill_scores(engine, text, f"test-sentence-end-{len(got)}")
    (lisa_text, lisa_end), (capital_text, capital_end) = got.values()
    assert lisa_text < TEXT_VETO and capital_text < TEXT_VETO, got
    assert lisa_end > 4 * policy.floor and capital_end < policy.floor, got
    await server.wait_idle(pinned_ok=True)


async def test_the_text_scores_are_read_given_that_the_last_word_is_over(server):
    """"who wrote Romeo and Juliet" (as Whisper wrote a complete question in `rtserve bench voice`): the model puts most
    of its mass after "Juliet" on the word going on ("te"), so as heard both text scores are small; given that the word
    is over (the real tokenizer's continuation tokens, the real prefill), a sentence end is likely. "What is the capital
    of" stays unfinished either way: nothing goes on with "of"."""
    from gateway.realtime.response import sentence_end_ids, stop_token_ids, word_continuation_ids
    from gateway.realtime.turn_detection import combine, early_end_ms

    engine, policy = server.engine, EAGERNESS["medium"]
    tok = engine.tokenizer
    ends, goes_on = sentence_end_ids(tok, tuple(stop_token_ids(tok))), word_continuation_ids(tok)
    assert tok.encode("te", add_special_tokens=False)[0] in goes_on and tok.convert_tokens_to_ids("?") not in goes_on
    assert not goes_on & ends and not goes_on & set(tok.encode(" by the", add_special_tokens=False))

    async def scores(text: str, continuation_ids: frozenset[int]) -> tuple[float, float]:
        return await prefill_scores(engine, text, f"test-word-end-{len(text)}-{len(continuation_ids)}",
                                    continuation_ids)

    heard_text, heard_end = await scores("who wrote Romeo and Juliet.", frozenset())
    text, end = await scores("who wrote Romeo and Juliet.", goes_on)
    assert text > 4 * heard_text and end > 4 * heard_end, (heard_text, heard_end, text, end)
    # with a voice that sounds finished, the turn now ends before the window; as heard it waited the window out
    assert early_end_ms(combine(heard_text, 0.9, heard_end), policy, WINDOW_MS) is None
    assert early_end_ms(combine(text, 0.9, end), policy, WINDOW_MS) is not None
    capital_text, capital_end = await scores("What is the capital of", goes_on)
    assert capital_text < policy.floor and capital_end < policy.floor, (capital_text, capital_end)
    await server.wait_idle(pinned_ok=True)


async def test_a_complete_question_ends_early(server):
    pcm, on_ms, off_ms = utterance("What is the capital of France?", tail_ms=PAUSE_MS)
    early = counter(server, "early_ends")
    raw = await open_voice(server, SESSION)
    await raw.stream(pcm, PCM16)
    events = await raw.until("response.done")
    check_turn(events, on_ms, off_ms)
    assert counter(server, "early_ends") == early + 1
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer("What is the capital of France?", done["transcript"]) <= 0.2
    assert events[-1]["response"]["status"] in ("completed", "incomplete")
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)


async def test_no_early_end_on_an_unfinished_question(server):
    first, _, _ = utterance("What is the capital of", tail_ms=PAUSE_MS)
    rest, _, _ = utterance("France?", lead_ms=0, tail_ms=1000)
    repairs, checks = counter(server, "repairs"), counter(server, "end_checks")
    raw = await open_voice(server, SESSION)
    await raw.stream(first, PCM16)
    await checked(server, checks)
    await raw.stream(rest, PCM16)
    events = await raw.until("response.done")
    types = [e["type"] for e in events]
    # one turn: an early end in the pause would have sent speech_stopped there, and a repair a second speech_started
    assert types.count("input_audio_buffer.speech_started") == types.count("input_audio_buffer.speech_stopped") == 1
    assert types.count("input_audio_buffer.committed") == 1
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    # the whole utterance in one item (Whisper may repeat the last word after the pause: not what is tested here)
    heard = normalize(done["transcript"])
    assert heard.startswith("what is the capital of") and "france" in heard, done["transcript"]
    assert counter(server, "repairs") == repairs
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)


async def test_speech_after_an_early_end_repairs_the_same_turn(server):
    """The turn ends early, the reply starts; the user goes on within the grace period: the reply is cancelled and
    leaves the conversation, the new speech joins the same user item, and the reply is made again for all of it."""
    first, _, _ = utterance("What is the capital of France?", tail_ms=PAUSE_MS)
    rest, _, _ = utterance("And how many people live there?", lead_ms=0, tail_ms=1000)
    repairs = counter(server, "repairs")
    # a spoken reply: it is still playing when the user goes on
    raw = await open_voice(server, {**SESSION, "output_modalities": ["audio"]})
    await raw.stream(first, PCM16)
    events = await raw.until("response.created")
    user_item = next(e for e in events if e["type"] == "input_audio_buffer.committed")["item_id"]
    await raw.stream(rest, PCM16)
    events += await raw.until("conversation.item.input_audio_transcription.completed")
    while True:  # the cancelled reply's done, then the new reply's
        events += await raw.until("response.done")
        if events[-1]["response"]["status"] != "cancelled":
            break
    statuses = [e["response"]["status"] for e in events if e["type"] == "response.done"]
    assert statuses[0] == "cancelled" and statuses[-1] in ("completed", "incomplete")
    cancelled = next(e for e in events if e["type"] == "response.done")["response"]
    assert cancelled["status_details"]["reason"] == "turn_detected"
    commits = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    assert commits == [user_item, user_item]
    added_users = [e for e in events if e["type"] == "conversation.item.added" and e["item"]["role"] == "user"]
    assert len(added_users) == 1  # no second user item
    assert {e["item_id"] for e in events if e["type"] == "conversation.item.deleted"} == \
        {item["id"] for item in cancelled["output"]}
    # as at a barge-in: speech_started, the cancelled reply's done events, and only then its items leave (a client
    # takes those done events as updates of the items they name)
    types = [e["type"] for e in events]
    done_at = types.index("response.done")
    assert [i for i, t in enumerate(types) if t == "input_audio_buffer.speech_started"][1] < done_at
    assert min(i for i, t in enumerate(types) if t == "conversation.item.deleted") > done_at
    final = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"][-1]
    assert final["item_id"] == user_item
    assert wer("What is the capital of France? And how many people live there?", final["transcript"]) <= 0.25
    session = server.app.state.sessions[raw.session_id]
    users = [it for it in session.conversation.items if it.role == "user"]
    assert [it.id for it in users] == [user_item] and users[0].text() == final["transcript"]
    assert counter(server, "repairs") == repairs + 1
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)


async def test_server_vad_opt_in_and_bad_values(server):
    raw = await open_voice(server, SESSION)
    await raw.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "rtserve_eagerness": "high"}}}}})
    updated = await raw.until("session.updated")
    assert updated[-1]["session"]["audio"]["input"]["turn_detection"]["rtserve_eagerness"] == "high"
    await expect_error(raw, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "rtserve_eagerness": "eager"}}}}}, "invalid_value",
        "session.audio.input.turn_detection.rtserve_eagerness", None)
    await expect_error(raw, {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "semantic_vad", "rtserve_eagerness": "high"}}}}}, "unknown_parameter",
        "session.audio.input.turn_detection.rtserve_eagerness", None)
    await raw.ws.close()


async def test_openai_agents_session_through_an_early_end_and_its_repair(server):
    """openai-agents' RealtimeSession (semantic VAD, spoken replies) through an early end and a repair: no error on
    either side, and the SDK's history holds one user item, the committed one, whose transcript is the joined
    utterance, none of the cancelled reply's items, and the new reply's assistant item last."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    first, _, _ = utterance("What is the capital of France?", tail_ms=PAUSE_MS)
    rest, _, _ = utterance("And how many people live there?", lead_ms=0, tail_ms=1000)
    repairs = counter(server, "repairs")
    settings = {"output_modalities": ["audio"], "max_output_tokens": 16,
                "turn_detection": {"type": "semantic_vad", "eagerness": "medium"}}
    agent = RealtimeAgent(name="voice", instructions=SESSION["instructions"])
    runner = RealtimeRunner(agent, config={"model_settings": settings})
    session = await runner.run(model_config={"url": server.realtime_url, "headers": {},
                                             "initial_model_settings": settings})
    raw, errors, history, sent_rest = [], [], [], False
    async with session:
        await send_speech(session, first)   # the client stops inside the pause
        async with asyncio.timeout(300):
            async for event in session:
                if event.type == "error":
                    errors.append(event.error)
                if event.type == "history_updated":
                    history = list(event.history)
                if event.type == "history_added":
                    history = [it for it in history if it.item_id != event.item.item_id] + [event.item]
                data = getattr(getattr(event, "data", None), "data", None)
                if not isinstance(data, dict):
                    continue
                raw.append(data)
                if data["type"] == "response.created" and not sent_rest:
                    sent_rest = True   # the early end's reply has started: the user goes on
                    await send_speech(session, rest)
                if data["type"] == "response.done" and data["response"]["status"] != "cancelled":
                    break
    assert not errors and not [e for e in raw if e["type"] == "error"], (errors, raw)
    statuses = [e["response"]["status"] for e in raw if e["type"] == "response.done"]
    assert statuses[0] == "cancelled" and statuses[-1] in ("completed", "incomplete"), statuses
    commits = [e["item_id"] for e in raw if e["type"] == "input_audio_buffer.committed"]
    assert len(commits) == 2 and commits[0] == commits[1]
    users = [it for it in history if it.type == "message" and it.role == "user"]
    assert [it.item_id for it in users] == [commits[0]], history
    heard = " ".join(c.transcript or "" for c in users[0].content if c.type == "input_audio")
    assert wer("What is the capital of France? And how many people live there?", heard) <= 0.25, heard
    cancelled = next(e for e in raw if e["type"] == "response.done")["response"]
    gone = {item["id"] for item in cancelled["output"]}
    assert not gone & {it.item_id for it in history}
    assert history[-1].type == "message" and history[-1].role == "assistant"
    assert counter(server, "repairs") == repairs + 1
    await server.wait_idle(pinned_ok=True)


async def test_a_turn_that_paused_is_transcribed_again_from_a_draft(server):
    """A turn that paused and went on: the next pause's transcription checks the first one's transcript, less its last
    word, in one pass (`Transcriber.transcribe`'s draft) instead of a decoder step per token; the transcript is the
    whole utterance, as without it."""
    first, _, _ = utterance("Please send an email to", tail_ms=PAUSE_MS)
    rest, _, _ = utterance("my manager about the meeting.", lead_ms=0, tail_ms=1000)

    def drafts() -> tuple[float, float]:
        lines = server.metrics_text().splitlines()
        value = lambda n: next(float(x.split()[-1]) for x in lines if x.startswith(n + " "))  # noqa: E731
        return value("rtserve_whisper_draft_tokens_total"), value("rtserve_whisper_draft_accepted_tokens_total")
    checked_before, kept_before = drafts()
    checks = counter(server, "end_checks")
    raw = await open_voice(server, SESSION)
    await raw.stream(first, PCM16)
    await checked(server, checks)
    await raw.stream(rest, PCM16)
    events = await raw.until("response.done")
    checked_now, kept_now = drafts()
    assert checked_now > checked_before and kept_now > kept_before, (checked_now, kept_now)
    done = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert wer("Please send an email to my manager about the meeting.", done["transcript"]) <= 0.25, \
        done["transcript"]
    await raw.ws.close()
    await server.wait_idle(pinned_ok=True)
