"""`rtserve serve ...` runs the gateway; `rtserve bench NAME ...` forwards the rest of argv to `bench.NAME.main(argv)`."""
from __future__ import annotations

import argparse
import importlib
import sys

from kernels import settings

USAGE = """usage: rtserve serve [options]      run the OpenAI-compatible Realtime + HTTP server
       rtserve bench NAME [args]    run bench/NAME.py (e.g. `rtserve bench realtime --help`)"""


def serve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="rtserve serve", description="OpenAI Realtime (WebSocket) + HTTP API server.")
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
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=settings.raw("RTSERVE_API_KEY") or None,
                    help="require this key (Bearer header, openai-insecure-api-key. subprotocol or ?api-key=)")
    ap.add_argument("--allowed-origins", default=None,
                    help="comma-separated browser origins allowed besides same-origin pages ('*' for any)")
    ap.add_argument("--kv-cache-memory", default=None, help='KV cache size, bytes or e.g. "2GiB" (engine default 1GiB)')
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None,
                    help="tokens per prefix-cache block (engine default 16)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="KV slots per page, the unit of KV memory; must divide --block-size (engine default 4)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                    help="LLM weights/activations (default bfloat16: AMX/AVX-512 GEMMs on CPU, half the memory traffic "
                         "per decoded token; float32 matches HF transformers token for token)")
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    ap.add_argument("--pinned-blocks-fraction", type=float, default=None,
                    help="share of the KV pool live sessions may keep pinned (engine default 0.5)")
    ap.add_argument("--device", default=None, help='"cpu" (default) or "cuda"')
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    ap.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quantization", default=None, choices=["none", "gguf"],
                    help='"gguf": decode batches of up to 64 rows run on the GGUF file\'s own Q4_1 blocks (faster decode '
                         'on CPU). Default: gguf for the embedded model on the CPU, none otherwise')
    ap.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    ap.add_argument("--send-queue-max", type=int, default=None,
                    help="outgoing events buffered per connection before a stalled client is disconnected")
    ap.add_argument("--max-request-bytes", type=int, default=None,
                    help="largest HTTP API request body in bytes; larger ones get a 413 before they are read "
                         "(default 4 MiB)")
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
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return ap


def engine_args(ns: argparse.Namespace) -> dict:
    """CLI flags → AsyncEngine keyword arguments (only those given, so the engine's defaults stay the defaults)."""
    args = {key: getattr(ns, key) for key in ("kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                                              "max_model_len", "block_size", "page_size", "dtype", "attention_backend",
                                              "pinned_blocks_fraction", "device", "num_threads", "quantization")
            if getattr(ns, key) is not None}
    if ns.no_prefix_caching:
        args["enable_prefix_caching"] = False
    if ns.enforce_eager:
        args["enforce_eager"] = True
    if ns.quantization is None:   # the embedded model is a Q4_1 GGUF: its own blocks make small-batch decode fast
        ns.quantization = "gguf" if ns.model is None and ns.device in (None, "cpu") else "none"
    args["quantization"] = None if ns.quantization == "none" else ns.quantization
    return args


def serve(argv: list[str]) -> int:
    import logging

    import uvicorn

    from gateway.app import WS_MAX_SIZE, Settings, create_app
    from gateway.realtime.session import SessionLimits

    ns = serve_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    limits = SessionLimits()
    if ns.send_queue_max:
        limits.send_queue_max = ns.send_queue_max
    origins = [o.strip().rstrip("/") for o in ns.allowed_origins.split(",") if o.strip()] if ns.allowed_origins \
        else None
    settings = Settings(model=ns.model, engine_args=engine_args(ns), api_key=ns.api_key or None,
                        allowed_origins=origins, limits=limits, public_url=f"http://{ns.host}:{ns.port}",
                        audio=not ns.no_audio, chat_template=ns.chat_template,
                        tool_call_parser=ns.tool_call_parser, enable_auto_tool_choice=ns.enable_auto_tool_choice,
                        served_model_name=ns.served_model_name, generation_config=ns.generation_config)
    if ns.max_request_bytes:
        settings.max_request_bytes = ns.max_request_bytes
    uvicorn.run(create_app(settings), host=ns.host, port=ns.port, ws_max_size=WS_MAX_SIZE,
                ws_per_message_deflate=ns.ws_compression, log_level=ns.log_level, timeout_graceful_shutdown=5)
    return 0


def bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rtserve bench NAME [args]   (NAME: a module in bench/, e.g. realtime, throughput)")
        return 0 if argv else 2
    name = argv[0]
    try:
        module = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        if e.name in (f"bench.{name}", "bench"):
            print(f"rtserve: no benchmark named {name!r} (expected bench/{name}.py)", file=sys.stderr)
            return 2
        raise
    return module.main(argv[1:]) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "bench":
        return bench(rest)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
