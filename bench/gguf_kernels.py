"""Per batch size, the kernels a GGUF Q4_1 / Q8_0 layer can run on this CPU: the integer dots (AVX-512 VNNI, also on
AMX CPUs), the dequantized tiles (AMX where the CPU has it, else fp32 FMAs), torch's 4-bit kernel and MKL's fp32 GEMM,
on random blocks of SmolLM2-135M's shapes (one decoder layer's four linears, and the Q8_0 lm_head). Rounds interleave
the kernels; the best of 3 is printed. One layer's weights are timed again and again, so they sit in the caches: the
engine's decode steps, which read 30 layers, find the crossovers at other row counts (`rtserve bench throughput`).

    rtserve bench gguf_kernels [--threads 2] [--output FILE.json] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import kernels
from engine.layers.gguf_linear import Int4Plane

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}   # (N, K)
ROWS = [1, 2, 4, 8, 12, 16, 32, 64, 256]


def layers(rng) -> tuple[dict, dict]:
    layer = {}
    for name, (n, k) in SHAPES.items():
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        d = (rng.random((n, k // 32)) * 0.02).astype(np.float16)
        m = (-rng.random((n, k // 32)) * 0.1).astype(np.float16)
        t = [torch.from_numpy(a) for a in (q, d, m)]
        d32, m32 = d.astype(np.float32), m.astype(np.float32)
        layer[name] = dict(tile=kernels.pack_gguf_q4_1(*t), vnni=kernels.pack_gguf_vnni_q4_1(*t),
                           wide=torch.from_numpy(d32.repeat(32, 1) * q + m32.repeat(32, 1)),
                           int4=Int4Plane(q, d32, m32 + 8 * d32, torch.bfloat16))
    q8 = torch.from_numpy(rng.integers(-128, 128, (49152, 576)).astype(np.int8))
    d8 = torch.from_numpy((rng.random((49152, 18)) * 0.01).astype(np.float16))
    head = dict(tile=kernels.pack_gguf_q8_0(q8, d8), vnni=kernels.pack_gguf_vnni_q8_0(q8, d8),
                wide=q8.float() * d8.float().repeat_interleave(32, 1))
    return layer, head


TILES = "AMX tiles" if kernels.cpu_isa() is kernels.Isa.AMX else "fp32 FMAs"   # what tile-order blocks run on
PATHS = {
    "int8 dots (VNNI)": lambda x, w: kernels.linear_gguf(x, *w["vnni"]),
    TILES: lambda x, w: kernels.linear_gguf(x, *w["tile"]),
    "torch 4-bit": lambda x, w: w["int4"].mm(x),
    "MKL fp32": lambda x, w: torch.nn.functional.linear(x.float(), w["wide"]).bfloat16(),
}


def main(argv: list[str] | None = None) -> int:
    from bench import report
    ap = report.parser("gguf_kernels", __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="torch / kernel threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layer, head = layers(np.random.default_rng(0))
    best: dict = {}
    with torch.inference_mode():
        for _ in range(3):
            for rows in ROWS:
                x, xd = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 1536).bfloat16()
                reps = max(3, 200 // rows)
                for path, f in PATHS.items():
                    if path == "torch 4-bit" and rows > 16:
                        continue
                    t = time.perf_counter()
                    for _ in range(reps):
                        for name in ("qkv", "o", "gate_up"):
                            f(x, layer[name])
                        f(xd, layer["down"])
                    ms = (time.perf_counter() - t) / reps * 1e3
                    ms_head = float("nan")
                    if path != "torch 4-bit":   # it takes no Q8_0
                        t = time.perf_counter()
                        for _ in range(max(1, reps // 10)):
                            f(x, head)
                        ms_head = (time.perf_counter() - t) / max(1, reps // 10) * 1e3
                    old = best.get((rows, path), (float("inf"), float("inf")))
                    best[(rows, path)] = (min(old[0], ms), min(old[1], ms_head))
    print(f"cpu_isa {kernels.cpu_isa().name}, {torch.get_num_threads()} threads")
    print("| rows | kernel | one layer's 4 linears, ms | Q8_0 lm_head, ms |\n|---|---|---|---|")
    for (rows, path), (ms, ms_head) in best.items():
        print(f"| {rows} | {path} | {ms:.3f} | {f'{ms_head:.2f}' if np.isfinite(ms_head) else '-'} |")
    results = {"cpu_isa": kernels.cpu_isa().name, "threads": torch.get_num_threads(),
               "rows": [{"rows": rows, "kernel": path, "layer_ms": ms, "lm_head_ms": ms_head}
                        for (rows, path), (ms, ms_head) in best.items()]}
    if args.output:
        report.write_json(args.output, args, results)
    path = report.plot_path(args)
    if path:
        paths = list(dict.fromkeys(p for _, p in best))
        report.save_plot(path, [report.Panel("one decoder layer's four linears", "line",
                                             {p: ([r for r, q in best if q == p], [best[(r, q)][0] for r, q in best
                                                                                  if q == p]) for p in paths},
                                             "rows", "ms", logx=True)],
                         f"rtserve bench gguf_kernels: {kernels.cpu_isa().name}, {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
