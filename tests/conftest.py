"""Shared fixtures: one real server (real engine, default model, in the server's bf16 + gguf configuration) for the whole
test session.

`server` runs uvicorn in a background thread on a free port with the product app (`gateway.app.create_app`) around one
shared AsyncEngine. The same app is also mounted under `/auth` with an API key configured (same engine), for tests of
authentication, and under `/tight` with a 16-event send queue, for the stalled-reader test; everything else uses the
open root. Tests reach engine stats through `server.stats()`.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

API_KEY = "test-key-123"


@dataclass
class Server:
    host: str
    port: int
    engine: object  # engine.AsyncEngine
    app: object
    tight_app: object = None
    api_key: str = API_KEY

    @property
    def base_url(self) -> str:  # OpenAI SDK base_url (HTTP API)
        return f"http://{self.host}:{self.port}/v1"

    @property
    def ws_base_url(self) -> str:  # OpenAI SDK websocket_base_url
        return f"ws://{self.host}:{self.port}/v1"

    @property
    def realtime_url(self) -> str:
        return f"ws://{self.host}:{self.port}/v1/realtime"

    @property
    def root_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def auth_prefix(self) -> str:  # the same app with `api_key` required
        return f"{self.host}:{self.port}/auth"

    @property
    def tight_prefix(self) -> str:  # the same app with a tiny per-connection send queue
        return f"{self.host}:{self.port}/tight"

    def stats(self) -> dict:
        return self.engine.stats()

    def metrics_text(self) -> str:
        return httpx.get(f"{self.root_url}/metrics", timeout=10).text

    async def wait_idle(self, timeout: float = 30.0, pinned_ok: bool = False) -> dict:
        """Wait until the engine has no running/waiting request (and, unless pinned_ok, no used block)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            idle = s["requests_running"] == 0 and s["requests_waiting"] == 0
            if idle and (pinned_ok or s["kv_pages_used"] == 0):
                return s
            if time.monotonic() > deadline:
                return s
            await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server():
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from engine import AsyncEngine
    from gateway.app import WS_MAX_SIZE, Settings, create_app
    from gateway.realtime.session import SessionLimits

    # the server's production configuration (`rtserve serve` defaults): bf16 on the embedded GGUF's own 4-bit blocks
    engine = AsyncEngine(kv_cache_memory="512MiB", max_num_seqs=64, dtype="bfloat16", quantization="gguf")
    open_app = create_app(Settings(), engine=engine)
    keyed_app = create_app(Settings(api_key=API_KEY), engine=engine)
    tight_app = create_app(Settings(limits=SessionLimits(send_queue_max=16, send_timeout_s=5)), engine=engine)
    root = Starlette(routes=[Mount("/auth", app=keyed_app), Mount("/tight", app=tight_app),
                             Mount("/", app=open_app)])
    port = _free_port()
    config = uvicorn.Config(root, host="127.0.0.1", port=port, ws_max_size=WS_MAX_SIZE, log_level="warning",
                            lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("test server did not start")
        time.sleep(0.05)
    yield Server("127.0.0.1", port, engine, open_app, tight_app)
    uv.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()
