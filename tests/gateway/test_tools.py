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
    check_streamed_equals_whole(text, tl.ToolCallParser, content, calls)


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


# Llama 3.1's chat template as meta-llama/Llama-3.1-8B-Instruct ships it (tokenizer_config.json), verbatim.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Pa}ris", "unit": "celsius"}}'
LLAMA_TEXTS = [LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL, "Sure. " + LLAMA_CALL, LLAMA_CALL[:-12],
               LLAMA_CALL + '; {"name": "get_time", "arguments": {}}', '{"parameters": {}, "name": "get_time"}',
               'A set {1, 2} and {"x": 1} and {"name": 5}.', "Hello {", "  hi  "]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama3_json_streamed_parse_equals_whole_parse(text):
    content, calls = tl.parse_output(text, tl.new_tool_parser("llama3_json"))
    check_streamed_equals_whole(text, lambda: tl.new_tool_parser("llama3_json"), content, calls)


def test_llama3_json_parse_shapes():
    parse = lambda text: tl.parse_output(text, tl.new_tool_parser("llama3_json"))   # noqa: E731
    for text in (LLAMA_CALL, "<|python_tag|>" + LLAMA_CALL):
        content, calls = parse(text)
        assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Pa}ris", "unit": "celsius"}
    assert [c["function"] for c in parse(LLAMA_CALL + '; {"name": "get_time", "arguments": {}}')[1]][1] == \
        {"name": "get_time", "arguments": "{}"}
    assert parse('{"parameters": {}, "name": "get_time"}')[1][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert parse("Sure. " + LLAMA_CALL)[0] == "Sure."
    assert parse('A set {1, 2} and {"x": 1} and {"name": 5}.') == ('A set {1, 2} and {"x": 1} and {"name": 5}.', [])
    assert tl.parse_output(LLAMA_CALL) == (LLAMA_CALL, [])   # a Llama call is text to the hermes parser


def test_llama3_json_grammars(tokenizer):
    manager = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    good = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    other = '{"name": "get_time", "parameters": {}}'
    hermes = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    cases = {  # request fields -> (accepted, rejected); Llama 3.1's template renders one call per turn
        "auto": ({}, ["Just text.", good, "Sure. " + good, other],
                 [good.replace("celsius", "kelvin"), good + "; " + other, good.replace('"parameters"', '"arguments"')]),
        "required": ({"tool_choice": "required"}, [good, other],
                     ["Just text.", hermes, "x" + good, good + "; " + other]),
        "named": ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, [other], [good]),
    }
    for name, (fields, ok, bad) in cases.items():
        so = tl.tool_constraint(tl.parse_request({"tools": TOOLS, **fields}), "llama3_json")
        for text in ok:
            assert accepts(manager, so, text, tokenizer), (name, text)
        for text in bad:
            assert not accepts(manager, so, text, tokenizer), (name, text)
    assert tl.tool_constraint(tl.parse_request({"tools": TOOLS, "tool_choice": "none"}), "llama3_json") is None


def test_tool_call_parser_follows_the_template(tokenizer):
    assert tl.detect_tool_call_parser(LLAMA31_TEMPLATE) == "llama3_json"
    assert tl.detect_tool_call_parser(HERMES_TEMPLATE) == "hermes"
    assert tl.detect_tool_call_parser(tokenizer.chat_template) == "hermes"
    assert tl.resolve_tool_call_parser(None, LLAMA31_TEMPLATE, True) == "llama3_json"
    assert tl.resolve_tool_call_parser("hermes", LLAMA31_TEMPLATE, True) == "hermes"   # the flag wins
    assert tl.resolve_tool_call_parser(None, tokenizer.chat_template, False) == "hermes"
    with pytest.raises(ValueError, match="own tool prompt"):   # SmolLM2's template: our prompt, hermes only
        tl.resolve_tool_call_parser("llama3_json", tokenizer.chat_template, False)
    with pytest.raises(ValueError, match="must be one of"):
        tl.resolve_tool_call_parser("mistral", LLAMA31_TEMPLATE, True)


def test_rendering_with_the_llama31_template(tokenizer):
    llama_tok = copy.deepcopy(tokenizer)
    llama_tok.chat_template = LLAMA31_TEMPLATE
    llama = PromptRenderer(llama_tok)
    assert llama.takes_tools()
    req = tl.parse_request({"tools": TOOLS})
    msgs, template_tools = tl.render(HISTORY, req, True)
    text = llama.template(msgs, tools=template_tools)
    # the definitions go into the first user message, as the template puts them
    first_user = text.split("<|start_header_id|>user<|end_header_id|>\n\n", 1)[1].split("<|eot_id|>")[0]
    assert '"name": "get_weather"' in first_user and first_user.endswith("Weather in Paris?")
    # the earlier call in the template's own call format, which the llama3_json grammar forces and its parser reads
    call = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n" + call + "<|eot_id|>" in text
    assert tl.parse_output(call, tl.new_tool_parser("llama3_json"))[1][0]["function"]["name"] == "get_weather"
    # the tool result as the template's ipython turn, not user text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18 degrees"<|eot_id|>' in text
    assert "You may call" not in text and "<tool_response>" not in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_markup_cut_by_the_token_limit_is_not_content():
    """An output cut at max_tokens while it opened a call: the held-back markup is dropped, not returned as text; an
    output that ended on its own keeps such a tail as text."""
    for parser in (tl.ToolCallParser, lambda: tl.new_tool_parser("hermes")):
        assert tl.parse_output("It is sunny. <tool_", parser(), cut=True) == ("It is sunny.", [])
        assert tl.parse_output("It is sunny. <tool_", parser(), cut=False) == ("It is sunny. <tool_", [])


def check_streamed_equals_whole(text: str, new_parser, content, calls) -> None:
    """Fed in random pieces (20 seeds), the parser yields the content and calls that parsing the whole text does."""
    for seed in range(20):
        rng, parser, events, i = random.Random(seed), new_parser(), [], 0
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
