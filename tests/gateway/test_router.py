"""Two engine cores behind one gateway (`--data-parallel-size 2`, gateway/router.py), with the product app and real
clients: every turn of a Realtime session lands on one replica and its turn-4 cached tokens equal the single-engine
case; HTTP requests sharing a system prompt go to the replica that cached it; a replica killed mid-stream ends only
its own session (error + close) and its HTTP request (503), the other replica's session goes on, and the replica is
started again and serves."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest
import websockets
from openai import AsyncOpenAI

from tests.conftest import Server, _serve
from tests.engine.procinfo import thread_nices_and_env
from tests.gateway.realtime.client import open_raw

ENGINE_ARGS = {"kv_cache_memory": "64MiB", "num_threads": 2}    # one thread per replica, as the reference has
INSTRUCTIONS = "You are a helpful assistant who answers every question briefly. " * 8
QUESTIONS = ["Tell me about the moon.", "What about the sun?", "And Mars?", "And Venus?"]
LONG_TASK = "List the numbers from 1 to 500, separated by commas."
WAIT_S = 120.0   # bounds for a slow shared machine, far above what each step takes


@pytest.fixture(scope="module")
def dp_server():
    from gateway.app import Settings, create_app
    from gateway.router import Router

    router = Router.start(2, None, ENGINE_ARGS)
    app = create_app(Settings(), engine=router)
    for port in _serve(router, {"/": app}):
        yield Server("127.0.0.1", port, router, app)


@pytest.fixture(scope="module")
def single_server():
    """The same model and arguments on one in-thread engine: the single-replica reference."""
    from engine import AsyncEngine
    from gateway.app import Settings, create_app

    engine = AsyncEngine(**{**ENGINE_ARGS, "num_threads": 1})
    app = create_app(Settings(), engine=engine)
    for port in _serve(engine, {"/": app}):
        yield Server("127.0.0.1", port, engine, app)


def replica_stats(server, index: int) -> dict:
    return server.engine.stats()["replicas"][index]


async def four_turns(server, router=None) -> tuple[list[int], set]:
    """A greedy 4-turn text session: cached tokens per turn, and the replicas it was bound to after each turn."""
    raw = await open_raw(server, max_output_tokens=16, instructions=INSTRUCTIONS)
    cached, replicas = [], set()
    for question in QUESTIONS:
        await raw.say(question)
        _, response, _ = await raw.respond({"temperature": 0})
        assert response["status"] in ("completed", "incomplete"), response
        cached.append(response["usage"]["input_token_details"]["cached_tokens"])
        if router is not None:
            replicas.add(router.replica_of_session(raw.session_id))
    await raw.ws.close()
    return cached, replicas


async def test_a_session_stays_on_one_replica_and_caches_as_on_one_engine(dp_server, single_server):
    router = dp_server.engine
    routed_before = [r["routed"] for r in router.stats()["replicas"]]
    (cached_a, replicas_a), (cached_b, replicas_b) = await asyncio.gather(four_turns(dp_server, router),
                                                                          four_turns(dp_server, router))
    assert len(replicas_a) == 1 and len(replicas_b) == 1 and replicas_a != replicas_b   # one each, both used
    routed = [r["routed"] - b for r, b in zip(router.stats()["replicas"], routed_before)]
    assert routed == [4, 4]
    reference, _ = await four_turns(single_server)
    assert cached_a[3] == cached_b[3] == reference[3] > 0
    await dp_server.wait_idle()
    assert all(r["sessions"] == 0 and r["kv_pages_used"] == 0 for r in router.stats()["replicas"])


async def test_http_requests_go_where_their_system_prompt_is_cached(dp_server):
    router = dp_server.engine
    client = AsyncOpenAI(base_url=dp_server.base_url, api_key="unused")
    systems = ["You are a terse assistant for a hardware store. Answer in one sentence. " * 6,
               "You are a poet who answers every question with a short rhyme about the sea. " * 6]

    async def ask(system: str, question: str, max_tokens: int = 8):
        return await client.chat.completions.create(
            model="SmolLM2-135M-Instruct", temperature=0, max_tokens=max_tokens,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])

    # the first system prompt's request is in flight on one replica when the second's arrives: the second goes to
    # the other, less loaded one
    first = asyncio.ensure_future(ask(systems[0], LONG_TASK, max_tokens=64))
    while sum(r["inflight"] for r in router.stats()["replicas"]) == 0:
        await asyncio.sleep(0.01)
    home = [r["inflight"] for r in router.stats()["replicas"]].index(1)
    await ask(systems[1], "What is a wave?")
    await first
    before = router.stats()["replicas"]
    for question in ["Do you sell hammers?", "Where are the nails?", "What is a wave?", "Why is the sea blue?"]:
        system = systems[0] if "sea" not in question and "wave" not in question else systems[1]
        reply = await ask(system, question)
        assert reply.usage.prompt_tokens_details.cached_tokens >= 64   # the shared system prompt's blocks
    after = router.stats()["replicas"]
    assert after[home]["routed"] - before[home]["routed"] == 2
    assert after[1 - home]["routed"] - before[1 - home]["routed"] == 2


async def test_a_killed_replica_ends_only_its_session_and_comes_back(dp_server):
    router = dp_server.engine
    await dp_server.wait_idle()
    lost = await open_raw(dp_server, max_output_tokens="inf")
    kept = await open_raw(dp_server, max_output_tokens=200)
    for raw in (lost, kept):              # bind each to a replica (the second goes to the one without a session)
        await raw.say("Hi.")
        await raw.respond({"temperature": 0, "max_output_tokens": 1})
    victim = router.replica_of_session(lost.session_id)
    assert router.replica_of_session(kept.session_id) == 1 - victim
    pid = router.replicas[victim].engine.pid

    await lost.say(LONG_TASK)
    await lost.send({"type": "response.create", "response": {"temperature": 0}})
    await kept.say(LONG_TASK)
    await kept.send({"type": "response.create", "response": {"temperature": 0}})
    # an HTTP request goes to either replica (its cached prefix decides): on the victim's it must end in a 5xx, on the
    # other's it completes
    http = asyncio.ensure_future(httpx.AsyncClient(timeout=WAIT_S).post(
        f"{dp_server.base_url}/chat/completions", json={"model": "SmolLM2-135M-Instruct", "temperature": 0,
                                                       "max_tokens": 400,
                                                       "messages": [{"role": "user", "content": LONG_TASK}]}))
    while replica_stats(dp_server, victim)["inflight"] + replica_stats(dp_server, 1 - victim)["inflight"] < 3 \
            or replica_stats(dp_server, victim)["generated_tokens_total"] == 0:
        await asyncio.sleep(0.02)
    http_on_victim = replica_stats(dp_server, victim)["inflight"] == 2
    os.kill(pid, signal.SIGKILL)

    events = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            events.append(await lost.recv(WAIT_S))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011       # a clean close, saying why
    done = [e for e in events if e["type"] == "response.done"]
    assert done and done[-1]["response"]["status"] == "failed"
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[-1]["error"]["type"] == "server_error"

    reply = await http
    assert (reply.status_code == 503) if http_on_victim else (reply.status_code == 200), reply.text
    events = await kept.until("response.done", WAIT_S)              # the other replica's session goes on
    assert events[-1]["response"]["status"] in ("completed", "incomplete")

    while not router.replicas[victim].engine.healthy:
        assert router.replicas[victim].engine.error is not None
        await asyncio.sleep(0.1)
    health = httpx.get(f"{dp_server.root_url}/health", timeout=10).json()
    assert health["status"] == "ok" and [r["status"] for r in health["replicas"]] == ["ok", "ok"]
    assert health["replicas"][victim]["restarts"] == 1 and health["replicas"][victim]["pid"] != pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    metrics = dp_server.metrics_text()
    assert f'rtserve_replica_restarts_total{{replica="{victim}"}} 1.0' in metrics

    fresh = await open_raw(dp_server, max_output_tokens=8)          # the restarted replica has no session: it gets it
    await fresh.say("Hi again.")
    _, response, _ = await fresh.respond({"temperature": 0})
    assert response["status"] in ("completed", "incomplete") and router.replica_of_session(fresh.session_id) == victim
    for raw in (fresh, kept):
        await raw.ws.close()
    await dp_server.wait_idle()


@pytest.mark.parametrize("audio", [True, False])
async def test_engine_cores_beside_the_audio_stage_run_behind_it(audio):
    """`rtserve serve --engine-process` with the audio stage on: the core's every thread runs CORE_NICE_BESIDE_AUDIO
    nicer than the gateway and its environment carries CORE_ENV_BESIDE_AUDIO (this process's is unchanged), and it
    serves; without the audio stage the core runs as the gateway does."""
    from engine import SamplingParams
    from gateway.app import Settings, _load_engine
    from gateway.router import CORE_ENV_BESIDE_AUDIO, CORE_NICE_BESIDE_AUDIO

    ours = os.nice(0)
    env_before = dict(os.environ)
    router = await _load_engine(Settings(engine_process=True, audio=audio, engine_args={"kv_cache_memory": "16MiB"}))
    try:
        assert dict(os.environ) == env_before
        nices, env = thread_nices_and_env(router.replicas[0].engine.pid)
        if audio:
            assert nices == {min(19, ours + CORE_NICE_BESIDE_AUDIO)}
            assert CORE_ENV_BESIDE_AUDIO.items() <= env.items()
        else:
            assert nices == {ours}
            assert all(env.get(k) == os.environ.get(k) for k in CORE_ENV_BESIDE_AUDIO)
        ids = router.tokenizer.encode("The capital of France is", add_special_tokens=False)
        outs = [o async for o in router.generate(None, ids, SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
    finally:
        router.shutdown()
