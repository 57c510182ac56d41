"""SamplingParams.prompt_logprob_positions: the logprob of chosen prompt tokens, from the prefill's own forward pass.

The Realtime turn detection asks for the logprob of the end-of-turn token right after the user's words in the prompt
it already prefills ahead of the turn's end; these tests check the value is the model's (the same as the first-token
logprob of the prompt cut just before that token), that it costs no step and no forward pass, and that it survives
chunked prefill and a prefix-cache hit.
"""
from __future__ import annotations

import math

import pytest

from engine import InvalidRequestError, LLMEngine, SamplingParams

TOL_NATS = 0.1  # bf16 rows computed in batches of different shapes (a whole prompt vs. its prefix)
TOP_TOL_NATS = 0.35  # the same, for tokens ranked below the first (the tolerance of the HF comparisons)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(dtype="bfloat16", quantization="gguf", kv_cache_memory="64MiB", max_num_batched_tokens=32,
                     long_prefill_token_threshold=0)


def chat_prompt(engine: LLMEngine, text: str) -> tuple[list[int], int]:
    """The prompt a reply to `text` renders, and the position of the end-of-turn token after the user's words."""
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    return ids, max(i for i, t in enumerate(ids) if t == eot)


def run(engine: LLMEngine, ids: list[int], params: SamplingParams, salt: str) -> tuple[list, int, int]:
    """Run one request alone to its end: its outputs, and the engine steps and forward passes it took."""
    calls = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch: (calls.append(len(batch)), execute(batch))[1]
    try:
        steps = engine.num_steps
        engine.add_request(ids, params, cache_salt=salt)
        outs = []
        while engine.has_unfinished():
            outs.extend(engine.step())
        return outs, engine.num_steps - steps, len(calls)
    finally:
        engine.runner.execute = execute


def test_end_of_turn_logprob_is_the_models_and_costs_no_forward_pass(engine):
    ids, pos = chat_prompt(engine, "What is the capital of France?")
    assert len(ids) > 32  # prefilled in more than one chunk: the scored position is in a chunk that does not sample
    scored, steps, passes = run(engine, ids, SamplingParams(max_tokens=3, temperature=0,
                                                             prompt_logprob_positions=[pos]), "a")
    plain, plain_steps, plain_passes = run(engine, ids, SamplingParams(max_tokens=3, temperature=0), "b")
    assert (steps, passes) == (plain_steps, plain_passes)
    assert [o.new_token_ids for o in scored] == [o.new_token_ids for o in plain]
    got = scored[0].prompt_logprobs
    assert set(got) == {pos} and all(o.prompt_logprobs is None for o in scored[1:])
    # the reference: the prompt cut before the end-of-turn token, whose first-token distribution is the same one
    ref, _, _ = run(engine, ids[:pos], SamplingParams(max_tokens=1, temperature=0, logprobs=20), "c")
    top = dict(ref[0].logprobs[0][1])
    assert ids[pos] in top and abs(got[pos] - top[ids[pos]]) < TOL_NATS
    assert got[pos] > math.log(0.3)  # a complete question: the model expects the turn to end here


def test_incomplete_text_scores_lower(engine):
    ids_c, pos_c = chat_prompt(engine, "What is the capital of France?")
    ids_i, pos_i = chat_prompt(engine, "What is the capital of")
    lp = {}
    for name, ids, pos in (("complete", ids_c, pos_c), ("incomplete", ids_i, pos_i)):
        outs, _, _ = run(engine, ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprob_positions=[pos]),
                         name)
        lp[name] = outs[0].prompt_logprobs[pos]
    assert lp["incomplete"] < lp["complete"] - 1.0


def test_a_prefix_cache_hit_stops_before_the_scored_position(engine):
    ids, pos = chat_prompt(engine, "Name three colors of the rainbow, please.")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprob_positions=[pos])
    first, _, _ = run(engine, ids, params, "same")
    again, _, _ = run(engine, ids, params, "same")
    assert again[0].num_cached_tokens > 0 and again[0].num_cached_tokens <= pos - 1
    assert abs(again[0].prompt_logprobs[pos] - first[0].prompt_logprobs[pos]) < TOL_NATS


@pytest.mark.parametrize("positions", [[0], [-1], ["3"], [True], list(range(1, 20)), 5])
def test_bad_positions_are_refused(positions):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprob_positions=positions)
    assert e.value.param == "prompt_logprob_positions"


def test_a_position_past_the_prompt_is_refused(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, prompt_logprob_positions=[3]))
    assert e.value.param == "prompt_logprob_positions" and not engine.has_unfinished()


def test_top_logprobs_at_the_scored_position_are_the_models_distribution(engine):
    """`prompt_logprobs=n`: the top-n of the distribution at each scored position, from the same pass (what else the
    model expected there: the turn detection sums its sentence ends), equal to the first-token top-n of the prompt cut
    before that position, with the scored token's own logprob among them when it ranks."""
    ids, pos = chat_prompt(engine, "Who wrote Romeo and Juliet")      # no "?": the end token is scored after "Juliet"
    scored, steps, passes = run(engine, ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprob_positions=[pos],
                                                             prompt_logprobs=5), "top")
    plain, plain_steps, plain_passes = run(engine, ids, SamplingParams(max_tokens=2, temperature=0), "top-plain")
    assert (steps, passes) == (plain_steps, plain_passes)
    top = scored[0].prompt_top_logprobs[pos]
    assert len(top) == 5 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert all(o.prompt_top_logprobs is None for o in scored[1:])
    ref, _, _ = run(engine, ids[:pos], SamplingParams(max_tokens=1, temperature=0, logprobs=5), "top-ref")
    ref_top = dict(ref[0].logprobs[0][1])
    # (the prompt's own chunk and the cut prompt's last one differ in shape: bf16 rows a few tenths of a nat apart at
    # the 5th rank, as close as HF's bf16 is to ours)
    assert {t for t, _ in top[:3]} == set(list(ref_top)[:3])
    assert all(abs(lp - ref_top[t]) < TOP_TOL_NATS for t, lp in top if t in ref_top)
    question = engine.tokenizer.convert_tokens_to_ids("?")
    assert question in dict(top)                                         # the model expected a "?" there
    own = dict(top).get(ids[pos])
    assert own is None or abs(own - scored[0].prompt_logprobs[pos]) < 1e-6
    without, _, _ = run(engine, ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprob_positions=[pos]), "x")
    assert without[0].prompt_top_logprobs is None


@pytest.mark.parametrize("top", [-1, 21, "3", True, 2.0])
def test_bad_prompt_logprobs_are_refused(top):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprob_positions=[1], prompt_logprobs=top)
    assert e.value.param == "prompt_logprobs"
