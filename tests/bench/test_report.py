"""bench/report.py, the output every `rtserve bench` module shares, and one benchmark through it end to end:
`rtserve bench realtime --url ... --output r.json --plot` against the session's real server."""
from __future__ import annotations

import io
import json

from PIL import Image

from bench import report
from gateway import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_table_has_units_and_dashes_for_missing_values():
    text = report.table([report.Column("server"), report.Column("output", "tok/s"), report.Column("TTFT", "ms", 0)],
                        [["a", 12.345, 80.4], ["b", None, float("nan")]])
    assert text.splitlines() == ["| server | output (tok/s) | TTFT (ms) |", "|---|---:|---:|",
                                 "| a | 12.3 | 80 |", "| b | — | — |"]


def test_progress_writes_lines_off_a_terminal():
    stream = io.StringIO()
    progress = report.Progress("level 8", total=3, every_s=3600, stream=stream)
    for _ in range(3):
        progress.advance("requests done")   # throttled: none of these is due yet
    progress.close("requests done, 12.0 tok/s")
    assert stream.getvalue().count("\n") == 1 and stream.getvalue().startswith("level 8: 3/3 requests done, 12.0")


def test_plot_path_defaults(tmp_path):
    ap = report.parser("demo", None)
    assert report.plot_path(ap.parse_args([])) is None
    assert str(report.plot_path(ap.parse_args(["--plot"]))) == "bench-demo.png"
    assert report.plot_path(ap.parse_args(["--output", str(tmp_path / "r.json"), "--plot"])) == tmp_path / "r.png"
    assert str(report.plot_path(ap.parse_args(["--plot", "x.png", "--output", "r.json"]))) == "x.png"


def test_bench_realtime_output_and_plot(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["bench", "realtime", "--url", server.realtime_url, "--sessions", "1,2", "--turns", "2",
                     "--max-output-tokens", "6", "--system-tokens", "60", "--output", str(out), "--plot"]) == 0
    captured = capsys.readouterr()
    assert "TTFT p50 (ms)" in captured.out and "output (tok/s)" in captured.out
    assert "external, 2 sessions: 4/4 turns done" in captured.err
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "realtime" and doc["machine"]["cpus"] >= 1
    assert [(run["mode"], run["sessions"], len(run["turns"])) for run in doc["runs"]] == [("external", 1, 1),
                                                                                         ("external", 2, 2)]
    for run in doc["runs"]:
        for session in run["turns"]:
            assert [t["index"] for t in session] == [1, 2]
            assert all(t["ttft"] > 0 and 0 < t["output_tokens"] <= 6 for t in session)
    png = tmp_path / "r.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()
