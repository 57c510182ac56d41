"""`rtserve serve` as a process answers while the model loads: /health is 503 with the loading stage, the API a 503
`model_loading`; once the server prints that it is ready, /health is 200 and the API serves. The log shows each
loading stage with its time."""
from __future__ import annotations

import re
import time

import httpx

from tests.conftest import _free_port
from tests.gateway.test_shutdown import Process


def test_health_is_503_with_the_stage_while_loading_then_200():
    port = _free_port()
    proc = Process(["--port", str(port), "--no-audio", "--kv-cache-memory", "64MiB"])
    base = f"http://127.0.0.1:{port}"
    stages, models_status = [], None
    try:
        deadline = time.monotonic() + 600   # a bound for a slow machine, not a measure
        while "rtserve: ready on" not in proc.output:
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output
            try:
                r = httpx.get(f"{base}/health", timeout=5)
            except httpx.TransportError:   # the socket is bound before anything loads, but uvicorn may not be up yet
                time.sleep(0.05)
                continue
            if r.status_code == 503:
                assert r.json()["status"] == "loading", r.text
                stages.append(r.json()["stage"])
                if models_status is None:
                    models = httpx.get(f"{base}/v1/models", timeout=5)
                    models_status = (models.status_code, models.json()["error"]["code"])
            time.sleep(0.05)
        assert "model" in stages, stages   # seen while the engine loaded
        assert models_status == (503, "model_loading")
        r = httpx.get(f"{base}/health", timeout=5)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert httpx.get(f"{base}/v1/models", timeout=5).status_code == 200
        # each stage logged with its time, in order; the 503s answered while loading have their access lines
        log = proc.output
        stages = [log.index(s) for s in ("rtserve: loading ", "rtserve.engine: weights loaded in ",
                                         "rtserve.engine: KV cache: ", "rtserve: model SmolLM2-135M-Instruct loaded",
                                         "rtserve: ready on")]
        assert stages == sorted(stages), log
        # what loading left alive is frozen before the server says it is ready (engine/heap.py)
        frozen = re.search(r"rtserve: gateway: (\d+) objects of the startup heap frozen", log)
        assert frozen and int(frozen[1]) > 50_000 and frozen.start() < log.index("rtserve: ready on"), log
        assert '"GET /health" 503' in log and '"GET /v1/models" 503' in log, log
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        proc.proc.wait()
