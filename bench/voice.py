"""Voice benchmark: concurrent spoken turns over the Realtime WebSocket, end of speech → first transcript/text/audio.

    rtserve bench voice --sessions 1,8

Starts `rtserve serve` as a subprocess (or measures `--url` as is). Each session streams real speech (piper, a
different question per session) in real time in `--chunk-ms` appends with server VAD (silence window 500 ms;
`--turn-detection semantic_vad`: the semantic end of turn, eagerness auto; `server_vad,semantic_vad`: both,
interleaved run by run), and keeps streaming silence like an open microphone until the reply is done and its audio has
played out (from its first delta, in real time: a user hears the answer before asking the next question; asking at
response.done would speak over the reply, within the server's repair grace of an early end, and join two questions
into one turn); `--turns` turns per session. Each session count runs
once per `--spread-ms` value: 0 = all sessions start at the same moment (their turns end within a few ms of each
other), S > 0 = session i starts i·S/N ms later (turns ending spread over S ms, like independent users).
Measured by the client, per turn, from the end of speech — the moment the append holding the last voiced sample
(−40 dB) was handed to the socket — to: speech_stopped, the transcription's `completed`, the first
`response.output_audio_transcript.delta` (first text) and the first `response.output_audio.delta` (first audio),
p50/p95; first audio minus speech_stopped; and the playback gap: how late the reply's audio deltas came for a client
that plays them from the first one on without pause (worst per turn, p95 and max over turns). `--output`'s JSON keeps
each turn's question and what the server's Whisper heard of it, so a slow turn can be traced to its question. Then the
Whisper encoder's real-time factor in this process, one batch of 8 clips vs the same clips one by one, and the server's
counters from /metrics.

A/B in rounds: `--server SPEC` (repeatable) names a server configuration to start, `--rounds N` repeats the whole set of
runs N times, interleaved: round 1 of every configuration, then round 2, ... (the order reversed every other round, A B
B A, so a drift of the machine's load falls on both alike), each round on a freshly started server. The summary gives,
per configuration, the median over rounds of each round's figures, every round's first audio p50, and the ratio to the
first configuration (the median of the per-round ratios). `--combine A.json B.json ...` prints that summary for the runs
of earlier `--output` files (e.g. one A/B split into several invocations), rounds numbered on in file order; the file
is written after every round, so an interrupted run keeps the rounds it finished.

    rtserve bench voice --sessions 8 --spread-ms 0 --rounds 4 --no-rtf \
        --server "name=base,pythonpath=/tmp/wt-base" --server "name=main" --output ab.json
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gc
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import orjson
import websockets

from bench import report
from bench.realtime import free_port, pct
from bench.serve import positive

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
    text: str = ""  # the question spoken


def make_clips() -> list[Clip]:
    from audio.codecs import float_to_int16
    from audio.speech import piper_speech, speech_bounds_ms

    clips = []
    for q in QUESTIONS:
        x = piper_speech(q, rate=RATE)
        _, off = speech_bounds_ms(x, RATE)
        x = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), x])
        clips.append(Clip(float_to_int16(x).tobytes(), 300 + off, q))
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
            heard: list[str] = []  # the server's transcripts of the turn

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
                    if ev["type"] == EVENTS["transcript"]:
                        heard.append(ev.get("transcript", ""))
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

            def listening() -> bool:  # to the reply: until it is done and its audio has played out
                return not done.is_set() or ("audio" in marks and
                                             time.perf_counter() < marks["audio"] + playback["played"])

            while listening():  # the microphone stays open: silence meanwhile
                await ws.send(orjson.dumps({"type": "input_audio_buffer.append", "audio": silence}).decode())
                sent_ms += chunk_ms
                await asyncio.sleep(max(0.0, t0 + sent_ms / 1000 - time.perf_counter()))
                if sent_ms > 120_000:
                    raise RuntimeError("no reply within 2 minutes of audio")
            await listener
            turn = {k: v - end_of_speech for k, v in marks.items()}
            # the same monotonic clock as the server's trace lines (--log-level debug) on this host: lines them up
            turn["end_of_speech_clock"] = end_of_speech
            turn["question"], turn["heard"] = clip.text, " / ".join(heard)  # which turns are slow, and what Whisper heard
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

    model.encode_clips(audios[:1])  # warm-up
    batched = best(lambda: model.encode_clips(audios))
    single = best(lambda: [model.encode_clips([a]) for a in audios])
    return batched / seconds, single / seconds


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) the process `pid` and its live descendants have used so far; None without a pid
    (`--url`) or where /proc cannot tell."""
    if pid is None:
        return None
    total, todo = 0.0, [pid]
    try:
        while todo:
            p = todo.pop()
            total += report.proc_stat(f"/proc/{p}/stat")[1]
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError, IndexError):
        return None
    return total


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
    secs = dict(re.findall(r'rtserve_whisper_(encoder|decoder)_seconds_total ([0-9.e+-]+)', text))
    clips = max(1.0, sum(int(s) * float(n) for s, n in sizes))
    drafts = dict(re.findall(r'rtserve_spec_decode_num_(draft|accepted)_tokens(?:_total)? ([0-9.e+-]+)', text))
    verified = float(drafts.get("draft", 0))
    whisper_drafts = dict(re.findall(r'rtserve_whisper_draft_(tokens|accepted_tokens)_total ([0-9.e+-]+)', text))
    return (", ".join(f"{s}×{int(float(n))}" for s, n in sizes) or "n/a") + \
        f"; decoder rows per step {mean_rows:.2f} over {float(dec.get('steps', 0)):.0f} steps" + \
        f"; Whisper draft tokens kept/checked {float(whisper_drafts.get('accepted_tokens', 0)):.0f}/" + \
        f"{float(whisper_drafts.get('tokens', 0)):.0f}" + \
        f"; speculative transcriptions used/started: {spec.get('used', '?')}/{spec.get('started', '?')}" + \
        f"; replies decoded during the pause adopted/started: {spec.get('adopted', '?')}/" + \
        f"{spec.get('pregenerated', '?')}" + \
        f"; reply pieces synthesized during the pause and sent: {int(float(spoken[0])) if spoken else '?'}" + \
        f"; Whisper RTF (encoder+decoder, served) {float(rtf[0]) if rtf else float('nan'):.3f}" + \
        f", per clip: encoder {1000 * float(secs.get('encoder', 'nan')) / clips:.0f} ms, decoder " + \
        f"{1000 * float(secs.get('decoder', 'nan')) / clips:.0f} ms" + \
        f"; TTS clauses {float(tts.get('requests_total', 0)):.0f}, mean " + \
        f"{1000 * float(tts.get('seconds_total', 0)) / max(1.0, float(tts.get('requests_total', 0))):.0f} ms, " + \
        f"max {1000 * float(tts.get('max_seconds', 0)):.0f} ms, max to first chunk " + \
        f"{1000 * float(tts.get('max_first_chunk_seconds', 0)):.0f} ms" + \
        (f"; draft tokens accepted/verified {float(drafts.get('accepted', 0)):.0f}/{verified:.0f}" if verified else "")


@dataclass(slots=True)
class ServerConfig:
    """One server configuration under test: its name in the tables, its flags, where its code comes from."""
    name: str
    args: list[str] = field(default_factory=list)
    pythonpath: str | None = None   # another source tree (an old commit's worktree): the server's code and cwd
    env: dict[str, str] = field(default_factory=dict)


SERVER_HELP = ("a server configuration to start, repeatable (the first is the baseline of the ratios): comma-separated "
               "name=NAME, pythonpath=DIR (run the server from another source tree, e.g. an old commit's "
               "`git worktree`: its PYTHONPATH and working directory), env=KEY=VALUE (repeatable), args=FLAGS (last: "
               "the rest of the text, commas included, split like a shell; added after --server-args). E.g. "
               "\"name=base,pythonpath=/tmp/wt-base\" \"name=itl0,env=RTSERVE_VNNI=0,args=--max-itl-ms 0\". "
               "Default: one server, `rtserve serve` with --server-args")


def parse_server(text: str) -> ServerConfig:
    """`--server`'s text → ServerConfig; a bad field is an argparse error (one line, exit code 2)."""
    fields: dict = {}
    env: dict[str, str] = {}
    args: list[str] = []
    parts = text.split(",")
    for i, part in enumerate(parts):
        key, eq, value = part.partition("=")
        key = key.strip()
        if key == "args" and eq:
            try:
                args = shlex.split(",".join([value, *parts[i + 1:]]))
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"args=: {e}") from None
            break
        if not eq or key not in ("name", "pythonpath", "env") or not value:
            raise argparse.ArgumentTypeError(f"{part!r}: expected name=NAME, pythonpath=DIR, env=KEY=VALUE or "
                                             f"args=FLAGS (last)")
        if key == "env":
            var, eq, val = value.partition("=")
            if not eq or not var:
                raise argparse.ArgumentTypeError(f"env={value!r}: expected env=KEY=VALUE")
            env[var] = val
        elif key in fields:
            raise argparse.ArgumentTypeError(f"{key}= given twice in {text!r}")
        else:
            fields[key] = value
    path = fields.get("pythonpath")
    if path is not None:
        if not Path(path).is_dir():
            raise argparse.ArgumentTypeError(f"pythonpath={path!r}: no such directory")
        path = str(Path(path).resolve())
    name = fields.get("name") or " ".join(args) or "default"
    return ServerConfig(name, args, path, env)


def round_order(configs: list, rnd: int) -> list:
    """Round `rnd` (from 1) runs every configuration, reversed every other round (A B, B A, ...)."""
    return list(configs) if rnd % 2 else list(reversed(configs))


def start_server(config: ServerConfig, common: list[str], port: int, log) -> subprocess.Popen:
    env = dict(os.environ, **config.env)
    if config.pythonpath:
        # `python -m` puts the working directory first on sys.path: it must be the tree too, or its code loses
        env["PYTHONPATH"] = config.pythonpath
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning", *common,
           *config.args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=config.pythonpath)

    def why() -> str:
        log.seek(0)
        return log.read()[-2000:].decode(errors="replace")
    try:
        label = f"starting {config.name}: rtserve serve {' '.join([*common, *config.args])}"
        report.wait_until_ready(proc, port, label, 900, why)
    except RuntimeError as exc:
        stop_server(proc)
        raise RuntimeError(f"{config.name}: {exc}") from None
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
    ap.add_argument("--server-args", default="", help="extra `rtserve serve` flags for every started server")
    ap.add_argument("--server", dest="servers", action="append", type=parse_server, default=None,
                    metavar="SPEC", help=SERVER_HELP)
    ap.add_argument("--rounds", type=positive(int), default=1,
                    help="repeat the whole set of runs this many times, every --server once per round, interleaved "
                         "(the order reversed every other round), each round on a fresh server; the summary gives "
                         "the median over rounds")
    ap.add_argument("--server-log", metavar="DIR", type=Path, default=None,
                    help="keep each started server's stderr as DIR/NAME-rROUND.log (with --server-args=\"--log-level "
                         "debug\": the per-turn trace lines)")
    ap.add_argument("--combine", metavar="FILE.json", nargs="+", type=Path, default=None,
                    help="measure nothing: print the summary of the runs in these earlier --output files together "
                         "(rounds numbered on in file order); with --output, write them as one file")
    ap.add_argument("--fresh-speech", action="store_true",
                    help="synthesize the questions anew for every round (piper draws its noise each time), so the "
                         "rounds sample how Whisper hears them, not only the machine; by default one synthesis serves "
                         "every round, and a question Whisper mishears is slow in all of them")
    ap.add_argument("--no-rtf", action="store_true", help="skip the in-process encoder RTF measurement")
    args = ap.parse_args(argv)
    if args.url and args.servers:
        ap.error("--url measures one running server; --server starts its own: give one or the other")
    args.servers = args.servers or [ServerConfig("default")]
    names = [c.name for c in args.servers]
    if len(set(names)) < len(names):
        ap.error(f"--server: each configuration needs its own name= (got {names})")
    return args


def combine(paths: list[Path]) -> tuple[list[dict], list]:
    """The runs (and server counters) of earlier --output files as one set, rounds numbered on in file order."""
    runs, counters, offset = [], [], 0
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"--combine: {path}: {e}") from None
        if doc.get("benchmark") != "voice" or not isinstance(doc.get("runs"), list):
            raise SystemExit(f"--combine: {path} is not a `rtserve bench voice --output` file")
        file_runs = [{**r, "server": r.get("server", "default"), "round": offset + r.get("round", 1)}
                     for r in doc["runs"]]
        runs += file_runs
        if isinstance(doc.get("server_counters"), list):
            counters += [{**c, "round": offset + c.get("round", 1)} for c in doc["server_counters"]]
        offset = max([offset, *(r["round"] for r in file_runs)])
    return runs, counters


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.combine:
        runs, counters = combine(args.combine)
        print_runs(runs)
        summary = summarize(runs)
        print_summary(summary)
        if args.output:
            report.write_json(args.output, json_config(args), {
                "runs": runs, "summary": summary, "server_counters": counters, "encoder_rtf": None,
                "combined_from": [str(p) for p in args.combine]})
        plot(args, runs)
        return 0
    counts = [int(x) for x in args.sessions.split(",") if x]
    spreads = [int(x) for x in args.spread_ms.split(",") if x]
    modes = [x for x in args.turn_detection.split(",") if x]
    bad = [m for m in modes if m not in ("server_vad", "semantic_vad")]
    if bad or not modes:
        raise SystemExit(f"--turn-detection: server_vad and/or semantic_vad, not {args.turn_detection!r}")
    configs = args.servers
    print(f"rtserve bench voice: sessions {counts}, {args.turns} turns, {args.chunk_ms} ms appends in real time, "
          f"{args.turn_detection}, {args.max_output_tokens} output tokens, start spread {spreads} ms, "
          f"{args.rounds} round(s) of {', '.join(c.name for c in configs)}, {os.cpu_count()} CPUs", flush=True)
    report.stage("synthesizing the spoken questions (piper) ...")
    clips = make_clips()
    with frozen_heap():
        runs, counters = run_rounds(args, clips, configs, counts, spreads, modes)
    rtf = None
    print_runs(runs)
    for c in counters:
        print(f"{c['server']}, round {c['round']}: server Whisper encoder batches (size×count): {c['counters']}",
              flush=True)
    summary = summarize(runs)
    print_summary(summary)
    if not args.no_rtf:
        batched, single = encoder_rtf()
        print(f"Whisper tiny.en encoder RTF, 8 clips: batched {batched:.4f}, one by one {single:.4f} "
              f"({single / batched:.1f}x)", flush=True)
        rtf = {"batched": batched, "one_by_one": single}
    if args.output:
        report.write_json(args.output, json_config(args), {"runs": runs, "summary": summary,
                                                           "server_counters": counters, "encoder_rtf": rtf,
                                                           "rounds_done": args.rounds})
    plot(args, runs)
    return 0


@contextlib.contextmanager
def frozen_heap():
    """The client's heap frozen while it measures: its full collections would delay its appends and the times it
    reads (see engine/heap.py; not imported here, it would bring torch into the client). Unless the process froze its
    own; a caller in this process (the tests) gets its heap collected again after."""
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.collect()
        gc.freeze()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()


def run_rounds(args: argparse.Namespace, clips: list[Clip], configs: list, counts: list[int], spreads: list[int],
               modes: list[str]) -> tuple[list, list]:
    """Every round of every --server configuration (interleaved, see `round_order`), each on a freshly started server
    unless --url: the runs and each round's server counters. With --output, the file is written after every round."""
    runs, counters = [], []
    common = args.server_args.split()
    for rnd in range(1, args.rounds + 1):
        if args.fresh_speech and rnd > 1:   # every configuration of a round hears the same speech
            report.stage(f"round {rnd}: synthesizing the spoken questions anew (piper) ...")
            clips = make_clips()
        for config in round_order(configs, rnd):
            proc, url = None, args.url
            if args.server_log is not None:
                args.server_log.mkdir(parents=True, exist_ok=True)
                log = open(args.server_log / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', config.name)}-r{rnd}.log", "w+b")
            else:
                log = tempfile.TemporaryFile()
            try:
                if url is None:
                    port = free_port()
                    proc = start_server(config, common, port, log)
                    url = f"ws://127.0.0.1:{port}/v1/realtime"
                runs += run_round(url, clips, args, counts, spreads, modes, config.name, rnd,
                                  None if proc is None else proc.pid)
                counters.append({"server": config.name, "round": rnd, "counters": server_batches(url)})
            finally:
                if proc is not None:
                    stop_server(proc)
                log.close()
        if args.output and rnd < args.rounds:   # an interrupted run keeps its finished rounds
            report.write_json(args.output, json_config(args), {"runs": runs, "summary": summarize(runs),
                                                               "server_counters": counters, "encoder_rtf": None,
                                                               "rounds_done": rnd})
    return runs, counters


def json_config(args: argparse.Namespace) -> argparse.Namespace:
    """The flags as JSON holds them: each --server as its fields, paths as text."""
    return argparse.Namespace(**{**vars(args), "servers": [asdict(c) for c in args.servers],
                                 "combine": [str(p) for p in args.combine or []] or None,
                                 "server_log": None if args.server_log is None else str(args.server_log)})


def run_round(url: str, clips: list[Clip], args, counts: list[int], spreads: list[int], modes: list[str],
              server: str, rnd: int, pid: int | None = None) -> list[dict]:
    """One round on one server: a warm-up turn per mode, then every (sessions, spread, mode) run. With the server's
    `pid`, each run also records the CPU seconds the server spent per turn."""
    runs = []
    for mode in modes:  # warm-up
        asyncio.run(run_session(url, 0, clips, 1, args.chunk_ms, args.max_output_tokens, turn_detection=mode))
    for n in counts:
        for spread in (spreads if n > 1 else [0]):
            for mode in modes:  # interleaved: each mode runs right after the other, on the same machine load
                progress = report.Progress(f"{server}, round {rnd}: {n} sessions, spread {spread} ms, {mode}",
                                           total=n * args.turns)

                async def load():
                    return await asyncio.gather(*(run_session(url, i, clips, args.turns, args.chunk_ms,
                                                              args.max_output_tokens, i * spread / 1000 / n,
                                                              progress, mode)
                                                  for i in range(n)))
                cpu0 = cpu_seconds(pid)
                turns = [t for r in asyncio.run(load()) for t in r]
                cpu1 = cpu_seconds(pid)
                progress.close("turns done")
                runs.append({"server": server, "round": rnd, "sessions": n, "spread_ms": spread,
                             "turn_detection": mode, "turns": turns,
                             "server_cpu_s_per_turn": None if cpu0 is None or cpu1 is None or not turns
                             else (cpu1 - cpu0) / len(turns)})
    return runs


def plot(args, runs: list[dict]) -> None:
    path = report.plot_path(args)
    if not path:
        return
    servers = len({r["server"] for r in runs}) > 1

    def label(r: dict) -> str:
        return (f"{r['server']}: " if servers else "") + \
            f"{r['sessions']} sessions, spread {r['spread_ms']} ms, {r['turn_detection']}"

    def pooled(key: str) -> dict:   # every round's turns together, per configuration and run
        out: dict[str, list] = {}
        for r in runs:
            out.setdefault(label(r), []).extend(1000 * t[key] for t in r["turns"] if key in t)
        return out

    report.save_plot(path, [report.Panel("end of speech → first audio", "cdf", pooled("audio"), "ms"),
                            report.Panel("end of speech → first text", "cdf", pooled("text"), "ms"),
                            report.Panel("end of speech → transcript", "cdf", pooled("transcript"), "ms")],
                     f"rtserve bench voice: {args.turns} turns per session, {args.max_output_tokens} output tokens")


# (column, turn key, percentile): the figures each run reports; "text_to_audio" is first audio − first text
FIGURES = (("first audio p50", "audio", 50), ("first audio p95", "audio", 95), ("transcript p50", "transcript", 50),
           ("transcript p95", "transcript", 95), ("first text p50", "text", 50),
           ("first text → first audio p50", "text_to_audio", 50),
           ("first audio − speech_stopped p50", "after_stopped", 50))


def turn_values(run: dict, key: str) -> list[float]:
    if key == "text_to_audio":
        return [t["audio"] - t["text"] for t in run["turns"] if "audio" in t and "text" in t]
    return [t[key] for t in run["turns"] if key in t]


def figures(run: dict) -> dict[str, float]:
    """One run's figures, ms (NaN where no turn has the mark)."""
    out = {}
    for name, key, q in FIGURES:
        values = turn_values(run, key)
        out[name] = 1000 * pct(values, q) if values else float("nan")
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """Per (sessions, spread, turn detection, server): every round's figures, their median over rounds, and the
    first audio p50 against the first server's in the same round (the median of those per-round ratios)."""
    servers = list(dict.fromkeys(r.get("server", "default") for r in runs))
    groups: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        key = (r["sessions"], r["spread_ms"], r["turn_detection"], r.get("server", "default"))
        groups.setdefault(key, {})[r.get("round", 1)] = {**figures(r), CPU_FIGURE: cpu_per_turn(r)}
    out = []
    for (n, spread, mode, server), by_round in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], servers.index(kv[0][3]))):
        rounds = sorted(by_round)
        per_round = {name: [by_round[rnd][name] for rnd in rounds] for name in [*(f[0] for f in FIGURES), CPU_FIGURE]}
        base = groups.get((n, spread, mode, servers[0]), {})
        ratios = [by_round[rnd]["first audio p50"] / base[rnd]["first audio p50"] for rnd in rounds
                  if rnd in base and base[rnd]["first audio p50"] > 0]
        out.append({"sessions": n, "spread_ms": spread, "turn_detection": mode, "server": server, "rounds": rounds,
                    "per_round": per_round, "median": {name: median(v) for name, v in per_round.items()},
                    "first_audio_p50_ratio": median(ratios), "baseline": servers[0]})
    return out


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]   # NaN: a round without the mark
    return statistics.median(values) if values else float("nan")


def print_runs(runs: list[dict]) -> None:
    def p(r: dict, key: str, q: float) -> float:
        return 1000 * pct([t[key] for t in r["turns"] if key in t], q)

    many = len({(r.get("server"), r.get("round")) for r in runs}) > 1
    cols = ([report.Column("server"), report.Column("round")] if many else []) + [
        report.Column("sessions"), report.Column("start spread", "ms", 0), report.Column("turn detection"),
        report.Column("turns"),
        report.Column("speech_stopped p50", "ms", 0), report.Column("transcript p50", "ms", 0),
        report.Column("transcript p95", "ms", 0), report.Column("first text p50", "ms", 0),
        report.Column("first text p95", "ms", 0), report.Column("first audio p50", "ms", 0),
        report.Column("first audio p95", "ms", 0), report.Column("first audio − speech_stopped p50", "ms", 0),
        report.Column("playback gap p95", "ms", 0), report.Column("playback gap max", "ms", 0),
        report.Column(CPU_FIGURE, "s", 2)]
    report.print_table(cols, [([r.get("server", "default"), r.get("round", 1)] if many else []) + [
        r["sessions"], float(r["spread_ms"]), r["turn_detection"], len(r["turns"]), p(r, "stopped", 50),
        p(r, "transcript", 50), p(r, "transcript", 95), p(r, "text", 50), p(r, "text", 95),
        p(r, "audio", 50), p(r, "audio", 95), p(r, "after_stopped", 50), p(r, "gap", 95),
        p(r, "gap", 100), cpu_per_turn(r)] for r in runs])


CPU_FIGURE = "server CPU per turn"


def cpu_per_turn(run: dict) -> float:
    value = run.get("server_cpu_s_per_turn")
    return float("nan") if value is None else value


def print_summary(summary: list[dict]) -> None:
    """The median over rounds per configuration; nothing to add for a single round of a single server."""
    if all(len(s["rounds"]) == 1 for s in summary) and len({s["server"] for s in summary}) == 1:
        return
    cols = [report.Column("sessions"), report.Column("start spread", "ms", 0), report.Column("turn detection"),
            report.Column("server"), report.Column("rounds"), report.Column("first audio p50, per round", "ms"),
            report.Column(f"first audio p50 / {summary[0]['baseline']}", "×", 2)] + \
        [report.Column(name, "ms", 0) for name, _, _ in FIGURES] + [report.Column(CPU_FIGURE, "s", 2)]
    rows = [[s["sessions"], float(s["spread_ms"]), s["turn_detection"], s["server"], len(s["rounds"]),
             " / ".join(f"{v:.0f}" for v in s["per_round"]["first audio p50"]), s["first_audio_p50_ratio"]] +
            [s["median"][name] for name, _, _ in FIGURES] + [s["median"].get(CPU_FIGURE, float("nan"))]
            for s in summary]
    report.print_table(cols, rows, "Median over rounds (ms); the ratio is the median of the per-round ratios")


if __name__ == "__main__":
    sys.exit(main())
