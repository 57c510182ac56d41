"""`rtserve bench throughput`: our engine vs HF transformers (sequential `generate` and static batches of 8).

Workload (same for every system in the run): `--num-requests` prompts of random token ids, prompt lengths uniform in
[16, 256], output lengths uniform in [16, 128], EOS ignored (every request generates exactly its output length). Reports
output tokens/s, the ratios against both HF baselines, and the KV waste at peak
((allocated slots - tokens stored) / allocated slots).
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


def bench_engine(prompts, outputs, dtype: str, engine_args: dict) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(dtype=dtype, **engine_args)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm-up
    llm.engine.peak_kv_waste = (0, 0)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(outputs), "engine did not produce the requested lengths"
    alloc, stored = llm.engine.peak_kv_waste
    ttft = sorted(o.ttft_s for o in outs)
    return {"elapsed": elapsed, "tokens": n_out, "tok_s": n_out / elapsed, "steps": llm.engine.num_steps,
            "kv_waste": (alloc - stored) / alloc if alloc else 0.0, "ttft_p50": ttft[len(ttft) // 2],
            "preemptions": llm.engine.scheduler.num_preemptions}


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
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--attention-backend", default=None, choices=["torch", "triton"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-hf", action="store_true", help="only measure the engine")
    ap.add_argument("--no-gguf-row", action="store_true",
                    help="skip the extra bf16 row with quantization=gguf (batches <= 8 rows on the GGUF's 4-bit blocks)")
    args = ap.parse_args(argv)

    from engine.models.loader import resolve_model_dir
    import json
    vocab = json.loads((resolve_model_dir(None) / "config.json").read_text())["vocab_size"]
    prompts, outputs = make_workload(args.num_requests, args.seed, vocab)
    engine_args = dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                       device=args.device)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    rows = []
    for dtype in (["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]):
        eng = bench_engine(prompts, outputs, dtype, engine_args)
        print_engine(dtype, eng)
        seq = stat = None
        if not args.skip_hf:
            model = load_hf(dtype, args.device)
            stat = bench_hf_static(model, prompts, outputs)
            print(f"[{dtype}] HF static batch 8: {stat['tok_s']:.1f} tok/s ({stat['elapsed']:.1f} s)", flush=True)
            seq = bench_hf_sequential(model, prompts, outputs)
            print(f"[{dtype}] HF sequential: {seq['tok_s']:.1f} tok/s ({seq['elapsed']:.1f} s)", flush=True)
            del model
        rows.append((dtype, eng, seq, stat))
        if dtype == "bfloat16" and not args.no_gguf_row:   # same HF baselines: HF can only run the dequantized weights
            eng = bench_engine(prompts, outputs, dtype, {**engine_args, "quantization": "gguf"})
            print_engine("bfloat16 + gguf q4", eng)
            rows.append(("bfloat16 + gguf q4", eng, seq, stat))

    print("\n| dtype | rtserve tok/s | HF sequential tok/s | HF static-8 tok/s | vs sequential | vs static-8 | "
          "KV waste at peak |")
    print("|---|---|---|---|---|---|---|")
    for dtype, eng, seq, stat in rows:
        vs_seq = f"{eng['tok_s'] / seq['tok_s']:.1f}x" if seq else "-"
        vs_stat = f"{eng['tok_s'] / stat['tok_s']:.1f}x" if stat else "-"
        print(f"| {dtype} | {eng['tok_s']:.1f} | {seq['tok_s']:.1f} | {stat['tok_s']:.1f} | {vs_seq} | {vs_stat} | "
              f"{eng['kv_waste']:.2%} |" if seq else
              f"| {dtype} | {eng['tok_s']:.1f} | - | - | - | - | {eng['kv_waste']:.2%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
