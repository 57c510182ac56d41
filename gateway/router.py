"""Router: AsyncEngine's interface over N engine cores on this host (`--data-parallel-size N`), each in its own process
with its own KV cache (engine/core_client.py).

Where a request goes:
- A Realtime session's requests (they carry `session_id`) go to the replica that holds its pinned KV: the session is
  bound to a replica on its first request and stays there (affinity), so every turn hits its prefix cache.
- Other requests (HTTP) go to the replica with the longest cached prefix of the prompt, estimated here: the router
  hashes each prompt's full blocks the way the block manager does (`hash_block`, chained, salted) and remembers, per
  replica, the blocks it sent there (LRU, as many as the replica's KV holds). Ties and misses go to the least loaded.
- `--router round-robin` ignores both (the baseline the benchmark compares against).

Load caps: a replica runs at most `max_inflight` requests (its `max_num_seqs`) and holds at most `max_sessions`
sessions; beyond every replica's capacity, requests and new sessions wait here (they are not refused) until one ends.

Faults: a replica whose core process dies fails its own streams (EngineDeadError); the router forgets its sessions and
tells `on_sessions_lost` listeners (the app ends those sessions), and new work goes to the live replicas while the
client starts that core again.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.block_manager import hash_block
from engine.core_client import EngineCoreClient, ProcessLauncher, replica_engine_args
from engine.errors import EngineDeadError
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from gateway import openmp

log = logging.getLogger("rtserve.router")
POLICIES = ("affinity", "round-robin")
_SUMMED_NOT = ("kv_page_size",)     # per-replica values that are the same everywhere, not amounts


# How engine cores in child processes share this host's CPUs with the audio stage of this process (Whisper, piper, the
# event loop). A voice turn goes through Whisper, then the LLM, then TTS, and at 8 simultaneous turns the CPUs are
# short: Whisper's queue and the first sentence's synthesis are what the turns wait on. Across two processes nothing
# ordered the core's threads behind them, and its OpenMP worker spins (busy-waits) between parallel regions for as
# long as libgomp's default spin count, taking a CPU from them whenever the core's main thread is descheduled. So the
# cores run nicer than the audio threads (which preempt them when they wake, and leave them every CPU when idle), and
# their OpenMP workers spin for fewer iterations before they sleep (gateway/openmp.py, as for the in-thread engine):
# still enough to bridge the gaps between a step's parallel regions, so a step is not slower for it.
CORE_NICE_BESIDE_AUDIO = 10
CORE_ENV_BESIDE_AUDIO = dict(openmp.SPIN_ENV)


def audio_first_launcher(args: dict) -> ProcessLauncher:
    """A child-process launcher for a core that shares the CPUs with this process's audio stage."""
    return ProcessLauncher(nice=CORE_NICE_BESIDE_AUDIO, env=dict(CORE_ENV_BESIDE_AUDIO))


@dataclass(slots=True, eq=False)
class Replica:
    index: int
    engine: EngineCoreClient
    max_blocks: int                                  # how many prefix blocks its KV cache holds
    inflight: int = 0
    sessions: set[str] = field(default_factory=set)
    blocks: OrderedDict = field(default_factory=OrderedDict)   # block hash -> None, LRU: what it likely has cached
    routed: int = 0

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class Router:
    def __init__(self, engines: list[EngineCoreClient], policy: str = "affinity", max_inflight: int | None = None,
                 max_sessions: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        first = engines[0]
        self.policy = policy
        self.block_size = first.block_size
        self.replicas = [Replica(i, e, max(1, e.kv_slots // e.block_size)) for i, e in enumerate(engines)]
        for rep in self.replicas:
            rep.engine.on_death = self._died_callback(rep)
        self.max_inflight = max_inflight or first.max_num_seqs
        self.max_sessions = max_sessions or first.max_num_seqs
        self.tokenizer, self.model_name, self.model_dir = first.tokenizer, first.model_name, first.model_dir
        self.max_model_len, self.num_threads = first.max_model_len, first.num_threads
        self.max_num_seqs = self.max_inflight * len(engines)     # what all replicas run at once
        self.on_sessions_lost: list[Callable[[list[str], str], None]] = []   # called on the event loop
        self._affinity: dict[str, Replica] = {}
        self._session_replicas: dict[str, set[Replica]] = {}    # every replica that may pin a session's blocks
        self._request_replica: dict[str, Replica] = {}
        self._waiters: list[asyncio.Future] = []
        self._rr = itertools.count()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def start(cls, data_parallel_size: int, model: str | None = None, engine_args: dict | None = None,
              policy: str = "affinity", launcher: Callable[[dict], object] | None = None,
              beside_audio: bool = False, **router_args) -> "Router":
        """Start `data_parallel_size` engine cores (in parallel; blocking), each with its share of the CPU threads:
        child processes of this one, or where `launcher(replica_engine_args)` puts each (engine/ray_core.py).
        `beside_audio`: this process runs the audio stage on the same CPUs (see `audio_first_launcher`)."""
        args = replica_engine_args(dict(engine_args or {}), data_parallel_size)
        if launcher is None and beside_audio:
            launcher = audio_first_launcher
        engines: list = [None] * data_parallel_size
        errors: list[BaseException] = []

        def load(i: int) -> None:
            try:
                engines[i] = EngineCoreClient(model, launcher=launcher(args) if launcher else None, **args)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(data_parallel_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            for e in engines:
                if e is not None:
                    e.shutdown()
            raise errors[0]
        return cls(engines, policy, **router_args)

    # ---- AsyncEngine's interface --------------------------------------------------------------------------------
    async def generate(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       session_id: str | None = None) -> AsyncIterator:
        self._loop = asyncio.get_running_loop()
        request_id = request_id or f"rreq-{next(self._ids)}"
        ids = list(prompt_token_ids)
        hashes = self._block_hashes(ids, cache_salt)
        rep = await self._acquire(session_id, hashes)
        self._request_replica[request_id] = rep
        rep.routed += 1
        rep.remember(hashes)       # concurrent requests with this prefix follow it there, and share its prefill
        out_ids: list[int] = []
        try:
            async for out in rep.engine.generate(request_id, ids, params, priority, cache_salt, session_id):
                out_ids += out.new_token_ids
                if out.finished and out.finish_reason in ("stop", "length"):
                    rep.remember(self._block_hashes(ids + out_ids, cache_salt))
                yield out
        finally:
            rep.inflight -= 1
            self._request_replica.pop(request_id, None)
            self._wake()

    async def compile_structured(self, spec: StructuredOutputsParams) -> None:
        await self._any_live().engine.compile_structured(spec)

    async def abort(self, request_id: str) -> None:
        rep = self._request_replica.get(request_id)
        if rep is not None:
            await rep.engine.abort(request_id)

    def release_session(self, session_id: str) -> None:
        self._affinity.pop(session_id, None)
        for rep in self._session_replicas.pop(session_id, ()):
            rep.sessions.discard(session_id)
            rep.engine.release_session(session_id)
        self._wake()

    @property
    def healthy(self) -> bool:
        """True while any replica serves."""
        return any(r.engine.healthy for r in self.replicas)

    @property
    def error(self) -> str | None:
        if self.healthy:
            return None
        return "; ".join(f"replica {r.index}: {r.engine.error or 'shut down'}" for r in self.replicas)

    def stats(self) -> dict:
        """The replicas' counters summed, and each replica's own under "replicas"."""
        per = [r.engine.stats() for r in self.replicas]
        total: dict = {}
        for s in per:
            for k, v in s.items():
                total[k] = v if k in _SUMMED_NOT else total.get(k, 0) + v
        total["replicas"] = [{**s, "replica": r.index, "healthy": r.engine.healthy, "sessions": len(r.sessions),
                              "inflight": r.inflight, "routed": r.routed, "restarts": r.engine.num_restarts}
                             for r, s in zip(self.replicas, per)]
        return total

    def replica_health(self) -> list[dict]:
        return [{"replica": r.index, "status": "ok" if r.engine.healthy else "error", "error": r.engine.error,
                 "pid": r.engine.pid, "sessions": len(r.sessions), "inflight": r.inflight,
                 "restarts": r.engine.num_restarts} for r in self.replicas]

    def replica_of_session(self, session_id: str) -> int | None:
        rep = self._affinity.get(session_id)
        return None if rep is None else rep.index

    def shutdown(self) -> None:
        threads = [threading.Thread(target=r.engine.shutdown) for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # ---- routing ------------------------------------------------------------------------------------------------
    def _block_hashes(self, ids: list[int], cache_salt: str | None) -> list[int]:
        bs, hashes, prev = self.block_size, [], None
        for i in range(len(ids) // bs):
            prev = hash_block(prev, ids[i * bs:(i + 1) * bs], cache_salt)
            hashes.append(prev)
        return hashes

    async def _acquire(self, session_id: str | None, hashes: list[int]) -> Replica:
        """A replica with room for one more request (waiting for one), counted in."""
        while True:
            rep = self._pick(session_id, hashes)
            if rep is not None:
                rep.inflight += 1
                if session_id is not None:
                    rep.sessions.add(session_id)
                    self._session_replicas.setdefault(session_id, set()).add(rep)
                return rep
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)

    def _pick(self, session_id: str | None, hashes: list[int]) -> Replica | None:
        live = [r for r in self.replicas if r.engine.healthy]
        if not live:
            raise EngineDeadError(f"no engine replica is running: {self.error}")
        has_room = [r for r in live if r.inflight < self.max_inflight]
        if self.policy == "round-robin":
            if not has_room:
                return None
            return has_room[next(self._rr) % len(has_room)]
        if session_id is not None:
            bound = self._affinity.get(session_id)
            if bound is not None:
                if not bound.engine.healthy:   # its KV is gone with it (the app ends such sessions)
                    raise EngineDeadError(f"the engine replica of this session is not running: {bound.engine.error}")
                return bound if bound.inflight < self.max_inflight else None
            room = [r for r in has_room if len(r.sessions) < self.max_sessions]
            if not room:
                return None
            # a session's KV grows where it lands: spread sessions first, then follow the cached prefix
            rep = min(room, key=lambda r: (len(r.sessions), -r.cached_prefix(hashes), r.inflight, r.index))
            self._affinity[session_id] = rep
            return rep
        if not has_room:
            return None
        return min(has_room, key=lambda r: (-r.cached_prefix(hashes), r.inflight, len(r.sessions), r.index))

    def _any_live(self) -> Replica:
        for r in self.replicas:
            if r.engine.healthy:
                return r
        raise EngineDeadError(f"no engine replica is running: {self.error}")

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ---- faults -------------------------------------------------------------------------------------------------
    def _died_callback(self, rep: Replica) -> Callable:
        def died(engine: EngineCoreClient) -> None:    # on the client's receiver thread
            loop = self._loop
            why = engine.error or "engine core died"
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._lost, rep, why)
        return died

    def _lost(self, rep: Replica, why: str) -> None:
        sessions = sorted(rep.sessions)
        rep.sessions.clear()
        rep.blocks.clear()
        for sid in sessions:
            if self._affinity.get(sid) is rep:
                self._affinity.pop(sid)
            self._session_replicas.get(sid, set()).discard(rep)
        log.error("replica %d lost; ending its %d session(s)", rep.index, len(sessions))
        for listener in list(self.on_sessions_lost):
            try:
                listener(sessions, f"engine replica {rep.index} failed: {why}")
            except Exception:
                log.exception("on_sessions_lost listener failed")
        self._wake()
