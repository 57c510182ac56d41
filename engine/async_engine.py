"""AsyncEngine: the engine loop in its own thread, streams delivered to asyncio consumers.

Model compute never runs on the event loop. Requests enter through a thread-safe command queue; each step's outputs go
back to each consumer's asyncio.Queue with one `call_soon_threadsafe` per event loop per step. Leaving the `async for`
early (break, cancel, disconnect) aborts the request, which frees its blocks at the next step.

Faults: a request the step failed on its own account (LLMEngine.step isolates it) raises RequestFailedError in its
consumer only; everyone else goes on. A step fault that cannot be pinned on a request stops the engine: every consumer
gets EngineDeadError, new requests are refused, and `healthy` / `error` say so (the gateway's /health answers 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import AsyncIterator, Callable

import kernels
from engine.errors import EngineDeadError, RequestFailedError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger("rtserve.engine")

# After the other work sharing the CPUs (`share_cpus_with`) goes idle, the engine keeps stepping on one thread this
# long before it takes all of its threads back: that work comes in bursts (a reply's speech is made a window at a
# time), and each change of the thread count costs a little.
SHARE_HOLD_S = 0.3


class AsyncEngine:
    def __init__(self, model: str | None = None, **engine_args):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._error: BaseException | None = None
        self.num_threads = engine_args.get("num_threads") or kernels.default_thread_count()  # the engine thread's
        self._others_busy: Callable[[], bool] | None = None   # share_cpus_with
        self._awaited: Callable[[], bool] | None = None       # share_cpus_with
        self._shared_until = 0.0       # (engine thread) steps run on one thread until then
        self._step_threads = self.num_threads
        # The engine thread builds the engine it steps (see _load); this thread waits for it, and a load error
        # raises here.
        loaded: Future[LLMEngine] = Future()
        self._thread = threading.Thread(target=self._run, args=(model, engine_args, loaded), name="rtserve-engine",
                                        daemon=True)
        self._thread.start()
        self.engine = loaded.result()
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len

    # ---- public API ---------------------------------------------------------------------------------------------
    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
        request_id = request_id or f"areq-{next(self._ids)}"
        self.engine.validate(list(prompt_token_ids), params, cache_salt)     # raises before the first yield
        if params.structured_outputs is not None:
            # compile (or hit the cache) on a worker thread: a bad spec raises here, and a slow schema never stalls
            # the engine thread, whose add_request then finds the grammar cached
            await self.compile_structured(params.structured_outputs)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, q)
        self._submit(("add", request_id, list(prompt_token_ids), params, priority, cache_salt, session_id))
        finished = False
        try:
            if not self.healthy:     # it stopped while this stream was being registered: nobody may answer
                raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            async for out in request_outputs(q):
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(("abort", request_id))

    async def compile_structured(self, spec: StructuredOutputsParams) -> None:
        """Compile a grammar (or hit the cache) on a worker thread; a spec the compiler rejects raises
        InvalidRequestError. The compiler is thread-safe, and the engine thread later finds the grammar cached."""
        await asyncio.to_thread(self.engine.structured.compile, spec)

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def release_session(self, session_id: str) -> None:
        self._submit(("release", session_id))

    @property
    def healthy(self) -> bool:
        """False once the engine stopped: shut down, or a step fault that no request could be blamed for."""
        return not self._stopped and self._error is None

    @property
    def error(self) -> str | None:
        """Why the engine stopped on a fault (None while healthy or after a clean shutdown)."""
        return None if self._error is None else f"engine step failed: {self._error!r}"

    def share_cpus_with(self, busy: Callable[[], bool] | None, awaited: Callable[[], bool] | None = None) -> None:
        """While `busy()` says that other work of this process needs the CPUs (the gateway passes its audio stage's:
        a turn being transcribed, speech being synthesized, a turn being scored), the engine steps on one thread, and
        on all `num_threads` again once it has said False for SHARE_HOLD_S, or at once while `awaited()` says that a
        user waits on what the engine is computing now (the gateway's: a reply decoding towards its first spoken
        piece). None: always all of them.

        Why: at the batch sizes a voice turn brings, a decode step's second thread buys little speed (the weights'
        memory traffic and the Python between ops do not split) but costs a whole CPU, and on a small machine that
        CPU is the one Whisper and piper wait for. The hold keeps the engine off the second CPU between a reply's
        synthesis windows; but when the engine itself is what a user waits for and nothing else computes, the second
        CPU has nothing better to do. Both hooks are called on the engine thread before every step: they must be
        cheap, and must not block."""
        self._others_busy, self._awaited = busy, awaited

    def stats(self) -> dict:
        """Engine counters as of the last step or command the engine thread handled."""
        return dict(self._stats)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread ------------------------------------------------------------------------------------------
    def _submit(self, cmd: tuple) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                _, rid, ids, params, priority, salt, session = cmd
                if rid not in self._streams:          # consumer already gone
                    continue
                try:
                    self.engine.add_request(ids, params, request_id=rid, priority=priority, cache_salt=salt,
                                            session_id=session)
                except Exception as e:                # validation races (e.g. duplicate id): fail that stream only
                    self._deliver([(rid, e)])
            elif kind == "abort":
                out = self.engine.abort_request(cmd[1])
                if out is not None:
                    self._deliver([(cmd[1], out)])
            elif kind == "release":
                self.engine.release_session(cmd[1])

    def _fit_threads(self) -> None:
        """(engine thread) One thread while the work this engine shares the CPUs with is busy and for SHARE_HOLD_S
        after, unless a user waits on the engine meanwhile (share_cpus_with)."""
        busy = self._others_busy
        if busy is None and self._step_threads == self.num_threads:
            return
        now = time.monotonic()
        try:
            if busy is not None and busy():
                self._shared_until = now + SHARE_HOLD_S
            elif now < self._shared_until and self._awaited is not None and self._awaited():
                self._shared_until = now
        except Exception:                             # noqa: BLE001 - a faulty hook costs the sharing, not the engine
            log.exception("the CPU-sharing hook failed; the engine keeps all its threads from now on")
            self._others_busy, self._awaited, self._shared_until = None, None, 0.0
        want = 1 if now < self._shared_until else self.num_threads
        if want != self._step_threads:
            kernels.set_thread_count(want)
            self._step_threads = want

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        self._stats = self.engine.stats()           # consumers that see a finish also see its blocks freed
        deliver(self._streams, items, self.engine.abort_request)

    def _load(self, model: str | None, engine_args: dict) -> LLMEngine:
        """Build the engine on the thread that will step it.

        Why: libgomp gives every thread that opens a parallel region a pool of worker threads of its own, kept for the
        life of that thread, and once the process holds more of them than it has CPUs, an idle worker sleeps after
        about a hundred spins instead of a few milliseconds' worth. Each of a decode step's many parallel regions
        then waits for a sleeping worker to be woken. Loading the model on another thread (the gateway's loader, the
        caller's) left that thread's pool alive beside the engine thread's, so a small CPU crossed that line; one
        thread that loads and steps keeps one pool, as the engine-core process has."""
        kernels.set_thread_count(self.num_threads)  # (a Whisper or other worker thread may set a different count)
        return LLMEngine(model=model, **engine_args)

    def _run(self, model: str | None, engine_args: dict, loaded: Future) -> None:
        try:
            self.engine = self._load(model, engine_args)
        except BaseException as e:                    # the constructor raises it
            self._stopped = True
            loaded.set_exception(e)
            return
        self._stats = self.engine.stats()           # snapshot published by the engine thread (no cross-thread reads)
        loaded.set_result(self.engine)
        while not self._stopped:
            self._drain_commands()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._fit_threads()
            try:
                outputs = self.engine.step()
            except Exception as e:                    # not pinned on any request: the engine cannot serve on
                log.exception("engine step failed and no request could be blamed; the engine stops")
                self._error = e
                failed = list(self.engine.requests)
                for rid in failed:
                    self.engine.abort_request(rid)
                self._deliver([(rid, EngineDeadError(self.error)) for rid in failed])
                break
            if outputs:
                self._deliver([(o.request_id, RequestFailedError(o.error) if o.error else o) for o in outputs])
        # shutting down (or stopped on a fault): fail whoever still waits
        why = self.error or "engine shut down"
        self._deliver([(rid, EngineDeadError(why)) for rid in list(self._streams)])


def deliver(streams: dict, items: list[tuple[str, object]], abort: Callable[[str], None]) -> None:
    """Hand a step's outputs (or errors) to their streams' event loops, one wakeup per loop. A stream whose loop has
    closed is abandoned: `abort` its request. Shared by the in-thread engine and the engine-core client."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
    for rid, out in items:
        stream = streams.get(rid)
        if stream is not None:
            by_loop[stream[0]].append((stream[1], out))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:                      # that event loop is closed; its requests are abandoned
            for q, out in batch:
                rid = getattr(out, "request_id", None)
                if rid is not None:
                    abort(rid)


async def request_outputs(q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
    """One request's outputs from its queue, up to the finished one; an exception put there (the engine failed the
    request, or stopped) is raised. Shared by the in-thread engine and the engine-core client."""
    while True:
        out = await q.get()
        if isinstance(out, BaseException):
            raise out
        yield out
        if out.finished:
            return


def _put_all(batch) -> None:
    for q, out in batch:
        q.put_nowait(out)
