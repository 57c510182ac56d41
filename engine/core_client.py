"""EngineCoreClient: AsyncEngine's interface on an engine core that runs in a child process (engine/core_process.py).

The event loop's work (JSON, base64, WebSocket frames) and the engine's Python no longer share one interpreter. The
client validates a request as LLMEngine would (so bad input never crosses), sends commands over a ZeroMQ PUSH socket
and a receiver thread turns each step's one message of outputs into each consumer's asyncio stream (one
`call_soon_threadsafe` per event loop per step, as AsyncEngine does).

Faults: errors a step pins on one request cross as RequestFailedError; a step fault the core cannot pin stops it
(EngineDeadError for everyone, `healthy` False, no restart: the next core would fail the same way). A core process
that dies (a crash, an OOM kill, `kill -9`) fails every stream in flight with EngineDeadError, calls `on_death`, and
is started again with fresh sockets: the client serves again without the gateway restarting. The child exits with
its parent (it watches the parent's sentinel); `shutdown` stops and joins it.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.util   # (its exit hook, registered now, runs after ours: see _shutdown_at_exit)
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import msgspec
import zmq

import kernels
from engine.async_engine import deliver, request_outputs
from engine.config import EngineArgs
from engine.core_process import decode_error, encode_params, encode_spec, run_engine_core
from engine.errors import EngineDeadError, ModelLoadError
from engine.llm_engine import RequestOutput, validate_request
from engine.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("rtserve.engine")
LOAD_POLL_MS = 1000
_live: weakref.WeakSet = weakref.WeakSet()    # clients not shut down yet


@atexit.register
def _shutdown_at_exit() -> None:
    """Stop every core before multiprocessing's own exit hook terminates them (registered later, it runs first), so a
    core ended by the interpreter's exit is not taken for a crash and started again."""
    for client in list(_live):
        client.shutdown()


def replica_engine_args(engine_args: dict, data_parallel_size: int) -> dict:
    """Engine arguments for one of `data_parallel_size` cores on this host: each gets its share of the CPU threads
    (`num_threads`, else torch's default for this process)."""
    total = engine_args.get("num_threads") or kernels.default_thread_count()
    return {**engine_args, "num_threads": max(1, total // data_parallel_size)}


@dataclass(slots=True)
class ProcessLauncher:
    """Where an engine core runs: here, a spawned child process of this one, over ipc sockets. Another launcher
    (engine/ray_core.py: a Ray actor on any node, over tcp) gives the client the same process-like handle: `pid`,
    `sentinel` (a file descriptor that becomes readable when the core has exited), `exitcode`, `join`, `kill`.

    `nice` is added to the core's niceness (every thread of it); `env` is set in the core's environment only (this
    process's own is left as it was): both are how a gateway that shares the CPUs with other work (the audio stage)
    orders the core behind it (gateway/router.py)."""
    nice: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def socket_dir(self) -> str:
        """A fresh private directory for one core's ipc sockets (the client removes it; a core whose parent was killed
        removes its sockets and the directory itself, engine/core_process.py)."""
        return tempfile.mkdtemp(prefix="rtserve-core-")

    def bind(self, sock: zmq.Socket, directory: str, name: str) -> str:
        addr = f"ipc://{directory}/{name}"
        sock.bind(addr)
        return addr

    def launch(self, engine_args: dict, input_addr: str, output_addr: str):
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(engine_args, input_addr, output_addr), kwargs={"nice": self.nice},
            name="rtserve-engine-core", daemon=True)
        with _child_env(self.env):
            proc.start()
        return proc


_env_lock = threading.Lock()


@contextlib.contextmanager
def _child_env(env: dict[str, str]):
    """This process's environment plus `env` while a child is spawned (it inherits the environment at its start).
    Why not set it in the child: OpenMP reads its variables (GOMP_SPINCOUNT) once, when the library loads, and the
    child loads it (torch) while unpickling its target, before any code of ours runs there. The variables are only
    read by libraries this process loaded long ago, so the moment they are visible here changes nothing here."""
    if not env:
        yield
        return
    with _env_lock:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class EngineCoreClient:
    def __init__(self, model: str | None = None, *, restart: bool = True,
                 on_death: Callable[["EngineCoreClient"], None] | None = None, launcher=None, **engine_args):
        self.engine_args = dict(model=model, **engine_args)
        EngineArgs.from_kwargs(**self.engine_args)      # a bad argument raises here, before a process starts
        self.launcher = launcher or ProcessLauncher()
        self.restart = restart
        self.on_death = on_death            # called on the receiver thread when the core process died
        self.num_restarts = 0
        self._ctx = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder()
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._compiles: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._stopped = False
        self._restarting: str | None = None       # why the core is being started again
        self._error: str | None = None            # why the core stopped for good
        self._proc = self._commands = self._outputs = None
        self.socket_dir: str | None = None  # where the core's ipc sockets are (None: the launcher binds tcp)
        info = self._start()
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(info["model_dir"])
        self.model_dir = Path(info["model_dir"])
        self.model_name = info["model_name"]
        self.max_model_len = info["max_model_len"]
        self.vocab_size = info["vocab_size"]
        self.kv_slots = info["kv_slots"]
        self.block_size = info["block_size"]
        self.max_num_seqs = info["max_num_seqs"]
        self.num_threads = info["num_threads"]
        self.frozen_objects = info["frozen_objects"]  # the core's startup heap, left out of garbage collection
        self._receiver = threading.Thread(target=self._receive, name="rtserve-core-client", daemon=True)
        self._receiver.start()
        _live.add(self)

    # ---- public API (AsyncEngine's) -----------------------------------------------------------------------------
    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        request_id = request_id or f"areq-{next(self._ids)}"
        ids = list(prompt_token_ids)
        validate_request(ids, params, cache_salt, self.vocab_size, self.max_model_len, self.kv_slots)
        if params.structured_outputs is not None:
            await self.compile_structured(params.structured_outputs)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        finished = False
        try:
            if not self.healthy or not self._send(["add", request_id, ids, encode_params(params), priority,
                                                   cache_salt, session_id]):
                raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            async for out in request_outputs(q):
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(["abort", request_id])

    async def compile_structured(self, spec: StructuredOutputsParams) -> None:
        """Compile a grammar in the core (on its compile thread); a spec the compiler rejects raises
        InvalidRequestError. The core's add_request later finds the grammar cached."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = next(self._call_ids)
        self._compiles[call_id] = (loop, fut)
        try:
            spec_d = spec if isinstance(spec, dict) else encode_spec(spec)
            if not self._send(["compile", call_id, spec_d]):
                raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            error = await fut
        finally:
            self._compiles.pop(call_id, None)
        if error is not None:
            raise decode_error(error)

    async def abort(self, request_id: str) -> None:
        self._send(["abort", request_id])

    def release_session(self, session_id: str) -> None:
        self._send(["release", session_id])

    def inject_fault(self, request_id: str, phase: str) -> None:
        """Tests only: LLMEngine.inject_fault in the core."""
        self._send(["fault", request_id, phase])

    @property
    def healthy(self) -> bool:
        return not self._stopped and self._error is None and self._restarting is None

    @property
    def error(self) -> str | None:
        if self._error is not None:
            return self._error
        if self._restarting is not None:
            return f"engine core restarting: {self._restarting}"
        return None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stats(self) -> dict:
        """Engine counters as of the last message the core sent (after each step and command)."""
        return dict(self._stats)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        _live.discard(self)
        self._send(["shutdown"])
        proc = self._proc
        if proc is not None:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._receiver.join(timeout=10)
        self._close_sockets()
        self._ctx.destroy(linger=0)

    # ---- the core process ---------------------------------------------------------------------------------------
    def _start(self) -> dict:
        """Bind fresh sockets, spawn the core, wait for its `ready` (blocking: the model loads)."""
        self.socket_dir = self.launcher.socket_dir()
        commands = self._ctx.socket(zmq.PUSH)
        commands.setsockopt(zmq.LINGER, 0)
        commands.setsockopt(zmq.SNDHWM, 0)        # never block the event loop on a slow core
        in_addr = self.launcher.bind(commands, self.socket_dir, "commands")
        outputs = self._ctx.socket(zmq.PULL)
        outputs.setsockopt(zmq.LINGER, 0)
        outputs.setsockopt(zmq.RCVHWM, 0)
        out_addr = self.launcher.bind(outputs, self.socket_dir, "outputs")
        proc = self.launcher.launch(self.engine_args, in_addr, out_addr)
        poller = zmq.Poller()
        poller.register(outputs, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(LOAD_POLL_MS))
                if outputs in events:
                    msg = self._decoder.decode(outputs.recv())
                    if msg[0] == "ready":
                        break
                    if msg[0] == "load_failed":
                        raise ModelLoadError(msg[1])
                elif proc.sentinel in events or self._stopped:
                    raise ModelLoadError(f"the engine core process exited while loading (exit code "
                                         f"{proc.exitcode})")
        except BaseException:
            proc.kill()
            proc.join(timeout=5)
            commands.close()
            outputs.close()
            self._remove_socket_dir()
            raise
        info = msg[1]
        self._stats = info["stats"]
        with self._send_lock:
            self._proc, self._commands, self._outputs = proc, commands, outputs
        return info

    def _close_sockets(self) -> None:
        with self._send_lock:
            for sock in (self._commands, self._outputs):
                if sock is not None:
                    sock.close(linger=0)
            self._commands = self._outputs = None
        self._remove_socket_dir()

    def _remove_socket_dir(self) -> None:
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _send(self, msg: list) -> bool:
        """Send a command; False when there is no live core to take it (then it is moot: the stream fails)."""
        with self._send_lock:
            if self._commands is None:
                return False
            try:
                self._commands.send(self._encoder.encode(msg), zmq.NOBLOCK)
                return True
            except zmq.ZMQError:
                return False

    def _receive(self) -> None:
        """The receiver thread: outputs to consumers; a dead core is failed over to a fresh one."""
        while True:
            exitcode = self._serve_core()
            if self._stopped or self._error is not None:
                break
            why = f"engine core process {self._proc.pid} died (exit code {exitcode})"
            log.error("%s; its requests fail and it is started again", why)
            self._restarting = why            # before the streams are failed: a new stream sees it
            self._fail_all(EngineDeadError(why))
            if self.on_death is not None:
                try:
                    self.on_death(self)
                except Exception:
                    log.exception("on_death callback failed")
            if not self.restart:
                self._error = why
                break
            self._close_sockets()
            try:
                self._start()
            except Exception as exc:
                self._error = f"{why}; restarting it failed: {exc}"
                log.error("%s", self._error)
                break
            self.num_restarts += 1
            self._restarting = None
            log.warning("engine core restarted (pid %s)", self._proc.pid)
        self._fail_all(EngineDeadError(f"engine is not running: {self.error or 'engine shut down'}"))

    def _serve_core(self) -> int | None:
        """Deliver the core's messages until its process exits; its exit code."""
        outputs, proc = self._outputs, self._proc
        poller = zmq.Poller()
        poller.register(outputs, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            self._drain(outputs)
            if proc.sentinel in events:
                proc.join(timeout=5)
                self._drain(outputs)
                return proc.exitcode

    def _drain(self, outputs: zmq.Socket) -> None:
        while True:
            try:
                msg = self._decoder.decode(outputs.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = msg[0]
            if kind == "out":
                _, rows, errors, stats = msg
                self._stats = stats         # consumers that see a finish also see its blocks freed
                items = [(row[0], RequestOutput(*row)) for row in rows]
                items += [(rid, decode_error(err)) for rid, err in errors]
                self._deliver(items)
            elif kind == "compiled":
                _, call_id, error = msg
                pending = self._compiles.get(call_id)
                if pending is not None:
                    pending[0].call_soon_threadsafe(_resolve, pending[1], error)
            elif kind == "dead":
                log.error("engine core stopped: %s", msg[1])
                self._error = msg[1]
                self._fail_all(EngineDeadError(msg[1]))

    def _fail_all(self, exc: EngineDeadError) -> None:
        self._deliver([(rid, exc) for rid in list(self._streams)])
        for loop, fut in list(self._compiles.values()):
            loop.call_soon_threadsafe(_fail, fut, exc)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        deliver(self._streams, items, lambda rid: self._send(["abort", rid]))


def _resolve(fut: asyncio.Future, error) -> None:
    if not fut.done():
        fut.set_result(error)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
