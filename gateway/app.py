"""The starlette app: routes, lifespan (one shared AsyncEngine, loaded in a thread), the Realtime WebSocket endpoint."""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket
from threadpoolctl import threadpool_limits

from audio.stage import AudioStage
from engine.heap import freeze_startup_heap
from gateway import audio_api, generation_config, handshake, http_api, logs, stats_log, tools
from gateway.access_log import AccessLog
from gateway.guard import HostOriginGuard
from gateway.metrics import CONTENT_TYPE, Metrics
from gateway.realtime.conversation import PromptRenderer
from gateway.realtime.session import RealtimeSession, SessionLimits
from kernels import settings as variables

log = logging.getLogger("rtserve")
WEB_DEMO_DIR = Path(__file__).resolve().parent.parent / "web_demo"
# HTTP streams end this long before the shutdown timeout, so their last chunk is written before uvicorn cancels them
STREAM_CUT_MARGIN_S = 1.0
WS_MAX_SIZE = 64 * 1024 * 1024  # uvicorn's hard limit; frames above protocol.MAX_FRAME_BYTES get an error event


@dataclass(slots=True)
class Settings:
    """Server settings; `engine_args` go to AsyncEngine as keyword arguments (named like the CLI flags)."""
    model: str | None = None
    engine_args: dict = field(default_factory=dict)
    api_key: str | None = None
    allowed_origins: list[str] | None = None
    allowed_hosts: list[str] | None = None  # names besides IP literals and localhost (gateway/guard.py)
    limits: SessionLimits = field(default_factory=SessionLimits)
    public_url: str | None = None  # printed in the ready message
    audio: bool = True  # the audio stage (VAD, Whisper, TTS); False answers audio events with audio_unavailable
    chat_template: str | None = None  # a Jinja chat template (text or file path) instead of the model's own
    tool_call_parser: str | None = None  # "hermes" | "llama3_json"; None: detected from the chat template
    enable_auto_tool_choice: bool = True  # False: tool_choice "auto" is a 400, as in vLLM without the flag
    max_request_bytes: int = http_api.DEFAULT_MAX_REQUEST_BYTES   # HTTP API bodies above this get a 413
    served_model_name: list[str] | None = None   # names clients use for the model; None: the model's own name
    generation_config: str = "auto"   # sampling defaults: "auto" (the model's), "vllm" (none), or a path
    log_stats_interval: float = 0.0   # seconds between stats lines while busy (gateway/stats_log.py); 0: none
    engine_process: bool = False   # the engine core in a child process (engine/core_client.py), not a thread
    data_parallel_size: int = 1    # engine cores on this host behind gateway/router.py (each in its own process)
    router: str = "affinity"       # "affinity" (sessions, then cached prefix) | "round-robin"


def create_app(settings: Settings | None = None, engine=None) -> Starlette:
    """Build the app. With `engine` given (tests, embedding) it is used as is and not shut down by the app."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        owned = engine is None
        # The server answers while the model loads (/health: 503 with the stage, the API: 503 model_loading), so a
        # person or an orchestrator can see it is alive and how far it got.
        loading = asyncio.create_task(_load(app, settings)) if owned else None
        stats = asyncio.create_task(stats_log.run(app.state, settings.log_stats_interval)) \
            if settings.log_stats_interval > 0 else None
        try:
            yield
        finally:
            for task in (loading, stats):
                if task is not None and not task.done():
                    task.cancel()
            if owned and app.state.audio is not None:
                await asyncio.to_thread(app.state.audio.close)
            if owned and app.state.engine is not None:
                await asyncio.to_thread(app.state.engine.shutdown)

    routes = [
        WebSocketRoute("/v1/realtime", realtime_endpoint),
        Route("/v1/models", http_api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", http_api.model, methods=["GET"]),
        Route("/v1/chat/completions", http_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", http_api.completions, methods=["POST"]),
        Route("/v1/audio/transcriptions", audio_api.transcriptions, methods=["POST"]),
        Route("/v1/audio/speech", audio_api.speech, methods=["POST"]),
        Route("/health", http_api.health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/v1/{path:path}", http_api.not_served, methods=http_api.ALL_METHODS),  # JSON 404/405, not the demo
    ]
    if WEB_DEMO_DIR.is_dir():
        routes.append(Mount("/", app=StaticFiles(directory=WEB_DEMO_DIR, html=True), name="web_demo"))
    app = Starlette(routes=routes, middleware=_middleware(settings), lifespan=lifespan)
    app.state.settings = settings
    app.state.started = int(time.time())
    app.state.engine = None
    app.state.loading_stage = "starting"
    app.state.loading_error = None   # why the model could not be loaded (the server then stops)
    # With an engine given (tests, embedding) the audio workers start on first use; else in the lifespan.
    app.state.audio = AudioStage() if settings.audio else None
    app.state.sessions = {}  # id -> live RealtimeSession (introspection for tests and debugging)
    app.state.streams_cut = asyncio.Event()  # set by `drain` just before the shutdown timeout: HTTP streams end
    app.state.metrics = Metrics(lambda: app.state.engine.stats() if app.state.engine is not None else None,
                                lambda: app.state.audio.stats() if app.state.audio is not None else None)
    if engine is not None:
        _attach(app, engine)
    return app


def _middleware(settings: Settings) -> list[Middleware]:
    """The access line around everything, then the Host and Origin checks (a refused request reaches nothing
    else), then CORS headers for the listed origins only."""
    logs.install()
    middleware = [Middleware(AccessLog),   # outermost: a refused request has its access line too
                  Middleware(HostOriginGuard, allowed_hosts=settings.allowed_hosts,
                             allowed_origins=settings.allowed_origins)]
    if settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                                     allow_headers=["*"]))
    return middleware


async def drain(app: Starlette, timeout: float) -> None:
    """Shutdown, before the server closes the sockets: every Realtime response in flight ends with `response.done`
    (cancelled) and the events queued are written, within `timeout` in all. HTTP streams still running just before
    `timeout` ends end with an error chunk and `[DONE]` (gateway/http_api.py), instead of being cut mid-body."""
    margin = min(STREAM_CUT_MARGIN_S, timeout / 2)
    asyncio.get_running_loop().call_later(max(0.0, timeout - margin), app.state.streams_cut.set)
    sessions = list(app.state.sessions.values())
    if sessions:
        tasks = [asyncio.create_task(s.drain()) for s in sessions]
        await asyncio.wait(tasks, timeout=timeout)
        for task in tasks:  # a client that stopped reading is cut by the close that follows
            task.cancel()


def _attach(app: Starlette, engine) -> None:
    settings: Settings = app.state.settings
    tokenizer = engine.tokenizer
    if settings.chat_template is not None:   # a copy: the engine's tokenizer keeps the model's own template
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = _read_template(settings.chat_template)
    app.state.served_model_names = list(settings.served_model_name or [engine.model_name])
    app.state.sampling_defaults = generation_config.sampling_defaults(
        settings.generation_config, getattr(engine, "model_dir", None)   # a Router's / EngineCoreClient's
        or getattr(getattr(engine, "engine", None), "model_dir", None),   # the LLMEngine's
        embedded=settings.model is None)
    app.state.renderer = PromptRenderer(tokenizer)
    app.state.tool_call_parser = tools.resolve_tool_call_parser(settings.tool_call_parser, tokenizer.chat_template,
                                                               app.state.renderer.takes_tools())
    if hasattr(engine, "on_sessions_lost"):   # a Router: a replica that dies ends the sessions it held
        engine.on_sessions_lost.append(lambda ids, why: _end_sessions(app, ids, why))
    app.state.engine = engine   # last: requests see the engine only with everything it needs


_ending: set[asyncio.Task] = set()   # the tasks ending sessions (held, so none is collected while it runs)


def _end_sessions(app: Starlette, session_ids: list[str], why: str) -> None:
    for sid in session_ids:
        session = app.state.sessions.get(sid)
        if session is not None:
            task = asyncio.get_running_loop().create_task(session.end_on_engine_fault(why))
            _ending.add(task)
            task.add_done_callback(_ending.discard)


def _read_template(template: str) -> str:
    """`--chat-template`: a file path, or the template text itself (as vLLM reads it)."""
    path = Path(template)
    if "{" not in template and path.is_file():
        return path.read_text()
    if "{" not in template:
        raise ValueError(f"--chat-template {template!r}: no such file, and not a Jinja template")
    return template


async def _load(app: Starlette, settings: Settings) -> None:
    """Load the engine, then warm the audio stage, then serve: the engine is published last, with all it needs. Each
    stage logs its time (the engine's own stages, GGUF conversion, weights, C++ ops, KV cache, log theirs)."""
    start = time.monotonic()
    blas_on_one_thread()
    try:
        app.state.loading_stage = "model"
        engine = await _load_engine(settings)
        if app.state.audio is not None:  # Whisper loads in its thread; the TTS voice is loaded here
            app.state.loading_stage = "audio"
            t0 = time.monotonic()
            await _alive(app.state.audio.warmup(), "audio", t0)
            log.info("audio stage ready in %.1f s (VAD, Whisper, piper voice)", time.monotonic() - t0)
        share_cpus(engine, app.state.audio)
        freeze_startup_heap("gateway")
        _attach(app, engine)
    except Exception as exc:   # nothing can be served: say why, and stop the server (SIGTERM: uvicorn's own exit)
        app.state.loading_error = str(exc)
        log.error("loading failed: %s", exc)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if settings.public_url:
        log.info("ready on %s  (realtime: %s/v1/realtime; started in %.1f s)", settings.public_url,
                 settings.public_url.replace("http", "ws", 1), time.monotonic() - start)


def blas_on_one_thread() -> None:
    """numpy's BLAS (OpenBLAS) on one thread in this process, unless the user set its count. Its calls here are small
    (resampling, Smart Turn's features), and a second BLAS thread mostly spins after each one, on a CPU the engine,
    Whisper and piper need (docs/benchmarks.md, Voice). torch's own thread pool is not touched."""
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        threadpool_limits(limits=1, user_api="blas")


def share_cpus(engine, audio: AudioStage | None) -> None:
    """An in-thread engine steps on one thread while the audio stage computes (AsyncEngine.share_cpus_with). An
    engine core in a child process runs niced behind the audio stage instead (gateway/router.py)."""
    from engine import AsyncEngine

    if audio is not None and isinstance(engine, AsyncEngine) and variables.enabled("RTSERVE_ENGINE_SHARES_CPUS"):
        engine.share_cpus_with(audio.busy, audio.reply_awaited)


async def _alive(work, stage: str, start: float):
    """Await `work` (run in a thread), saying every little while that the stage is still going, so a slow first
    start (the C++ ops built, a model converted) is visibly alive between its stage lines."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=15.0)
        if done:
            return task.result()
        log.info("still loading: %s (%.0f s)", stage, time.monotonic() - start)


async def _load_engine(settings: Settings):
    """Load the model in a thread."""
    from engine import AsyncEngine

    name = settings.model or "the embedded default model (SmolLM2-135M-Instruct)"
    log.info("loading %s ...", name)
    start = time.monotonic()
    if settings.data_parallel_size > 1 or settings.engine_process:
        from gateway.router import Router
        make = lambda: Router.start(settings.data_parallel_size, settings.model, settings.engine_args,  # noqa: E731
                                    policy=settings.router, beside_audio=settings.audio)
    else:
        make = lambda: AsyncEngine(model=settings.model, **settings.engine_args)  # noqa: E731
    engine = await _alive(asyncio.to_thread(make), "model", start)
    stats = engine.stats()
    pages, page_size = stats.get("kv_pages_total"), stats.get("kv_page_size")
    log.info("model %s loaded in %.1f s (max_model_len %d, KV cache %s tokens: %s pages of %s)", engine.model_name,
             time.monotonic() - start, engine.max_model_len, pages * page_size if pages and page_size else "?",
             pages, page_size)
    return engine


async def metrics_endpoint(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE)


async def realtime_endpoint(websocket: WebSocket) -> None:
    state = websocket.app.state
    settings: Settings = state.settings
    hs = handshake.negotiate(websocket.headers, websocket.query_params, websocket.scope.get("subprotocols") or [],
                             settings.api_key, settings.allowed_origins)
    if hs.reject is None and state.engine is None:
        hs.reject = (503, "The model is still loading.")
    if hs.reject is not None:
        status, message = hs.reject
        code = {401: "invalid_api_key", 403: "origin_not_allowed"}.get(status, "model_loading")
        client = websocket.client
        log.info("refused WebSocket %s from %s: %s %s", websocket.url.path,
                 f"{client.host}:{client.port}" if client else "-", status, message)
        body = {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}}
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(JSONResponse(body, status_code=status))
        else:
            await websocket.close(code=1008, reason=message)
        return
    await websocket.accept(subprotocol=hs.subprotocol)
    hs.model = state.served_model_names[0]   # session.model names what serves it, not what the client asked for
    session = RealtimeSession(websocket, state.engine, state.renderer, state.metrics, hs, settings.limits,
                              audio=state.audio)
    if "temperature" in state.sampling_defaults:   # the model's default (--generation-config) until the client sets one
        session.config["temperature"] = state.sampling_defaults["temperature"]
    session.responses.sampling_defaults = generation_config.realtime_defaults(state.sampling_defaults)
    state.sessions[session.id] = session
    opened = time.monotonic()
    try:
        await session.run()
    finally:
        state.sessions.pop(session.id, None)
        log.info('"WebSocket %s" session %s closed after %.1f s (%s)', websocket.url.path, session.id,
                 time.monotonic() - opened, session.close_reason or "server closed")
    if session.close_reason != "client closed":  # we are ending it (slow reader): say why, without waiting long
        with contextlib.suppress(Exception):
            await asyncio.wait_for(websocket.close(code=session.close_code,
                                                   reason=(session.close_reason or "")[:120]), 1.0)
