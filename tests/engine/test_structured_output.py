"""Grammar-constrained decoding (SamplingParams.structured_outputs) on the real model in the server's configuration
(bf16 on the GGUF's 4-bit blocks): every sampled output follows its schema / regex / choice / grammar, constrained and
unconstrained rows share batches without changing the unconstrained ones, and no matcher outlives its request."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine import LLM, InvalidRequestError, LLMEngine, SamplingParams, StructuredOutputsParams
from tests.engine.test_llm_engine import BLOCK_SIZE, PAGE_SIZE, assert_greedy, drive, kv_bytes

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="bfloat16", quantization="gguf")


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)


def constrained(max_tokens: int = 300, temperature: float = 1.0, seed: int | None = None, **so) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(**so))


def assert_no_matchers(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["structured_requests"] == 0 and not llm.engine.structured.matchers, s
    assert (s["requests_running"], s["requests_waiting"]) == (0, 0), s


def test_json_schema_20_samples_at_temperature_1_all_validate(llm):
    """20 seeded samples in one batch: each is JSON that the jsonschema library validates against the schema."""
    prompt = chat(llm, "Describe a person as JSON with their name, age, job and hobbies.")
    steps_before = llm.engine.stats()["structured_mask_steps"]
    outs = llm.generate([prompt] * 20, [constrained(json=PERSON, seed=i) for i in range(20)])
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), PERSON)
        assert list(json.loads(o.text)) == list(PERSON["properties"]), "properties come in the schema's order"
    assert len({o.text for o in outs}) > 1, "seeded samples at temperature 1 should differ"
    assert llm.engine.stats()["structured_mask_steps"] > steps_before
    assert_no_matchers(llm)


def assert_json_object(o, max_tokens: int) -> None:
    """json_object bounds nothing (a free object can nest or run a string on), so a sample either ends as an object or
    is cut by max_tokens inside one."""
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict), o.text
    else:
        assert o.finish_reason == "length" and len(o.token_ids) == max_tokens and o.text.startswith("{"), o.text


def test_json_schema_as_text_and_json_object(llm):
    out = llm.generate(chat(llm, "Describe a person as JSON."), constrained(json=json.dumps(PERSON), seed=1))[0]
    jsonschema.validate(json.loads(out.text), PERSON)
    prompt = chat(llm, 'What is 6 times 7? Reply in JSON like {"answer": <number>}.')
    outs = llm.generate([prompt] * 9, [constrained(json_object=True, temperature=0)] +
                        [constrained(json_object=True, seed=i) for i in range(8)])
    assert outs[0].finish_reason == "stop" and isinstance(json.loads(outs[0].text), dict), outs[0].text
    for o in outs:
        assert_json_object(o, 300)
    assert sum(o.finish_reason == "stop" for o in outs) >= 5
    assert_no_matchers(llm)


def test_regex(llm):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    prompt = chat(llm, "What is a phone number I can call?")
    outs = llm.generate([prompt] * 6, [constrained(regex=pattern, temperature=0)] +
                        [constrained(regex=pattern, seed=i) for i in range(5)])
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (o.finish_reason, o.text)
    assert_no_matchers(llm)


def test_choice_and_grammar(llm):
    choices = ["yes", "no", "it depends"]
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'
    outs = llm.generate([chat(llm, "Is the sky blue?")] * 6 + [chat(llm, "What is 6 times 7?")] * 3,
                        [constrained(choice=choices, seed=i) for i in range(5)] +
                        [constrained(choice=choices, temperature=0)] +
                        [constrained(grammar=grammar, seed=i) for i in range(2)] +
                        [constrained(grammar=grammar, temperature=0)])
    for o in outs[:6]:
        assert o.finish_reason == "stop" and o.text in choices, (o.finish_reason, o.text)
    for o in outs[6:]:
        assert o.finish_reason == "stop" and re.fullmatch(r"The answer is \d\d?\.", o.text), o.text
    assert_no_matchers(llm)


def test_mixed_batch_leaves_unconstrained_rows_as_alone(llm):
    """Constrained and unconstrained requests in the same steps: the unconstrained rows get their greedy output alone
    (up to the bf16 near-ties test_llm_engine.assert_greedy allows for batch-size-dependent kernels)."""
    eng = llm.engine
    texts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    plain = {eng.add_request(t, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)): t for t in texts}
    cons = [eng.add_request(chat(llm, "Describe a person as JSON."), constrained(json=PERSON, seed=i))
            for i in range(2)]
    cons.append(eng.add_request(chat(llm, "Phone?"), constrained(regex=r"\d{3}-\d{4}", temperature=0)))
    tokens, _, reasons = drive(eng)
    for rid in cons:
        assert reasons[rid] == "stop"
    for rid in cons[:2]:
        jsonschema.validate(json.loads(llm.tokenizer.decode(tokens[rid], skip_special_tokens=True)), PERSON)
    assert re.fullmatch(r"\d{3}-\d{4}", llm.tokenizer.decode(tokens[cons[2]], skip_special_tokens=True))
    assert_no_matchers(llm)
    for rid, text in plain.items():
        assert reasons[rid] == "length" and len(tokens[rid]) == 24
        assert_greedy(eng, eng.tokenizer.encode(text, add_special_tokens=False), tokens[rid])


def test_abort_and_finish_leave_no_matcher(llm):
    eng = llm.engine
    prompt = chat(llm, "Describe a person as JSON.")
    rids = [eng.add_request(prompt, constrained(json=PERSON, seed=i)) for i in range(3)]
    plain = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert eng.stats()["structured_requests"] == 3          # a matcher per constrained request, from admission on
    eng.abort_request(rids[0])                               # aborted while waiting
    assert eng.stats()["structured_requests"] == 2
    for _ in range(3):
        eng.step()
    eng.abort_request(rids[1])                               # aborted mid-decode
    assert eng.stats()["structured_requests"] == 1
    _, _, reasons = drive(eng)
    assert reasons == {rids[2]: "stop", plain: reasons[plain]}
    assert_no_matchers(llm)


def test_preempted_constrained_requests_resume_valid(llm):
    """A pool of 160 slots and four constrained requests of ~30 prompt and 25+ output tokens each: some are preempted
    and recomputed from their tokens, their matchers carry on, and every output still validates."""
    eng = LLMEngine(dtype="bfloat16", quantization="gguf", kv_cache_memory=kv_bytes(40), page_size=PAGE_SIZE,
                    block_size=BLOCK_SIZE, max_num_seqs=4)
    prompt = chat(llm, "Describe a person as JSON.")
    rids = [eng.add_request(prompt, constrained(json=PERSON, seed=i), cache_salt=str(i)) for i in range(4)]
    tokens, _, reasons = drive(eng)
    assert eng.scheduler.num_preemptions > 0
    for rid in rids:
        assert reasons[rid] == "stop"
        jsonschema.validate(json.loads(eng.tokenizer.decode(tokens[rid], skip_special_tokens=True)), PERSON)
    assert eng.stats()["structured_requests"] == 0 and not eng.structured.matchers


def test_bad_specs_fail_alone_at_admission(llm):
    eng = llm.engine
    before = eng.stats()
    for so, param in [({"json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "structured_outputs.json"),
                      ({"json": "{not json"}, "structured_outputs.json"),
                      ({"regex": "(unclosed"}, "structured_outputs.regex"),
                      ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar")]:
        with pytest.raises(InvalidRequestError) as exc:
            eng.add_request("hello", SamplingParams(structured_outputs=so))
        assert exc.value.param == param, (exc.value.param, str(exc.value))
    for so, param in [({"regex": "a", "choice": ["b"]}, "structured_outputs"),
                      ({"choice": []}, "structured_outputs.choice"),
                      ({"jsn": {}}, "structured_outputs.jsn")]:
        with pytest.raises(InvalidRequestError) as exc:
            SamplingParams(structured_outputs=so)
        assert exc.value.param == param, (exc.value.param, str(exc.value))
    assert not eng.has_unfinished()
    after = eng.stats()
    assert after["structured_requests"] == 0 and after["num_steps"] == before["num_steps"]
    # the engine serves on: a good constrained request right after
    out = llm.generate(chat(llm, "yes or no?"), constrained(choice=["yes", "no"], temperature=0))[0]
    assert out.text in ("yes", "no")
    assert_no_matchers(llm)
