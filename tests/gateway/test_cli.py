"""`rtserve` command line (no engine): serve flags map to engine arguments."""
from __future__ import annotations


def test_cli_flags_map_to_engine_args(capsys):
    from gateway import cli

    ns = cli.serve_parser().parse_args(["--kv-cache-memory", "2GiB", "--max-num-seqs", "8", "--no-prefix-caching",
                                        "--port", "9000", "--api-key", "k"])
    assert cli.engine_args(ns) == {"kv_cache_memory": "2GiB", "max_num_seqs": 8, "enable_prefix_caching": False,
                                   "dtype": "bfloat16",   # the server's default; the engine API's stays float32
                                   "quantization": "gguf",   # the embedded model is a Q4_1 GGUF: decode on its blocks
                                   "max_itl_ms": None, "long_prefill_token_threshold": 128}   # the server's defaults
    off = cli.engine_args(cli.serve_parser().parse_args(["--max-itl-ms", "250", "--long-prefill-token-threshold", "0",
                                                         "--no-share-inflight-prefixes"]))
    assert (off["max_itl_ms"], off["long_prefill_token_threshold"], off["share_inflight_prefixes"]) == (250, 0, False)
    assert cli.engine_args(cli.serve_parser().parse_args(["--dtype", "float32"]))["dtype"] == "float32"
    assert cli.engine_args(cli.serve_parser().parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in cli.engine_args(cli.serve_parser().parse_args([]))
    assert cli.engine_args(cli.serve_parser().parse_args(["--quantization", "none"]))["quantization"] is None
    assert cli.engine_args(cli.serve_parser().parse_args(["--model", "/m/hf-dir"]))["quantization"] is None
    assert (ns.port, ns.api_key, ns.host) == (9000, "k", "127.0.0.1")
    assert cli.main(["bench", "no_such_bench"]) == 2
    assert cli.main([]) == 2 and "rtserve serve" in capsys.readouterr().out
