"""LiveKit Agents' OpenAI Realtime plugin (livekit-plugins-openai) against the real server, with no LiveKit server.

The plugin's `RealtimeModel` / `RealtimeSession` run standalone: outside a job context the model opens an aiohttp
session of its own (and closes it in `aclose`), and the session connects to `base_url` + `/realtime` with the GA
dialect. What is checked is what an `AgentSession` relies on: `generate_reply()` resolves to a generation (the server
echoes the `metadata.client_event_id` the plugin matches on) whose message streams text, with and without
instructions (the plugin sends `response.instructions: null` when none are given), and a `function_tool` registered
through `update_tools` with tool_choice "required" surfaces as a `FunctionCall` with schema-valid JSON arguments; its
output goes back through `update_chat_ctx` and the next reply answers. Every error the plugin reports fails the test.

Decoding is greedy (the server's default for these sessions) or constrained by the tool_choice grammar, so every
assertion holds for every run."""
from __future__ import annotations

import asyncio
import contextlib
import json

import jsonschema
from livekit.agents import function_tool, llm
from livekit.plugins.openai.realtime import RealtimeModel

ASK = "What's the weather like in Paris right now?"


@contextlib.asynccontextmanager
async def livekit_session(server, *, max_tokens: int = 32):
    """A plugin session on the server's open root, text output, with the plugin's other defaults (semantic VAD,
    input transcription). Yields the session, the errors it emitted and the client events it sent."""
    model = RealtimeModel(base_url=server.base_url, api_key="unused", model="gpt-realtime", modalities=["text"])
    model.update_options(max_response_output_tokens=max_tokens)
    session = model.session()
    errors: list = []
    sent: list[dict] = []
    session.on("error", errors.append)
    session.on("openai_client_event_queued", sent.append)
    try:
        yield session, errors, sent
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


def response_creates(sent: list[dict]) -> list[dict]:
    return [e["response"] for e in sent if e["type"] == "response.create"]


async def test_livekit_generate_reply_with_and_without_instructions(server):
    """generate_reply(instructions=...) and plain generate_reply() each resolve and stream a non-empty text message;
    the plain one goes out with `instructions: null`, which the server takes as "not set"."""
    async with livekit_session(server) as (session, errors, sent):
        texts, calls = await reply(session, instructions="Say hello to the user in one short sentence.")
        assert len(texts) == 1 and texts[0].strip() and not calls, (texts, calls)

        texts, calls = await reply(session)
        assert len(texts) == 1 and texts[0].strip() and not calls, (texts, calls)

        first, plain = response_creates(sent)
        assert first["instructions"] == "Say hello to the user in one short sentence."
        assert "instructions" in plain and plain["instructions"] is None, plain
        assert errors == []


async def test_livekit_function_tool_required(server):
    """A livekit `function_tool` set through update_tools with tool_choice "required" (update_options): the reply
    carries a FunctionCall of that tool whose arguments are JSON valid against the schema the plugin sent; the
    tool's output goes back through update_chat_ctx and the next reply (tool_choice "none") answers in text."""

    @function_tool
    async def get_weather(city: str) -> str:
        """Current weather in a city.

        Args:
            city: The city name.
        """
        return f"21 degrees and sunny in {city}"

    async with livekit_session(server, max_tokens=64) as (session, errors, sent):
        await session.update_instructions("You answer questions about the weather. Use the tools.")
        await session.update_tools([get_weather])
        session.update_options(tool_choice="required")
        chat_ctx = session.chat_ctx.copy()
        chat_ctx.add_message(role="user", content=ASK)
        async with asyncio.timeout(60):
            await session.update_chat_ctx(chat_ctx)

        texts, calls = await reply(session)
        assert len(calls) == 1 and not any(t.strip() for t in texts), (texts, calls)
        call = calls[0]
        assert call.name == "get_weather" and call.call_id, call
        [tool] = [t for e in sent if e["type"] == "session.update" for t in e["session"].get("tools") or []]
        args = json.loads(call.arguments)
        jsonschema.validate(args, tool["parameters"])
        assert isinstance(args["city"], str) and args["city"]

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
