"""Speculative decoding by n-gram prompt lookup (engine/ngram_proposer.py, engine/rejection_sampler.py), on the real
model, against the same engine without it.

Greedy exactness runs in float32: there a row's logits do not depend on how many query tokens the step carries, so the
outputs must be equal token for token. (In bf16 on the 4-bit path each batch size takes its own kernel and near-ties can
flip either way: tests/engine/test_llm_engine.py explains.) The sampling tests draw from the engines' own seeded
generators, so each run is the same run, and the statistical bound is one a correct sampler passes by a wide margin.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.errors import InvalidRequestError
from engine.ngram_proposer import NgramProposer, next_num_drafts
from engine.rejection_sampler import accepted_tokens
from gateway.metrics import EngineCollector
from tests.engine.prompts import PROMPTS

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGES = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. All that "
    "glitters is not gold, and not all those who wander are lost.",
    "To reset the router, hold the small button on the back for ten seconds until the light turns orange, then wait "
    "two minutes before you connect again.",
    "The museum opens at nine in the morning and closes at six in the evening, except on public holidays, when it "
    "stays closed all day.",
]
ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_num_seqs=32, max_num_batched_tokens=128,
              long_prefill_token_threshold=32)


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {"plain": LLM(**ENGINE), "spec": LLM(**ENGINE, speculative_config=SPEC)}


def repeat_prompt(llm: LLM, passage: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": "Repeat exactly: " + passage}],
                                             tokenize=False, add_generation_prompt=True)


def chat_prompt(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)


def run_steps(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[dict, int]:
    """Drive engine.step() by hand: returns {request id: (token ids, text from the streamed deltas, finish reason,
    logprobs)} and how many steps verified drafts next to a request without drafts. After every step, a decoding
    request holds no page past its tokens (the slots of rejected drafts went back to the pool)."""
    eng = llm.engine
    bm = eng.block_manager
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {rid: ([], "", None, []) for rid in ids}
    mixed_steps = 0
    while eng.has_unfinished():
        outs = eng.step()
        step = eng.last_step
        with_drafts = [s for s in step.scheduled if s.spec_token_ids]
        if with_drafts and len(with_drafts) < len(step.scheduled):
            mixed_steps += 1
        for out in outs:
            toks, text, _, lps = results[out.request_id]
            results[out.request_id] = (toks + out.new_token_ids, text + out.text_delta, out.finish_reason,
                                       lps + (out.logprobs or []))
            assert out.num_output_tokens == len(results[out.request_id][0])
        for req in eng.scheduler.running:
            if req.num_tokens - req.num_computed_tokens == 1:
                assert len(req.block_table) <= bm.pages_for(req.num_tokens), req.request_id
    return {rid: results[rid] for rid in ids}, mixed_steps


def assert_pool_at_baseline(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free == bm.num_pages and not llm.engine.scheduler.running
    assert all(p.ref_count == 0 for p in bm.pages)
    stats = llm.engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["requests_running"] == 0 and stats["requests_waiting"] == 0


def test_proposer_matches_vllm_prompt_lookup():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]       # longest suffix (1 2 3) seen before
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3]) == [4, 5, 9]       # a shorter n-gram (2 3) when the longest misses
    assert p.propose([7, 2, 8, 2, 9, 2]) == [8, 2, 9]             # the earliest occurrence, as vLLM
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], max_drafts=1) == [4]
    assert p.propose([1, 2, 3, 4, 5, 6, 7, 8]) == []              # nothing repeats: no draft, a plain decode
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 9, 3]) == []  # a 1-gram is below prompt_lookup_min
    # the draft allowance: +2 after all accepted (up to k), -1 after a rejection (down to 1)
    assert [next_num_drafts(4, 4, 4, 4), next_num_drafts(1, 1, 1, 4), next_num_drafts(4, 4, 2, 4),
            next_num_drafts(1, 1, 0, 4)] == [4, 3, 3, 1]


def test_acceptance_rule():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]   # all accepted + bonus
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]         # rejected at 1: the target's token there
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accepted_tokens([], [3]) == [3]


def test_bad_speculative_config_is_refused():
    for bad, why in [("{", "JSON"), ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                     ({"method": "ngram"}, "num_speculative_tokens"), ({"method": "ngram", "k": 2}, "unknown key"),
                     ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
                     ({"num_speculative_tokens": "2"}, "integer")]:
        with pytest.raises(InvalidRequestError, match=why) as e:
            SpeculativeConfig.parse(bad)
        assert e.value.param == "speculative_config"
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}).prompt_lookup_min == 4


def test_greedy_is_identical_with_and_without_drafts(engines):
    plain, spec = engines["plain"], engines["spec"]
    prompts = [repeat_prompt(plain, p) for p in PASSAGES] + [chat_prompt(plain, "Name three red fruits.")] \
        + PROMPTS[:4]
    params = [SamplingParams(temperature=0, max_tokens=80) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=80, logprobs=2)
    params[2] = SamplingParams(temperature=0, max_tokens=80, repetition_penalty=1.2, frequency_penalty=0.3)
    before = spec.engine.stats()
    want, _ = run_steps(plain, prompts, params)
    got, mixed_steps = run_steps(spec, prompts, params)
    after = spec.engine.stats()
    for (w_toks, w_text, w_reason, w_lps), (g_toks, g_text, g_reason, g_lps) in zip(want.values(), got.values()):
        assert (g_toks, g_text, g_reason) == (w_toks, w_text, w_reason)
        assert len(g_lps) == len(w_lps)
        for (g_lp, g_top), (w_lp, w_top) in zip(g_lps, w_lps):
            assert [t for t, _ in g_top] == [t for t, _ in w_top] and abs(g_lp - w_lp) < 1e-3
    assert got[list(got)[1]][3], "the logprobs request got its logprobs"
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert accepted > 40 and 0 < accepted <= drafted, (accepted, drafted)   # the repeats copy their prompts
    assert mixed_steps > 0                   # drafts were verified in the same steps as requests without any
    assert spec.engine.num_steps - before["num_steps"] < plain.engine.num_steps
    assert_pool_at_baseline(plain)
    assert_pool_at_baseline(spec)


def test_stop_string_max_tokens_and_eos_inside_an_accepted_run(engines):
    plain, spec = engines["plain"], engines["spec"]
    prompt = repeat_prompt(plain, PASSAGES[0])
    params = [SamplingParams(temperature=0, max_tokens=80, stop=["thousand"]),
              SamplingParams(temperature=0, max_tokens=80, stop=["single st"]),   # a stop string ending mid-token
              SamplingParams(temperature=0, max_tokens=17),
              SamplingParams(temperature=0, max_tokens=80, stop_token_ids=[plain.tokenizer.encode(" gold")[0]]),
              SamplingParams(temperature=0, max_tokens=200)]                      # ends at EOS
    want, _ = run_steps(plain, [prompt] * len(params), params)
    before = spec.engine.stats()
    got, _ = run_steps(spec, [prompt] * len(params), params)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    assert list(got.values()) == list(want.values())
    reasons = [r for _, _, r, _ in got.values()]
    assert reasons == ["stop", "stop", "length", "stop", "stop"]
    texts = [t for _, t, _, _ in got.values()]
    assert "thousand" not in texts[0] and texts[0].endswith("of a ")
    assert "single st" not in texts[1] and len(list(got.values())[2][0]) == 17
    assert texts[4].startswith("The quick brown fox") and "glitters is not gold" in texts[4]
    assert_pool_at_baseline(spec)


def chi_square_p_value(a: Counter, b: Counter) -> float:
    """Homogeneity of two samples of categories (categories seen fewer than 10 times in both together are pooled)."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rest = (sum(a.values()) - sum(a[k] for k in keys), sum(b.values()) - sum(b[k] for k in keys))
    table = np.array([[a[k], b[k]] for k in keys] + ([list(rest)] if sum(rest) else []), dtype=np.float64)
    if len(table) < 2:
        return 1.0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(table) - 1) / 2), torch.tensor(stat / 2)))


def test_sampling_keeps_the_target_distribution(engines):
    """Many samples of the first output tokens of a prompt the reply quotes (so drafts are proposed and verified at
    temperature 0.8, both accepted and rejected), with and without drafts: at each position the token frequencies
    agree (chi-square homogeneity). The engines' shared generators are seeded, so the test draws the same every run."""
    plain, spec = engines["plain"], engines["spec"]
    prompt = repeat_prompt(plain, PASSAGES[0])
    n, length = 240, 6
    counts = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        llm.engine.sampler.generator.manual_seed(1234)
        before = llm.engine.stats()
        outs = llm.generate([prompt] * n, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=length,
                                                         ignore_eos=True))
        after = llm.engine.stats()
        counts[name] = [Counter(o.token_ids[i] for o in outs) for i in range(length)]
        if name == "spec":
            drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            assert drafted > n and 0 < accepted < drafted, (accepted, drafted)   # both outcomes were exercised
    for i in range(1, length):
        assert len(counts["plain"][i]) > 1, "the position has more than one likely token"
        p = chi_square_p_value(counts["plain"][i], counts["spec"][i])
        assert p > 1e-3, (i, p, counts["plain"][i].most_common(5), counts["spec"][i].most_common(5))
    assert_pool_at_baseline(spec)


def test_seeded_request_gives_the_same_tokens_with_drafts(engines):
    """Each emitted token is drawn with the request's own next random number, as without drafts (the generator is
    rewound past the rows that were not used), so a seeded request gives the same tokens either way."""
    plain, spec = engines["plain"], engines["spec"]
    prompts = [repeat_prompt(plain, p) for p in PASSAGES]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=40) for s in (1, 2, 3)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    before = spec.engine.stats()["spec_decode_num_accepted_tokens"]
    got = [o.token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > before


def test_structured_requests_get_no_drafts_and_metrics_are_exported(engines):
    """A grammar-constrained request decodes without drafts (its mask would be needed at every draft position), next
    to one that gets them."""
    spec = engines["spec"]
    prompt = repeat_prompt(spec, PASSAGES[1])
    eng = spec.engine
    free = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=30))
    constrained = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                         structured_outputs={"regex": "To reset the [a-z ]+"}))
    drafts = Counter()
    text = ""
    while eng.has_unfinished():
        for out in eng.step():
            text += out.text_delta if out.request_id == constrained else ""
        drafts.update({s.request.request_id: len(s.spec_token_ids) for s in eng.last_step.scheduled})
    assert drafts[free] > 0 and drafts[constrained] == 0
    assert text.startswith("To reset the")
    registry = CollectorRegistry()
    registry.register(EngineCollector(spec.engine.stats))
    text = generate_latest(registry).decode()
    stats = spec.engine.stats()
    assert f"rtserve_spec_decode_num_accepted_tokens_total {float(stats['spec_decode_num_accepted_tokens'])}" in text
    assert f"rtserve_spec_decode_num_draft_tokens_total {float(stats['spec_decode_num_draft_tokens'])}" in text
    assert "rtserve_spec_decode_num_drafts_total" in text
    rate = stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"]
    assert f"rtserve_spec_decode_acceptance_rate {rate}" in text and 0 < rate <= 1
    assert_pool_at_baseline(spec)
