"""The `rtserve` command: `rtserve serve [MODEL]` runs the gateway, `rtserve bench NAME ...` runs bench/NAME.py.

`rtserve serve` checks its flags, then binds the port, before it imports the engine or loads anything: a bad value or
a busy port ends in one line naming the flag, with exit code 2, instead of a traceback after the model has loaded.
This module therefore imports nothing heavy at import time (`kernels` pulls in torch).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from gateway import openmp
from gateway.logs import LOG_FORMATS   # logging and re only: this module stays light

# `rtserve bench --help` lists these; each module's own `--help` explains its flags (tests/gateway/test_cli.py keeps
# this list equal to the modules in bench/).
BENCHMARKS = {
    "throughput": "offline engine tok/s against HF transformers (sequential and static batches of 8), KV waste; "
                  "--structured json adds the same workload under a JSON-schema grammar",
    "realtime": "concurrent text sessions over the Realtime WebSocket, prefix cache on vs off: time to first delta, "
                "gaps between deltas, TTFT per turn (starts its own server, or measures --url)",
    "voice": "concurrent spoken turns over the Realtime WebSocket: end of speech to transcript, first text and first "
             "audio, playback gaps (starts its own server, or measures --url)",
    "tts": "many replies starting to speak at once on the shared TTS worker: first audio, whole clause, worst "
           "playback gap; streamed synthesis against piper's whole-clause way",
    "turn": "end of turn on our own spoken utterances (complete / paused mid-clause): early ends, false ends and "
            "detection delay for the fixed 500 ms window, the engine's and Smart Turn's signals alone and combined",
    "whisper": "Whisper on our own spoken utterances (piper, espeak-ng): word error rate, loops and encoder / decoder "
               "time per turn, the server's model against exact fp32, optionally at shorter encoder contexts",
    "priority": "a Realtime-priority turn's time to first token while a long HTTP-priority prompt is in flight, on "
                "the engine alone",
    "serve": "any OpenAI-compatible server (rtserve, llama.cpp's llama-server, vLLM) over HTTP: a seeded workload "
             "with fixed output lengths at a sweep of concurrency levels; output tok/s, TTFT, inter-token latency "
             "(--base-url URL, or --launch rtserve,llama-server)",
    "gguf_kernels": "per batch size, the kernels a GGUF Q4_1 / Q8_0 layer can run on this CPU (integer dots, fp32 "
                    "FMAs, torch's 4-bit kernel, MKL fp32)",
    "served_ab": "the served path against the engine alone on the throughput workload: rtserve serve with the audio "
                 "stage on, --no-audio, and the engine in-process, interleaved; per-thread CPU seconds",
    "structured_libs": "xgrammar (the engine's grammar library) against llguidance and outlines-core on the engine's "
                       "tokenizer: grammar compile time and token-mask time per decode step",
}
DTYPES = ("auto", "bfloat16", "float32")
# `rtserve serve`'s speculative decoding on the CPU: n-gram drafts from the request's own tokens. A spoken reply's first
# words often quote the question ("The boiling point of water is ..."), so its first piece is decoded in fewer steps,
# and on the CPU a decode step verifies a few more rows for little more than one (docs/benchmarks.md, Voice). Off on a
# GPU, where it is unmeasured and would leave the captured decode graphs.
SERVE_SPECULATIVE_CONFIG = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                            '"prompt_lookup_min": 2}')
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# CLI flag -> engine argument; only the flags a user gives are passed, so the engine's defaults stay the defaults
ENGINE_FLAGS = ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                "page_size", "dtype", "attention_backend", "pinned_blocks_fraction", "device", "num_threads",
                "quantization", "max_itl_ms", "long_prefill_token_threshold", "speculative_config")


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but an error is one line (the flag and what it allows), not the usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None: those flags say in their help what happens when they are not given."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def _positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def serve_parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or ArgumentParser(prog="rtserve serve", description="OpenAI Realtime (WebSocket) + HTTP API server.",
                              formatter_class=HelpFormatter)
    ap.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="HF model directory or .gguf file, as in `vllm serve MODEL` (the same as --model)")
    ap.add_argument("--model", default=None, help="HF model directory or .gguf file (default: embedded SmolLM2-135M)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the model name(s) the API accepts and answers with (the first is reported in Realtime "
                         "sessions and /health); a request for another model gets a 404. Default: the model's own "
                         "name (--model as given, or SmolLM2-135M-Instruct)")
    ap.add_argument("--generation-config", default="auto",
                    help='sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, '
                         'repetition_penalty): "auto" reads the model\'s generation_config.json (the embedded model: '
                         'temperature 0.2, top_p 0.9), "vllm" uses none (temperature 1), or a folder or file with a '
                         'generation_config.json. A client\'s own value always wins')
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (bound before the model loads)")
    ap.add_argument("--api-key", default=None,
                    help="require this key (Bearer header, openai-insecure-api-key. subprotocol or ?api-key=); "
                         "default: $RTSERVE_API_KEY, else no key")
    ap.add_argument("--allowed-origins", default=None,
                    help="comma-separated browser origins allowed besides same-origin pages ('*' for any); "
                         "a request from any other page is refused (HTTP and WebSocket)")
    ap.add_argument("--allowed-hosts", default=None,
                    help="comma-separated Host names accepted besides IP addresses, localhost and the --host name "
                         "('*.example.com' for subdomains, '*' for any): guards against DNS rebinding")
    ap.add_argument("--shutdown-timeout", type=float, default=5.0,
                    help="seconds a shutdown (SIGTERM) waits: Realtime responses in flight end with response.done "
                         "(cancelled), HTTP streams get this long to finish (default 5)")
    ap.add_argument("--kv-cache-memory", default=None, help='KV cache size, bytes or e.g. "2GiB" (engine default 1GiB)')
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="most requests running at once (engine default 64)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="most tokens one engine step computes, decodes and prefill chunks together (engine default "
                         "512)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + output in tokens (default: the model's context length)")
    ap.add_argument("--max-itl-ms", type=float, default=200.0,
                    help="target inter-token gap of running streams: steps that carry prefill are sized to it from "
                         "the measured cost per token, and so are steps of HTTP prefill alone (a Realtime turn that "
                         "arrives waits about this long at most), at a cost in throughput and in time to first token "
                         "when many cold prompts arrive at once (docs/benchmarks.md). 0: off, every step may batch "
                         "--max-num-batched-tokens (default 200)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=128,
                    help="prefill tokens any one request gets per step while another has prefill work too "
                         "(default 128; 0: no cap)")
    ap.add_argument("--no-share-inflight-prefixes", action="store_true",
                    help="requests that arrive together with the same uncached prefix each compute it (default: the "
                         "later ones wait for the first one's blocks and hit the prefix cache)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per prefix-cache block (engine default 16)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="KV slots per page, the unit of KV memory; must divide --block-size (engine default 4)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="LLM weights/activations. auto = bfloat16: AMX/AVX-512 GEMMs on CPU, half the memory traffic "
                         "per decoded token; float32 matches HF transformers token for token")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"],
                    help="default: $RTSERVE_ATTENTION_BACKEND, else Triton for CUDA tensors and torch otherwise")
    ap.add_argument("--pinned-blocks-fraction", type=float, default=None,
                    help="share of the KV pool live sessions may keep pinned (engine default 0.5)")
    ap.add_argument("--device", default=None, help='"cpu" (default) or "cuda"')
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch CPU threads (default: chosen per CPU); split evenly across --data-parallel-size "
                         "engine cores")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                    help="run the engine core (scheduler, KV cache, model) in a child process instead of a thread of "
                         "the server's")
    ap.add_argument("--data-parallel-size", type=_positive_int, default=1,
                    help="engine cores on this host, each in its own process with its own KV cache and a share of "
                         "the threads; Realtime sessions stay on one, HTTP requests go where their prefix is cached")
    ap.add_argument("--router", default="affinity", choices=["affinity", "round-robin"],
                    help="with --data-parallel-size > 1: affinity (sessions, cached prefixes) or round-robin")
    ap.add_argument("--ray", action="store_true",
                    help="run on a Ray cluster (the `ray` extra): the gateway as a Ray Serve ingress on --host/--port, "
                         "its --data-parallel-size engine cores as Ray actors on any node (RAY_ADDRESS, else a "
                         "cluster started here by `ray start`, else a new one-node cluster); docs/scale-out.md")
    ap.add_argument("--quantization", default=None, choices=["none", "gguf"],
                    help='"gguf": decode batches of up to 64 rows run on the GGUF file\'s own Q4_1 blocks (faster decode '
                         'on CPU). Default: gguf for the embedded model on the CPU, none otherwise')
    ap.add_argument("--speculative-config", default=None,
                    help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 4, '
                         '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' drafts tokens from each request\'s own '
                         'prompt and output (n-gram prompt lookup) and verifies them in the same batched step; '
                         'faster where replies quote their prompt. Default: that config on the CPU, none on a GPU; '
                         '"none" turns it off')
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the KV cache of prompt prefixes seen before (a session's earlier turns, shared "
                         "instructions)")
    ap.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                    help=argparse.SUPPRESS)   # the old spelling of --no-enable-prefix-caching
    ap.add_argument("--send-queue-max", type=int, default=None,
                    help="outgoing events buffered per connection before a stalled client is disconnected")
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="largest HTTP API request body in bytes; larger ones get a 413 before they are read "
                         "(default 4 MiB)")
    ap.add_argument("--send-queue-max-bytes", type=int, default=None,
                    help="outgoing bytes buffered per connection before a stalled client is disconnected "
                         "(default 32 MiB)")
    ap.add_argument("--no-audio", action="store_true",
                    help="text only: no VAD/Whisper/TTS (audio events answer audio_unavailable)")
    ap.add_argument("--ws-compression", action="store_true",
                    help="offer permessage-deflate on WebSockets: base64 audio shrinks, at a cost in event-loop "
                         "CPU for every second of audio each way (off by default: a voice server here is CPU-bound)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template, as a file path or the text itself, instead of the model's own")
    ap.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                    help='tool_choice "auto" (the default when a request has tools): text or a call, the model '
                         'decides. On by default, since the call grammar makes any call it opens valid; '
                         '--no-enable-auto-tool-choice answers "auto" with a 400 as vLLM does without the flag')
    ap.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                    help="the model's tool-call format, for the call grammar and the parser: hermes (<tool_call> JSON, "
                         'Qwen2.5 / Hermes, and rtserve\'s own tool prompt) or llama3_json (Llama 3.1\'s {"name", '
                         '"parameters"} JSON). Default: detected from the chat template')
    ap.add_argument("--log-level", default="info", choices=LOG_LEVELS[:-1], help="rtserve's own log level")
    ap.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                    help="log lines on stderr as text, or json: one object per line with the keys time, level, "
                         "logger, message and the line's own fields (an access line's status, ttft_ms, ...)")
    ap.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                    help="seconds between the stats lines (throughput, running and waiting requests, KV cache use, "
                         "prefix cache hit rate, sessions), logged only while the engine has work; 0: none")
    ap.add_argument("--disable-log-stats", action="store_true", help="no stats lines (as --log-stats-interval 0)")
    ap.add_argument("--uvicorn-log-level", default=None, choices=LOG_LEVELS,
                    help="uvicorn's log level (its connection lines; the access lines are rtserve's own); default: "
                         "--log-level")
    return ap


def main_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="rtserve", description="rtserve: an OpenAI Realtime + HTTP API server on its own engine.")
    ap.add_argument("--version", action="version", version=f"rtserve {package_version()}")
    commands = ap.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=ArgumentParser)
    serve_parser(commands.add_parser("serve", help="run the OpenAI-compatible Realtime + HTTP server",
                                     description="OpenAI Realtime (WebSocket) + HTTP API server.",
                                     formatter_class=HelpFormatter))
    bench = commands.add_parser("bench", help="run a benchmark (`rtserve bench --help` lists them)",
                                description="Run a benchmark from bench/. `rtserve bench NAME --help` explains NAME's "
                                            "flags; docs/benchmarks.md has the latest figures and the commands.")
    names = bench.add_subparsers(dest="name", metavar="NAME", required=True, parser_class=ArgumentParser)
    for name, summary in BENCHMARKS.items():
        names.add_parser(name, help=summary, add_help=False)   # its own argv goes to bench/NAME.py's parser
    return ap


def package_version() -> str:
    try:
        return version("rtserve")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "unknown"


def engine_args(ns: argparse.Namespace) -> dict:
    """CLI flags → AsyncEngine keyword arguments (only those given, so the engine's defaults stay the defaults)."""
    args = {key: getattr(ns, key) for key in ENGINE_FLAGS if getattr(ns, key) is not None}
    if args.get("dtype") == "auto":   # the server's fast path; the engine API's own default stays float32
        args["dtype"] = "bfloat16"
    if not ns.enable_prefix_caching:
        args["enable_prefix_caching"] = False
    if ns.no_share_inflight_prefixes:
        args["share_inflight_prefixes"] = False
    if args.get("max_itl_ms") == 0:
        args["max_itl_ms"] = None
    if ns.enforce_eager:
        args["enforce_eager"] = True
    if ns.quantization is None:   # the embedded model is a Q4_1 GGUF: its own blocks make small-batch decode fast
        ns.quantization = "gguf" if ns.model is None and ns.device in (None, "cpu") else "none"
    args["quantization"] = None if ns.quantization == "none" else ns.quantization
    if ns.speculative_config is None:
        ns.speculative_config = SERVE_SPECULATIVE_CONFIG if ns.device in (None, "cpu") else "none"
    if ns.speculative_config.strip().lower() == "none":
        args.pop("speculative_config", None)
    else:
        args["speculative_config"] = ns.speculative_config
    return args


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_model(ns: argparse.Namespace) -> str | None:
    """The one-line problem with MODEL / --model, or None. Only the path is looked at: nothing is loaded."""
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            return f"argument MODEL: {ns.model_tag!r} and --model {ns.model!r} disagree; give one"
        ns.model = ns.model_tag
    if ns.model is None:
        return None
    path = Path(ns.model).expanduser()
    if not path.exists():
        return f"argument --model: {path} does not exist (expected a HF model directory or a .gguf file)"
    if path.is_dir() and not (path / "config.json").is_file():
        return f"argument --model: {path} has no config.json (expected a HF model directory or a .gguf file)"
    if path.is_file() and path.suffix.lower() != ".gguf":
        return f"argument --model: {path} is not a .gguf file (expected a HF model directory or a .gguf file)"
    if ns.quantization == "gguf" and path.suffix.lower() != ".gguf":
        return f"argument --quantization: gguf needs a .gguf model file, got {path}"
    return None


def check_engine_args(args: dict) -> str | None:
    """The engine's own validation (engine.EngineArgs) of the flags, as one line naming the flag, or None."""
    from engine import EngineArgs, parse_size
    from engine.errors import InvalidRequestError

    if "kv_cache_memory" in args:
        try:
            parse_size(args["kv_cache_memory"])
        except ValueError as e:
            return f"argument --kv-cache-memory: {e}"
    try:
        EngineArgs.from_kwargs(**args)
    except InvalidRequestError as e:
        message = str(e)
        for name in ENGINE_FLAGS:   # the engine's names, spelt as the flags the user typed
            message = message.replace(name, flag(name))
        return message if not e.param or flag(e.param) in message else f"argument {flag(e.param)}: {message}"
    return None


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound now so a busy port fails before the model loads; uvicorn serves on it later."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds: a TIME_WAIT port is free
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve(argv: list[str], ns: argparse.Namespace | None = None) -> int:
    openmp.bound_spinning()   # before anything loads torch (gateway/openmp.py)
    ap = serve_parser()
    ns = ns or ap.parse_args(argv)
    problem = check_model(ns)
    if problem:
        ap.error(problem)
    if ns.log_stats_interval < 0:
        ap.error(f"argument --log-stats-interval: must be >= 0 seconds, got {ns.log_stats_interval:g}")
    if ns.ray and importlib.util.find_spec("ray") is None:
        ap.error("argument --ray: Ray is not installed (pip install 'rtserve[ray]')")
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        ap.error(f"argument --port: cannot listen on {ns.host}:{ns.port}: {e.strerror or e}")
    try:
        args = engine_args(ns)
        problem = check_engine_args(args)
        if problem:
            ap.error(problem)
        return run_server(ns, args, sock)
    finally:
        sock.close()


def run_server(ns: argparse.Namespace, args: dict, sock: socket.socket) -> int:
    import uvicorn

    from gateway import logs, memory
    from gateway.app import WS_MAX_SIZE, create_app, drain

    logs.configure(ns.log_level, ns.log_format)
    memory.fix_thresholds()   # so that worker threads give big transient memory back (gateway/memory.py)
    settings = server_settings(ns, args, f"http://{ns.host}:{sock.getsockname()[1]}")
    if ns.ray:
        from gateway import ray_app
        port = sock.getsockname()[1]
        sock.close()        # Ray Serve's proxy listens there
        return ray_app.run(settings, ns.host, port, ns.log_level, ns.log_format)
    app = create_app(settings)
    # uvicorn's loggers go to the root handler (log_config=None); rtserve's access line, with timings, replaces
    # uvicorn's own
    config = uvicorn.Config(app, ws_max_size=WS_MAX_SIZE, ws_per_message_deflate=ns.ws_compression,
                            log_level=ns.uvicorn_log_level or ns.log_level, log_config=None, access_log=False,
                            timeout_graceful_shutdown=ns.shutdown_timeout)
    _draining_server()(config, lambda: drain(app, ns.shutdown_timeout)).run(sockets=[sock])
    return 0


def server_settings(ns: argparse.Namespace, args: dict, public_url: str):
    """The app's Settings from `rtserve serve`'s flags."""
    from gateway.app import Settings
    from gateway.guard import default_allowed_hosts
    from gateway.realtime.session import SessionLimits
    from kernels import settings as env

    limits = SessionLimits()
    if ns.send_queue_max:
        limits.send_queue_max = ns.send_queue_max
    if ns.send_queue_max_bytes:
        limits.send_queue_max_bytes = ns.send_queue_max_bytes
    origins = [o.strip().rstrip("/") for o in ns.allowed_origins.split(",") if o.strip()] if ns.allowed_origins \
        else None
    hosts = default_allowed_hosts(ns.host) + [h.strip() for h in (ns.allowed_hosts or "").split(",") if h.strip()]
    settings = Settings(model=ns.model, engine_args=args, api_key=ns.api_key or env.raw("RTSERVE_API_KEY") or None,
                        allowed_origins=origins, allowed_hosts=hosts, limits=limits,
                        public_url=public_url,
                        audio=not ns.no_audio, chat_template=ns.chat_template,
                        tool_call_parser=ns.tool_call_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice,
                        served_model_name=ns.served_model_name, generation_config=ns.generation_config,
                        log_stats_interval=0.0 if ns.disable_log_stats else ns.log_stats_interval,
                        engine_process=ns.engine_process, data_parallel_size=ns.data_parallel_size,
                        router=ns.router)
    if ns.max_request_bytes:
        settings.max_request_bytes = ns.max_request_bytes
    return settings


def _draining_server():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, which on shutdown closes every WebSocket at once (1012): first stop accepting, then let
        the app end its Realtime responses (`drain`), then uvicorn's own shutdown (HTTP requests get the rest of the
        timeout to finish)."""

        def __init__(self, config, drain_app) -> None:
            super().__init__(config)
            self.drain_app = drain_app

        async def shutdown(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            for server in self.servers:
                server.close()
            await self.drain_app()
            self.config.timeout_graceful_shutdown = max(0.1, (self.config.timeout_graceful_shutdown or 0)
                                                        - (loop.time() - start))
            await super().shutdown(sockets)

    return DrainingServer


def bench(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"bench.{name}")
    return module.main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        return bench(argv[1], argv[2:])   # the benchmark's own parser reads the rest, --help included
    ap = main_parser()
    if not argv:
        ap.print_help()
        return 2
    ns = ap.parse_args(argv)
    if ns.command == "serve":
        return serve(argv[1:], ns)
    return 2   # `rtserve bench` without a known NAME ends in argparse's error above


if __name__ == "__main__":
    sys.exit(main())
