"""`rtserve bench serve` against the session's real server: the JSON holds every request's timings and the summary,
every request got exactly the output tokens it asked for, the plot is a PNG; bad flags and an unreachable or refusing
server end in one line, not a traceback."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest
from PIL import Image

from gateway import cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench_serve(*argv: str) -> int:
    return cli.main(["bench", "serve", *argv])


def test_bench_serve_chat(server, tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = bench_serve("--base-url", server.base_url, "--concurrency", "1,2", "--num-prompts", "3", "--input-len", "24",
                     "--output-len", "6", "--output", str(out), "--plot", str(png))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "serve" and doc["prompt_unit"] == "tokens"   # the embedded model's tokenizer
    assert doc["machine"]["cpus"] >= 1 and isinstance(doc["machine"]["cpu_flags"], list) and doc["machine"]["commit"]
    (run,) = doc["runs"]
    assert run["server"]["model"] == "SmolLM2-135M-Instruct" and run["server"]["local"] is True
    assert run["server"]["base_url"] == server.root_url and run["server"]["health"]["status"] == "ok"
    assert "ignore_eos" in run["fields_sent"]
    assert [level["summary"]["concurrency"] for level in run["levels"]] == [1, 2]
    for level in run["levels"]:
        summary, requests = level["summary"], level["requests"]
        assert len(requests) == summary["requests"] == 3
        assert summary["errors"] == summary["wrong_length"] == 0
        for r in requests:
            assert r["error"] is None and r["output_tokens"] == r["output_len"]
            assert 3 <= r["output_len"] <= 9 and r["prompt_tokens"] >= r["input_len"]
            assert 0 < r["ttft_s"] <= r["latency_s"] and all(g >= 0 for g in r["itl_s"])
        assert summary["output_tokens"] == sum(r["output_len"] for r in requests)
        assert summary["output_tok_s"] > 0 and summary["request_s"] > 0
        for key in ("ttft_ms", "itl_ms", "tpot_ms"):
            assert summary[key]["p50"] <= summary[key]["p95"] <= summary[key]["p99"]
    assert "output (tok/s)" in captured.out and "TTFT p99 (ms)" in captured.out and "ITL p50 (ms)" in captured.out
    assert "concurrency 2: 3/3 requests done" in captured.err   # the progress line's last state
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()
    asyncio.run(server.wait_idle())


def test_bench_serve_completions_in_rounds(server, capsys):
    rc = bench_serve("--base-url", server.root_url, "--endpoint", "completions", "--concurrency", "2",
                     "--num-prompts", "2", "--input-len", "16", "--output-len", "5", "--range-ratio", "0",
                     "--tokenizer", "none", "--seed", "7", "--rounds", "2")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    for round_ in (1, 2):
        row = next(line for line in captured.out.splitlines()
                   if line.startswith(f"| {round_} | {server.root_url} | 2 |"))
        assert row.split("|")[4:7] == [" 2 ", " 0 ", " 0 "]   # requests, errors, wrong length
    assert "median of 2 rounds" in captured.out
    asyncio.run(server.wait_idle())


@pytest.mark.parametrize("argv, flag", [
    (["--base-url", "http://127.0.0.1:1", "--concurrency", "0,8"], "--concurrency"),
    (["--base-url", "http://127.0.0.1:1", "--concurrency", "one"], "--concurrency"),
    (["--base-url", "http://127.0.0.1:1", "--range-ratio", "1.5"], "--range-ratio"),
    (["--base-url", "http://127.0.0.1:1", "--endpoint", "embeddings"], "--endpoint"),
    (["--base-url", "http://127.0.0.1:1", "--num-prompts", "-3"], "--num-prompts"),
    (["--launch", "vllm"], "--launch"),
    (["--launch", "rtserve", "--base-url", "http://127.0.0.1:1"], "--base-url"),
    ([], "--base-url"),
])
def test_bad_flags_exit_2_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve(*argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and flag in err and err.count("\n") == 1, err


def test_unreachable_server_is_one_line(capsys):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bench_serve("--base-url", f"http://127.0.0.1:{port}") == 1
    err = capsys.readouterr().err
    assert err.startswith(f"rtserve bench serve: error: cannot reach http://127.0.0.1:{port}") and \
        err.count("\n") == 1 and "Traceback" not in err


def test_refused_model_is_one_line(server, capsys):
    assert bench_serve("--base-url", server.root_url, "--model", "no-such-model", "--concurrency", "1",
                       "--tokenizer", "none") == 1
    err = capsys.readouterr().err
    assert "the warm-up request failed: HTTP 404" in err and "Traceback" not in err
    assert server.stats()["requests_running"] == 0
