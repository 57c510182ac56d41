"""Served vs engine-only A/B on `rtserve bench throughput`'s seeded workload (issue 24).

`rtserve bench served_ab --configs audio,noaudio,engine --rounds 2`: each round, for each config in
turn, `audio` starts `rtserve serve` (the audio stage on, nobody speaking), `noaudio` starts `rtserve serve --no-audio`,
and `engine` runs the engine alone (`bench.throughput.bench_engine`, bf16 + GGUF q4 as the server loads the embedded
model) in a fresh process. The servers get the workload's prompts as token ids on `/v1/completions`, all at once,
streamed, EOS ignored, temperature 0, so every system computes the same tokens. Per server it also prints each
thread's CPU seconds (from /proc) while idle and under the load: which threads work, and whether idle ones spin.
Ratios are per round against the last config (configs interleave, since a shared machine's speed drifts).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp

from bench import report

PY = sys.executable


def workload(n, seed):
    from bench.throughput import make_workload
    from engine.models.loader import resolve_model_dir
    vocab = json.loads((resolve_model_dir(None) / "config.json").read_text())["vocab_size"]
    return make_workload(n, seed, vocab)


def threads_cpu(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = report.proc_stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:
            continue
    return out


def cpu_delta(a, b):
    d = {tid: (b[tid][0], b[tid][1] - a.get(tid, (None, 0.0))[1]) for tid in b}
    return d


async def one(session, url, prompt, n_out, stream):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": n_out, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["usage"]["completion_tokens"]
        toks = 0
        async for line in r.content:
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                if d.get("usage"):
                    toks = d["usage"]["completion_tokens"]
        return toks


async def drive(url, prompts, outputs, stream):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        await one(s, url, prompts[0][:32], 4, stream)   # warm-up
        t0 = time.perf_counter()
        toks = await asyncio.gather(*(one(s, url, p, o, stream) for p, o in zip(prompts, outputs)))
        el = time.perf_counter() - t0
    assert sum(toks) == sum(outputs), (sum(toks), sum(outputs))
    return sum(toks) / el, el


def wait_health(url, proc, timeout=300):
    import urllib.request
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError("server died")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not healthy")


def show_threads(label, d, top=8):
    items = sorted(d.items(), key=lambda kv: -kv[1][1])
    tot = sum(v[1] for v in d.values())
    print(f"    {label}: total {tot:.2f} cpu-s; " + ", ".join(f"{tid}:{c}={s:.2f}" for tid, (c, s) in items[:top]
                                                            if s > 0), flush=True)


def run_server(cfg, prompts, outputs, args, port):
    extra = ["--no-audio"] if cfg == "noaudio" else []
    extra += args.server_args.split() if args.server_args else []
    env = dict(os.environ)
    for kv in (args.env or "").split(","):
        if kv:
            k, v = kv.split("=", 1)
            env[k] = v
    cmd = [PY, "-m", "gateway.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if args.quiet else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc)
        time.sleep(1.0)
        a = threads_cpu(proc.pid)
        time.sleep(args.idle)
        b = threads_cpu(proc.pid)
        idle = cpu_delta(a, b)
        tok_s, el = asyncio.run(drive(url, prompts, outputs, args.stream))
        c = threads_cpu(proc.pid)
        load = cpu_delta(b, c)
        return tok_s, el, idle, load
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


ENGINE_SNIPPET = r"""
import json, sys
from bench.throughput import bench_engine, make_workload
prompts, outputs = json.loads(sys.stdin.read())
eng = bench_engine(prompts, outputs, "bfloat16", dict(quantization="gguf", max_num_seqs=64, max_num_batched_tokens=512))
print(json.dumps(eng))
"""


def run_engine(prompts, outputs):
    r = subprocess.run([PY, "-c", ENGINE_SNIPPET], input=json.dumps([prompts, outputs]), capture_output=True,
                       text=True, check=True)
    eng = json.loads(r.stdout.strip().splitlines()[-1])
    return eng["tok_s"], eng["elapsed"]


def main(argv: list[str] | None = None) -> int:
    ap = report.parser("served_ab", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="audio,noaudio,engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--env", default="")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    prompts, outputs = workload(args.num_requests, args.seed)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens, "
          f"stream={args.stream}", flush=True)
    res = {c: [] for c in args.configs.split(",")}
    for r in range(args.rounds):
        for cfg in res:
            if cfg == "engine":
                tok_s, el = run_engine(prompts, outputs)
                print(f"[round {r + 1}] {cfg}: {tok_s:.1f} tok/s ({el:.1f} s)", flush=True)
            else:
                tok_s, el, idle, load = run_server(cfg, prompts, outputs, args, args.port)
                print(f"[round {r + 1}] {cfg}: {tok_s:.1f} tok/s ({el:.1f} s)", flush=True)
                show_threads(f"idle {args.idle:.0f}s", idle)
                show_threads("load", load)
            res[cfg].append(tok_s)
    print("summary:", {c: [round(x, 1) for x in v] for c, v in res.items()})
    base = list(res)[-1]
    for c in res:
        if c != base:
            print(f"  {c}/{base} per round: " + ", ".join(f"{a / b:.3f}" for a, b in zip(res[c], res[base])))
    if args.output:
        report.write_json(args.output, args, {"tok_s": res})
    path = report.plot_path(args)
    if path:
        report.save_plot(path, [report.Panel("output tok/s per round", "bars",
                                             {f"round {r + 1}": {c: v[r] for c, v in res.items()}
                                              for r in range(args.rounds)}, ylabel="tok/s")],
                         "rtserve bench served_ab: the served path against the engine alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
