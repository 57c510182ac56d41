"""LiveKit Agents' OpenAI Realtime plugin (livekit-plugins-openai) against the real server, with no LiveKit server.

The plugin's `RealtimeModel` / `RealtimeSession` run standalone: outside a job context the model opens an aiohttp
session of its own (and closes it in `aclose`), and the session connects to `base_url` + `/realtime` in the GA dialect
with the plugin's defaults (semantic VAD, input transcription), text output. What is checked is what an `AgentSession`
relies on: `generate_reply()` resolves to a generation (the server echoes the `metadata.client_event_id` the plugin
matches on) whose message streams exactly the text the server's `response.done` carries, with and without
instructions (the plugin sends `response.instructions: null` when none are given); a `function_tool` registered
through `update_tools` with tool_choice "required" surfaces as `FunctionCall`s with schema-valid JSON arguments, and
its output goes back through `update_chat_ctx` and the next reply answers. Every error the plugin reports fails.

The plugin sets no temperature (the GA dialect has none), so replies are sampled at the session's default; the
assertions are ones every sample meets: calls are forced and bounded by the tool grammar (the city has a maxLength,
so the first call always fits in max_output_tokens; later parallel calls may be cut, and only completed ones are
checked)."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated

import jsonschema
from pydantic import Field
from livekit import rtc
from livekit.agents import function_tool, llm
from livekit.plugins.openai.realtime import RealtimeModel

from tests.gateway.realtime.client import utterance, wer
from tests.gateway.realtime.test_turn_detection import PAUSE_MS, counter

ASK = "What's the weather like in Paris right now?"


@contextlib.asynccontextmanager
async def livekit_session(server, *, max_tokens: int = 32):
    """A plugin session on the server's open root, text output, with the plugin's other defaults (semantic VAD,
    input transcription). Yields the session, the errors it emitted, the client events it sent and the server events
    it received."""
    model = RealtimeModel(base_url=server.base_url, api_key="unused", model="gpt-realtime", modalities=["text"])
    model.update_options(max_response_output_tokens=max_tokens)
    session = model.session()
    errors: list = []
    sent: list[dict] = []
    received: list[dict] = []
    session.on("error", errors.append)
    session.on("openai_client_event_queued", sent.append)
    session.on("openai_server_event_received", received.append)
    try:
        yield session, errors, sent, received
    finally:
        await session.aclose()
        await model.aclose()
    await server.wait_idle()


async def collect(generation: llm.GenerationCreatedEvent) -> tuple[list[str], list[llm.FunctionCall]]:
    """The texts of the generation's messages and its function calls, read until the response is done."""
    texts = []
    async for message in generation.message_stream:
        texts.append("".join([delta async for delta in message.text_stream]))
    calls = [call async for call in generation.function_stream]
    return texts, calls


async def reply(session, **kwargs) -> tuple[list[str], list[llm.FunctionCall]]:
    async with asyncio.timeout(180):
        return await collect(await session.generate_reply(**kwargs))


def push_speech(session, pcm: bytes) -> None:
    """pcm16 24 kHz audio into the plugin, in 100 ms frames."""
    for i in range(0, len(pcm), 4800):
        chunk = pcm[i:i + 4800]
        session.push_audio(rtc.AudioFrame(chunk, 24000, 1, len(chunk) // 2))


def response_creates(sent: list[dict]) -> list[dict]:
    return [e["response"] for e in sent if e["type"] == "response.create"]


def responses_done(received: list[dict]) -> list[dict]:
    return [e["response"] for e in received if e["type"] == "response.done"]


def message_texts(response: dict) -> list[str]:
    return ["".join(part.get("text", "") for part in item["content"])
            for item in response["output"] if item["type"] == "message"]


async def test_livekit_generate_reply_with_and_without_instructions(server):
    """generate_reply(instructions=...) and plain generate_reply() each resolve and stream a non-empty text message,
    the text of the server's response.done; the plain one goes out with `instructions: null`, which the server takes
    as "not set"."""
    async with livekit_session(server) as (session, errors, sent, received):
        first = await reply(session, instructions="Say hello to the user in one short sentence.")
        plain = await reply(session)
        for (texts, calls), done in zip((first, plain), responses_done(received), strict=True):
            assert done["status"] in ("completed", "incomplete"), done
            assert texts == message_texts(done) and len(texts) == 1 and texts[0].strip() and not calls, (texts, done)

        first, plain = response_creates(sent)
        assert first["instructions"] == "Say hello to the user in one short sentence."
        assert "instructions" in plain and plain["instructions"] is None, plain
        assert errors == []


async def test_livekit_function_tool_required(server):
    """A livekit `function_tool` set through update_tools with tool_choice "required" (update_options): the reply
    carries FunctionCalls of that tool, no text; the first (and every completed one) has arguments that are JSON
    valid against the schema the plugin sent. The tool's output goes back through update_chat_ctx and the next
    reply (tool_choice "none") answers in text."""

    @function_tool
    async def get_weather(city: Annotated[str, Field(max_length=40, description="The city name.")]) -> str:
        """Current weather in a city."""
        return f"21 degrees and sunny in {city}"

    async with livekit_session(server, max_tokens=160) as (session, errors, sent, received):
        await session.update_instructions("You answer questions about the weather. Use the tools.")
        await session.update_tools([get_weather])
        session.update_options(tool_choice="required")
        chat_ctx = session.chat_ctx.copy()
        chat_ctx.add_message(role="user", content=ASK)
        async with asyncio.timeout(60):
            await session.update_chat_ctx(chat_ctx)

        texts, calls = await reply(session)
        [done] = responses_done(received)
        assert calls and not texts and not message_texts(done), (texts, done)
        [tool] = [t for e in sent if e["type"] == "session.update" for t in e["session"].get("tools") or []]
        assert tool["parameters"]["properties"]["city"]["maxLength"] == 40
        completed = {item["call_id"] for item in done["output"] if item["status"] == "completed"}
        assert calls[0].call_id in completed, done
        assert [c.call_id for c in calls] == [item["call_id"] for item in done["output"]]
        for call in calls:
            assert call.name == "get_weather", call
            if call.call_id in completed:
                jsonschema.validate(json.loads(call.arguments), tool["parameters"])
        call, args = calls[0], json.loads(calls[0].arguments)

        # the call is in the plugin's mirror of the conversation, as the server announced it
        assert any(isinstance(item, llm.FunctionCall) and item.call_id == call.call_id
                   for item in session.chat_ctx.items)

        chat_ctx = session.chat_ctx.copy()
        chat_ctx.items.append(llm.FunctionCallOutput(call_id=call.call_id, name=call.name, is_error=False,
                                                     output=f"21 degrees and sunny in {args['city']}"))
        async with asyncio.timeout(60):
            await session.update_chat_ctx(chat_ctx)
        texts, calls = await reply(session, tool_choice="none")
        assert len(texts) == 1 and texts[0].strip() and not calls, (texts, calls)
        assert errors == []


async def test_livekit_spoken_turn_ends_early(server):
    """Speech pushed through the plugin's `push_audio` (piper's "What is the capital of France?", then a pause the
    client never finishes), under the plugin's default semantic VAD: the server ends the turn early, and the plugin
    reports speech started and stopped, the final transcript and a server-created generation whose message streams the
    text of the server's response.done."""
    pcm, _, _ = utterance("What is the capital of France?", tail_ms=PAUSE_MS)   # pcm16, 24 kHz
    early = counter(server, "early_ends")
    async with livekit_session(server) as (session, errors, sent, received):
        seen: dict[str, list] = {"input_speech_started": [], "input_speech_stopped": [],
                                 "input_audio_transcription_completed": [], "generation_created": []}
        for name, got in seen.items():
            session.on(name, got.append)
        push_speech(session, pcm)
        async with asyncio.timeout(180):
            while not seen["generation_created"]:
                await asyncio.sleep(0.05)
            texts, calls = await collect(seen["generation_created"][0])
        assert seen["input_speech_started"] and seen["input_speech_stopped"]
        final = [t for t in seen["input_audio_transcription_completed"] if t.is_final]
        assert len(final) == 1 and wer("What is the capital of France?", final[0].transcript) <= 0.2, final
        assert not seen["generation_created"][0].user_initiated
        [done] = responses_done(received)
        assert done["status"] in ("completed", "incomplete") and texts == message_texts(done) and texts[0].strip()
        assert not calls and errors == []
        assert counter(server, "early_ends") == early + 1


async def test_livekit_through_a_repaired_turn(server):
    """The user goes on right after an early end (speech pushed through the plugin): the plugin reports no error, the
    first generation ends with the cancelled reply, a second server-created generation answers the whole utterance,
    and the plugin's mirror of the conversation holds the user item once (by its id) and none of the cancelled reply's
    items. (The mirror appends each completed transcript to the item's content, docs/gateway.md, Repair.)"""
    first, _, _ = utterance("What is the capital of France?", tail_ms=PAUSE_MS)
    rest, _, _ = utterance("And how many people live there?", lead_ms=0, tail_ms=1000)
    repairs = counter(server, "repairs")

    async with livekit_session(server) as (session, errors, sent, received):
        generations: list = []
        session.on("generation_created", generations.append)
        push_speech(session, first)
        async with asyncio.timeout(180):
            while not generations:
                await asyncio.sleep(0.05)
            push_speech(session, rest)   # the early end's reply has started: the user goes on
            await collect(generations[0])
            while len(generations) < 2:
                await asyncio.sleep(0.05)
            texts, _ = await collect(generations[1])
            while len(responses_done(received)) < 2:
                await asyncio.sleep(0.05)
        cancelled, done = responses_done(received)
        assert cancelled["status"] == "cancelled" and done["status"] in ("completed", "incomplete")
        assert texts == message_texts(done)
        commits = [e["item_id"] for e in received if e["type"] == "input_audio_buffer.committed"]
        assert len(commits) == 2 and commits[0] == commits[1]
        mirror = session.chat_ctx.items
        assert [item.id for item in mirror if getattr(item, "role", None) == "user"] == [commits[0]]
        assert not {item["id"] for item in cancelled["output"]} & {item.id for item in mirror}
        assert errors == []
        assert counter(server, "repairs") == repairs + 1
