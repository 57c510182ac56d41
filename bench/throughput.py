"""`rtserve bench throughput`: our engine vs HF transformers (sequential `generate` and static batches of 8).

Workload (same for every system in the run): `--num-requests` prompts of random token ids, prompt lengths uniform in
[16, 256], output lengths uniform in [16, 128], EOS ignored (every request generates exactly its output length). Reports
output tokens/s, the ratios against both HF baselines, and the KV waste at peak
((allocated slots - tokens stored) / allocated slots). Decoding is greedy; `--sampling "temperature=0.2,top_p=0.9"`
draws instead (each engine request seeded, HF with the same settings), which adds the sampler's own cost per step.

`--structured json` adds, in every round and right after each engine run, the same workload with a JSON-schema
constraint on every request (grammar-constrained decoding, engine/structured_output.py), and reports its tok/s, the
ratio to the unconstrained run of the same round, and the engine's mask time per step (filling and applying the token
bitmasks and advancing the matchers). The schema is an object with one string field whose minLength is more characters
than the longest output can hold, so the grammar cannot end before `max_tokens` and every constrained request, like the
unconstrained one, generates exactly its output length: both runs do the same model work and differ only by the
grammar (a string field is also where most of a real JSON answer's tokens go).

`--speculative-config JSON` (vLLM's spelling, e.g. '{"method": "ngram", "num_speculative_tokens": 4}') replaces the HF
comparison with an A/B of the engine without and with speculative decoding: both engines are loaded once, and each round
runs the round's requests on one, then the other (the order alternates between rounds, so drift on a shared machine
falls on both), and the table gives median tok/s, the median of the per-round ratios and the draft acceptance rate.
`--workload repeat` is one where drafts hit: each prompt (the chat template around "Repeat exactly: <passage>", a
passage of a few seeded sentences) asks for a reply that quotes it, generated greedily up to EOS or the passage's length
plus a margin. `--workload random` is the random-token workload above, sampled at temperature 1 with a seed per
request (greedy, the small model falls into loops on random prompts, and loops are where drafts hit best); there drafts
are proposed and mostly rejected, which is the cost of speculation when it does not pay. Each round draws new
requests (seed + round), so the prefix cache carries nothing from one round to the next; `--num-requests 1` measures a
single stream.
"""
from __future__ import annotations

import random
import time

import torch

from bench import report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_workload(n: int, seed: int, vocab: int, prompt_range=(16, 256), output_range=(16, 128)):
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        prompts.append([rng.randrange(100, vocab - 100) for _ in range(plen)])
        outputs.append(rng.randint(*output_range))
    return prompts, outputs


SENTENCES = [
    "The museum opens at nine in the morning and closes at six in the evening, except on public holidays.",
    "Please send the signed contract to the legal department before Friday, together with a copy of your ID.",
    "Rain is expected over the northern hills tonight, with clear skies returning by Thursday afternoon.",
    "The recipe needs two cups of flour, one egg, a pinch of salt and a spoonful of melted butter.",
    "Our team moved the weekly meeting to Tuesday so that everyone can attend the training on Monday.",
    "The library has extended its hours for the exam period and added forty new seats on the second floor.",
    "To reset the router, hold the small button on the back for ten seconds until the light turns orange.",
    "The train to the coast leaves from platform four every hour, and the journey takes about ninety minutes.",
    "A healthy garden needs good soil, enough sunlight, regular watering and a little patience every season.",
    "The new bridge will carry both cyclists and pedestrians, and it should be finished by the end of next year.",
    "Students must hand in their projects by the last day of the month, either on paper or by email.",
    "The old lighthouse on the island was restored last summer and is now open to visitors at weekends.",
]


def make_repeat_workload(n: int, seed: int, tokenizer) -> tuple[list[list[int]], list[int]]:
    """Prompts whose reply quotes them (drafts from the prompt hit): the chat template around "Repeat exactly:" and
    three to five seeded sentences; the output budget is the passage's length in tokens plus a margin."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(n):
        passage = " ".join(rng.sample(SENTENCES, rng.randint(3, 5)))
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat exactly: " + passage}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
        outputs.append(len(tokenizer.encode(passage, add_special_tokens=False)) + 8)
    return prompts, outputs


def absorbing_schema(tokenizer, max_output: int) -> dict:
    """A JSON schema whose one string field cannot close before `max_output` tokens: its minLength exceeds what that
    many of the vocabulary's longest tokens spell."""
    longest = max(map(len, tokenizer.batch_decode([[i] for i in range(len(tokenizer))])))
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": longest * max_output}},
            "required": ["text"], "additionalProperties": False}


SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float}


def parse_sampling(spec: str) -> dict:
    """`--sampling "temperature=0.2,top_p=0.9"` -> {"temperature": 0.2, "top_p": 0.9}; ValueError names what is wrong."""
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, eq, value = part.partition("=")
        if not eq or key.strip() not in SAMPLING_KEYS:
            raise ValueError(f"{part!r}: expected KEY=VALUE with KEY one of {', '.join(SAMPLING_KEYS)}")
        out[key.strip()] = SAMPLING_KEYS[key.strip()](value)
    if out.get("temperature", 1.0) <= 0:
        raise ValueError("temperature must be > 0 (without --sampling the workload is greedy)")
    return out


def hf_sampling(sampling: dict | None) -> dict:
    """HF generate()'s arguments for the same draws: greedy without --sampling; with it, top_k 0 unless given (HF
    would otherwise apply its default top-k of 50, which the engine does not)."""
    if not sampling:
        return {"do_sample": False}
    return {"do_sample": True, "top_k": 0, **sampling}


def bench_engine(prompts, outputs, dtype: str, engine_args: dict, schema: dict | None = None,
                 sampling: dict | None = None) -> dict:
    from engine import LLM, SamplingParams, StructuredOutputsParams
    llm = LLM(dtype=dtype, **engine_args)
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                   structured_outputs=so))   # warm-up (and the grammar's compile)
    llm.engine.peak_kv_waste = (0, 0)
    before = llm.engine.stats()
    draw = [dict(sampling, seed=i) if sampling else {"temperature": 0} for i in range(len(outputs))]
    params = [SamplingParams(**d, max_tokens=o, ignore_eos=True, structured_outputs=so) for d, o in zip(draw, outputs)]
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


def spec_round(llm, prompts, outputs, workload: str, seed: int) -> dict:
    """One round of requests on an already loaded engine: "repeat" greedy up to EOS, "random" sampled (temperature 1,
    seeded per request, EOS ignored)."""
    from engine import SamplingParams
    before = llm.engine.stats()
    if workload == "repeat":
        params = [SamplingParams(temperature=0, max_tokens=o) for o in outputs]
    else:
        params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=o, ignore_eos=True)
                  for i, o in enumerate(outputs)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    after = llm.engine.stats()
    n_out = sum(len(o.token_ids) for o in outs)
    drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    return {"elapsed": elapsed, "tokens": n_out, "tok_s": n_out / elapsed,
            "steps": after["num_steps"] - before["num_steps"], "acceptance": accepted / drafts if drafts else 0.0,
            "drafts": drafts, "accepted": accepted}


def bench_spec(args, engine_args: dict) -> int:
    """The A/B of speculative decoding described in the module docstring."""
    import json

    from engine import LLM
    from engine.models.loader import resolve_model_dir
    spec = args.speculative_config
    dtype = "bfloat16" if args.dtype == "both" else args.dtype
    eargs = dict(engine_args, dtype=dtype)
    if dtype == "bfloat16" and not args.no_gguf_row:
        eargs["quantization"] = "gguf"
    engines = {"plain": LLM(**eargs), "spec": LLM(**eargs, speculative_config=spec)}
    vocab = json.loads((resolve_model_dir(None) / "config.json").read_text())["vocab_size"]
    workloads = ["repeat", "random"] if args.workload == "both" else [args.workload]
    print(f"speculative decoding A/B: {spec}, dtype {dtype}{' + gguf' if 'quantization' in eargs else ''}, "
          f"{args.num_requests} request(s) per round, {args.repeats} rounds, torch threads {torch.get_num_threads()}",
          flush=True)
    for llm in engines.values():   # warm-up, drafts included
        spec_round(llm, *make_repeat_workload(1, -1, llm.tokenizer), "repeat", 0)
    table = []
    for workload in workloads:
        runs = {"plain": [], "spec": []}
        for r in range(max(1, args.repeats)):
            if workload == "repeat":
                prompts, outputs = make_repeat_workload(args.num_requests, args.seed + r, engines["plain"].tokenizer)
            else:
                prompts, outputs = make_workload(args.num_requests, args.seed + r, vocab)
            for name in (["plain", "spec"] if r % 2 == 0 else ["spec", "plain"]):
                res = spec_round(engines[name], prompts, outputs, workload, args.seed + r)
                runs[name].append(res)
                print(f"[{workload}, round {r + 1}] {name}: {res['tok_s']:.1f} tok/s ({res['tokens']} tokens, "
                      f"{res['steps']} steps" + (f", {res['accepted']}/{res['drafts']} drafts accepted"
                                                 if name == "spec" else "") + ")", flush=True)
        table.append((workload, runs))
    print("\n| workload | requests per round | plain tok/s | spec tok/s | spec / plain (median of rounds) | "
          "acceptance rate |")
    print("|---|---|---|---|---|---|")
    for workload, runs in table:
        ratios = [s["tok_s"] / p["tok_s"] for p, s in zip(runs["plain"], runs["spec"])]
        drafts = sum(s["drafts"] for s in runs["spec"])
        accepted = sum(s["accepted"] for s in runs["spec"])
        print(f"| {workload} | {args.num_requests} | {_median([p['tok_s'] for p in runs['plain']]):.1f} | "
              f"{_median([s['tok_s'] for s in runs['spec']]):.1f} | {_median(ratios):.2f}x "
              f"({', '.join(f'{x:.2f}' for x in ratios)}) | {accepted / drafts if drafts else 0.0:.2f} |")
    return 0


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
    report.stage(f"[{label}] rtserve: {eng['tok_s']:.1f} tok/s ({eng['elapsed']:.1f} s, {eng['steps']} steps, "
                 f"kv waste {eng['kv_waste']:.2%})")


def load_hf(dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    from engine.models.loader import resolve_model_dir
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=DTYPES[dtype]).to(device).eval()


@torch.inference_mode()
def bench_hf_sequential(model, prompts, outputs, sampling: dict | None = None) -> dict:
    dev = model.device
    model.generate(torch.tensor([prompts[0][:32]], device=dev), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   pad_token_id=0)
    t0 = time.perf_counter()
    n = 0
    for p, o in zip(prompts, outputs):
        out = model.generate(torch.tensor([p], device=dev), max_new_tokens=o, min_new_tokens=o, pad_token_id=0,
                             **hf_sampling(sampling))
        n += out.shape[1] - len(p)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": n, "tok_s": n / elapsed}


@torch.inference_mode()
def bench_hf_static(model, prompts, outputs, batch_size: int = 8, sampling: dict | None = None) -> dict:
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
        model.generate(ids, attention_mask=mask, max_new_tokens=max(os_), min_new_tokens=max(os_), pad_token_id=0,
                       **hf_sampling(sampling))
        n += sum(os_)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": n, "tok_s": n / elapsed}


def main(argv: list[str] | None = None) -> int:
    ap = report.parser("throughput", __doc__)
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
    ap.add_argument("--speculative-config", default=None,
                    help='vLLM\'s JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\': A/B the engine '
                         'without and with speculative decoding instead of the HF comparison (see above)')
    ap.add_argument("--workload", default="both", choices=["repeat", "random", "both"],
                    help="with --speculative-config: prompts the reply quotes (drafts hit), random tokens, or both")
    ap.add_argument("--engine-process", action="store_true",
                    help="instead: the in-thread AsyncEngine against the engine core in its own process "
                         "(engine/core_client.py), every request at once through asyncio, interleaved rounds")
    ap.add_argument("--sampling", default=None, metavar="KEY=VALUE,...",
                    help='draw instead of greedy decoding, e.g. "temperature=0.2,top_p=0.9" (the embedded model\'s '
                         'defaults, what Realtime replies use); keys: temperature, top_p, top_k, min_p. Each engine '
                         'request has its own seed; the HF baselines draw with the same settings. For the HF '
                         'comparison and --structured; not with --speculative-config or --engine-process')
    args = ap.parse_args(argv)
    if args.sampling is not None:
        try:
            args.sampling = parse_sampling(args.sampling)
        except ValueError as e:
            ap.error(f"argument --sampling: {e}")
        if args.speculative_config is not None or args.engine_process:
            ap.error("argument --sampling: not with --speculative-config or --engine-process (their workloads set "
                     "their own sampling)")
    if args.speculative_config is not None:   # a bad config is one line and exit code 2, before anything loads
        from engine.config import SpeculativeConfig
        from engine.errors import InvalidRequestError
        try:
            args.speculative_config = SpeculativeConfig.parse(args.speculative_config)
        except InvalidRequestError as e:
            ap.error(f"argument --speculative-config: {e}")

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
    if args.speculative_config is not None:
        return bench_spec(args, engine_args)
    workload = f"{len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens" + (
        ", sampled (" + ", ".join(f"{k} {v}" for k, v in args.sampling.items()) + ")" if args.sampling else ", greedy")
    print(f"workload: {workload}, torch threads {torch.get_num_threads()}, {args.repeats} rounds", flush=True)
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
                eng = bench_engine(prompts, outputs, dtype, eargs, sampling=args.sampling)
                runs[label].append(eng)
                print_engine(f"{label}, round {r + 1}", eng)
                if schema is not None:
                    con = bench_engine(prompts, outputs, dtype, eargs, schema, sampling=args.sampling)
                    structured_runs.setdefault(label, []).append((eng, con))
                    print_engine(f"{label} + json schema, round {r + 1}", con)
                    report.stage(f"    mask {con['mask_ms_per_step']:.3f} ms/step of {con['step_ms']:.1f} ms/step, "
                                 f"{con['tok_s'] / eng['tok_s']:.3f}x unconstrained")
            if model is not None:
                stats.append(bench_hf_static(model, prompts, outputs, sampling=args.sampling))
                report.stage(f"[{dtype}, round {r + 1}] HF static batch 8: {stats[-1]['tok_s']:.1f} tok/s "
                             f"({stats[-1]['elapsed']:.1f} s)")
        seq = None
        if model is not None:
            seq = bench_hf_sequential(model, prompts, outputs, sampling=args.sampling)
            report.stage(f"[{dtype}] HF sequential: {seq['tok_s']:.1f} tok/s ({seq['elapsed']:.1f} s)")
            del model
        for label, _ in variants:
            rows.append((label, runs[label], seq, stats))

    summary = []
    for label, engs, seq, stats in rows:
        eng = _median([e["tok_s"] for e in engs])
        stat = _median([s["tok_s"] for s in stats]) if stats else None
        vs_stat = _median([e["tok_s"] / s["tok_s"] for e, s in zip(engs, stats)]) if stats else None
        summary.append({"dtype": label, "rtserve_tok_s": eng, "hf_sequential_tok_s": seq["tok_s"] if seq else None,
                        "hf_static8_tok_s": stat, "vs_sequential": eng / seq["tok_s"] if seq else None,
                        "vs_static8": vs_stat, "kv_waste": engs[0]["kv_waste"]})
    report.print_table(
        [report.Column("dtype"), report.Column("rtserve", "tok/s"), report.Column("HF sequential", "tok/s"),
         report.Column("HF static-8", "tok/s"), report.Column("vs sequential", "×"),
         report.Column("vs static-8", "×"), report.Column("KV waste at peak", "%", 2)],
        [[r["dtype"], r["rtserve_tok_s"], r["hf_sequential_tok_s"], r["hf_static8_tok_s"], r["vs_sequential"],
          r["vs_static8"], 100 * r["kv_waste"]] for r in summary], f"workload: {workload}")
    structured = []
    for label, pairs in structured_runs.items():
        structured.append({"dtype": label, "requests": len(prompts),
                           "unconstrained_tok_s": _median([e["tok_s"] for e, _ in pairs]),
                           "json_schema_tok_s": _median([c["tok_s"] for _, c in pairs]),
                           "ratio": _median([c["tok_s"] / e["tok_s"] for e, c in pairs]),
                           "mask_ms_per_step": _median([c["mask_ms_per_step"] for _, c in pairs]),
                           "step_ms": _median([c["step_ms"] for _, c in pairs])})
    if structured:
        report.print_table(
            [report.Column("dtype"), report.Column("requests"), report.Column("unconstrained", "tok/s"),
             report.Column("json schema", "tok/s"), report.Column("ratio", "×", 3),
             report.Column("mask", "ms/step", 3), report.Column("step", "ms")],
            [list(r.values()) for r in structured],
            "constrained (every request under a JSON schema) vs unconstrained, same workload, same rounds:")
    if args.repeats > 1:
        print("\nper round (rtserve tok/s / HF static-8 tok/s = ratio):")
        for label, engs, _, stats in rows:
            print(f"  {label}: " + ", ".join(f"{e['tok_s']:.0f}/{s['tok_s']:.0f}={e['tok_s'] / s['tok_s']:.1f}x"
                                             for e, s in zip(engs, stats)) if stats else
                  f"  {label}: " + ", ".join(f"{e['tok_s']:.0f}" for e in engs))
    if args.output:
        report.write_json(args.output, args, {
            "workload": {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                         "output_tokens": sum(outputs)},
            "summary": summary, "structured": structured,
            "rounds": [{"dtype": label, "engine": engs, "hf_sequential": seq, "hf_static8": stats}
                       for label, engs, seq, stats in rows],
            "structured_rounds": {label: [{"unconstrained": e, "json_schema": c} for e, c in pairs]
                                  for label, pairs in structured_runs.items()}})
    path = report.plot_path(args)
    if path:
        panels = [report.Panel("output throughput, same workload", "bars", {
            r["dtype"]: {"rtserve": r["rtserve_tok_s"], "HF static-8": r["hf_static8_tok_s"],
                         "HF sequential": r["hf_sequential_tok_s"]} for r in summary}, ylabel="tok/s")]
        if structured:
            panels.append(report.Panel("JSON-schema constrained vs not", "bars", {
                r["dtype"]: {"unconstrained": r["unconstrained_tok_s"], "json schema": r["json_schema_tok_s"]}
                for r in structured}, ylabel="tok/s"))
        report.save_plot(path, panels, f"rtserve bench throughput: {workload}")
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


if __name__ == "__main__":
    raise SystemExit(main())
