"""Whisper benchmark: word error rate and time per turn, the server's Whisper against the exact fp32 model.

    rtserve bench whisper [--limit N] [--floors 500,400] [--batches 1,2,4,8] [--threads 1] [--output FILE.json]

Speech synthesized now, nothing recorded: the utterances of `rtserve bench turn` (its complete questions and
statements, and its paused ones spoken through), by piper (joe-us with its own noise) and, for the complete ones, by
espeak-ng too. Each clip is a turn as server VAD hands it over (300 ms before the speech, 500 ms after) and is
transcribed alone, as a turn is at one session: log-mel features and the encoder over the context the server uses
(`WhisperModel.context_positions`), then the greedy decoder. Models, interleaved clip by clip:
- `server`: what `rtserve serve` loads (`RTSERVE_WHISPER_DTYPE`, default bf16: the linear layers on 8-bit blocks for
  the packed kernel, `audio/whisper.py`);
- `server, whole context computed`: the same model with every position of the context computed, where the server
  computes the audio + 1 s and takes the rest from a run over silence (`WhisperModel.encode_clips`);
- `fp32`: the same weights in fp32 with torch's own GEMMs (`RTSERVE_WHISPER_DTYPE=float32`), the exact reference.
With `--floors`, the server's model also runs at those encoder-context floors (positions, 50 a second) in place of
`MIN_CONTEXT_POSITIONS`: what a shorter context would save, and whether the decoder starts to loop.
Reported per model: WER over all clips, per voice, clips whose transcript runs past twice the reference's words
(a loop), and the median encoder (features included) and decoder milliseconds per clip, on `--threads` threads
(the server's Whisper worker uses one).
With `--batches`, the server's encoder also runs on batches of that many clips (the server batches the turns that
wait together): the median milliseconds per clip for each size, sizes interleaved group by group, and the ratio to a
batch of one. It tells whether holding a turn back for company would make the encoder cheaper.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from contextlib import contextmanager

import numpy as np

from bench.report import int_list
from bench.turn import COMPLETE, PAUSED


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def clips(limit: int) -> list[tuple[str, str, np.ndarray]]:
    """(voice, reference text, 16 kHz audio as server VAD hands the turn over)."""
    from audio.speech import espeak_speech, piper_speech

    complete = COMPLETE[:limit or None]
    spoken = complete + [f"{head} {rest}" for head, rest in PAUSED[:limit or None]]
    out = [("piper", t, piper_speech(t)) for t in spoken] + [("espeak", t, espeak_speech(t)) for t in complete]
    pad = np.zeros(4800, np.float32), np.zeros(8000, np.float32)
    return [(v, t, np.concatenate([pad[0], a.astype(np.float32), pad[1]])) for v, t, a in out]


@contextmanager
def context_floor(positions: int | None):
    import audio.whisper as whisper

    saved = whisper.MIN_CONTEXT_POSITIONS
    whisper.MIN_CONTEXT_POSITIONS = saved if positions is None else positions
    try:
        yield
    finally:
        whisper.MIN_CONTEXT_POSITIONS = saved


def transcribe(model, audio: np.ndarray, floor: int | None, whole: bool = False) -> tuple[str, float, float]:
    """(text, encoder seconds incl. features, decoder seconds) for one clip; `whole`: every position of the context
    computed, no silence tail."""
    with context_floor(floor):
        t0 = time.perf_counter()
        enc = model.encode(model.features([audio])) if whole else model.encode_clips([audio])
        t1 = time.perf_counter()
        tokens = model.decode_greedy(enc, [model.max_tokens_for(len(audio))])[0]
        t2 = time.perf_counter()
    return model.detokenize(tokens).strip(), t1 - t0, t2 - t1


def summarize(name: str, results: list[tuple[str, str, str, float, float]]) -> dict:
    import jiwer

    def wer(rows) -> float:
        return float(np.mean([jiwer.wer(" ".join(_words(ref)), " ".join(_words(hyp)) or "<empty>")
                              for _, ref, hyp, _, _ in rows])) if rows else float("nan")
    voices = sorted({v for v, *_ in results})
    return {
        "model": name, "clips": len(results), "wer": wer(results),
        "wer_by_voice": {v: wer([r for r in results if r[0] == v]) for v in voices},
        "loops": sum(len(_words(hyp)) > 2 * len(_words(ref)) for _, ref, hyp, _, _ in results),
        "encoder_ms_p50": 1000 * statistics.median(r[3] for r in results),
        "decoder_ms_p50": 1000 * statistics.median(r[4] for r in results),
    }


def encoder_batches(model, data: list, sizes: list[int], rounds: int = 3) -> list[dict]:
    """Median encoder milliseconds per clip (features included) at each batch size, sizes interleaved."""
    audios = [a for _, _, a in data]
    per_clip: dict[int, list[float]] = {b: [] for b in sizes}
    for _ in range(rounds):
        for start in range(0, len(audios) - max(sizes) + 1, max(sizes)):
            for b in sizes:
                group = audios[start:start + b]
                t0 = time.perf_counter()
                model.encode_clips(group)
                per_clip[b].append((time.perf_counter() - t0) / b)
    one = statistics.median(per_clip[sizes[0]])
    return [{"batch": b, "groups": len(per_clip[b]), "encoder_ms_per_clip": 1000 * statistics.median(per_clip[b]),
             "vs_first": statistics.median(per_clip[b]) / one} for b in sizes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rtserve bench whisper", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=0, help="only the first N utterances of each set (0: all)")
    ap.add_argument("--floors", default="", type=int_list(50, 1500, "floors (1 s to Whisper's 30 s window)"),
                    help="comma-separated encoder-context floors (positions) to try on the server's model as well, "
                         "e.g. 400,300")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (the server's Whisper worker: 1)")
    ap.add_argument("--batches", default="", type=int_list(1, 32, "batch sizes (clips)"),
                    help="comma-separated encoder batch sizes to time on the server's model, e.g. 1,2,4,8 (the first "
                         "is the baseline of the ratios)")
    ap.add_argument("--output", metavar="FILE.json", help="write the summary and every transcript as JSON")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    floors, batches = args.floors, args.batches

    import torch

    import kernels
    from audio.whisper import WhisperModel, default_dtype

    kernels.set_thread_count(args.threads)
    data = clips(args.limit)
    if batches and len(data) < max(batches):   # before any model runs
        ap.error(f"--batches {max(batches)} needs at least that many clips, got {len(data)} (--limit)")
    server = WhisperModel.load(dtype=default_dtype())
    models = {"server": (server, None, False), "server, whole context computed": (server, None, True),
              "fp32": (WhisperModel.load(dtype=torch.float32), None, False)}
    for f in floors:
        models[f"server, floor {f}"] = (server, f, False)
    print(f"rtserve bench whisper: {len(data)} clips, {args.threads} thread(s), CPU {kernels.packed_isa().name}, "
          f"models {', '.join(models)}", flush=True)
    for model, floor, whole in models.values():   # warm-up: first calls allocate and pick kernels
        transcribe(model, data[0][2], floor, whole)
    results: dict[str, list] = {name: [] for name in models}
    for voice, ref, audio in data:
        for name, (model, floor, whole) in models.items():
            text, enc_s, dec_s = transcribe(model, audio, floor, whole)
            results[name].append((voice, ref, text, enc_s, dec_s))
    summary = [summarize(name, rows) for name, rows in results.items()]
    voices = sorted(summary[0]["wer_by_voice"])
    print("| model | WER | " + " | ".join(f"WER {v}" for v in voices) + " | loops | encoder p50 (ms) | "
          "decoder p50 (ms) |")
    print("|---|---:|" + "---:|" * len(voices) + "---:|---:|---:|")
    for s in summary:
        print(f"| {s['model']} | {100 * s['wer']:.2f} % | "
              + " | ".join(f"{100 * s['wer_by_voice'][v]:.2f} %" for v in voices)
              + f" | {s['loops']} | {s['encoder_ms_p50']:.1f} | {s['decoder_ms_p50']:.1f} |")
    batch_rows = []
    if batches:
        batch_rows = encoder_batches(models["server"][0], data, batches)
        print("\n| encoder batch | groups | ms per clip (p50) | vs batch " + str(batches[0]) + " |")
        print("|---:|---:|---:|---:|")
        for r in batch_rows:
            print(f"| {r['batch']} | {r['groups']} | {r['encoder_ms_per_clip']:.1f} | {r['vs_first']:.2f} |")
    if args.output:
        with open(args.output, "w") as f:
            transcripts = {name: [r[:3] for r in rows] for name, rows in results.items()}
            json.dump({"summary": summary, "encoder_batches": batch_rows, "transcripts": transcripts}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
