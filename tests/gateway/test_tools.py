"""gateway/tools.py without the server: the call parser (streamed in any split = the whole text), the grammar each
tool_choice compiles to (with the default model's tokenizer), and rendering through a chat template that takes tools
(a Hermes-style template like Qwen2.5's) next to SmolLM2's, which does not."""
from __future__ import annotations

import copy
import json
import random

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from engine.models.loader import resolve_model_dir
from engine.structured_output import StructuredOutputManager
from gateway import tools as tl
from gateway.realtime.conversation import PromptRenderer

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time"}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "celsius"}}</tool_call>'
TEXTS = ["Hello <tool world", CALL, "Sure.\n" + CALL + "\n" + CALL + "\n", CALL[:-20],
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',          # Qwen2.5's layout
         '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>', "<tool_call>junk</tool_call> ok", "  hi  "]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_parse_equals_whole_parse(text):
    content, calls = tl.parse_output(text)
    assert "<tool_call>" not in (content or "") or "junk" in content
    for seed in range(20):
        rng, parser, events, i = random.Random(seed), tl.ToolCallParser(), [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            events += parser.feed(text[i:i + n])
            i += n
        events += parser.finish()
        assert ("".join(e[1] for e in events if e[0] == "content") or None) == content
        args = {}
        for e in events:
            if e[0] == "args":
                args[e[1]] = args.get(e[1], "") + e[2]
        assert [e[3] for e in events if e[0] == "call"] == [c["function"]["name"] for c in calls]
        assert [args.get(i, "") for i in range(len(calls))] == [c["function"]["arguments"] for c in calls]


def test_parse_output_shapes():
    content, calls = tl.parse_output("Sure.\n" + CALL)
    assert content == "Sure." and len(calls) == 1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Pa}ris", "unit": "celsius"}
    assert tl.parse_output('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')[1][0]["function"] == \
        {"name": "get_time", "arguments": "{}"}
    assert tl.parse_output("  hi  ") == ("hi", [])


def accepts(manager, so, text, tokenizer) -> bool:
    m = xgr.GrammarMatcher(manager.compile(so))
    return all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and \
        m.accept_token(tokenizer.eos_token_id)


def test_tool_choice_grammars(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    good = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    other = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    spaced = good.replace('"city": ', '"city":  ')
    wrong = good.replace("celsius", "kelvin")
    cases = {  # request fields -> (accepted, rejected)
        "auto": ({}, ["Just text.", good, "Sure. " + good, good + "\n" + other], [spaced, wrong]),
        "required": ({"tool_choice": "required"}, [good, other, good + "\n" + other], ["Just text.", "x" + good]),
        "single": ({"tool_choice": "required", "parallel_tool_calls": False}, [good], [good + "\n" + other]),
        "named": ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, [other], [good]),
    }
    for name, (fields, ok, bad) in cases.items():
        so = tl.parse_request({"tools": TOOLS, **fields}).constraint()
        for text in ok:
            assert accepts(manager, so, text, tokenizer), (name, text)
        for text in bad:
            assert not accepts(manager, so, text, tokenizer), (name, text)
    assert tl.parse_request({"tools": TOOLS, "tool_choice": "none"}).constraint() is None


HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]


def test_rendering_follows_the_template(tokenizer):
    req = tl.parse_request({"tools": TOOLS})
    smol = PromptRenderer(tokenizer)
    assert not smol.takes_tools()
    msgs, template_tools = tl.render(HISTORY, req, smol.takes_tools())
    text = smol.template(msgs, tools=template_tools)
    assert template_tools is None and "<tools>\n" + json.dumps(TOOLS[0]) in text and "You may call" in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>" in text

    hermes_tok = copy.deepcopy(tokenizer)
    hermes_tok.chat_template = HERMES_TEMPLATE
    hermes = PromptRenderer(hermes_tok)
    assert hermes.takes_tools()
    msgs, template_tools = tl.render(HISTORY, req, hermes.takes_tools())
    text = hermes.template(msgs, tools=template_tools)
    assert "You may call" not in text and '"name": "get_weather"' in text.split("</tools>")[0]
    # the template formats the arguments itself: an object, not a JSON string inside JSON
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    # tool_choice none: the template gets no tools
    assert tl.render(HISTORY, tl.parse_request({"tools": TOOLS, "tool_choice": "none"}), True)[1] is None
