"""`rtserve serve --ray` (gateway/ray_app.py, engine/ray_core.py) as a process that starts a one-node Ray cluster with 2
CPUs: the gateway is a Ray Serve ingress and 2 engine cores of the default model are Ray actors behind its router.
Realtime sessions (through Serve's proxy) stay on one replica each and hit their prefix cache; HTTP requests with the
official openai SDK go through; `kill -9` of one replica's actor process ends only its session (error + close), Ray
restarts the actor, and the replica serves again; on SIGTERM the application, its actors and the cluster are gone."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest
import websockets
from openai import AsyncOpenAI

from tests.conftest import Server, _free_port
from tests.gateway.realtime.client import open_raw
from tests.gateway.test_shutdown import Process

pytestmark = pytest.mark.slow
INSTRUCTIONS = "You are a helpful assistant who answers every question briefly. " * 8
LONG_TASK = "List the numbers from 1 to 500, separated by commas."
WAIT_S = 300.0   # bounds for a slow shared machine, far above what each step takes


@pytest.fixture(scope="module")
def ray_server():
    port = _free_port()
    proc = Process(["--ray", "--data-parallel-size", "2", "--num-threads", "2", "--kv-cache-memory", "64MiB",
                    "--no-audio", "--port", str(port), "--log-level", "info"])
    try:
        proc.wait_for("rtserve: ready on", 900)
        server = Server("127.0.0.1", port, None, None)
        server.process = proc
        yield server
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.wait()


def health(server) -> dict:
    return httpx.get(f"{server.root_url}/health", timeout=30).json()


async def wait_for(server, check, what: str):
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}; the server said:\n{server.process.output[-6000:]}"
        await asyncio.sleep(0.2)


def test_the_ingress_logs_and_freezes_its_startup_heap(ray_server):
    """The ingress replica's process is set up as `rtserve serve`'s own: its log lines in the server's format reach
    the driver's output, and its startup heap is frozen before it serves."""
    lines = [line for line in ray_server.process.output.splitlines() if "Ray Serve ingress:" in line]
    assert lines and "ServeReplica" in lines[0], ray_server.process.output[-3000:]
    frozen = int(lines[0].split("Ray Serve ingress:")[1].split()[0])
    assert frozen > 50_000 and "objects of the startup heap frozen" in lines[0]


async def test_sessions_and_http_requests_go_through_ray_serve(ray_server):
    replicas = health(ray_server)["replicas"]
    assert [r["status"] for r in replicas] == ["ok", "ok"]
    assert all(psutil.pid_exists(r["pid"]) for r in replicas)   # the actors' worker processes, on this node

    sessions = [await open_raw(ray_server, max_output_tokens=8, instructions=INSTRUCTIONS) for _ in range(2)]
    cached = []
    for raw in sessions:
        for question in ["Tell me about the moon.", "What about the sun?"]:
            await raw.say(question)
            _, response, _ = await raw.respond({"temperature": 0})
            assert response["status"] in ("completed", "incomplete"), response
            cached.append(response["usage"]["input_token_details"]["cached_tokens"])
    assert [r["sessions"] for r in health(ray_server)["replicas"]] == [1, 1]   # one each: spread, then affinity
    assert cached[1] > 0 and cached[3] > 0              # each second turn found its first turn's KV on its replica

    client = AsyncOpenAI(base_url=ray_server.base_url, api_key="unused")
    reply = await client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
                                                 messages=[{"role": "user", "content": "Say hello."}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
                                                  stream=True, messages=[{"role": "user", "content": "Say hi."}])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    async with httpx.AsyncClient(timeout=30) as http:
        bad = await http.post(f"{ray_server.base_url}/chat/completions",
                              json={"model": "SmolLM2-135M-Instruct", "max_tokens": 0,
                                    "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"

    for raw in sessions:
        await raw.ws.close()
    await wait_for(ray_server, lambda: [r["sessions"] for r in health(ray_server)["replicas"]] == [0, 0],
                   "sessions released")
    metrics = httpx.get(f"{ray_server.root_url}/metrics", timeout=30).text
    assert 'rtserve_replica_healthy{replica="0"} 1.0' in metrics and 'rtserve_replica_healthy{replica="1"} 1.0' \
        in metrics


async def test_a_killed_engine_actor_ends_only_its_sessions_and_ray_restarts_it(ray_server):
    lost = await open_raw(ray_server, max_output_tokens="inf")
    await lost.say("Hi.")
    await lost.respond({"temperature": 0, "max_output_tokens": 1})
    victim = [r["sessions"] for r in health(ray_server)["replicas"]].index(1)
    kept = await open_raw(ray_server, max_output_tokens=200)
    await kept.say("Hi.")
    await kept.respond({"temperature": 0, "max_output_tokens": 1})
    before = health(ray_server)["replicas"]
    assert before[1 - victim]["sessions"] == 1              # the second session went to the other replica
    pid = before[victim]["pid"]

    for raw in (lost, kept):
        await raw.say(LONG_TASK)
        await raw.send({"type": "response.create", "response": {"temperature": 0}})
    await lost.until("response.output_text.delta", WAIT_S)   # the victim is mid-stream
    os.kill(pid, signal.SIGKILL)

    events = []
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            events.append(await lost.recv(WAIT_S))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011       # a clean close, saying why
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[-1]["error"]["type"] == "server_error"
    events = await kept.until("response.done", WAIT_S)              # the other replica's session goes on
    assert events[-1]["response"]["status"] in ("completed", "incomplete")

    def restarted() -> bool:
        r = health(ray_server)["replicas"][victim]
        return r["status"] == "ok" and r["restarts"] == 1 and r["pid"] not in (None, pid)
    await wait_for(ray_server, restarted, "the killed replica serves again")
    after = health(ray_server)
    assert after["status"] == "ok"
    assert not psutil.pid_exists(pid) and psutil.pid_exists(after["replicas"][victim]["pid"])

    fresh = await open_raw(ray_server, max_output_tokens=8)          # the restarted replica has no session: it gets it
    await fresh.say("Hi again.")
    _, response, _ = await fresh.respond({"temperature": 0})
    assert response["status"] in ("completed", "incomplete")
    assert health(ray_server)["replicas"][victim]["sessions"] == 1
    for raw in (fresh, kept):
        await raw.ws.close()


def test_sigterm_deletes_the_application_and_stops_the_cluster(ray_server):
    """Last in the module: the server's whole process tree (Ray's head, the actors) ends with it."""
    proc = ray_server.process.proc
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert tree                                       # Ray's processes, started by the server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=WAIT_S) == 0
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [p.info if hasattr(p, "info") else p for p in alive]
    assert "deleting the Ray Serve application" in ray_server.process.output
