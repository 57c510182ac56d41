"""End to end: the engine with the Triton attention backend generates the same greedy tokens as the torch backend.

On CPU the kernels run under the Triton interpreter (slow: 30 layers x 2 launches per step), so the scenario is a
handful of steps that still covers what matters: a prefill, then one step that mixes a decode with a prefill chunk
that hits the prefix cache (context longer than the query), then batched decodes.
The Triton module's entry points are wrapped (each call goes through to the real kernel) to count them: the Triton
run must launch them in every layer, the torch run never.
`RTSERVE_TEST_DEVICE=cuda` runs it compiled on a GPU (bench/gpu_check.sh).
"""
from __future__ import annotations

import os

from kernels import settings  # triton is imported later, on first use: TRITON_INTERPRET is set before that

DEVICE = settings.raw("RTSERVE_TEST_DEVICE")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import kernels  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from kernels import triton as triton_ops  # noqa: E402

PROMPT_A = ("You are a helpful assistant for a realtime voice gateway. Answer briefly and politely, in one short "
            "sentence, and never use lists or markdown because the answer is spoken aloud by a speech synthesizer. "
            "Question: what is the capital of France? Answer:")
PROMPT_B_TAIL = " Name three colours of the rainbow:"
MAX_TOKENS = 4


def _run(backend: str) -> dict:
    """Prefill A; then decode A next to B's prefill (B shares A's first full blocks); then decode both."""
    llm = LLM(model=None, attention_backend=backend, kv_cache_memory="16MiB", device=DEVICE, num_threads=2)
    eng = llm.engine
    ids_a = llm.tokenizer.encode(PROMPT_A, add_special_tokens=False)
    shared = (len(ids_a) // eng.args.block_size) * eng.args.block_size
    assert shared >= 2 * eng.args.block_size, "prompt A must fill two KV blocks"
    ids_b = ids_a[:shared] + llm.tokenizer.encode(PROMPT_B_TAIL, add_special_tokens=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {"a": [], "b": []}
    cached_b = 0
    eng.add_request(ids_a, params, request_id="a")
    outs = eng.step()                          # prefill of A
    eng.add_request(ids_b, params, request_id="b")
    steps = 1
    while True:
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
            if o.request_id == "b":
                cached_b = max(cached_b, o.num_cached_tokens)
        if not eng.has_unfinished():
            break
        outs = eng.step()                      # first: decode A + prefill B over its cached prefix
        steps += 1
    return {"tokens": tokens, "cached_b": cached_b, "shared": shared, "steps": steps,
            "layers": eng.runner.config["num_hidden_layers"]}


@pytest.fixture
def restore_backend():
    yield
    kernels.set_backend(None)


@pytest.fixture
def triton_calls(monkeypatch) -> dict[str, int]:
    """Calls of the Triton backend's entry points, counted by wrappers that run the real kernels."""
    calls = {"paged_attention": 0, "store_kvcache": 0}
    for name in calls:
        real = getattr(triton_ops, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(triton_ops, name, counted)
    return calls


@pytest.mark.slow
def test_triton_backend_matches_torch_greedy(restore_backend, triton_calls):
    torch.set_num_threads(2)
    ref = _run("torch")
    assert triton_calls == {"paged_attention": 0, "store_kvcache": 0}, "the torch run must not touch Triton"
    got = _run("triton")
    layers = got["layers"]              # at least both prefills, in every layer (decodes may replay CUDA graphs)
    assert triton_calls["paged_attention"] >= layers * 2, triton_calls
    assert triton_calls["store_kvcache"] >= layers * 2, triton_calls
    assert ref["cached_b"] == ref["shared"] and got["cached_b"] == got["shared"], "B must hit the prefix cache"
    assert [len(t) for t in ref["tokens"].values()] == [MAX_TOKENS, MAX_TOKENS]
    assert got["tokens"] == ref["tokens"]
