"""/health tells the truth about the engine: 200 while it serves, 503 with the reason once it stopped on a step fault
that no request could be blamed for (the requests in flight get an error; the engine refuses new ones).

The app is the product app around an engine of its own (this test breaks it); the fault is a model runner whose
forward raises for every batch, as a lost device would: the engine's handling of that is what is under test."""
from __future__ import annotations

import httpx
import pytest

from engine import AsyncEngine
from gateway.app import Settings, create_app


@pytest.fixture
def engine():
    eng = AsyncEngine(kv_cache_memory="32MiB")
    yield eng
    eng.shutdown()


async def test_health_is_503_once_the_engine_stopped_on_a_fault(engine, monkeypatch):
    app = create_app(Settings(audio=False), engine=engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
        r = await client.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"

        def lost_device(scheduled):
            raise RuntimeError("the device is gone")

        monkeypatch.setattr(engine.engine.runner, "execute", lost_device)
        body = {"model": engine.model_name, "prompt": "Hello", "max_tokens": 4}
        r = await client.post("/v1/completions", json=body)      # no Python text reaches the client
        assert r.status_code == 503 and "/health" in r.json()["error"]["message"]
        assert "device" not in r.text
        r = await client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error" and "the device is gone" in r.json()["error"]
        r = await client.post("/v1/completions", json=body)      # refused at once, not hung
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
