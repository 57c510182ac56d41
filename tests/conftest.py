"""Shared fixtures: one real server (real engine, default model, in the server's bf16 + gguf configuration) for the whole
test session.

`server` runs uvicorn in a background thread on a free port with the product app (`gateway.app.create_app`) around one
shared AsyncEngine. The same app is also mounted under `/auth` with an API key configured (same engine), for tests of
authentication, and under `/tight` with a 16-event send queue, for the stalled-reader test; everything else uses the
open root. Tests reach engine stats through `server.stats()`. `small_server` (per module) is the same app on an
engine of its own with a small context and KV pool, for context overflow and KV pressure.
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

    async def wait_idle(self, timeout: float = 60.0, pinned_ok: bool = False, pages_used: int = 0) -> dict:
        """Wait until the engine has no running/waiting request and, unless pinned_ok, at most `pages_used` KV pages in
        use; fail if it is not so within `timeout` (a bound for a slow CI machine, not a measure)."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            idle = s["requests_running"] == 0 and s["requests_waiting"] == 0
            if idle and (pinned_ok or s["kv_pages_used"] <= pages_used):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not go idle within {timeout} s: {s}")
            await asyncio.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(engine, apps: dict[str, object]):
    """Run the Starlette mount of `apps` (prefix -> app) with uvicorn in a background thread; yields the port."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from gateway.app import WS_MAX_SIZE

    root = Starlette(routes=[Mount(prefix, app=app) for prefix, app in apps.items()])
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
    try:
        yield port
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


@pytest.fixture(scope="session")
def server():
    from engine import AsyncEngine
    from gateway.app import Settings, create_app
    from gateway.cli import SERVE_SPECULATIVE_CONFIG
    from gateway.realtime.session import SessionLimits

    # the server's production configuration (`rtserve serve` defaults): bf16 on the embedded GGUF's own 4-bit blocks,
    # n-gram drafts
    engine = AsyncEngine(kv_cache_memory="512MiB", max_num_seqs=64, dtype="bfloat16", quantization="gguf",
                         speculative_config=SERVE_SPECULATIVE_CONFIG)
    open_app = create_app(Settings(), engine=engine)
    keyed_app = create_app(Settings(api_key=API_KEY), engine=engine)
    tight_app = create_app(Settings(limits=SessionLimits(send_queue_max=16, send_timeout_s=5)), engine=engine)
    for port in _serve(engine, {"/auth": keyed_app, "/tight": tight_app, "/": open_app}):
        yield Server("127.0.0.1", port, engine, open_app, tight_app)


# The small server: a context of SMALL_CONTEXT tokens and a KV pool of about as many, so a test can overflow the
# context with a few items and fill the pool with one request.
SMALL_CONTEXT = 1024


@pytest.fixture(scope="module")
def small_server():
    """The product app on an engine of its own with a small context and a small KV pool (same model and dtype)."""
    from engine import AsyncEngine
    from gateway.app import Settings, create_app

    engine = AsyncEngine(kv_cache_memory="24MiB", max_model_len=SMALL_CONTEXT, max_num_seqs=8, dtype="bfloat16",
                         quantization="gguf")
    app = create_app(Settings(), engine=engine)
    for port in _serve(engine, {"/": app}):
        yield Server("127.0.0.1", port, engine, app)
