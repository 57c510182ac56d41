"""The engine core in its own process (engine/core_client.py + engine/core_process.py): streams equal the offline
engine's, an abort frees the pages, structured output and bad input cross as typed errors, a fault pinned on one
request fails only it, and a killed core fails its streams, is started again and serves; the core exits with its
parent."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from engine.core_client import EngineCoreClient
from engine.errors import EngineDeadError, RequestFailedError
from tests.engine.procinfo import thread_nices_and_env

PROMPTS = ["Question 1: name a fruit and describe it.", "Question 2: name a river and describe it.",
           "Question 3: name a bird and describe it."]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
WAIT_S = 30.0   # a bound for a slow machine, far above a step, far below an endless request


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(kv_cache_memory="32MiB")
    yield client
    socket_dir = client.socket_dir
    client.shutdown()
    assert not os.path.exists(socket_dir)      # the ipc sockets' directory leaves with the core


async def collect(eng, rid, prompt, params=PARAMS):
    ids = eng.tokenizer.encode(prompt, add_special_tokens=False)
    toks, text, last = [], "", None
    async for out in eng.generate(rid, ids, params):
        toks += out.new_token_ids
        text += out.text_delta
        last = out
    return toks, text, last


def idle(stats: dict) -> bool:
    return stats["requests_running"] == 0 and stats["requests_waiting"] == 0 and stats["kv_pages_used"] == 0


async def test_streams_equal_offline_and_abort_frees_pages(core):
    got = await asyncio.wait_for(asyncio.gather(*(collect(core, f"s{i}", p) for i, p in enumerate(PROMPTS))), WAIT_S)
    offline = LLM(kv_cache_memory="32MiB").generate([core.tokenizer.encode(p, add_special_tokens=False)
                                                     for p in PROMPTS], PARAMS)
    for (toks, text, last), off in zip(got, offline):
        assert toks == off.token_ids and text == off.text and last.finish_reason == "length"
    assert idle(core.stats())

    ids = core.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    endless = SamplingParams(temperature=0, max_tokens=core.max_model_len - len(ids) - 1, ignore_eos=True)
    gen = core.generate("endless", ids, endless)
    await asyncio.wait_for(anext(gen), WAIT_S)
    assert core.stats()["requests_running"] == 1
    await gen.aclose()                      # the consumer leaves: the core aborts it
    deadline = time.monotonic() + WAIT_S
    while not idle(core.stats()):
        assert time.monotonic() < deadline, core.stats()
        await asyncio.sleep(0.05)


async def test_structured_output_and_bad_input_cross_as_typed_errors(core):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    params = SamplingParams(temperature=0, max_tokens=30,
                            structured_outputs=StructuredOutputsParams(json=schema))
    _, text, last = await asyncio.wait_for(collect(core, "json", "Give me a number as JSON.", params), WAIT_S)
    assert last.finish_reason == "stop" and 0 <= json.loads(text)["n"] <= 9
    with pytest.raises(InvalidRequestError) as e:
        await collect(core, "bad-grammar", "x", SamplingParams(structured_outputs=StructuredOutputsParams(
            grammar="root ::= (")))
    assert e.value.param == "structured_outputs.grammar"
    with pytest.raises(InvalidRequestError) as e:
        await collect(core, "bad-seed", "x", SamplingParams(seed=2**70))
    assert e.value.param == "seed"
    assert core.healthy and idle(core.stats())


async def test_a_request_fault_fails_only_that_stream(core):
    core.inject_fault("bad-1", "sample")
    got = await asyncio.wait_for(asyncio.gather(*(collect(core, "bad-1" if i == 1 else f"ok-{i}", p)
                                                  for i, p in enumerate(PROMPTS)), return_exceptions=True), WAIT_S)
    assert isinstance(got[1], RequestFailedError) and "injected sample fault" in str(got[1])
    assert all(g[2].finish_reason == "length" for i, g in enumerate(got) if i != 1)
    assert core.healthy and idle(core.stats())


async def test_a_killed_core_fails_its_streams_and_is_started_again(core):
    first_pid, first_dir = core.pid, core.socket_dir
    endless = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    task = asyncio.ensure_future(collect(core, "doomed", PROMPTS[0], endless))
    while core.stats()["requests_running"] == 0:
        await asyncio.sleep(0.02)
    os.kill(first_pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="died"):
        await asyncio.wait_for(task, WAIT_S)
    deadline = time.monotonic() + 120
    while not core.healthy:
        assert time.monotonic() < deadline and core.error is not None
        await asyncio.sleep(0.1)
    assert core.pid != first_pid and core.num_restarts == 1
    assert not os.path.exists(first_dir) and os.path.isdir(core.socket_dir)  # fresh sockets, the old ones removed
    _, _, last = await asyncio.wait_for(collect(core, "after", PROMPTS[1]), WAIT_S)
    assert last.finish_reason == "length" and idle(core.stats())
    with pytest.raises(ProcessLookupError):
        os.kill(first_pid, 0)


def test_the_core_froze_its_startup_heap(core):
    """The core's model, tokenizer and modules are left out of its garbage collections (engine/heap.py)."""
    assert core.frozen_objects > 50_000


def test_the_default_launcher_starts_the_core_as_this_process_runs(core):
    """Nicer and with an environment of its own only when asked (gateway/router.py asks beside the audio stage)."""
    nices, env = thread_nices_and_env(core.pid)
    assert nices == {os.nice(0)}
    assert env.get("GOMP_SPINCOUNT") == os.environ.get("GOMP_SPINCOUNT")


def test_the_core_exits_with_its_parent(tmp_path):
    """A parent killed with SIGKILL runs no cleanup: the core notices on its own, removes the parent's ipc sockets and
    their directory, and exits."""
    script = ("from engine.core_client import EngineCoreClient\n"
              "c = EngineCoreClient(kv_cache_memory='16MiB')\n"
              "print(c.pid, c.socket_dir, flush=True)\n"
              "import time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pid, socket_dir = parent.stdout.readline().split()
        core_pid = int(pid)
        assert sorted(os.listdir(socket_dir)) == ["commands", "outputs"]
        os.kill(core_pid, 0)                         # alive while its parent is
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + WAIT_S
        while _alive(core_pid):
            assert time.monotonic() < deadline, "the engine core outlived its parent"
            time.sleep(0.05)
        assert not os.path.exists(socket_dir)
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"
