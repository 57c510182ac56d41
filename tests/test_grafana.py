"""docs/grafana/rtserve.json against the server: every series a panel's PromQL queries is one the running test server
exports on /metrics, so the dashboard cannot drift from gateway/metrics.py. The metric names are read out of each
expression (functions, label matchers, ranges, `by (...)` groupings and keywords left out)."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import httpx
import soundfile as sf
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.audio.speech import steady_piper_speech

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "rtserve.json"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
             "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)   # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)\b(\s*\()?", expr):
        if m.group(2) is None and m.group(1).lower() not in _KEYWORDS:   # a name followed by "(" is a function
            names.add(m.group(1))
    return names


def panel_queries(dashboard: dict):
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:   # a collapsed row holds its panels
            for target in inner.get("targets", []):
                yield inner["title"], target["expr"]


def test_metric_names_are_read_from_promql():
    expr = ('histogram_quantile(0.9, sum by (le, api) (rate(rtserve_ttft_bucket{instance=~"$instance",api="http"}'
            '[$__rate_interval]))) / on (instance) rtserve_kv_pages_total offset 5m > bool 0.5')
    assert metric_names(expr) == {"rtserve_ttft_bucket", "rtserve_kv_pages_total"}


def test_dashboard_is_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "rtserve"
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["description"], panel["title"]
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "instance"}


async def test_every_series_the_dashboard_queries_is_served(server):
    # the Whisper and TTS series are exported once the audio workers run: one transcription starts them
    buf = io.BytesIO()
    sf.write(buf, steady_piper_speech("what is the capital of france"), 16_000, format="WAV", subtype="PCM_16")
    client = AsyncOpenAI(api_key="unused", base_url=server.base_url, max_retries=0)
    await client.audio.transcriptions.create(model="whisper-1", file=("q.wav", buf.getvalue(), "audio/wav"))
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://{server.host}:{server.port}/metrics")
    assert r.status_code == 200
    served = {s.name for family in text_string_to_metric_families(r.text) for s in family.samples}
    queries = list(panel_queries(json.loads(DASHBOARD.read_text())))
    assert len(queries) >= 10
    for title, expr in queries:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= served, f"panel {title!r} queries {sorted(names - served)}, not on /metrics"
