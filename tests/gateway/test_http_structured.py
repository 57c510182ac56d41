"""Structured outputs over HTTP with the official openai SDK against the real engine: `response_format` (json_schema
strict, json_object, the SDK's `parse()` with a pydantic model) on chat, vLLM's extra fields on completions and chat,
and 400s with `param` for specs the grammar compiler rejects, with the engine back to idle after them.

Sampled requests carry a `seed`; every assertion holds for every sample."""
from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's own name: what the test server serves
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 1, "maximum": 40},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "population_millions", "continent", "landmarks"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a big city as JSON: its name, population, continent, landmarks."}]


class Weather(BaseModel):
    city: str = Field(max_length=24)
    temperature_c: int = Field(ge=-50, le=50)
    sunny: bool


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=server.base_url)


async def test_json_schema_strict_20_samples_all_validate(server):
    c = client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    resps = await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=i,
                                                             max_tokens=300, response_format=fmt)
                                   for i in range(20)])
    for r in resps:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (choice.finish_reason, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    await server.wait_idle(pinned_ok=True)
    assert server.stats()["structured_requests"] == 0


async def test_json_object_and_streamed_schema(server):
    c = client(server)
    ask = [{"role": "user", "content": 'What is 6 times 7? Reply in JSON like {"answer": <number>}.'}]
    r = await c.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=300,
                                        response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for seed in (1, 2, 3):   # a free object is unbounded: a sample ends as an object or is cut inside one
        r = await c.chat.completions.create(model=MODEL, messages=ask, seed=seed, max_tokens=300,
                                            response_format={"type": "json_object"})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert r.usage.completion_tokens == 300 and text.startswith("{"), text
    stream = await c.chat.completions.create(
        model=MODEL, messages=MESSAGES, seed=4, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    parts, reasons = [], []
    async for chunk in stream:
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert reasons == ["stop"]
    jsonschema.validate(json.loads("".join(parts)), SCHEMA)


async def test_sdk_parse_with_pydantic_model(server):
    c = client(server)
    for seed in (0, 1):
        r = await c.chat.completions.parse(
            model=MODEL, seed=seed, max_tokens=100, response_format=Weather,
            messages=[{"role": "user", "content": "What is the weather in Paris today?"}])
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Weather), r.choices[0].message.content
        assert -50 <= parsed.temperature_c <= 50


async def test_vllm_extra_fields_on_completions_and_chat(server):
    c = client(server)
    r = await c.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                                   extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = await c.completions.create(model=MODEL, prompt="My phone number is", max_tokens=20, seed=3,
                                   extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    r = await c.completions.create(model=MODEL, prompt="Today's date:", max_tokens=20, seed=5,
                                   extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20\d{2}-[01]\d-[0-3]\d", r.choices[0].text), r.choices[0].text
    r = await c.completions.create(model=MODEL, prompt="The answer:", max_tokens=20, seed=6,
                                   extra_body={"guided_grammar": 'root ::= "answer: " ("A" | "B" | "C")'})
    assert r.choices[0].text in ("answer: A", "answer: B", "answer: C")
    r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, seed=7, max_tokens=300,
                                        extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, seed=8, max_tokens=300,
                                        extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


BAD = [  # (request fields, the param the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
]


async def test_bad_specs_are_400_with_param_and_leave_nothing_running(server):
    c = client(server)
    await server.wait_idle(pinned_ok=True)
    before = server.stats()
    for fields, param in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **fields)
        assert info.value.body["param"] == param, (fields, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model=MODEL, prompt="hi", max_tokens=8, extra_body={"guided_json": {"type": "nope"}})
    assert info.value.body["param"] == "guided_json", info.value.body
    after = await server.wait_idle(pinned_ok=True)
    assert after["structured_requests"] == 0 and after["prompt_tokens_total"] == before["prompt_tokens_total"]
    assert after["num_steps"] == before["num_steps"], "a rejected request reached the engine"
    metrics = server.metrics_text()
    assert re.search(r"^rtserve_structured_requests 0\.0$", metrics, re.M), metrics
    assert re.search(r"^rtserve_requests_running 0\.0$", metrics, re.M)
    # the server serves on
    r = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                        extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].message.content == "ok"
