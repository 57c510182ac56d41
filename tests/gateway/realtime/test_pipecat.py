"""pipecat's OpenAI Realtime service (pipecat-ai's `OpenAIRealtimeLLMService`) against the real server, in a pipecat
pipeline with no transport: frames in at the front, frames collected at both ends.

pipecat parses every server event it knows with its own pydantic models and takes any error event, and any event its
models refuse, as fatal to the connection (its receive loop ends). So a session that ran through here met pipecat's
schemas and sent it no error it does not expect. What is checked is what a pipecat voice bot relies on:
- the bot speaks first: the service's system instruction goes out in `session.update`, and pipecat's response.create
  (with `output_modalities`) gets a spoken reply (`TTSAudioRawFrame`s at 24 kHz, `TTSTextFrame`s);
- the user speaks (piper's voice as `InputAudioRawFrame`s), the server's semantic VAD ends the turn, and pipecat gets
  the final transcript (`TranscriptionFrame`, upstream) and a spoken reply to it;
- `retrieve_conversation_item` returns the user's item, and for an id that names no item fails its own future only
  (pipecat matches OpenAI's error code `item_retrieve_invalid_item_id` and the event_id it chose): the connection goes
  on, and the next retrieve answers;
- a tool call: pipecat runs its registered function on the call's arguments, sends the result, and the reply to it is
  spoken;
- barge-in: the user speaks over the bot, and pipecat's truncate of the reply it was playing keeps what was heard;
- pipecat's own turn detection (`turn_detection=False`): its commit and response.create answer the user.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
from pipecat.frames.frames import (EndFrame, ErrorFrame, Frame, FunctionCallResultFrame, InputAudioRawFrame,
                                   LLMContextFrame, LLMFullResponseEndFrame, LLMUpdateSettingsFrame,
                                   ProposedUserStartedSpeakingFrame, ProposedUserStoppedSpeakingFrame,
                                   TranscriptionFrame, TTSAudioRawFrame, TTSTextFrame, UserStartedSpeakingFrame,
                                   UserStoppedSpeakingFrame)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.aggregators.llm_context import LLMContext
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.llm_service import FunctionCallParams
from pipecat.services.openai.realtime import events
from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
from pipecat.tests.utils import QueuedFrameProcessor
from pipecat.workers.runner import WorkerRunner

from tests.gateway.realtime.client import utterance, wer
from tests.gateway.realtime.test_turn_detection import PAUSE_MS, counter

ASK = "What is the capital of France?"
RATE = 24_000


class Frames:
    """What reached either end of the pipeline, in order."""

    def __init__(self) -> None:
        self.down: asyncio.Queue = asyncio.Queue()
        self.up: asyncio.Queue = asyncio.Queue()
        self.seen: list[tuple[str, Frame]] = []

    async def drain(self) -> None:
        for name, queue in (("down", self.down), ("up", self.up)):
            while not queue.empty():
                self.seen.append((name, queue.get_nowait()))

    async def until(self, check, timeout: float = 180) -> None:
        async with asyncio.timeout(timeout):
            while True:
                await self.drain()
                errors = [f for _, f in self.seen if isinstance(f, ErrorFrame)]
                assert not errors, errors
                if check(self):
                    return
                await asyncio.sleep(0.05)

    def of(self, kind: type, direction: str | None = None) -> list:
        return [f for d, f in self.seen if isinstance(f, kind) and direction in (None, d)]


@contextlib.asynccontextmanager
async def pipecat_bot(server, instructions: str, context: LLMContext | None = None, functions: dict | None = None,
                      **properties):
    """pipecat's Realtime service in a pipeline on the server's open root: audio out, the server's semantic VAD and
    input transcription, `instructions` as its system instruction, `properties` on its session, `functions` (name ->
    handler) registered; the initial context (`context`, else an empty one) sent, which makes the bot answer it
    (speak first)."""
    props = events.SessionProperties(**{
        "max_output_tokens": 24,
        "audio": events.AudioConfiguration(input=events.AudioInput(
            transcription=events.InputAudioTranscription(),
            turn_detection=events.SemanticTurnDetection(eagerness="auto"))), **properties})
    service = OpenAIRealtimeLLMService(
        api_key="unused", base_url=f"ws://{server.host}:{server.port}/v1/realtime",
        settings=OpenAIRealtimeLLMService.Settings(model="gpt-realtime", system_instruction=instructions,
                                                   session_properties=props))
    for name, handler in (functions or {}).items():
        service.register_function(name, handler)
    frames = Frames()
    pipeline = Pipeline([QueuedFrameProcessor(queue=frames.up, queue_direction=FrameDirection.UPSTREAM),
                         service,
                         QueuedFrameProcessor(queue=frames.down, queue_direction=FrameDirection.DOWNSTREAM)])
    worker = PipelineWorker(pipeline, cancel_on_idle_timeout=False,
                            params=PipelineParams(audio_in_sample_rate=RATE, audio_out_sample_rate=RATE))
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    run = asyncio.create_task(runner.run())
    try:
        await worker.queue_frame(LLMContextFrame(context or LLMContext()))
        yield service, worker, frames
    finally:
        await worker.queue_frame(EndFrame())
        async with asyncio.timeout(30):
            await run
    await server.wait_idle()


def speech_frames(pcm: bytes) -> list[InputAudioRawFrame]:
    """pcm16 24 kHz audio as a transport's 20 ms input frames."""
    step = RATE // 50 * 2
    return [InputAudioRawFrame(audio=pcm[i:i + step], sample_rate=RATE, num_channels=1)
            for i in range(0, len(pcm), step)]


def spoken(seen: list[tuple[str, Frame]]) -> tuple[int, str]:
    """Bytes of reply audio and the reply's transcript text among these frames (`Frames.seen` or a slice of it)."""
    audio = [f for _, f in seen if isinstance(f, TTSAudioRawFrame)]
    assert all(f.sample_rate == RATE and f.num_channels == 1 for f in audio)
    return sum(len(f.audio) for f in audio), "".join(f.text for _, f in seen if isinstance(f, TTSTextFrame))


@pytest.mark.slow
async def test_pipecat_voice_bot_speaks_first_then_answers_a_spoken_question(server):
    """The bot's greeting, then piper's "What is the capital of France?" and a pause the client never finishes: the
    turn ends early, pipecat gets the transcript and a spoken answer, and retrieves items (a missing one failing only
    its own call)."""
    pcm, _, _ = utterance(ASK, tail_ms=PAUSE_MS)
    early = counter(server, "early_ends")
    async with pipecat_bot(server, "You are a helpful assistant. Greet the user in a few words.") as (
            service, worker, frames):
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 1)   # the greeting
        greeting_bytes, greeting_text = spoken(frames.seen)
        assert greeting_bytes > RATE // 5 and greeting_text.strip()
        mark = len(frames.seen)

        for frame in speech_frames(pcm):
            await worker.queue_frame(frame)
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 2 and f.of(TranscriptionFrame, "up"))
        [heard] = frames.of(TranscriptionFrame, "up")
        assert wer(ASK, heard.text) <= 0.2, heard.text
        answer_bytes, answer_text = spoken(frames.seen[mark:])
        assert answer_bytes > RATE // 5 and answer_text.strip()
        assert counter(server, "early_ends") == early + 1
        assert frames.of(ProposedUserStartedSpeakingFrame) and frames.of(ProposedUserStoppedSpeakingFrame)  # server VAD

        user_id = heard.result.item_id
        item = await asyncio.wait_for(service.retrieve_conversation_item(user_id), 30)
        assert item.role == "user" and wer(ASK, item.content[0].transcript) <= 0.2
        with pytest.raises(Exception, match="does not exist"):
            await asyncio.wait_for(service.retrieve_conversation_item("item_gone"), 30)
        again = await asyncio.wait_for(service.retrieve_conversation_item(user_id), 30)   # the connection went on
        assert again.id == user_id
        await frames.drain()
        assert not frames.of(ErrorFrame)


WEATHER = FunctionSchema(
    name="get_weather", description="The current weather in a city.",
    properties={"city": {"type": "string", "maxLength": 40, "description": "The city, e.g. Paris"}}, required=["city"])


@pytest.mark.slow
async def test_pipecat_function_call_round_trip(server):
    """A voice agent's tool call the pipecat way: the model must call `get_weather` (tool_choice required) on the
    initial context's question; pipecat runs the registered handler with the parsed arguments and sends its result
    (a `function_call_output` item); the session is then switched to tool_choice none, and the context frame the
    assistant aggregator would push upstream asks for the reply, which is spoken. (A call costs the 135M model about
    30 tokens with its wrapper, and it may add a parallel one, which max_output_tokens may cut: pipecat runs only
    calls whose arguments parse, and each of those is checked.)"""
    context = LLMContext(messages=[{"role": "user", "content": "What's the weather like in Paris right now?"}],
                         tools=ToolsSchema(standard_tools=[WEATHER]))
    calls: list[dict] = []

    async def get_weather(params: FunctionCallParams) -> None:
        calls.append(dict(params.arguments))
        await params.result_callback({"sky": "sunny", "temperature_c": 21})

    async with pipecat_bot(server, "You are a weather assistant. Use get_weather for weather questions.", context,
                           {"get_weather": get_weather}, tool_choice="required", max_output_tokens=64) as (
            service, worker, frames):
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 1 and f.of(FunctionCallResultFrame))
        assert calls and all(isinstance(c.get("city"), str) and 0 < len(c["city"]) <= 40 for c in calls), calls
        [result] = frames.of(FunctionCallResultFrame, "down")[:1]
        assert result.function_name == "get_weather" and result.result == {"sky": "sunny", "temperature_c": 21}
        mark = len(frames.seen)

        settled = service.settings.session_properties.model_copy(update={"tool_choice": "none"})
        await worker.queue_frame(LLMUpdateSettingsFrame(delta=OpenAIRealtimeLLMService.Settings(
            session_properties=settled)))
        # the service handles its frames in order, both ways: once it is applying the update (whose session.update
        # it sends before it takes the next frame), the aggregator's context frame comes after it
        await frames.until(lambda f: service.settings.session_properties.tool_choice == "none")
        await worker.queue_frame(LLMContextFrame(context), FrameDirection.UPSTREAM)
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 2)
        answer_bytes, answer_text = spoken(frames.seen[mark:])
        assert answer_bytes > RATE // 5 and answer_text.strip()
        assert len(calls) == len(frames.of(FunctionCallResultFrame, "down"))   # no call after tool_choice none


@pytest.mark.slow
async def test_pipecat_barge_in(server):
    """The user speaks over the bot's story, in real time as a transport delivers it: the server cancels the reply,
    pipecat truncates the item it was playing (its own `conversation.item.truncate`, audio_end_ms from its clock), so
    the item keeps the start of its transcript that was heard; and the new turn is transcribed and answered. No error
    reaches pipecat on the way."""
    pcm, _, _ = utterance(ASK, lead_ms=0, tail_ms=PAUSE_MS)
    async with pipecat_bot(server, "You are a storyteller. Tell a long story about the sea.",
                           max_output_tokens=96) as (service, worker, frames):
        created: list = []

        @service.event_handler("on_conversation_item_created")
        async def _created(service, item_id, item):
            created.append(item)

        await frames.until(lambda f: f.of(TTSAudioRawFrame))   # the bot speaks
        [story] = [item for item in created if item.role == "assistant"]
        await asyncio.sleep(2.0)   # and the user listens a while
        for frame in speech_frames(pcm):
            await worker.queue_frame(frame)
            await asyncio.sleep(0.02)
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 2 and f.of(TranscriptionFrame, "up"))
        [heard] = frames.of(TranscriptionFrame, "up")
        assert wer(ASK, heard.text) <= 0.2, heard.text

        first_end = next(i for i, (_, f) in enumerate(frames.seen) if isinstance(f, LLMFullResponseEndFrame))
        _, told = spoken(frames.seen[:first_end])
        cut = await asyncio.wait_for(service.retrieve_conversation_item(story.id), 30)
        assert cut.status == "incomplete", cut   # cancelled by the barge-in
        [part] = cut.content
        heard_part = part.transcript.strip()
        assert heard_part and told.startswith(heard_part) and len(heard_part) < len(told.strip()), (heard_part, told)
        assert not frames.of(ErrorFrame)


@pytest.mark.slow
async def test_pipecat_local_turn_detection(server):
    """pipecat's manual mode (`turn_detection=False`, sent as null: its own VAD drives the turns): the user's speech
    between the VAD's started and stopped frames is committed and answered by pipecat's own response.create, with the
    server's transcript, and the server reports no speech events of its own."""
    pcm, _, _ = utterance(ASK, tail_ms=300)
    manual = events.AudioConfiguration(input=events.AudioInput(transcription=events.InputAudioTranscription(),
                                                                turn_detection=False))
    async with pipecat_bot(server, "You are a helpful assistant. Greet the user in a few words.", audio=manual) as (
            service, worker, frames):
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 1)   # the greeting
        mark = len(frames.seen)
        await worker.queue_frame(UserStartedSpeakingFrame())
        for frame in speech_frames(pcm):
            await worker.queue_frame(frame)
        await worker.queue_frame(UserStoppedSpeakingFrame())
        await frames.until(lambda f: len(f.of(LLMFullResponseEndFrame)) == 2 and f.of(TranscriptionFrame, "up"))
        [heard] = frames.of(TranscriptionFrame, "up")
        assert wer(ASK, heard.text) <= 0.2, heard.text
        answer_bytes, answer_text = spoken(frames.seen[mark:])
        assert answer_bytes > RATE // 5 and answer_text.strip()
        # pipecat broadcasts these on the server's speech_started / speech_stopped: none came
        assert not frames.of(ProposedUserStartedSpeakingFrame) and not frames.of(ProposedUserStoppedSpeakingFrame)
