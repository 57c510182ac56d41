"""Host and Origin checks (gateway/guard.py): a web page cannot drive the server, over HTTP or WebSocket.

The rules alone, then the product app on the shared engine: the test session's open app (no lists: IP literals and
localhost only, same-origin pages only) and an app of this module's own with `--allowed-origins` and `--allowed-hosts`.
"""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import websockets

from gateway.guard import default_allowed_hosts, host_allowed
from tests.gateway.realtime.client import Raw

EVIL = "evil.example"
APP_ORIGIN = "http://app.example"


def test_host_rules():
    for host in ("127.0.0.1:8000", "[::1]:8000", "10.1.2.3", "localhost:8000", "LOCALHOST", "a.localhost:1", None):
        assert host_allowed(host, None), host
    for host in ("evil.example:8000", "evil.example", "localhost.evil.example", "127.0.0.1.evil.example", "[bad",
                 "x:y:z"):
        assert not host_allowed(host, None), host
    assert host_allowed("api.example.com:443", ["api.example.com"])
    assert not host_allowed("other.example.com", ["api.example.com"])
    assert host_allowed("a.b.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil", ["*.example.com"])
    assert host_allowed("anything.example", ["*"])
    assert default_allowed_hosts("127.0.0.1") == [] and default_allowed_hosts("myhost") == ["myhost"]
    assert default_allowed_hosts("0.0.0.0")  # the machine's own hostname


async def test_foreign_host_refused_over_http_and_websocket(server):
    """DNS rebinding: Host = Origin = a foreign name passes any same-origin rule, so the Host itself is refused."""
    foreign = f"{EVIL}:{server.port}"
    r = httpx.get(f"{server.base_url}/models", headers={"Host": foreign, "Origin": f"http://{foreign}"})
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "host_not_allowed" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/chat/completions", headers={"Host": foreign},
                   json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(f"ws://{foreign}/v1/realtime", host=server.host, port=server.port,
                                      origin=f"http://{foreign}"):
            pass
    assert info.value.response.status_code == 403
    assert b"host_not_allowed" in info.value.response.body
    # loopback names and the listen address still work
    for host in (f"localhost:{server.port}", f"{server.host}:{server.port}"):
        assert httpx.get(f"{server.base_url}/models", headers={"Host": host}).status_code == 200


async def test_cross_site_browser_requests_refused(server):
    """An Origin that is not the server's own is refused on the HTTP API too (the official SDK sees a 403)."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", default_headers={"Origin": f"http://{EVIL}"},
                           max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert info.value.code == "origin_not_allowed"
    # no Origin (SDKs, curl) and same-origin pages pass, without CORS headers
    r = httpx.get(f"{server.base_url}/models")
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.base_url}/models", headers={"Origin": server.root_url})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.base_url}/models", headers={"Origin": "null"})  # sandboxed frames, file:// pages
    assert r.status_code == 403


@pytest.fixture(scope="module")
def listed_server(server):
    """The product app with allowed origins and hosts, on the shared engine, in a uvicorn thread of its own."""
    import uvicorn

    from gateway.app import Settings, create_app
    from tests.conftest import Server, _free_port

    app = create_app(Settings(allowed_origins=[APP_ORIGIN], allowed_hosts=["rtserve.test", "*.corp.test"]),
                     engine=server.engine)
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the listed server did not start"
        time.sleep(0.05)
    yield Server("127.0.0.1", port, server.engine, app)
    uv.should_exit = True
    thread.join(timeout=10)


async def test_allowed_origins_get_cors_and_others_none(listed_server):
    url = f"{listed_server.base_url}/models"
    r = httpx.get(url, headers={"Origin": APP_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    preflight = httpx.options(f"{listed_server.base_url}/chat/completions", headers={
        "Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == APP_ORIGIN
    client = openai.OpenAI(base_url=listed_server.base_url, api_key="x", default_headers={"Origin": APP_ORIGIN})
    reply = client.with_raw_response.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi."}], max_tokens=2, temperature=0)
    assert reply.headers["access-control-allow-origin"] == APP_ORIGIN
    assert reply.parse().choices[0].finish_reason in ("stop", "length")
    r = httpx.get(url, headers={"Origin": f"http://{EVIL}"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{listed_server.base_url}/chat/completions", headers={
        "Origin": f"http://{EVIL}", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    # WebSocket: the listed origin connects, another is refused
    async with websockets.connect(listed_server.realtime_url, origin=APP_ORIGIN) as ws:
        assert (await Raw(ws).recv())["type"] == "session.created"
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(listed_server.realtime_url, origin=f"http://{EVIL}"):
            pass
    assert info.value.response.status_code == 403


async def test_allowed_hosts(listed_server):
    port = listed_server.port
    for host, status in ((f"rtserve.test:{port}", 200), (f"a.corp.test:{port}", 200), (f"corp.test.evil:{port}", 403),
                         (f"localhost:{port}", 200), (f"{EVIL}:{port}", 403)):
        assert httpx.get(f"{listed_server.base_url}/models", headers={"Host": host}).status_code == status, host
    async with websockets.connect(f"ws://rtserve.test:{port}/v1/realtime", host="127.0.0.1", port=port,
                                  origin=f"http://rtserve.test:{port}") as ws:  # a page served under that name
        assert (await Raw(ws).recv())["type"] == "session.created"
    await listed_server.wait_idle()
