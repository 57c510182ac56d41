"""TTS burst benchmark: `rtserve bench tts [--pieces 8] [--rounds 3]`.

Many replies start speaking at once (the 8-session voice burst): each asks the shared `TTSWorker` for its first
clause at the same moment. Measured per clause, from the moment all were submitted: first audio, the whole clause,
and the worst playback gap (how late a chunk came for gapless playback from the first one on). Two workers in the
same process, in interleaved rounds: **streamed** (the server's: vocoder windows of 24 frames doubling to 96,
earliest listener deadline first) and **whole clause** (the same split graph run once per sentence: piper's own
way, which is the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from audio.tts import CHUNK_FRAMES, FIRST_CHUNK_FRAMES, TTSWorker
from bench import report
from kernels import settings

PIECES = ["The capital of France", "A spider has eight legs.", "Sure, here is a short", "Albania is a small country",
          "The largest planet is Jupiter.", "Marcus Aurelius was a Roman", "One of the most famous",
          "Water boils at one hundred", "Light travels very fast", "My favourite colour is blue,",
          "Cats sleep most of the day.", "The answer is forty two.", "It depends on the weather,",
          "Mount Everest is the highest", "Python is a programming language.", "Good morning to you too!"]


async def _burst(worker: TTSWorker, pieces: list[str]) -> dict:
    t0 = time.monotonic()
    rate = 24_000

    async def one(text: str) -> tuple[float, float, float]:
        job = worker.submit(text, "pcm16")
        first, played, gap = None, 0.0, 0.0
        async for raw in job.chunks():
            now = time.monotonic() - t0
            if first is None:
                first = now
            else:
                gap = max(gap, now - (first + played))
            played += len(raw) / (2 * rate)
        return first, time.monotonic() - t0, gap

    res = await asyncio.gather(*(one(p) for p in pieces))
    firsts, ends, gaps = zip(*res)
    return {"first_p50": statistics.median(firsts), "first_max": max(firsts), "done_p50": statistics.median(ends),
            "gap_max": max(gaps)}


async def _run(args) -> dict:
    pieces = (PIECES * (args.pieces // len(PIECES) + 1))[:args.pieces]
    workers = {"streamed": TTSWorker(threads=args.threads, window_frames=(FIRST_CHUNK_FRAMES, CHUNK_FRAMES)),
               "whole clause": TTSWorker(threads=args.threads, window_frames=(1 << 20, 1 << 20))}
    report.stage("loading piper and warming up both workers ...")
    for w in workers.values():
        await w.warmup()
    rows: dict[str, list[dict]] = {k: [] for k in workers}
    progress = report.Progress("tts bursts", total=args.rounds * len(workers))
    for _ in range(args.rounds):
        for name, w in workers.items():
            rows[name].append(await _burst(w, pieces))
            progress.advance(f"bursts done ({name})")
    progress.close("bursts done")
    for w in workers.values():
        w.close()
    print(f"rtserve bench tts: {args.pieces} first clauses at once, {args.threads} TTS threads, {args.rounds} "
          "interleaved rounds (median of rounds)")
    medians = {name: {k: 1000 * statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    report.print_table(
        [report.Column("synthesis"), report.Column("first audio p50", "ms", 0),
         report.Column("first audio, last clause", "ms", 0), report.Column("clause done p50", "ms", 0),
         report.Column("worst playback gap", "ms", 0)],
        [[name, m["first_p50"], m["first_max"], m["done_p50"], m["gap_max"]] for name, m in medians.items()])
    s, b = (medians[k]["first_p50"] for k in ("streamed", "whole clause"))
    print(f"first audio p50: streamed is {b / s:.2f}x sooner than whole-clause synthesis")
    return {"rounds": rows, "median_ms": medians}


def main(argv: list[str] | None = None) -> int:
    ap = report.parser("tts", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pieces", type=int, default=8, help="clauses submitted at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=settings.integer("RTSERVE_TTS_THREADS"))
    args = ap.parse_args(argv)
    results = asyncio.run(_run(args))
    if args.output:
        report.write_json(args.output, args, results)
    path = report.plot_path(args)
    if path:
        med = results["median_ms"]
        report.save_plot(path, [report.Panel("a burst of first clauses (median of rounds)", "bars", {
            "first audio p50": {k: m["first_p50"] for k, m in med.items()},
            "first audio, last clause": {k: m["first_max"] for k, m in med.items()},
            "clause done p50": {k: m["done_p50"] for k, m in med.items()},
            "worst playback gap": {k: m["gap_max"] for k, m in med.items()}}, ylabel="ms")],
            f"rtserve bench tts: {args.pieces} clauses at once, {args.threads} TTS threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
