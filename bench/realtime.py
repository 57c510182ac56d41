"""Realtime benchmark: concurrent text sessions over the WebSocket, prefix cache on vs off in the same run.

    rtserve bench realtime --sessions 8,32 --turns 4

Starts `rtserve serve` as a subprocess (once with the prefix cache, once without; or measures `--url` as is), then for
each session count opens that many Realtime sessions at once. Each session sets a ~500-token system prompt, then runs
`--turns` user turns (item.create + response.create). Reported per mode and session count: p50/p95 time to first
delta (response.create → first text delta, measured by the client), p50/p95 gaps between deltas, and TTFT per turn
index; the last line compares turn-N TTFT with and without the cache.

    rtserve bench realtime --data-parallel-size 1,2 --router affinity,round-robin --sessions 32 --turns 4

starts one server per engine-core count and router (`--data-parallel-size N --router R`, the router only matters
for N > 1) instead, and compares each one's prefix-cache hit rate (cached / input tokens over every turn) and turn-N
TTFT with the single replica's.

`--background-http N` measures priority (issue 21): every session count runs twice in a row, without and then with N
HTTP clients sending ~`--background-prompt-tokens`-token `/v1/completions` prompts (each unique, so the prefix cache
cannot shorten them) in a loop for the whole load; the last lines compare the Realtime TTFT of the two.
`--shared-system-prompt` gives every session the same system prompt (as one voice app's users share one), so turn 1
shows identical prefixes in flight being computed once.

    rtserve bench realtime --sessions 32 --turns 4 --modes legacy,cache --rounds 2 --shared-system-prompt

measures the latency scheduling (issue 21) against the settings before it in one run: mode `legacy` is the prefix
cache with `LEGACY_FLAGS` (no inter-token gap target, no per-request prefill cap, identical prefixes in flight
computed by each request), `cache` the server's defaults; `--rounds 2` runs the modes A, B, A, B so that noise from a
shared machine falls on both. The last lines compare each round's turn-1 TTFT, gap p95 and throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import orjson
import websockets

from bench import report

QUESTIONS = ["What is the capital of France?", "Name three rivers in Europe.", "What is photosynthesis?",
             "Give me a synonym for happy.", "How many legs does a spider have?", "What is the boiling point of water?"]
SYSTEM_SENTENCES = ["You are a helpful, careful and friendly assistant for a travel company.",
                    "Always answer in plain English and keep answers short unless asked for detail.",
                    "Never invent facts; say so when you are not sure about something.",
                    "Prefer concrete examples, dates and numbers over vague statements.",
                    "When the user asks about travel, mention the best season to visit.",
                    "Be polite, and do not use emojis or markdown formatting in answers."]


LEGACY_FLAGS = ["--max-itl-ms", "0", "--long-prefill-token-threshold", "0", "--no-share-inflight-prefixes"]


def system_prompt(session: int, approx_tokens: int, shared: bool = False) -> str:
    """~`approx_tokens` tokens (about 13 per sentence), unique per session so turn 1 starts cold for everyone (or, with
    `shared`, the same for all)."""
    n = max(1, approx_tokens // 13)
    body = " ".join(SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] for i in range(n))
    return body if shared else f"Session {session}. {body}"


@dataclass
class Turn:
    index: int
    ttft: float
    gaps: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


async def run_session(url: str, sid: int, turns: int, max_tokens: int, prompt_tokens: int,
                      progress: report.Progress | None = None, shared_prompt: bool = False) -> list[Turn]:
    out = []
    async with websockets.connect(url, max_size=None) as ws:
        async def until(etype: str) -> dict:
            while True:
                ev = orjson.loads(await ws.recv())
                if ev["type"] == "error":
                    raise RuntimeError(ev["error"])
                if ev["type"] == etype:
                    return ev

        await until("session.created")
        await ws.send(orjson.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["text"], "max_output_tokens": max_tokens,
            "instructions": system_prompt(sid, prompt_tokens, shared_prompt)}}).decode())
        await until("session.updated")
        for t in range(turns):
            await ws.send(orjson.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": QUESTIONS[(sid + t) % len(QUESTIONS)]}]}}).decode())
            await until("conversation.item.done")
            start = time.perf_counter()
            await ws.send('{"type": "response.create"}')
            first = last = None
            gaps = []
            while True:
                ev = orjson.loads(await ws.recv())
                if ev["type"] == "response.output_text.delta":
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                elif ev["type"] == "response.done":
                    usage = ev["response"]["usage"] or {}
                    break
                elif ev["type"] == "error":
                    raise RuntimeError(ev["error"])
            ttft = (first or time.perf_counter()) - start
            out.append(Turn(t + 1, ttft, gaps, usage.get("input_token_details", {}).get("cached_tokens", 0),
                            usage.get("input_tokens", 0), usage.get("output_tokens", 0)))
            if progress is not None:
                progress.advance("turns done")
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ms(x: float) -> str:
    return f"{x * 1000:7.0f}"


async def background_http(url: str, clients: int, prompt_tokens: int) -> None:
    """`clients` HTTP clients, each sending a long completion prompt (unique: a fresh number first) and waiting for
    its answer, again and again until cancelled (which closes its connection: the server aborts the request)."""
    base = url.replace("ws://", "http://", 1).split("/v1/realtime")[0]
    ids = itertools.count()

    async def client(h: httpx.AsyncClient, model: str) -> None:
        while True:
            prompt = f"Document {next(ids)}. {system_prompt(0, prompt_tokens, shared=True)}\nSummary:"
            r = await h.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16})
            r.raise_for_status()

    async with httpx.AsyncClient(timeout=None) as h:
        model = (await h.get(f"{base}/v1/models")).json()["data"][0]["id"]
        await asyncio.gather(*(client(h, model) for _ in range(clients)))


async def run_load(url: str, sessions: int, args, progress: report.Progress | None = None,
                   background: int = 0, first_session: int = 0) -> list[list[Turn]]:
    bg = asyncio.ensure_future(background_http(url, background, args.background_prompt_tokens)) \
        if background else None
    try:
        if bg is not None:   # the long prompts are in flight before the first turn
            await asyncio.sleep(1.0)
            if bg.done():
                bg.result()
        return await asyncio.gather(*(run_session(url, i, args.turns, args.max_output_tokens, args.system_tokens,
                                                  progress, args.shared_system_prompt)
                                     for i in range(first_session, first_session + sessions)))
    finally:
        if bg is not None:
            bg.cancel()
            await asyncio.gather(bg, return_exceptions=True)


def summarize(mode: str, sessions: int, results: list[list[Turn]], wall: float, turns: int) -> dict:
    all_turns = [t for r in results for t in r]
    ttfts = [t.ttft for t in all_turns]
    gaps = [g for t in all_turns for g in t.gaps]
    per_turn = {n: statistics.median([t.ttft for t in all_turns if t.index == n]) for n in range(1, turns + 1)}
    cached = {n: statistics.mean([t.cached_tokens / max(1, t.input_tokens) for t in all_turns if t.index == n])
              for n in range(1, turns + 1)}
    out_tokens = sum(t.output_tokens for t in all_turns)
    hit_rate = sum(t.cached_tokens for t in all_turns) / max(1, sum(t.input_tokens for t in all_turns))
    return {"mode": mode, "sessions": sessions, "ttft_p50": pct(ttfts, 50), "ttft_p95": pct(ttfts, 95),
            "gap_p50": pct(gaps, 50), "gap_p95": pct(gaps, 95), "per_turn": per_turn,
            "cached_last_turn": cached[turns], "hit_rate": hit_rate, "output_tok_s": out_tokens / wall, "wall_s": wall,
            "turns": [[asdict(t) for t in r] for r in results]}


def print_summaries(summaries: list[dict], turns: int) -> None:
    cols = [report.Column("mode"), report.Column("sessions"), report.Column("TTFT p50", "ms", 0),
            report.Column("TTFT p95", "ms", 0), report.Column("gap p50", "ms", 0), report.Column("gap p95", "ms", 0)]
    cols += [report.Column(f"turn-{n} TTFT p50", "ms", 0) for n in range(1, turns + 1)]
    cols += [report.Column(f"cached, turn {turns}", "%", 0), report.Column("hit rate", "%", 1),
             report.Column("output", "tok/s")]
    report.print_table(cols, [[s["mode"], s["sessions"], 1000 * s["ttft_p50"], 1000 * s["ttft_p95"],
                               1000 * s["gap_p50"], 1000 * s["gap_p95"],
                               *[1000 * s["per_turn"][n] for n in range(1, turns + 1)],
                               100 * s["cached_last_turn"], 100 * s["hit_rate"], s["output_tok_s"]] for s in summaries])


def plot(path, summaries: list[dict], title: str) -> None:
    modes = list(dict.fromkeys(s["mode"] for s in summaries))
    line = {m: ([s["sessions"] for s in summaries if s["mode"] == m],
                [s["output_tok_s"] for s in summaries if s["mode"] == m]) for m in modes}
    per_turn = {f"{s['mode']}, {s['sessions']} sessions": (list(s["per_turn"]), [1000 * v for v in
                                                                                 s["per_turn"].values()])
                for s in summaries}
    ttft = {f"{s['mode']}, {s['sessions']}": [1000 * t["ttft"] for r in s["turns"] for t in r] for s in summaries}
    gaps = {f"{s['mode']}, {s['sessions']}": [1000 * g for r in s["turns"] for t in r for g in t["gaps"]]
            for s in summaries}
    report.save_plot(path, [
        report.Panel("output throughput", "line", line, "concurrent sessions", "output tok/s", logx=True),
        report.Panel("time to first delta", "cdf", ttft, "TTFT (ms)", logx=True),
        report.Panel("gaps between deltas", "cdf", gaps, "gap (ms)", logx=True),
        report.Panel("TTFT p50 per turn", "line", per_turn, "turn", "TTFT p50 (ms)")], title)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, prefix_cache: bool, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if not prefix_cache:
        cmd.append("--no-prefix-caching")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        report.wait_until_ready(proc, port, f"starting rtserve serve{'' if prefix_cache else ' --no-prefix-caching'}",
                                600, lambda: proc.stderr.read()[-2000:])
    except RuntimeError:
        proc.kill()
        raise
    return proc


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = report.parser("realtime", __doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="8,32", help="comma-separated concurrent session counts")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=500, help="approximate system prompt length")
    ap.add_argument("--url", default=None, help="measure a running server (ws://host:port/v1/realtime) as it is")
    ap.add_argument("--modes", default="cache,nocache",
                    help="which server variants to start: cache (defaults), nocache (--no-prefix-caching), legacy "
                         "(the prefix cache with the scheduling before issue 21: " + " ".join(LEGACY_FLAGS) + ")")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times in turn (A, B, A, B), each round a server of its own")
    ap.add_argument("--server-args", default="", help="extra `rtserve serve` flags for the started servers")
    ap.add_argument("--data-parallel-size", default=None,
                    help="comma-separated engine-core counts: one server per count (and router), prefix cache on")
    ap.add_argument("--router", default="affinity,round-robin",
                    help="comma-separated routers for the counts above 1: affinity, round-robin")
    ap.add_argument("--background-http", type=int, default=0, metavar="N",
                    help="also run each session count with N HTTP clients sending long prompts in a loop, and compare")
    ap.add_argument("--background-prompt-tokens", type=int, default=3000,
                    help="approximate length of the background HTTP prompts")
    ap.add_argument("--shared-system-prompt", action="store_true",
                    help="every session sends the same system prompt (default: one of its own)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    counts = [int(x) for x in args.sessions.split(",") if x]
    print(f"rtserve bench realtime: sessions {counts}, {args.turns} turns, ~{args.system_tokens}-token system "
          f"prompt{' (shared)' if args.shared_system_prompt else ''}, {args.max_output_tokens} output tokens per "
          f"turn, {os.cpu_count()} CPUs"
          + (f"; with and without {args.background_http} background HTTP clients (~{args.background_prompt_tokens}-"
             f"token prompts)" if args.background_http else ""), flush=True)
    summaries: dict[tuple[str, int], dict] = {}
    modes = [("external", None, [])] if args.url else [
        (m if args.rounds == 1 else f"{m}#{r + 1}", m != "nocache", LEGACY_FLAGS if m == "legacy" else [])
        for r in range(max(1, args.rounds)) for m in args.modes.split(",") if m]
    if args.data_parallel_size and not args.url:
        modes = []
        for dp in (int(x) for x in args.data_parallel_size.split(",") if x):
            for router in (args.router.split(",") if dp > 1 else ["affinity"]):
                modes.append((f"dp{dp}" + (f"-{router}" if dp > 1 else ""), True,
                              ["--data-parallel-size", str(dp), "--router", router]))
    for mode, cache, mode_args in modes:
        proc = None
        url = args.url
        if url is None:
            port = free_port()
            proc = start_server(port, cache, args.server_args.split() + mode_args)
            url = f"ws://127.0.0.1:{port}/v1/realtime"
        try:
            # warm-up, on a system prompt of its own: it must not put the measured sessions' prompts in the cache
            asyncio.run(run_session(url, -1, 1, args.max_output_tokens, args.system_tokens))
            # each load's sessions have system prompts of their own (numbers no earlier load used, a multiple of
            # the question count apart so they ask the same questions): no load starts on another's cached prompts
            loads = itertools.count(0, 6000)
            for n in counts:
                for background in (0, args.background_http) if args.background_http else (0,):
                    label = f"{mode}+http" if background else mode
                    progress = report.Progress(f"{label}, {n} sessions", total=n * args.turns)
                    start = time.perf_counter()
                    results = asyncio.run(run_load(url, n, args, progress, background, next(loads)))
                    summaries[(label, n)] = summarize(label, n, results, time.perf_counter() - start, args.turns)
                    progress.close(f"turns done, {summaries[(label, n)]['output_tok_s']:.1f} output tok/s")
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    print_summaries(list(summaries.values()), args.turns)
    for (label, n), with_http in summaries.items():
        alone = summaries.get((label.removesuffix("+http"), n)) if label.endswith("+http") else None
        if alone:
            print(f"{label.removesuffix('+http')} sessions {n}: Realtime TTFT p50 {ms(with_http['ttft_p50']).strip()} "
                  f"ms with {args.background_http} background HTTP clients vs {ms(alone['ttft_p50']).strip()} ms "
                  f"without ({with_http['ttft_p50'] / alone['ttft_p50']:.1f}x; goal <= 2x); p95 "
                  f"{ms(with_http['ttft_p95']).strip()} vs {ms(alone['ttft_p95']).strip()} ms")
    for n in counts:
        one = summaries.get(("dp1", n))
        for (mode, m), summary in summaries.items():
            if one and m == n and mode != "dp1":
                t = args.turns
                print(f"sessions {n}, {mode}: prefix-cache hit rate {summary['hit_rate']:.1%} = "
                      f"{summary['hit_rate'] / max(1e-9, one['hit_rate']):.2f} of one replica's "
                      f"({one['hit_rate']:.1%}); turn-{t} TTFT p50 {ms(summary['per_turn'][t]).strip()} ms vs "
                      f"{ms(one['per_turn'][t]).strip()} ms")
        for r in range(1, max(1, args.rounds) + 1):
            tag = "" if args.rounds == 1 else f"#{r}"
            old, new = summaries.get((f"legacy{tag}", n)), summaries.get((f"cache{tag}", n))
            if old and new:
                print(f"sessions {n}{tag and ', round ' + tag[1:]}: turn-1 TTFT p50 {ms(new['per_turn'][1]).strip()} "
                      f"ms vs {ms(old['per_turn'][1]).strip()} ms with the legacy scheduling "
                      f"({old['per_turn'][1] / new['per_turn'][1]:.1f}x lower); gap p95 {ms(new['gap_p95']).strip()} "
                      f"vs {ms(old['gap_p95']).strip()} ms; output {new['output_tok_s']:.1f} vs "
                      f"{old['output_tok_s']:.1f} tok/s ({new['output_tok_s'] / old['output_tok_s'] - 1:+.0%})")
        on, off = summaries.get(("cache", n)), summaries.get(("nocache", n))
        if on and off:
            t = args.turns
            print(f"sessions {n}: turn-{t} TTFT p50 {ms(on['per_turn'][t]).strip()} ms with the prefix cache vs "
                  f"{ms(off['per_turn'][t]).strip()} ms without ({off['per_turn'][t] / on['per_turn'][t]:.1f}x)")
    if args.output:
        report.write_json(args.output, args, {"runs": list(summaries.values())})
    path = report.plot_path(args)
    if path:
        plot(path, list(summaries.values()), f"rtserve bench realtime: ~{args.system_tokens}-token system prompt, "
                                              f"{args.turns} turns, {args.max_output_tokens} output tokens per turn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
