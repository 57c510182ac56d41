"""The decode-graph path (engine/cuda_graph.py) on the CPU: the same padded static buffers as on CUDA, run eagerly.

On a GPU the step is captured and replayed (bench/gpu_check.sh runs the engine tests there); what can be checked
here is the padding: rows past the real batch must not store keys/values or disturb the real rows, so greedy tokens
equal the normal path's, and the KV pages are all returned afterwards.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "List three colours:", "Once upon a time, in a small village,"]


@pytest.mark.slow
def test_padded_static_decode_path_matches_eager():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = LLM(model=None, kv_cache_memory="64MiB", num_threads=2)
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    del ref
    llm = LLM(model=None, kv_cache_memory="64MiB", num_threads=2)
    eng = llm.engine
    assert eng.runner.enable_decode_graphs(eng.args.max_num_seqs, eng.max_model_len, capture=False)
    graphs = eng.runner.graphs
    calls = []
    run = graphs.run
    graphs.run = lambda *a: (calls.append(len(a[0])), run(*a))[1]
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    assert calls and set(calls) == {3}, calls            # 3 decodes a step, padded to the bucket of 4
    assert graphs.bucket(3) == 4
    bm = eng.block_manager
    assert bm.num_free == bm.num_pages
