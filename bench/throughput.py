"""`rtserve bench throughput`: our engine vs HF transformers (sequential `generate` and static batches of 8).

Workload (same for every system in the run): `--num-requests` prompts of random token ids, prompt lengths uniform in
[16, 256], output lengths uniform in [16, 128], EOS ignored (every request generates exactly its output length). Reports
output tokens/s, the ratios against both HF baselines, and the KV waste at peak
((allocated slots - tokens stored) / allocated slots).

`--structured json` adds, in every round and right after each engine run, the same workload with a JSON-schema
constraint on every request (grammar-constrained decoding, engine/structured_output.py), and reports its tok/s, the
ratio to the unconstrained run of the same round, and the engine's mask time per step (filling and applying the token
bitmasks and advancing the matchers). The schema is an object with one string field whose minLength is more characters
than the longest output can hold, so the grammar cannot end before `max_tokens` and every constrained request, like the
unconstrained one, generates exactly its output length: both runs do the same model work and differ only by the
grammar (a string field is also where most of a real JSON answer's tokens go).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_workload(n: int, seed: int, vocab: int, prompt_range=(16, 256), output_range=(16, 128)):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(plen)])
        outputs.append(rng.randint(*output_range))
    return prompts, outputs


def absorbing_schema(tokenizer, max_output: int) -> dict:
    """A JSON schema whose one string field cannot close before `max_output` tokens: its minLength exceeds what that
    many of the vocabulary's longest tokens spell."""
    longest = max(map(len, tokenizer.batch_decode([[i] for i in range(len(tokenizer))])))
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": longest * max_output}},
            "required": ["text"], "additionalProperties": False}


def bench_engine(prompts, outputs, dtype: str, engine_args: dict, schema: dict | None = None) -> dict:
    from engine import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(dtype=dtype, **engine_args)
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   structured_outputs=so))   # warm-up (and the grammar's compile)
    llm.engine.peak_kv_waste = (0, 0)
    before = llm.engine.stats()
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, structured_outputs=so) for o in outputs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(outputs), "engine did not produce the requested lengths"
    after = llm.engine.stats()
    steps = after["num_steps"] - before["num_steps"]
    alloc, stored = llm.engine.peak_kv_waste
    ttft = sorted(o.ttft_s for o in outs)
    return {"elapsed": elapsed, "tokens": n_out, "tok_s": n_out / elapsed, "steps": llm.engine.num_steps,
            "kv_waste": (alloc - stored) / alloc if alloc else 0.0, "ttft_p50": ttft[len(ttft) // 2],
            "preemptions": llm.engine.scheduler.num_preemptions,
            "mask_ms_per_step": 1e3 * (after["structured_mask_s"] - before["structured_mask_s"]) / max(1, steps),
            "step_ms": 1e3 * elapsed / max(1, steps)}


def bench_served(prompts, outputs, dtype: str, engine_args: dict, process: bool) -> dict:
    """The workload through the served engine's asyncio interface, every request at once: the in-thread AsyncEngine,
    or the engine core in a child process (EngineCoreClient). A fresh engine per run."""
    import asyncio

    from engine import AsyncEngine, SamplingParams
    from engine.core_client import EngineCoreClient
    eng = (EngineCoreClient if process else AsyncEngine)(dtype=dtype, **engine_args)

    async def one(i: int, p: list[int], o: int) -> int:
        n = 0
        async for out in eng.generate(f"r{i}", p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)):
            n += len(out.new_token_ids)
        return n

    async def run() -> tuple[float, int]:
        await one(-1, prompts[0][:32], 4)    # warm-up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p, o) for i, (p, o) in enumerate(zip(prompts, outputs))))
        return time.perf_counter() - t0, sum(counts)

    try:
        elapsed, n_out = asyncio.run(run())
    finally:
        eng.shutdown()
    assert n_out == sum(outputs), "engine did not produce the requested lengths"
    return {"elapsed": elapsed, "tokens": n_out, "tok_s": n_out / elapsed}


def compare_engine_process(prompts, outputs, dtypes: list[str], engine_args: dict, repeats: int) -> None:
    """In-thread AsyncEngine vs the engine core in its own process, interleaved rounds, on the same workload."""
    print("\n| dtype | in-thread tok/s | engine-core process tok/s | process / in-thread (median of rounds) |")
    print("|---|---|---|---|")
    for dtype in dtypes:
        thread, proc = [], []
        for r in range(max(1, repeats)):
            thread.append(bench_served(prompts, outputs, dtype, engine_args, process=False))
            proc.append(bench_served(prompts, outputs, dtype, engine_args, process=True))
            print(f"  [{dtype}, round {r + 1}] in-thread {thread[-1]['tok_s']:.1f} tok/s, process "
                  f"{proc[-1]['tok_s']:.1f} tok/s", flush=True)
        print(f"| {dtype} | {_median([t['tok_s'] for t in thread]):.1f} | {_median([p['tok_s'] for p in proc]):.1f} | "
              f"{_median([p['tok_s'] / t['tok_s'] for t, p in zip(thread, proc)]):.3f}x |", flush=True)


def print_engine(label: str, eng: dict) -> None:
    print(f"[{label}] rtserve: {eng['tok_s']:.1f} tok/s ({eng['elapsed']:.1f} s, {eng['steps']} steps, "
          f"kv waste {eng['kv_waste']:.2%})", flush=True)


def load_hf(dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    from engine.models.loader import resolve_model_dir
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=DTYPES[dtype]).to(device).eval()


@torch.inference_mode()
def bench_hf_sequential(model, prompts, outputs) -> dict:
    dev = model.device
    model.generate(torch.tensor([prompts[0][:32]], device=dev), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   pad_token_id=0)
    t0 = time.perf_counter()
    n = 0
    for p, o in zip(prompts, outputs):
        out = model.generate(torch.tensor([p], device=dev), max_new_tokens=o, min_new_tokens=o, do_sample=False, pad_token_id=0)
        n += out.shape[1] - len(p)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": n, "tok_s": n / elapsed}


@torch.inference_mode()
def bench_hf_static(model, prompts, outputs, batch_size: int = 8) -> dict:
    """Static batching: left-pad each batch of 8, run until its longest output is done; count only useful tokens."""
    model.generate(torch.tensor([prompts[0][:32]] * 2, device=model.device), max_new_tokens=4, min_new_tokens=4,
                   do_sample=False, pad_token_id=0)   # warm-up (on a GPU: context, kernels, allocator)
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch_size):
        ps, os_ = prompts[i:i + batch_size], outputs[i:i + batch_size]
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=model.device)
        model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_), do_sample=False,
                       pad_token_id=0)
        n += sum(os_)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": n, "tok_s": n / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rtserve bench throughput", description=__doc__)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="both", choices=["float32", "bfloat16", "both"])
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=None, help="KV slots per page (engine default: 4)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-hf", action="store_true", help="only measure the engine")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (GPU)")
    ap.add_argument("--no-gguf-row", action="store_true",
                    help="skip the extra bf16 row with quantization=gguf (batches <= 8 rows on the GGUF's 4-bit blocks)")
    ap.add_argument("--structured", choices=["json"], default=None,
                    help="also run the workload with a JSON-schema constraint on every request (see above)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of (engine, HF static-8), interleaved, each engine on a fresh LLM (no prefix-cache "
                         "carry-over); a shared machine's speed drifts within minutes, so the table gives medians and "
                         "the median of the per-round ratios. HF sequential (the long one) runs once.")
    ap.add_argument("--engine-process", action="store_true",
                    help="instead: the in-thread AsyncEngine against the engine core in its own process "
                         "(engine/core_client.py), every request at once through asyncio, interleaved rounds")
    args = ap.parse_args(argv)

    from engine.models.loader import resolve_model_dir
    import json
    vocab = json.loads((resolve_model_dir(None) / "config.json").read_text())["vocab_size"]
    prompts, outputs = make_workload(args.num_requests, args.seed, vocab)
    schema = None
    if args.structured == "json":
        from transformers import AutoTokenizer
        schema = absorbing_schema(AutoTokenizer.from_pretrained(resolve_model_dir(None)), max(outputs))
    engine_args = dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, page_size=args.page_size,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       attention_backend=args.attention_backend,
                       device=args.device, enforce_eager=args.enforce_eager)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens, "
          f"torch threads {torch.get_num_threads()}, {args.repeats} rounds", flush=True)
    if args.engine_process:
        compare_engine_process(prompts, outputs, ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype],
                               engine_args, args.repeats)
        return 0
    rows = []
    structured_runs: dict[str, list[tuple[dict, dict]]] = {}
    for dtype in (["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]):
        variants = [(dtype, engine_args)]
        if dtype == "bfloat16" and not args.no_gguf_row:   # same HF baselines: HF can only run the dequantized weights
            variants.append(("bfloat16 + gguf q4", {**engine_args, "quantization": "gguf"}))
        model = None if args.skip_hf else load_hf(dtype, args.device)
        runs = {label: [] for label, _ in variants}
        stats = []
        for r in range(max(1, args.repeats)):
            for label, eargs in variants:
                eng = bench_engine(prompts, outputs, dtype, eargs)
                runs[label].append(eng)
                print_engine(f"{label}, round {r + 1}", eng)
                if schema is not None:
                    con = bench_engine(prompts, outputs, dtype, eargs, schema)
                    structured_runs.setdefault(label, []).append((eng, con))
                    print_engine(f"{label} + json schema, round {r + 1}", con)
                    print(f"    mask {con['mask_ms_per_step']:.3f} ms/step of {con['step_ms']:.1f} ms/step, "
                          f"{con['tok_s'] / eng['tok_s']:.3f}x unconstrained", flush=True)
            if model is not None:
                stats.append(bench_hf_static(model, prompts, outputs))
                print(f"[{dtype}, round {r + 1}] HF static batch 8: {stats[-1]['tok_s']:.1f} tok/s "
                      f"({stats[-1]['elapsed']:.1f} s)", flush=True)
        seq = None
        if model is not None:
            seq = bench_hf_sequential(model, prompts, outputs)
            print(f"[{dtype}] HF sequential: {seq['tok_s']:.1f} tok/s ({seq['elapsed']:.1f} s)", flush=True)
            del model
        for label, _ in variants:
            rows.append((label, runs[label], seq, stats))

    print("\n| dtype | rtserve tok/s | HF sequential tok/s | HF static-8 tok/s | vs sequential | vs static-8 | "
          "KV waste at peak |")
    print("|---|---|---|---|---|---|---|")
    for label, engs, seq, stats in rows:
        eng = _median([e["tok_s"] for e in engs])
        waste = engs[0]["kv_waste"]
        if not stats:
            print(f"| {label} | {eng:.1f} | - | - | - | - | {waste:.2%} |")
            continue
        stat = _median([s["tok_s"] for s in stats])
        vs_stat = _median([e["tok_s"] / s["tok_s"] for e, s in zip(engs, stats)])
        print(f"| {label} | {eng:.1f} | {seq['tok_s']:.1f} | {stat:.1f} | {eng / seq['tok_s']:.1f}x | {vs_stat:.1f}x | "
              f"{waste:.2%} |")
    if structured_runs:
        print("\nconstrained (every request under a JSON schema) vs unconstrained, same workload, same rounds:\n"
              "\n| dtype | requests | unconstrained tok/s | json schema tok/s | ratio | mask ms/step | step ms |")
        print("|---|---|---|---|---|---|---|")
        for label, pairs in structured_runs.items():
            print(f"| {label} | {len(prompts)} | {_median([e['tok_s'] for e, _ in pairs]):.1f} | "
                  f"{_median([c['tok_s'] for _, c in pairs]):.1f} | "
                  f"{_median([c['tok_s'] / e['tok_s'] for e, c in pairs]):.3f}x | "
                  f"{_median([c['mask_ms_per_step'] for _, c in pairs]):.3f} | "
                  f"{_median([c['step_ms'] for _, c in pairs]):.1f} |")
    if args.repeats > 1:
        print("\nper round (rtserve tok/s / HF static-8 tok/s = ratio):")
        for label, engs, _, stats in rows:
            print(f"  {label}: " + ", ".join(f"{e['tok_s']:.0f}/{s['tok_s']:.0f}={e['tok_s'] / s['tok_s']:.1f}x"
                                             for e, s in zip(engs, stats)) if stats else
                  f"  {label}: " + ", ".join(f"{e['tok_s']:.0f}" for e in engs))
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


if __name__ == "__main__":
    raise SystemExit(main())
