"""`rtserve bench voice` in rounds and across server configurations: `--server` specs parse (and bad ones end in one
line, exit code 2), rounds interleave A B B A, the summary takes the median over rounds and the per-round ratio,
`--combine` joins earlier --output files, a configuration with pythonpath= runs its server from that tree; then the
bench against the session's real server, two rounds, with the JSON carrying each round."""
from __future__ import annotations

import gc
import json
import math
import textwrap
import time

import pytest

from bench import voice
from bench.voice import ServerConfig
from gateway import cli


def bench_voice(*argv: str) -> int:
    return cli.main(["bench", "voice", *argv])


def test_server_spec_fields(tmp_path):
    spec = voice.parse_server(f"name=base,pythonpath={tmp_path},env=RTSERVE_VNNI=0,env=A=b=c,"
                              "args=--max-itl-ms 0 --served-model-name 'a,b'")
    assert spec == ServerConfig("base", ["--max-itl-ms", "0", "--served-model-name", "a,b"], str(tmp_path.resolve()),
                                {"RTSERVE_VNNI": "0", "A": "b=c"})
    assert voice.parse_server("args=--max-itl-ms 0") == ServerConfig("--max-itl-ms 0", ["--max-itl-ms", "0"])
    assert voice.parse_server("name=main") == ServerConfig("main")


@pytest.mark.parametrize("spec, message", [
    ("name=a,foo=1", "'foo=1': expected name=NAME"),
    ("main", "'main': expected name=NAME"),
    ("name=", "'name=': expected"),
    ("name=a,env=NOVALUE", "env='NOVALUE': expected env=KEY=VALUE"),
    ("name=a,name=b", "name= given twice"),
    ("name=a,pythonpath=/no/such/tree", "pythonpath='/no/such/tree': no such directory"),
    ("name=a,args=--x 'unclosed", "args=: No closing quotation"),
])
def test_bad_server_spec_is_one_line(spec, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_voice("--server", spec)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["--server", "name=a", "--server", "name=a,args=--max-itl-ms 0"], "each configuration needs its own name="),
    (["--server", "name=a", "--url", "ws://127.0.0.1:1/v1/realtime"], "give one or the other"),
    (["--rounds", "0"], "--rounds: must be > 0"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_voice(*argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1


def test_default_is_one_server_with_server_args():
    args = voice.parse_args(["--server-args=--max-itl-ms 0", "--rounds", "3"])
    assert args.servers == [ServerConfig("default")] and args.rounds == 3


def test_rounds_interleave_and_alternate():
    assert [voice.round_order(["a", "b", "c"], r) for r in (1, 2, 3)] == [["a", "b", "c"], ["c", "b", "a"],
                                                                        ["a", "b", "c"]]


def turn(audio: float, text: float | None = None, transcript: float = 0.5) -> dict:
    t = {"stopped": 0.5, "transcript": transcript, "audio": audio, "after_stopped": audio - 0.5}
    if text is not None:
        t["text"] = text
    return t


def run(server: str, rnd: int, audios: list[float], sessions: int = 2) -> dict:
    return {"server": server, "round": rnd, "sessions": sessions, "spread_ms": 0, "turn_detection": "server_vad",
            "turns": [turn(a, a - 0.1) for a in audios]}


def test_summary_medians_over_rounds_and_per_round_ratio():
    runs = [run("base", 1, [0.6, 0.7, 0.8]), run("main", 1, [0.9, 1.0, 1.1]),  # p50s: base 700, 500, 900
            run("main", 2, [0.5, 0.6, 0.7]), run("base", 2, [0.4, 0.5, 0.6]),  # main 1000, 600, 900
            run("base", 3, [0.9]), run("main", 3, [0.8, 0.9, 1.0])]
    base, main = voice.summarize(runs)
    assert (base["server"], main["server"]) == ("base", "main") and base["rounds"] == main["rounds"] == [1, 2, 3]
    assert [round(v) for v in base["per_round"]["first audio p50"]] == [700, 500, 900]
    assert [round(v) for v in main["per_round"]["first audio p50"]] == [1000, 600, 900]
    assert round(base["median"]["first audio p50"]) == 700 and round(main["median"]["first audio p50"]) == 900
    assert round(main["median"]["first text → first audio p50"]) == 100
    assert base["first_audio_p50_ratio"] == 1.0
    assert main["first_audio_p50_ratio"] == pytest.approx(sorted([1000 / 700, 600 / 500, 900 / 900])[1])


def test_summary_without_a_mark_in_a_round():
    runs = [run("a", 1, [0.6]), run("a", 2, [0.8])]
    runs[1]["turns"] = [{"stopped": 0.5}]   # a round where no reply came
    (only,) = voice.summarize(runs)
    assert math.isnan(only["per_round"]["first audio p50"][1]) and round(only["median"]["first audio p50"]) == 600


def write_doc(path, runs: list[dict], counters: list[dict] | None = None) -> None:
    path.write_text(json.dumps({"benchmark": "voice", "runs": runs, "server_counters": counters or []}))


def test_combine_numbers_rounds_on(tmp_path, capsys):
    first, second, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ab.json"
    write_doc(first, [run("base", 1, [0.6]), run("main", 1, [0.9])], [{"server": "base", "round": 1, "counters": ""}])
    write_doc(second, [run("main", 1, [0.5]), run("base", 1, [0.4]), run("main", 2, [0.7]), run("base", 2, [0.6])])
    assert bench_voice("--combine", str(first), str(second), "--output", str(out)) == 0
    captured = capsys.readouterr()
    assert "Median over rounds" in captured.out and "| 600 / 400 / 600 |" in captured.out
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "voice" and doc["combined_from"] == doc["config"]["combine"] == [str(first), str(second)]
    assert [(r["server"], r["round"]) for r in doc["runs"]] == [("base", 1), ("main", 1), ("main", 2), ("base", 2),
                                                                ("main", 3), ("base", 3)]
    assert [(s["server"], s["rounds"]) for s in doc["summary"]] == [("base", [1, 2, 3]), ("main", [1, 2, 3])]
    assert doc["server_counters"] == [{"server": "base", "round": 1, "counters": ""}]


def test_combine_refuses_other_files(tmp_path, capsys):
    other = tmp_path / "serve.json"
    other.write_text(json.dumps({"benchmark": "serve", "runs": []}))
    with pytest.raises(SystemExit) as exit_info:
        bench_voice("--combine", str(other))
    assert "is not a `rtserve bench voice --output` file" in str(exit_info.value.code)


def test_pythonpath_runs_the_server_from_that_tree(tmp_path):
    """The launcher's part: the server process imports gateway from the configured tree (not from the bench's own,
    which `python -m` would put first on sys.path from the working directory) and gets its env; a stand-in `gateway.cli`
    there answers /health and reports where it runs."""
    tree = tmp_path / "tree"
    (tree / "gateway").mkdir(parents=True)
    (tree / "gateway" / "__init__.py").write_text("")
    report_path = tmp_path / "where.json"
    (tree / "gateway" / "cli.py").write_text(textwrap.dedent(f"""
        import json, os, sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        import gateway
        json.dump({{"gateway": gateway.__file__, "argv": sys.argv[1:], "vnni": os.environ.get("RTSERVE_VNNI")}},
                  open({str(report_path)!r}, "w"))
        class Health(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"{{}}")
        HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
    """))
    config = voice.parse_server(f"name=old,pythonpath={tree},env=RTSERVE_VNNI=0,args=--max-itl-ms 0")
    port = voice.free_port()
    with (tmp_path / "server.log").open("w+b") as log:
        proc = voice.start_server(config, ["--no-audio"], port, log)
        voice.stop_server(proc)
    where = json.loads(report_path.read_text())
    assert where["gateway"] == str(tree / "gateway" / "__init__.py") and where["vnni"] == "0"
    assert where["argv"] == ["serve", "--port", str(port), "--log-level", "warning", "--no-audio", "--max-itl-ms", "0"]
    assert proc.returncode is not None


def test_a_server_that_exits_is_reported(tmp_path):
    tree = tmp_path / "tree"
    (tree / "gateway").mkdir(parents=True)
    (tree / "gateway" / "__init__.py").write_text("")
    (tree / "gateway" / "cli.py").write_text("import sys\nsys.exit('no model here')\n")
    with (tmp_path / "server.log").open("w+b") as log, pytest.raises(RuntimeError, match="no model here"):
        voice.start_server(voice.parse_server(f"name=old,pythonpath={tree}"), [], voice.free_port(), log)


def test_bench_voice_rounds_against_the_server(server, tmp_path, capsys):
    out = tmp_path / "voice.json"
    rc = bench_voice("--url", server.realtime_url, "--sessions", "1", "--turns", "1", "--max-output-tokens", "6",
                     "--no-rtf", "--rounds", "2", "--fresh-speech", "--output", str(out))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "round 2: synthesizing the spoken questions anew" in captured.err
    assert gc.get_freeze_count() == 0  # the client's heap, frozen while it measured, is collected again
    assert "default, round 2: 1 sessions, spread 0 ms, server_vad: 1/1 turns done" in captured.err
    assert "Median over rounds" in captured.out and "first audio p50, per round (ms)" in captured.out
    doc = json.loads(out.read_text())
    assert [(r["server"], r["round"], r["sessions"], len(r["turns"])) for r in doc["runs"]] == [
        ("default", 1, 1, 1), ("default", 2, 1, 1)]
    for r in doc["runs"]:
        (t,) = r["turns"]
        assert 0 < t["stopped"] <= t["transcript"] and t["text"] > 0 and t["audio"] > 0
        assert 0 < t["end_of_speech_clock"] < time.perf_counter()  # the clock the server's trace lines use
        assert t["question"] == "What is the capital of France?" and "capital" in t["heard"].lower()  # session 0's
    (summary,) = doc["summary"]
    assert summary["rounds"] == [1, 2] and len(summary["per_round"]["first audio p50"]) == 2
    assert summary["first_audio_p50_ratio"] == 1.0
    assert [(c["server"], c["round"]) for c in doc["server_counters"]] == [("default", 1), ("default", 2)]
    assert doc["config"]["servers"] == [{"name": "default", "args": [], "pythonpath": None, "env": {}}]
    assert doc["config"]["fresh_speech"] is True


def test_fresh_speech_is_a_new_draw():
    """--fresh-speech's premise: piper draws its noise on every synthesis, so each round hears other speech."""
    first, again = voice.make_clips(), voice.make_clips()
    assert [c.text for c in first] == [c.text for c in again] == voice.QUESTIONS
    assert all(a.pcm != b.pcm for a, b in zip(first, again))
