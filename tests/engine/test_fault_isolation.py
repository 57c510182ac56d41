"""One request's fault never hurts another: a step that raises on one request's account fails that request alone (its
consumer gets RequestFailedError, its pages are freed) while the others of the same batch complete with the very tokens
they produce without the fault; only a fault no request can be blamed for stops the engine, and then it says so.

Input can no longer make a step raise (the engine validates every field a step touches before queueing, see
test_poison_inputs_are_refused_before_they_reach_a_step), so the faults are injected with LLMEngine.inject_fault: a
test-only hook that raises at the start of one phase (forward, sample, output) of any step whose batch holds the marked
request, as a bug triggered by that request's data would. The scheduler, model and sampler run unchanged. fp32: its rows
do not depend on the batch they run in, so "the same tokens" is exact.
"""
from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, InvalidRequestError, LLMEngine, SamplingParams
from engine.errors import EngineDeadError, RequestFailedError
from engine.llm_engine import EngineStepError
from tests.engine.prompts import PROMPTS

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
WAIT_S = 60.0     # far above the few steps these requests take, so only a hang reaches it


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(kv_cache_memory="32MiB")


def run(engine: LLMEngine, prompts: list[str], params: list[SamplingParams], tag: str,
        faults: dict[int, str] | None = None) -> dict[int, tuple[list[int], str, str | None]]:
    """Add all prompts, mark the faulty ones, step to the end: {index: (tokens, finish_reason, error)}."""
    ids = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        ids[engine.add_request(p, sp, request_id=f"{tag}-{i}")] = i
        if faults and i in faults:
            engine.inject_fault(f"{tag}-{i}", faults[i])
    res: dict[int, list] = {i: [[], None, None] for i in ids.values()}
    while engine.has_unfinished():
        for out in engine.step():
            r = res[ids[out.request_id]]
            r[0] += out.new_token_ids
            if out.finished:
                r[1], r[2] = out.finish_reason, out.error
    return {i: (toks, reason, err) for i, (toks, reason, err) in res.items()}


def idle(stats: dict) -> bool:
    return (stats["requests_running"], stats["requests_waiting"], stats["kv_pages_used"]) == (0, 0, 0)


@pytest.mark.parametrize("phase", ["forward", "sample", "output"])
def test_a_fault_fails_only_its_request_and_the_batch_completes_unchanged(engine, phase):
    prompts = PROMPTS[:4]
    params = [PARAMS, SEEDED, PARAMS, SEEDED]          # greedy and seeded rows alike keep their tokens
    clean = run(engine, prompts, params, f"clean-{phase}")
    faulty = run(engine, prompts, params, f"faulty-{phase}", faults={2: phase})
    toks, reason, err = faulty[2]
    assert reason == "error" and f"injected {phase} fault" in err and toks == []
    for i in (0, 1, 3):
        assert faulty[i] == clean[i] and clean[i][1] == "length" and len(clean[i][0]) == 10
    assert idle(engine.stats())


def test_a_fault_mid_generation_fails_it_there_and_frees_its_pages(engine):
    """The fault strikes once the request is decoding next to others (not at its first step)."""
    prompts, params = PROMPTS[4:7], [PARAMS] * 3
    clean = run(engine, prompts, params, "clean-mid")
    ids = [engine.add_request(p, sp, request_id=f"mid-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    got = {rid: [] for rid in ids}
    finish = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished:
                finish[out.request_id] = out.finish_reason
        if len(got["mid-1"]) == 3 and "mid-1" not in engine.fault_injection:
            engine.inject_fault("mid-1", "sample")
    assert finish == {"mid-0": "length", "mid-1": "error", "mid-2": "length"}
    assert got["mid-1"] == clean[1][0][:3]
    assert got["mid-0"] == clean[0][0] and got["mid-2"] == clean[2][0]
    assert idle(engine.stats())


def test_a_forward_fault_no_request_can_be_blamed_for_raises(engine):
    """Alone in its step, a request whose forward raises cannot be told from a broken engine: the step raises."""
    engine.add_request(PROMPTS[0], PARAMS, request_id="alone")
    engine.inject_fault("alone", "forward")
    with pytest.raises(EngineStepError, match="injected forward fault"):
        while engine.has_unfinished():
            engine.step()
    engine.abort_request("alone")
    assert idle(engine.stats())


# ---- AsyncEngine: consumers ---------------------------------------------------------------------------------------
async def collect(eng: AsyncEngine, rid: str, prompt: str, params: SamplingParams = PARAMS):
    ids = eng.tokenizer.encode(prompt, add_special_tokens=False)
    toks, last = [], None
    async for out in eng.generate(rid, ids, params):
        toks += out.new_token_ids
        last = out
    return toks, last.finish_reason


@pytest.fixture(scope="module")
def aengine():
    eng = AsyncEngine(kv_cache_memory="32MiB")
    yield eng
    eng.shutdown()


async def test_only_the_faulty_stream_fails_and_the_engine_serves_on(aengine):
    prompts = PROMPTS[:4]
    clean = await asyncio.wait_for(asyncio.gather(*(collect(aengine, f"ok-{i}", p) for i, p in enumerate(prompts))),
                                   WAIT_S)
    aengine.engine.inject_fault("bad-1", "sample")    # before it is submitted: the engine thread reads it in a step
    got = await asyncio.wait_for(asyncio.gather(*(collect(aengine, f"bad-{i}" if i == 1 else f"ok2-{i}", p)
                                                  for i, p in enumerate(prompts)), return_exceptions=True), WAIT_S)
    assert isinstance(got[1], RequestFailedError) and "injected sample fault" in str(got[1])
    assert [got[i] for i in (0, 2, 3)] == [clean[i] for i in (0, 2, 3)]
    assert aengine.healthy and aengine.error is None and idle(aengine.stats())
    assert await asyncio.wait_for(collect(aengine, "after", prompts[1]), WAIT_S) == clean[1]


async def test_a_transient_forward_fault_costs_nobody_anything(aengine, monkeypatch):
    """A forward that raises once and then works (nothing to do with any request) is retried on halves of the batch:
    every request completes with its own tokens."""
    prompts = PROMPTS[4:6]
    clean = await asyncio.wait_for(asyncio.gather(*(collect(aengine, f"t-ok-{i}", p) for i, p in enumerate(prompts))),
                                   WAIT_S)
    runner = aengine.engine.runner
    real_execute = runner.execute
    raised = []

    def execute_failing_once(scheduled):
        if not raised and len(scheduled) == 2 and all(s.request.num_output_tokens >= 2 for s in scheduled):
            raised.append(len(scheduled))
            raise RuntimeError("transient fault in the forward pass")
        return real_execute(scheduled)

    monkeypatch.setattr(runner, "execute", execute_failing_once)
    got = await asyncio.wait_for(asyncio.gather(*(collect(aengine, f"t-{i}", p) for i, p in enumerate(prompts))),
                                 WAIT_S)
    assert raised == [2] and got == clean
    assert aengine.healthy and idle(aengine.stats())


async def test_poison_inputs_are_refused_before_they_reach_a_step(aengine):
    ids = aengine.tokenizer.encode("Hello", add_special_tokens=False)
    cases = [(lambda: dict(params=PARAMS, cache_salt={"a": 1}), "cache_salt"),
             (lambda: dict(params=SamplingParams(temperature=1.0, top_k=2**64 - 1)), "top_k"),
             (lambda: dict(params=SamplingParams(stop=[["x"]])), "stop"),
             (lambda: dict(params=SamplingParams(stop_token_ids=["x"])), "stop_token_ids"),
             (lambda: dict(params=SamplingParams(seed=2**70)), "seed")]
    for make, param in cases:
        with pytest.raises(InvalidRequestError) as e:
            async for _ in aengine.generate(None, ids, **make()):
                pass
        assert e.value.param == param
    assert aengine.healthy and idle(aengine.stats())


async def test_a_fault_no_request_can_be_blamed_for_stops_the_engine_and_says_so(monkeypatch):
    eng = AsyncEngine(kv_cache_memory="32MiB")
    try:
        def broken(scheduled):
            raise RuntimeError("the device is gone")

        monkeypatch.setattr(eng.engine.runner, "execute", broken)
        got = await asyncio.wait_for(asyncio.gather(*(collect(eng, f"d-{i}", p) for i, p in enumerate(PROMPTS[:3])),
                                                    return_exceptions=True), WAIT_S)
        assert all(isinstance(g, EngineDeadError) and "the device is gone" in str(g) for g in got)
        assert not eng.healthy and "the device is gone" in eng.error
        with pytest.raises(EngineDeadError, match="the device is gone"):
            await collect(eng, "late", PROMPTS[0])
    finally:
        eng.shutdown()
