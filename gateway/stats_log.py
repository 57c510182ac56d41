"""The periodic stats line, as vLLM prints one: every `--log-stats-interval` seconds while the engine has work,
prompt and generation throughput over the interval, running and waiting requests, KV cache use, the prefix cache hit
rate and the open Realtime sessions. Silent while idle, so a quiet server's log stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger("rtserve.stats")


@dataclass(slots=True)
class StatsLine:
    running: int
    waiting: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    kv_usage: float   # share of the KV pages held by requests or pinned by sessions
    prefix_cache_hit_rate: float | None   # hits / queried prompt tokens in the interval; None: nothing queried
    sessions: int

    def text(self) -> str:
        hit = "-" if self.prefix_cache_hit_rate is None else f"{self.prefix_cache_hit_rate:.1%}"
        return (f"Avg prompt throughput: {self.prompt_tokens_per_s:.1f} tokens/s, Avg generation throughput: "
                f"{self.generation_tokens_per_s:.1f} tokens/s, Running: {self.running} reqs, Waiting: "
                f"{self.waiting} reqs, KV cache usage: {self.kv_usage:.1%}, Prefix cache hit rate: {hit}, "
                f"Realtime sessions: {self.sessions}")


def stats_line(prev: dict, cur: dict, seconds: float, sessions: int) -> StatsLine | None:
    """The line for the interval between two `engine.stats()` snapshots, or None when the engine was idle all along
    (no request running or waiting, no token computed)."""
    prompt = cur.get("prompt_tokens_total", 0) - prev.get("prompt_tokens_total", 0)
    generated = cur.get("generated_tokens_total", 0) - prev.get("generated_tokens_total", 0)
    running, waiting = cur.get("requests_running", 0), cur.get("requests_waiting", 0)
    if not (prompt or generated or running or waiting):
        return None
    queries = cur.get("prefix_cache_queries", 0) - prev.get("prefix_cache_queries", 0)
    hits = cur.get("prefix_cache_hits", 0) - prev.get("prefix_cache_hits", 0)
    total = cur.get("kv_pages_total") or 0
    return StatsLine(running=running, waiting=waiting, prompt_tokens_per_s=prompt / seconds,
                     generation_tokens_per_s=generated / seconds,
                     kv_usage=cur.get("kv_pages_used", 0) / total if total else 0.0,
                     prefix_cache_hit_rate=hits / queries if queries else None, sessions=sessions)


async def run(state, interval: float) -> None:
    """Log a stats line every `interval` seconds while busy (`state`: the app's state; its engine may still be
    loading, and is read anew each time)."""
    loop = asyncio.get_running_loop()
    prev, prev_t = None, loop.time()
    while True:
        await asyncio.sleep(interval)
        engine = state.engine
        if engine is None:
            continue
        cur, now = engine.stats(), loop.time()
        line = stats_line(prev, cur, now - prev_t, len(state.sessions)) if prev is not None else None
        prev, prev_t = cur, now
        if line is not None:
            log.info(line.text(), extra=_fields(line))


def _fields(line: StatsLine) -> dict:
    return {"running": line.running, "waiting": line.waiting,
            "prompt_tokens_per_s": round(line.prompt_tokens_per_s, 2),
            "generation_tokens_per_s": round(line.generation_tokens_per_s, 2), "kv_usage": round(line.kv_usage, 4),
            "prefix_cache_hit_rate": None if line.prefix_cache_hit_rate is None
            else round(line.prefix_cache_hit_rate, 4), "sessions": line.sessions}
