"""Voice benchmark: concurrent spoken turns over the Realtime WebSocket, end of speech → first transcript/text/audio.

    rtserve bench voice --sessions 1,8

Starts `rtserve serve` as a subprocess (or measures `--url` as is). Each session streams real speech (piper, a
different question per session) in real time in `--chunk-ms` appends with server VAD (silence window 500 ms;
`--turn-detection semantic_vad`: the semantic end of turn, eagerness auto; `server_vad,semantic_vad`: both,
interleaved run by run), and keeps streaming silence like an open microphone until the reply is done; `--turns` turns per session. Each session count runs
once per `--spread-ms` value: 0 = all sessions start at the same moment (their turns end within a few ms of each
other), S > 0 = session i starts i·S/N ms later (turns ending spread over S ms, like independent users).
Measured by the client, per turn, from the end of speech — the moment the append holding the last voiced sample
(−40 dB) was handed to the socket — to: speech_stopped, the transcription's `completed`, the first
`response.output_audio_transcript.delta` (first text) and the first `response.output_audio.delta` (first audio),
p50/p95; first audio minus speech_stopped; and the playback gap: how late the reply's audio deltas came for a client
that plays them from the first one on without pause (worst per turn, p95 and max over turns). Then the Whisper encoder's real-time factor in this process, one batch of
8 clips vs the same clips one by one, and the server's counters from /metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import os
import re
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np
import orjson
import websockets

from bench import report
from bench.realtime import free_port, pct, start_server

QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
             "Name a large animal that lives in the ocean.", "What is the boiling point of water?",
             "Who wrote Romeo and Juliet?", "What is two plus two?", "Which planet is closest to the sun?"]
RATE = 24000
EVENTS = {"stopped": "input_audio_buffer.speech_stopped",
          "transcript": "conversation.item.input_audio_transcription.completed",
          "text": "response.output_audio_transcript.delta", "audio": "response.output_audio.delta"}


@dataclass
class Clip:
    pcm: bytes  # pcm16 24 kHz, with 300 ms of silence before the voice
    speech_end_ms: float


def make_clips() -> list[Clip]:
    from audio.codecs import float_to_int16
    from audio.speech import piper_speech, speech_bounds_ms

    clips = []
    for q in QUESTIONS:
        x = piper_speech(q, rate=RATE)
        _, off = speech_bounds_ms(x, RATE)
        x = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), x])
        clips.append(Clip(float_to_int16(x).tobytes(), 300 + off))
    return clips


async def run_session(url: str, sid: int, clips: list[Clip], turns: int, chunk_ms: int, max_tokens: int,
                      delay_s: float = 0.0, progress: report.Progress | None = None,
                      turn_detection: str = "server_vad") -> list:
    out = []
    await asyncio.sleep(delay_s)
    silence = base64.b64encode(bytes(RATE * 2 * chunk_ms // 1000)).decode()
    async with websockets.connect(url, max_size=None) as ws:
        async def recv() -> dict:
            ev = orjson.loads(await ws.recv())
            if ev["type"] == "error":
                raise RuntimeError(ev["error"])
            return ev

        while (await recv())["type"] != "session.created":
            pass
        await ws.send(orjson.dumps({"type": "session.update", "session": {
            "type": "realtime", "output_modalities": ["audio"], "max_output_tokens": max_tokens,
            "instructions": "You are a concise voice assistant. Answer in one short sentence.",
            "audio": {"input": {"turn_detection": {"type": turn_detection}}}}}).decode())
        while (await recv())["type"] != "session.updated":
            pass
        for t in range(turns):
            clip = clips[(sid + t) % len(clips)]
            marks: dict[str, float] = {}
            done = asyncio.Event()
            playback = {"played": 0.0, "gap": 0.0}  # audio received; worst lateness for gapless playback

            async def listen():
                while True:
                    ev = await recv()
                    now = time.perf_counter()
                    if ev["type"] == EVENTS["audio"]:
                        if "audio" in marks:
                            playback["gap"] = max(playback["gap"], now - marks["audio"] - playback["played"])
                        playback["played"] += len(base64.b64decode(ev["delta"])) / (2 * RATE)
                    for key, etype in EVENTS.items():
                        if ev["type"] == etype and key not in marks:
                            marks[key] = now
                    if ev["type"] == "response.done":
                        done.set()
                        return

            listener = asyncio.create_task(listen())
            step = RATE * 2 * chunk_ms // 1000
            last_voiced = (int(clip.speech_end_ms * RATE / 1000) - 1) * 2  # byte offset of the last voiced sample
            end_of_speech = None
            t0 = time.perf_counter()
            sent_ms = 0.0
            for i in range(0, len(clip.pcm), step):  # the question, in real time
                await ws.send(orjson.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(clip.pcm[i:i + step]).decode()}).decode())
                if i <= last_voiced < i + step:  # the end of speech, as the client sent it
                    end_of_speech = time.perf_counter()
                sent_ms += chunk_ms
                await asyncio.sleep(max(0.0, t0 + sent_ms / 1000 - time.perf_counter()))
            while not done.is_set():  # the microphone stays open: silence until the reply is done
                await ws.send(orjson.dumps({"type": "input_audio_buffer.append", "audio": silence}).decode())
                sent_ms += chunk_ms
                await asyncio.sleep(max(0.0, t0 + sent_ms / 1000 - time.perf_counter()))
                if sent_ms > 120_000:
                    raise RuntimeError("no reply within 2 minutes of audio")
            await listener
            turn = {k: v - end_of_speech for k, v in marks.items()}
            if "audio" in marks and "stopped" in marks:
                turn["after_stopped"] = marks["audio"] - marks["stopped"]
            if "audio" in marks:
                turn["gap"] = playback["gap"]
            out.append(turn)
            if progress is not None:
                progress.advance("turns done")
    return out


def encoder_rtf(n: int = 8) -> tuple[float, float]:
    """Whisper encoder seconds per audio second: n clips in one batch vs one at a time (best of 3)."""
    from audio.speech import piper_speech
    from audio.whisper import get_whisper

    model = get_whisper()
    audios = [piper_speech(QUESTIONS[i % len(QUESTIONS)], rate=16000) for i in range(n)]
    seconds = sum(len(a) for a in audios) / 16000

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    model.encode(model.features(audios[:1]))  # warm-up
    batched = best(lambda: model.encode(model.features(audios)))
    single = best(lambda: [model.encode(model.features([a])) for a in audios])
    return batched / seconds, single / seconds


def server_batches(url: str) -> str:
    base = url.replace("ws://", "http://").replace("wss://", "https://").split("/v1/")[0]
    try:
        text = httpx.get(base + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return "n/a"
    sizes = re.findall(r'rtserve_whisper_batch_size_count\{size="(\d+)"\} ([0-9.]+)', text)
    spec = dict(re.findall(r'rtserve_speculative_transcriptions_(started|used)_total ([0-9.]+)', text))
    spec.update(re.findall(r'rtserve_speculative_replies_(pregenerated|adopted)_total ([0-9.]+)', text))
    spoken = re.findall(r'rtserve_speculative_speech_pieces_used_total ([0-9.]+)', text)
    tts = dict(re.findall(r'rtserve_tts_(requests_total|seconds_total|max_seconds|max_first_chunk_seconds) '
                          r'([0-9.e+-]+)', text))
    rtf = re.findall(r'rtserve_whisper_rtf ([0-9.e+-]+)', text)
    dec = dict(re.findall(r'rtserve_whisper_decode_(steps|rows)_total ([0-9.e+-]+)', text))
    mean_rows = float(dec.get("rows", 0)) / max(1.0, float(dec.get("steps", 0)))
    return (", ".join(f"{s}×{int(float(n))}" for s, n in sizes) or "n/a") + \
        f"; decoder rows per step {mean_rows:.2f} over {float(dec.get('steps', 0)):.0f} steps" + \
        f"; speculative transcriptions used/started: {spec.get('used', '?')}/{spec.get('started', '?')}" + \
        f"; replies decoded during the pause adopted/started: {spec.get('adopted', '?')}/" + \
        f"{spec.get('pregenerated', '?')}" + \
        f"; reply pieces synthesized during the pause and sent: {int(float(spoken[0])) if spoken else '?'}" + \
        f"; Whisper RTF (encoder+decoder, served) {float(rtf[0]) if rtf else float('nan'):.3f}" + \
        f"; TTS clauses {float(tts.get('requests_total', 0)):.0f}, mean " + \
        f"{1000 * float(tts.get('seconds_total', 0)) / max(1.0, float(tts.get('requests_total', 0))):.0f} ms, " + \
        f"max {1000 * float(tts.get('max_seconds', 0)):.0f} ms, max to first chunk " + \
        f"{1000 * float(tts.get('max_first_chunk_seconds', 0)):.0f} ms"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = report.parser("voice", __doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,8", help="comma-separated concurrent session counts")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--chunk-ms", type=int, default=40, help="append size (20-100 ms)")
    ap.add_argument("--spread-ms", default="0,1500",
                    help="comma-separated: session i starts i*S/N ms after the first (0: all at once); "
                         "one run per value for each session count above 1")
    ap.add_argument("--max-output-tokens", type=int, default=24)
    ap.add_argument("--turn-detection", default="server_vad",
                    help="server_vad (500 ms window), semantic_vad (eagerness auto: early ends of turn), or both "
                         "comma-separated: each run of sessions is repeated per mode, interleaved")
    ap.add_argument("--url", default=None, help="measure a running server (ws://host:port/v1/realtime) as it is")
    ap.add_argument("--server-args", default="", help="extra `rtserve serve` flags for the started server")
    ap.add_argument("--no-rtf", action="store_true", help="skip the in-process encoder RTF measurement")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    counts = [int(x) for x in args.sessions.split(",") if x]
    spreads = [int(x) for x in args.spread_ms.split(",") if x]
    modes = [x for x in args.turn_detection.split(",") if x]
    bad = [m for m in modes if m not in ("server_vad", "semantic_vad")]
    if bad or not modes:
        raise SystemExit(f"--turn-detection: server_vad and/or semantic_vad, not {args.turn_detection!r}")
    print(f"rtserve bench voice: sessions {counts}, {args.turns} turns, {args.chunk_ms} ms appends in real time, "
          f"{args.turn_detection}, {args.max_output_tokens} output tokens, start spread {spreads} ms, "
          f"{os.cpu_count()} CPUs", flush=True)
    report.stage("synthesizing the spoken questions (piper) ...")
    clips = make_clips()
    proc, url = None, args.url
    runs, counters, rtf = [], None, None
    if url is None:
        port = free_port()
        proc = start_server(port, True, args.server_args.split())
        url = f"ws://127.0.0.1:{port}/v1/realtime"
    try:
        for mode in modes:  # warm-up
            asyncio.run(run_session(url, 0, clips, 1, args.chunk_ms, args.max_output_tokens, turn_detection=mode))
        for n in counts:
            for spread in (spreads if n > 1 else [0]):
                for mode in modes:  # interleaved: each mode runs right after the other, on the same machine load
                    progress = report.Progress(f"{n} sessions, spread {spread} ms, {mode}", total=n * args.turns)

                    async def load():
                        return await asyncio.gather(*(run_session(url, i, clips, args.turns, args.chunk_ms,
                                                                  args.max_output_tokens, i * spread / 1000 / n,
                                                                  progress, mode)
                                                      for i in range(n)))
                    turns = [t for r in asyncio.run(load()) for t in r]
                    progress.close("turns done")
                    runs.append({"sessions": n, "spread_ms": spread, "turn_detection": mode, "turns": turns})
        print_runs(runs)
        counters = server_batches(url)
        print(f"server Whisper encoder batches (size×count): {counters}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001
                proc.kill()
    if not args.no_rtf:
        batched, single = encoder_rtf()
        print(f"Whisper tiny.en encoder RTF, 8 clips: batched {batched:.4f}, one by one {single:.4f} "
              f"({single / batched:.1f}x)", flush=True)
        rtf = {"batched": batched, "one_by_one": single}
    if args.output:
        report.write_json(args.output, args, {"runs": runs, "server_counters": counters, "encoder_rtf": rtf})
    path = report.plot_path(args)
    if path:
        label = lambda r: f"{r['sessions']} sessions, spread {r['spread_ms']} ms, {r['turn_detection']}"  # noqa: E731
        report.save_plot(path, [
            report.Panel("end of speech → first audio", "cdf",
                         {label(r): [1000 * t["audio"] for t in r["turns"] if "audio" in t] for r in runs}, "ms"),
            report.Panel("end of speech → first text", "cdf",
                         {label(r): [1000 * t["text"] for t in r["turns"] if "text" in t] for r in runs}, "ms"),
            report.Panel("end of speech → transcript", "cdf",
                         {label(r): [1000 * t["transcript"] for t in r["turns"] if "transcript" in t] for r in runs},
                         "ms")],
            f"rtserve bench voice: {args.turns} turns per session, {args.max_output_tokens} output tokens")
    return 0


def print_runs(runs: list[dict]) -> None:
    def p(r: dict, key: str, q: float) -> float:
        return 1000 * pct([t[key] for t in r["turns"] if key in t], q)

    cols = [report.Column("sessions"), report.Column("start spread", "ms", 0), report.Column("turn detection"),
            report.Column("turns"),
            report.Column("speech_stopped p50", "ms", 0), report.Column("transcript p50", "ms", 0),
            report.Column("transcript p95", "ms", 0), report.Column("first text p50", "ms", 0),
            report.Column("first text p95", "ms", 0), report.Column("first audio p50", "ms", 0),
            report.Column("first audio p95", "ms", 0), report.Column("first audio − speech_stopped p50", "ms", 0),
            report.Column("playback gap p95", "ms", 0), report.Column("playback gap max", "ms", 0)]
    report.print_table(cols, [[r["sessions"], float(r["spread_ms"]), r["turn_detection"], len(r["turns"]),
                               p(r, "stopped", 50),
                               p(r, "transcript", 50), p(r, "transcript", 95), p(r, "text", 50), p(r, "text", 95),
                               p(r, "audio", 50), p(r, "audio", 95), p(r, "after_stopped", 50), p(r, "gap", 95),
                               p(r, "gap", 100)] for r in runs])


if __name__ == "__main__":
    sys.exit(main())
