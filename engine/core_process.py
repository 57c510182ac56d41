"""The engine core in a process of its own: LLMEngine's step loop behind two ZeroMQ sockets (vLLM v1's EngineCore).

The parent (engine/core_client.py) binds a PUSH socket for commands and a PULL socket for outputs; this process
connects to both. Messages are msgpack arrays (msgspec):

  parent -> core   ["add", request_id, prompt_token_ids, params, priority, cache_salt, session_id]
                   ["abort", request_id]  ["release", session_id]  ["compile", call_id, spec]
                   ["fault", request_id, phase] (tests only)  ["shutdown"]
  core -> parent   ["ready", info]  ["load_failed", message]
                   ["out", outputs, errors, stats]   one per loop iteration: every output of the step (and of the
                                                     commands drained before it) with the stats after it
                   ["compiled", call_id, error]  ["dead", message]

Grammars compile on a worker thread that has a PUSH socket of its own (ZeroMQ sockets are single-thread), so a slow
schema never stalls the step loop. The process exits with its parent: a thread waits on the parent's sentinel.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec
import zmq

from engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError, RequestFailedError
from engine.heap import freeze_startup_heap
from engine.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("rtserve.engine")

# ---- what crosses, both ways -----------------------------------------------------------------------------------------
_ERROR_KINDS = {"too_long": PromptTooLongError, "invalid": InvalidRequestError, "failed": RequestFailedError,
                "dead": EngineDeadError}


def encode_error(exc: BaseException) -> list:
    """[kind, message, param]: the typed errors the gateway tells apart (most specific class first)."""
    for kind, cls in _ERROR_KINDS.items():
        if isinstance(exc, cls):
            return [kind, str(exc), getattr(exc, "param", None)]
    return ["failed", f"{type(exc).__name__}: {exc}", None]


def decode_error(err: list) -> BaseException:
    kind, message, param = err
    cls = _ERROR_KINDS[kind]
    return cls(message, param=param) if issubclass(cls, InvalidRequestError) else cls(message)


def encode_params(params: SamplingParams) -> dict:
    return msgspec.to_builtins(params)


def decode_params(d: dict) -> SamplingParams:
    return SamplingParams(**d)          # a dict structured_outputs is turned back into StructuredOutputsParams


def encode_spec(spec: StructuredOutputsParams) -> dict:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if getattr(spec, f.name) is not None}


# ---- the process -----------------------------------------------------------------------------------------------------
def run_engine_core(engine_args: dict, input_addr: str, output_addr: str, nice: int = 0) -> None:
    """The child's entry point (multiprocessing spawn target). `nice`: added to this process's niceness first."""
    if nice:
        renice_threads(nice)
    threading.Thread(target=_exit_with_parent, args=(input_addr, output_addr), name="rtserve-core-parent-watch",
                     daemon=True).start()
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from engine.llm_engine import LLMEngine
        import kernels
        engine = LLMEngine(**engine_args)
    except Exception as exc:
        outputs.send(encoder.encode(["load_failed", f"{type(exc).__name__}: {exc}"]))
        outputs.close()
        ctx.destroy(linger=0)
        return
    kernels.set_thread_count(engine.args.num_threads or kernels.default_thread_count())
    frozen = freeze_startup_heap("engine core")
    outputs.send(encoder.encode(["ready", {
        "model_name": engine.model_name, "model_dir": str(engine.model_dir), "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size, "kv_slots": engine.block_manager.num_slots,
        "block_size": engine.args.block_size, "max_num_seqs": engine.args.max_num_seqs,
        "num_threads": engine.args.num_threads or kernels.default_thread_count(), "frozen_objects": frozen,
        "stats": engine.stats()}]))
    EngineCoreLoop(engine, commands, outputs, encoder, ctx, output_addr).run()
    commands.close(linger=0)
    outputs.close()              # (lingers: the last outputs reach the parent)
    ctx.destroy(linger=0)        # and the compile thread's socket


def renice_threads(increment: int) -> None:
    """Add `increment` to the niceness of every thread of this process. Linux keeps a nice value per thread, and a
    new thread inherits its creator's: the threads started from here on (OpenMP's workers, ZeroMQ's I/O thread)
    follow this one, and the ones already running (importing torch starts one) are changed one by one."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:          # no /proc: the process-wide call is all there is
        os.nice(increment)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
        except ProcessLookupError:     # that thread has ended meanwhile
            pass


def _exit_with_parent(*addrs: str) -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        try:
            remove_ipc_sockets(*addrs)  # a parent killed outright (SIGKILL, the OOM killer) left them behind
        finally:
            os._exit(0)      # the parent is gone: nobody can read what this process would compute


def remove_ipc_sockets(*addrs: str) -> None:
    """Remove the socket files of these `ipc://` addresses, then their directories where that leaves them empty
    (a tcp address has no file)."""
    dirs = set()
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            dirs.add(os.path.dirname(path))
            try:
                os.unlink(path)
            except OSError:     # gone already
                pass
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:     # not empty: not only ours
            pass


class EngineCoreLoop:
    def __init__(self, engine, commands: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder,
                 ctx: zmq.Context, output_addr: str) -> None:
        self.engine, self.commands, self.outputs, self.encoder = engine, commands, outputs, encoder
        self.decoder = msgspec.msgpack.Decoder()
        self.ctx, self.output_addr = ctx, output_addr
        self.compiler = ThreadPoolExecutor(1, thread_name_prefix="rtserve-core-compile")
        self.compile_socket = threading.local()
        self.stopped = False

    def run(self) -> None:
        pending: list = []          # outputs of commands (aborts) and of the step, sent together
        errors: list = []
        while not self.stopped:
            if not self.engine.has_unfinished() and not pending and not errors:
                self.commands.poll()            # idle: block until a command comes
            changed = self._drain(pending, errors)
            if self.stopped:
                break
            if self.engine.has_unfinished():
                try:
                    step_outputs = self.engine.step()
                except Exception as exc:         # not pinned on any request: this core cannot serve on
                    log.exception("engine step failed and no request could be blamed; the engine core stops")
                    self.outputs.send(self.encoder.encode(["dead", f"engine step failed: {exc!r}"]))
                    return
                for o in step_outputs:
                    if o.error:
                        errors.append([o.request_id, ["failed", o.error, None]])
                    else:
                        pending.append(_output_row(o))
                changed = True
            if changed:
                self.outputs.send(self.encoder.encode(["out", pending, errors, self.engine.stats()]))
                pending, errors = [], []
        self.compiler.shutdown(wait=False, cancel_futures=True)

    def _drain(self, pending: list, errors: list) -> bool:
        changed = False
        while True:
            try:
                msg = self.decoder.decode(self.commands.recv(zmq.NOBLOCK))
            except zmq.Again:
                return changed
            changed = True
            kind = msg[0]
            if kind == "add":
                _, rid, ids, params, priority, salt, session = msg
                try:
                    self.engine.add_request(ids, decode_params(params), request_id=rid, priority=priority,
                                            cache_salt=salt, session_id=session)
                except Exception as exc:        # validation races (a duplicate id): fail that stream only
                    errors.append([rid, encode_error(exc)])
            elif kind == "abort":
                out = self.engine.abort_request(msg[1])
                if out is not None:
                    pending.append(_output_row(out))
            elif kind == "release":
                self.engine.release_session(msg[1])
            elif kind == "compile":
                self.compiler.submit(self._compile, msg[1], msg[2])
            elif kind == "fault":
                self.engine.inject_fault(msg[1], msg[2])
            elif kind == "shutdown":
                self.stopped = True
                return changed

    def _compile(self, call_id: int, spec: dict) -> None:
        sock = getattr(self.compile_socket, "sock", None)
        if sock is None:
            sock = self.compile_socket.sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.output_addr)
        try:
            self.engine.structured.compile(StructuredOutputsParams(**spec))
            error = None
        except Exception as exc:
            error = encode_error(exc)
        sock.send(self.encoder.encode(["compiled", call_id, error]))


def _output_row(o) -> list:
    return [o.request_id, o.new_token_ids, o.text_delta, o.finished, o.finish_reason, o.num_prompt_tokens,
            o.num_cached_tokens, o.num_output_tokens, o.logprobs, o.error, o.prompt_logprobs, o.prompt_top_logprobs]
