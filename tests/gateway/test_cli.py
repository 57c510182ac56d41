"""`rtserve` command line: flags map to engine arguments; a bad value or a busy port ends in one line naming the flag,
exit code 2, before anything loads; --version; `rtserve bench --help` lists every benchmark. No model is loaded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import cli

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str, code: str | None = None) -> subprocess.CompletedProcess:
    """`python -m gateway.cli ARGV` from this tree, as `rtserve ARGV` runs it; the timeout only guards a hang."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", code, *argv] if code else [sys.executable, "-m", "gateway.cli", *argv]
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_cli_flags_map_to_engine_args(capsys):
    ns = cli.serve_parser().parse_args(["--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--no-prefix-caching",
                                        "--port", "9000", "--api-key", "k"])
    assert cli.engine_args(ns) == {"kv_cache_memory": "2GiB", "max_num_seqs": 8, "enable_prefix_caching": False,
                                   "dtype": "bfloat16",   # the server's default; the engine API's stays float32
                                   "quantization": "gguf",   # the embedded model is a Q4_1 GGUF: decode on its blocks
                                   "max_itl_ms": 200.0, "long_prefill_token_threshold": 128,   # the server's defaults
                                   "speculative_config": cli.SERVE_SPECULATIVE_CONFIG}   # n-gram drafts on the CPU
    off = cli.engine_args(cli.serve_parser().parse_args(["--max-itl-ms", "0", "--long-prefill-token-threshold", "0",
                                                         "--no-share-inflight-prefixes"]))
    assert (off["max_itl_ms"], off["long_prefill_token_threshold"], off["share_inflight_prefixes"]) == (None, 0, False)
    assert cli.engine_args(cli.serve_parser().parse_args(["--dtype", "float32"]))["dtype"] == "float32"
    assert cli.engine_args(cli.serve_parser().parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in cli.engine_args(cli.serve_parser().parse_args([]))
    assert cli.engine_args(cli.serve_parser().parse_args(["--quantization", "none"]))["quantization"] is None
    assert cli.engine_args(cli.serve_parser().parse_args(["--model", "/m/hf-dir"]))["quantization"] is None
    for argv in (["--speculative-config", "none"], ["--device", "cuda"]):   # off when asked, and off on a GPU
        assert "speculative_config" not in cli.engine_args(cli.serve_parser().parse_args(argv))
    mine = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert cli.engine_args(cli.serve_parser().parse_args(["--speculative-config", mine]))["speculative_config"] == mine
    assert (ns.port, ns.api_key, ns.host) == (9000, "k", "127.0.0.1")
    assert cli.main([]) == 2 and "serve" in capsys.readouterr().out


def test_prefix_caching_flags_and_the_old_spelling():
    for argv in (["--no-enable-prefix-caching"], ["--no-prefix-caching"]):
        assert cli.engine_args(cli.serve_parser().parse_args(argv))["enable_prefix_caching"] is False
    for argv in ([], ["--enable-prefix-caching"]):
        assert "enable_prefix_caching" not in cli.engine_args(cli.serve_parser().parse_args(argv))


def test_positional_model_is_the_model_flag(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    ns = cli.serve_parser().parse_args([str(tmp_path)])
    assert cli.check_model(ns) is None and ns.model == str(tmp_path)
    ns = cli.serve_parser().parse_args([str(tmp_path), "--model", str(tmp_path)])
    assert cli.check_model(ns) is None and ns.model == str(tmp_path)
    ns = cli.serve_parser().parse_args([str(tmp_path), "--model", "/elsewhere"])
    assert "--model" in cli.check_model(ns)


def test_tool_flags():
    ns = cli.serve_parser().parse_args([])
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.chat_template) == (True, None, None)
    ns = cli.serve_parser().parse_args(["--no-enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                                        "--chat-template", "tpl.jinja"])
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.chat_template) == (False, "llama3_json", "tpl.jinja")
    assert cli.serve_parser().parse_args(["--enable-auto-tool-choice"]).enable_auto_tool_choice is True
    with pytest.raises(SystemExit):
        cli.serve_parser().parse_args(["--tool-call-parser", "mistral"])


def _bad_values(tmp_path: Path) -> list[tuple[list[str], str]]:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "model.bin").write_bytes(b"")
    return [
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--page-size", "3"], "--page-size"),
        (["--block-size", "0"], "--block-size"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--pinned-blocks-fraction", "2"], "--pinned-blocks-fraction"),
        (["--speculative-config", "{method: ngram}"], "--speculative-config"),                    # not JSON
        (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "--speculative-config"),
        (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),     # no num_speculative_tokens
        (["--port", "http"], "--port"),
        (["--dtype", "float16"], "--dtype"),
        (["--model", str(tmp_path / "missing")], "--model"),
        ([str(tmp_path / "missing")], "--model"),
        ([str(tmp_path)], "--model"),                       # a directory without config.json
        (["--model", str(tmp_path / "model.bin")], "--model"),
        (["--model", str(tmp_path / "hf"), "--quantization", "gguf"], "--quantization"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--data-parallel-size", "0"], "--data-parallel-size"),
        (["--router", "random"], "--router"),
    ]


def test_each_bad_value_is_one_line_naming_the_flag_exit_2(tmp_path, capsys):
    for argv, flag in _bad_values(tmp_path):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--port", "0", *argv])   # port 0: any free port, so only the bad value can fail
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2, argv
        assert out == "" and err.count("\n") == 1, (argv, err)
        assert err.startswith("rtserve") and "error: " in err and flag in err, (argv, err)


def test_bad_model_path_and_busy_port_fail_before_anything_loads(tmp_path):
    """As a real command: one stderr line, exit 2, and neither torch nor the engine was imported (nothing loaded)."""
    probe = ("import sys\nfrom gateway import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print(e.code, 'torch' in sys.modules, 'engine' in sys.modules)\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for argv, flag in (([], "--port"), (["--model", str(tmp_path / "missing")], "--model")):
            r = run_cli("serve", "--port", port, *argv, code=probe)
            assert r.stdout == "2 False False\n", (argv, r.stdout, r.stderr)
            assert r.stderr.count("\n") == 1 and flag in r.stderr, r.stderr
        r = run_cli("serve", "--port", port)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
        assert "--port" in r.stderr and "in use" in r.stderr


def test_version():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"rtserve {cli.package_version()}"
    assert cli.package_version()[0].isdigit()


def test_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert exit_info.value.code == 0
    for shown in ("(default: 8000)", "(default: 127.0.0.1)", "(default: auto)", "(default: info)", "MODEL",
                  "--enable-prefix-caching, --no-enable-prefix-caching", "--uvicorn-log-level"):
        assert shown in out, shown
    assert "(default: None)" not in out


def test_bench_help_lists_every_benchmark(capsys):
    modules = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "report"))
    assert sorted(cli.BENCHMARKS) == modules
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for name, summary in cli.BENCHMARKS.items():
        assert name in out and " ".join(summary.split()[:3]) in " ".join(out.split()), name
    with pytest.raises(SystemExit) as exit_info:   # NAME's own flags: bench/NAME.py's parser answers --help
        cli.main(["bench", "throughput", "--help"])
    assert exit_info.value.code == 0 and "--num-requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "no_such_bench"])
    assert exit_info.value.code == 2 and "no_such_bench" in capsys.readouterr().err


def test_security_and_limit_flags():
    from gateway import cli
    from gateway.guard import default_allowed_hosts

    ns = cli.serve_parser().parse_args(["--allowed-hosts", "api.example.com,*.corp.test", "--shutdown-timeout", "2.5",
                                        "--send-queue-max-bytes", "1048576"])
    assert (ns.allowed_hosts, ns.shutdown_timeout, ns.send_queue_max_bytes) == ("api.example.com,*.corp.test", 2.5,
                                                                                1048576)
    defaults = cli.serve_parser().parse_args([])
    assert defaults.shutdown_timeout == 5.0 and defaults.allowed_hosts is None
    assert default_allowed_hosts(defaults.host) == []  # loopback: IP literals and localhost only
