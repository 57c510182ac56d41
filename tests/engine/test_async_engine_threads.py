"""The in-thread engine's OpenMP workers keep spinning between a step's parallel regions (engine/async_engine.py,
AsyncEngine._load): built on a loader thread, the engine left that thread's OpenMP pool beside its own, the process
went over libgomp's CPU count, and its idle workers slept after a few spins, so every parallel region of a step
waited for a futex wake. Counted, not timed: the process's voluntary context switches per decode step. A fresh
process, loaded as the gateway loads it (asyncio.to_thread)."""
from __future__ import annotations

import subprocess
import sys

CODE = """
import asyncio, os
from engine import AsyncEngine, SamplingParams

def switches():
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration):
            pass
    return total

async def main():
    eng = await asyncio.to_thread(AsyncEngine, kv_cache_memory="64MiB")
    try:
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        async for _ in eng.generate("warm", list(range(100, 140)), params):
            pass
        steps, before = eng.stats()["num_steps"], switches()
        async for _ in eng.generate("r", list(range(200, 240)), params):
            pass
        print(eng.stats()["num_steps"] - steps, switches() - before, eng.num_threads)
    finally:
        eng.shutdown()

asyncio.run(main())
"""


def test_decode_steps_do_not_sleep_between_parallel_regions():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600, check=True)
    steps, switches, threads = map(int, out.stdout.split()[-3:])
    assert steps >= 64
    # a step's own wakeups (the event loop's, the engine thread's between steps) are a few; a worker that sleeps
    # between parallel regions adds one per region, and a decode step has dozens
    assert switches < 25 * steps or threads < 2, out.stdout + out.stderr


SHARING = """
import asyncio, time
from engine import AsyncEngine, SamplingParams
from engine.async_engine import SHARE_HOLD_S

async def run(eng, rid):
    seen = set()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    async for out in eng.generate(rid, list(range(100, 140)), params):
        seen.add(eng.stats()["intra_op_threads"])
    return out.num_output_tokens, sorted(seen)

async def main():
    eng = await asyncio.to_thread(AsyncEngine, kv_cache_memory="64MiB", num_threads=2)
    busy = {"now": True, "calls": 0, "awaited": False}
    def awaited():
        return busy["awaited"]
    def others_busy():
        busy["calls"] += 1
        if busy["now"] == "raise":
            raise RuntimeError("hook bug")
        return busy["now"]
    try:
        print("alone", *await run(eng, "a"))
        eng.share_cpus_with(others_busy, awaited)
        print("busy", *await run(eng, "b"))
        busy["now"] = False
        print("held", *await run(eng, "h"))        # right after: inside the hold
        busy["now"] = True
        await run(eng, "b2")
        busy["now"], busy["awaited"] = False, True
        print("awaited", *await run(eng, "w"))     # right after, but a user waits on the engine: no hold
        busy["awaited"] = False
        await asyncio.sleep(SHARE_HOLD_S + 0.2)
        print("idle", *await run(eng, "c"))
        busy["now"] = "raise"
        print("faulty", *await run(eng, "d"))
        print("calls", busy["calls"] > 0)
    finally:
        eng.shutdown()

asyncio.run(main())
"""


def test_the_engine_steps_on_one_thread_while_the_work_it_shares_the_cpus_with_is_busy():
    out = subprocess.run([sys.executable, "-c", SHARING], capture_output=True, text=True, timeout=600, check=True)
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert lines["alone"] == "16 [2]", out.stdout
    assert lines["busy"] == "16 [1]", out.stdout      # every step while busy() said True
    assert lines["held"].startswith("16 [1"), out.stdout   # one thread for SHARE_HOLD_S after it said False...
    assert lines["awaited"] == "16 [2]", out.stdout   # ...unless a user waits on the engine and nothing else computes
    assert lines["idle"] == "16 [2]", out.stdout      # all threads back once it said False for the hold time
    assert lines["faulty"] == "16 [2]", out.stdout    # a hook that raises costs the sharing, not the requests
    assert "the CPU-sharing hook failed" in out.stderr
    assert lines["calls"] == "True"
