"""LiveKit Agents' OpenAI plugins for a cascaded voice agent (STT → LLM → TTS, each over the HTTP API) against the
real server, the way an `AgentSession` built from `openai.STT(use_realtime=False)`, `openai.LLM` and `openai.TTS`
pointed at `base_url` calls them, with no LiveKit server.

Checked: the LLM streams a reply, and with a `function_tool` and tool_choice "required" a call whose arguments
parse; the TTS synthesizes 24 kHz frames that carry the response's request id; the STT's one-shot recognition of a
piper clip is a final transcript of it."""
from __future__ import annotations

import json

from livekit import rtc
from livekit.agents import function_tool, llm, stt
from livekit.agents.utils import http_context
from livekit.plugins import openai as lk

from tests.gateway.realtime.client import utterance, wer

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"


@function_tool
async def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "sunny"


async def reply(model: lk.LLM, ctx: llm.ChatContext, **kwargs) -> tuple[str, list]:
    text, calls = "", []
    async with model.chat(chat_ctx=ctx, **kwargs) as stream:
        async for chunk in stream:
            if chunk.delta:
                text += chunk.delta.content or ""
                calls += chunk.delta.tool_calls or []
    return text, calls


async def test_livekit_cascade_plugins(server):
    async with http_context.open():   # outside a job: the plugins' aiohttp session comes from here
        # one call at most (the 135M model repeats a forced call until the cap otherwise, and the plugin passes on
        # calls only when the reply ends on them, not on its length)
        model = lk.LLM(base_url=server.base_url, api_key="unused", model=MODEL, temperature=0.0,
                       max_completion_tokens=48, parallel_tool_calls=False)
        ctx = llm.ChatContext()
        ctx.add_message(role="system", content="You are a concise assistant.")
        ctx.add_message(role="user", content="What's the weather like in Paris right now?")
        text, calls = await reply(model, ctx)
        assert text.strip() and not calls
        text, calls = await reply(model, ctx, tools=[get_weather], tool_choice="required")
        assert len(calls) == 1 and calls[0].name == "get_weather", calls
        assert isinstance(json.loads(calls[0].arguments)["city"], str)

        tts = lk.TTS(base_url=server.base_url, api_key="unused")
        frames = [f async for f in tts.synthesize("The capital of France is Paris.")]
        assert frames and all(f.frame.sample_rate == 24000 and f.request_id for f in frames)
        assert sum(f.frame.samples_per_channel for f in frames) > 24000 // 2

        pcm, _, _ = utterance(ASK)   # pcm16, 24 kHz
        recognizer = lk.STT(base_url=server.base_url, api_key="unused", model="whisper-1", use_realtime=False)
        event = await recognizer.recognize(rtc.AudioFrame(pcm, 24000, 1, len(pcm) // 2))
        assert event.type == stt.SpeechEventType.FINAL_TRANSCRIPT and wer(ASK, event.alternatives[0].text) <= 0.2
        await tts.aclose()
        await recognizer.aclose()
        await model.aclose()
