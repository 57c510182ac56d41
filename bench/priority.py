"""Realtime-priority TTFT while a long HTTP-priority prompt is in flight, on the engine alone (no sockets).

    rtserve bench priority --background-tokens 3000 --reps 5

Loads the engine in the server's configuration (bf16 on the embedded GGUF's blocks, and the `rtserve serve` defaults
of the scheduling flags where this checkout has them: --long-prefill-token-threshold 128; pass
--engine-args max_itl_ms=250.0 for a latency target, inactive here anyway: no stream is decoding). Each rep
submits a ~N-token prompt at priority 1 (HTTP), waits until it is mid-prefill, then submits a short turn at priority 0
(Realtime) and measures the time to its first token; then the background prompt is aborted. Every rep uses prompts of
its own, so nothing hits the prefix cache. Also reports the turn's TTFT with no background load.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import fields

from bench import report
from engine import AsyncEngine, EngineArgs, SamplingParams

FIRST = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
TEXT = ("The river runs past the old mill and the stone bridge, through fields of wheat and barley, towards the sea. "
        "Farmers bring their grain to the market every Thursday, and the town has grown around the square. ")


async def first_token(eng: AsyncEngine, ids: list[int], priority: int) -> float:
    t0 = time.perf_counter()
    async for out in eng.generate(None, ids, FIRST, priority=priority):
        if out.new_token_ids:
            return time.perf_counter() - t0
    raise RuntimeError("no token")


async def idle(eng: AsyncEngine) -> None:
    while eng.stats()["requests_running"] or eng.stats()["requests_waiting"]:
        await asyncio.sleep(0.01)


async def run(eng: AsyncEngine, reps: int, background_tokens: int, lead_s: float) -> tuple[list[float], list[float]]:
    tok = eng.tokenizer
    alone, loaded = [], []
    progress = report.Progress("priority reps", total=reps)
    for rep in range(reps):
        turn = tok.encode(f"Rep {rep}. User: what is the capital of France?\nAssistant:", add_special_tokens=False)
        alone.append(await first_token(eng, turn, 0))
        turn = tok.encode(f"Rep {rep}b. User: what is the capital of Spain?\nAssistant:", add_special_tokens=False)
        long = tok.encode(f"Document {rep}. " + TEXT * (background_tokens // 40 + 1), add_special_tokens=False)
        bg = asyncio.create_task(first_token(eng, long[:background_tokens], 1))
        await asyncio.sleep(lead_s)                      # the long prompt is running, mid-prefill
        loaded.append(await first_token(eng, turn, 0))
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)
        await idle(eng)
        progress.advance("reps done")
    progress.close("reps done")
    return alone, loaded


def main(argv: list[str] | None = None) -> int:
    ap = report.parser("priority", __doc__.split("\n\n")[0])
    ap.add_argument("--background-tokens", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lead-s", type=float, default=1.0, help="how long the long prompt runs before the turn arrives")
    ap.add_argument("--engine-args", default="", help="extra engine kwargs, k=v,k=v (numbers parsed)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    known = {f.name for f in fields(EngineArgs)}
    kwargs = dict(dtype="bfloat16", quantization="gguf")
    kwargs.update({k: v for k, v in (("long_prefill_token_threshold", 128),) if k in known})
    for kv in filter(None, args.engine_args.split(",")):
        k, v = kv.split("=")
        kwargs[k] = None if v == "None" else float(v) if "." in v else int(v)
    report.stage(f"loading the engine {kwargs} ...")
    eng = AsyncEngine(**kwargs)
    try:
        alone, loaded = asyncio.run(run(eng, args.reps, args.background_tokens, args.lead_s))
    finally:
        eng.shutdown()
    med = statistics.median
    print(f"engine {kwargs}, {args.reps} reps:")
    report.print_table([report.Column("turn"), report.Column("TTFT p50", "ms", 0), report.Column("TTFT max", "ms", 0),
                        report.Column("per rep", "ms")],
                       [["alone", 1000 * med(alone), 1000 * max(alone), " ".join(f"{x * 1000:.0f}" for x in alone)],
                        [f"with a {args.background_tokens}-token priority-1 prompt in flight", 1000 * med(loaded),
                         1000 * max(loaded), " ".join(f"{x * 1000:.0f}" for x in loaded)]])
    if args.output:
        report.write_json(args.output, args, {"engine_args": kwargs, "ttft_alone_s": alone, "ttft_loaded_s": loaded})
    path = report.plot_path(args)
    if path:
        report.save_plot(path, [report.Panel("Realtime turn's time to first token", "bars", {
            "p50": {"alone": 1000 * med(alone), "long prompt in flight": 1000 * med(loaded)},
            "max": {"alone": 1000 * max(alone), "long prompt in flight": 1000 * max(loaded)}}, ylabel="ms")],
            f"rtserve bench priority: {args.background_tokens}-token priority-1 prompt, {args.reps} reps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
