"""`rtserve serve` as a process: SIGTERM drains (every Realtime response in flight ends with `response.done`
cancelled before the 1012 close, an HTTP stream in flight finishes, one still running at the shutdown timeout ends
with an error chunk and `[DONE]`), refused handshakes are logged once at info with their reason and no ERROR, and the
API key never reaches the log."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import websockets

from tests.conftest import _free_port
from tests.gateway.realtime.client import Raw

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-shutdown-secret-4242"
SESSIONS = 8
SHUTDOWN_TIMEOUT_S = 30   # ample for the drain and the short stream; the long stream runs far past it


class Process:
    """The server process with its merged stdout/stderr collected line by line."""

    def __init__(self, args: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server never printed {text!r}:\n{self.output}")
            time.sleep(0.1)


@pytest.fixture
def process():
    port = _free_port()
    proc = Process(["--port", str(port), "--no-audio", "--api-key", KEY, "--max-num-seqs", str(SESSIONS + 2),
                    "--kv-cache-memory", "256MiB", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                    "--log-level", "info"])
    proc.port = port
    try:
        proc.wait_for("rtserve: ready on", 600)
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.wait()


async def start_long_reply(url: str) -> Raw:
    ws = await websockets.connect(url, max_size=None)
    raw = Raw(ws)
    assert (await raw.recv())["type"] == "session.created"
    await raw.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                          "max_output_tokens": 4096}})
    await raw.until("session.updated")
    await raw.say("Write a very long story about a dragon who learns to cook, with many chapters.")
    await raw.send({"type": "response.create"})
    await raw.until("response.output_text.delta")
    return raw


async def test_sigterm_drains_then_closes(process):
    url = f"ws://127.0.0.1:{process.port}/v1/realtime"
    # a refused handshake: a clean 401, logged once at info with its reason
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(f"{url}?api-key=wrong-key"):
            pass
    assert info.value.response.status_code == 401
    # Realtime responses in flight (the key in the URL, as old relays send it) and one HTTP stream
    sessions = await asyncio.gather(*(start_long_reply(f"{url}?api-key={KEY}") for _ in range(SESSIONS)))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{process.port}/v1", api_key=KEY, max_retries=0)
    stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                  messages=[{"role": "user", "content": "Count to 50."}],
                                                  max_tokens=24, temperature=0, stream=True)
    chunks = [await anext(aiter(stream))]
    endless = await client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time",
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert (await anext(aiter(endless))).choices[0].text is not None   # (no max_tokens: the whole context)

    process.proc.send_signal(signal.SIGTERM)
    for raw in sessions:
        events = await raw.until("response.done", timeout=120)
        done = events[-1]["response"]
        assert done["status"] == "cancelled" and done["status_details"]["type"] == "cancelled", done
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await raw.recv(timeout=120)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    async for chunk in stream:  # the HTTP stream ran to its end
        chunks.append(chunk)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.APIError) as cut:   # the endless one: an error chunk at the timeout, the body whole
        async for _ in endless:
            pass
    assert cut.value.body["code"] == "server_shutting_down", cut.value.body
    # uvicorn re-raises the captured SIGTERM once its shutdown is done, so the exit status is that signal's
    assert await asyncio.to_thread(process.proc.wait, 120) in (0, -signal.SIGTERM)

    log = process.output
    assert KEY not in log and "wrong-key" not in log and "api-key=[redacted]" in log, log
    assert "without completing handshake" not in log and "ERROR" not in log, log
    assert log.count("refused WebSocket /v1/realtime") == 1 and "Incorrect or missing API key" in log, log
