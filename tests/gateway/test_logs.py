"""`rtserve serve --log-format json` as a process: every line on its output is one JSON object with the stable keys;
the startup stages are logged with their times; each HTTP request has one access line with its timings and token
counts; no API key is logged; the periodic stats line is silent while idle and appears, with its fields, under
traffic."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import websockets

from tests.conftest import _free_port
from tests.gateway.realtime.client import Raw
from tests.gateway.test_shutdown import Process

KEY = "sk-logs-secret-1717"
INTERVAL = 0.25
STATS_FIELDS = {"running", "waiting", "prompt_tokens_per_s", "generation_tokens_per_s", "kv_usage",
                "prefix_cache_hit_rate", "sessions"}


def records(proc: Process) -> list[dict]:
    lines = [line for line in proc.output.splitlines() if line.strip()]
    out = []
    for line in lines:
        record = json.loads(line)   # every line is JSON: uvicorn's, warnings and the engine's included
        assert {"time", "level", "logger", "message"} <= record.keys(), record
        out.append(record)
    return out


def by_logger(proc: Process, name: str) -> list[dict]:
    return [r for r in records(proc) if r["logger"] == name]


def wait_until(proc: Process, found, what: str, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout   # a bound for a slow machine, not a measure
    while not (hits := found(records(proc))):
        assert proc.proc.poll() is None and time.monotonic() < deadline, f"no {what}:\n{proc.output}"
        time.sleep(0.05)
    return hits


async def test_json_logs_stages_access_lines_and_stats():
    port = _free_port()
    proc = Process(["--port", str(port), "--no-audio", "--kv-cache-memory", "64MiB", "--api-key", KEY,
                    "--log-format", "json", "--log-stats-interval", str(INTERVAL)])
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_until, proc, lambda rs: [r for r in rs if r["message"].startswith("ready on")],
                                "ready line", 600)
        messages = [r["message"] for r in records(proc)]
        for stage in ("weights loaded in", "KV cache: ", "model SmolLM2-135M-Instruct loaded in", "ready on"):
            assert any(m.startswith(stage) for m in messages), (stage, messages)

        # idle: the engine is loaded, nobody asks anything, so no stats line however many intervals pass
        await asyncio.sleep(8 * INTERVAL)
        assert by_logger(proc, "rtserve.stats") == [], proc.output

        # traffic: a Realtime session open (its key in the URL), a chat completion, a stream, a bad request
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?api-key={KEY}")
        raw = Raw(ws)
        assert (await raw.recv())["type"] == "session.created"
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        reply = await client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
                                                     messages=[{"role": "user", "content": "Name three colors."}])
        async with httpx.AsyncClient() as http:
            body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "stream": True,
                    "messages": [{"role": "user", "content": "Count to five."}]}
            async with http.stream("POST", f"{base}/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42"}) as r:
                assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"   # the client's, echoed
                chunks = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            bad = await http.post(f"{base}/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct"},
                                  headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "no spaces <here>"})
            assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("req_")   # refused: ours

        stats = await asyncio.to_thread(
            wait_until, proc, lambda rs: [r for r in rs if r["logger"] == "rtserve.stats"
                                          and r["generation_tokens_per_s"] > 0 and r["sessions"] == 1], "stats line")
        line = stats[0]
        assert STATS_FIELDS <= line.keys() and 0 <= line["kv_usage"] <= 1, line
        assert "Avg generation throughput" in line["message"] and "Realtime sessions: 1" in line["message"], line
        await ws.close()

        access = [r for r in by_logger(proc, "rtserve.access") if r["path"] == "/v1/chat/completions"]
        # a streamed response's line is written when its handler returns, which may come after the next request's
        # (the bad one, refused at once): only the two 200s, sent one after the other, keep their order
        assert sorted(r["status"] for r in access) == [200, 200, 400], access
        done, streamed = [r for r in access if r["status"] == 200]
        refused = next(r for r in access if r["status"] == 400)
        assert done["method"] == "POST" and done["prompt_tokens"] == reply.usage.prompt_tokens
        assert done["completion_tokens"] == reply.usage.completion_tokens
        assert 0 < done["ttft_ms"] <= done["duration_ms"], done
        assert chunks and streamed["prompt_tokens"] > 0 and 0 < streamed["completion_tokens"] <= 8, streamed
        assert 0 < streamed["ttft_ms"] <= streamed["duration_ms"], streamed
        assert refused["ttft_ms"] is None and refused["prompt_tokens"] is None, refused
        # each line names its response's x-request-id (the SDK's `_request_id`)
        assert (done["request_id"], streamed["request_id"], refused["request_id"]) == \
            (reply._request_id, "trace-42", bad.headers["x-request-id"]), access
        assert KEY not in proc.output, proc.output
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.wait()
