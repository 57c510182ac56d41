"""The CPU attention paths against a plain float64 reference: the C++ paged-decode op (kernels/csrc/, built on first use)
and the pure-torch path it replaces for decodes (RTSERVE_CPU_EXT=0 at start-up; here `cpu_ext._enabled`), on mixed
batches of decodes and prefill chunks with shuffled physical blocks, GQA groups 1-4, head_dim 64 (the op's
register-tiled path) and 32 (its generic loop)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_ext, torch_ops
from test_triton_kernels import _batch

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SPECS = [(1, 17), (1, 1), (5, 5), (1, 300), (1, 16), (12, 40), (1, 33)]


def reference(q, k_cache, v_cache, cu, seq_lens, block_tables, scale):
    """Dense causal attention per sequence, in float64."""
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kvh
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        ctx, start, n = int(seq_lens[b]), int(cu[b]), int(cu[b + 1] - cu[b])
        blocks = block_tables[b, :-(-ctx // bs)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)   # [ctx, heads, d]
        v = v_cache[blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[start:start + n].double(), k) * scale
        qpos = torch.arange(ctx - n, ctx).unsqueeze(1)
        s = s.masked_fill(torch.arange(ctx).unsqueeze(0) > qpos, float("-inf"))
        out[start:start + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def test_the_cpp_op_builds_here():
    assert cpu_ext.paged_decode() is not None, "g++ and ninja are installed by `make test`; the op must build"


@pytest.mark.parametrize("ext", [True, False], ids=["cpp-op", "pure-torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 64), (4, 64), (2, 32)])
@pytest.mark.parametrize("block_size", [16, 8, 4, 32])
def test_mixed_batch_matches_reference(ext, dtype, group, head_dim, block_size, monkeypatch):
    monkeypatch.setattr(cpu_ext, "_enabled", ext)
    q, k_cache, v_cache, cu, seq_lens, tables = _batch(SPECS, block_size, 2, group, head_dim, dtype,
                                                       seed=group * head_dim)
    scale = head_dim ** -0.5
    out = torch_ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    ref = reference(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_op_writes_only_the_decode_rows():
    """Prefill rows belong to SDPA; the op must leave them alone (and handle a strided q view)."""
    q, k_cache, v_cache, cu, seq_lens, tables = _batch(SPECS, 16, 3, 3, 64, torch.bfloat16)
    plan = torch_ops._plan(cu, seq_lens, tables, 16, grouped=False)
    out = torch.full_like(q, 7.0)
    cpu_ext.paged_decode()(q, k_cache, v_cache, tables, seq_lens, plan.decode_rows, plan.decode_seqs, 0.125, out)
    decode = torch.zeros(q.shape[0], dtype=torch.bool)
    decode[plan.decode_rows] = True
    assert bool((out[~decode] == 7.0).all()) and not bool((out[decode] == 7.0).any())
    assert sorted(plan.decode_rows.tolist()) == [int(cu[i]) for i, (n, _) in enumerate(SPECS) if n == 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 8, 4])
def test_whole_sequence_tasks_equal_per_head_tasks(dtype, block_size):
    """With many decodes a task takes all kv heads of a sequence (and prefetches the other heads' lines); with few,
    one head. Both compute each head the same way, so the outputs are equal bit for bit, and match the reference."""
    specs = [(1, c) for c in (17, 1, 300, 16, 33, 64, 5, 250, 129, 48, 90, 31)] + [(12, 40)]
    q, k_cache, v_cache, cu, seq_lens, tables = _batch(specs, block_size, 3, 3, 64, dtype, seed=5)
    plan = torch_ops._plan(cu, seq_lens, tables, block_size, grouped=False)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 64):   # 12 decodes: >= 4 per thread at 1 thread (whole sequences), < 4 at 64 threads (per head)
            torch.set_num_threads(n)
            out = torch.zeros_like(q)
            cpu_ext.paged_decode()(q, k_cache, v_cache, tables, seq_lens, plan.decode_rows, plan.decode_seqs, 0.125,
                                   out)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    ref = reference(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    rows = plan.decode_rows
    torch.testing.assert_close(outs[0][rows].double(), ref[rows], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows", [1, 7, 512])
def test_rms_norm_rounds_where_hf_rounds(rows):
    """bf16 RMSNorm rounds where HF's LlamaRMSNorm does (fp32 normalise, round, multiply by the bf16 weight, round):
    equal but for a rare last-bit difference from the order of the sum of squares."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(576, generator=g).to(torch.bfloat16)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    out = cpu_ext.rms_norm()(x, w, 1e-5)
    assert (out == hf).float().mean() > 0.999
    assert bool(((out.float() - hf.float()).abs() <= hf.float().abs() * 2 ** -6 + 1e-30).all())   # two bf16 steps


@pytest.mark.parametrize("rows", [1, 33, 512])
def test_silu_and_mul_matches_torch(rows):
    """Same rounding points as torch's silu(gate) * up; only exp() may differ by an ulp before the bf16 rounding."""
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = cpu_ext.silu_and_mul()(gate_up)
    assert (out == ref).float().mean() > 0.99
    ulp = ref.float().abs() * 2 ** -7 + 1e-30            # one bf16 step (8 significant bits)
    assert bool(((out.float() - ref.float()).abs() <= 2 * ulp + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 33, 512])
def test_add_rms_norm_is_the_add_then_the_norm(rows, dtype):
    """The fused residual add + RMSNorm: the residual becomes exactly torch's `residual + x`, and the output is the
    C++ RMSNorm of that sum, bit for bit."""
    g = torch.Generator().manual_seed(rows)
    x, res = ((torch.randn(2, rows, 576, generator=g) * 3).to(dtype))
    w = torch.randn(576, generator=g).to(dtype)
    total = res + x
    out = kernels.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, total)                                  # in place, rounded as torch's add
    assert torch.equal(out, cpu_ext.rms_norm()(total, w, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_and_store_matches_the_torch_ops(heads, kv_heads, head_dim, dtype, monkeypatch):
    """The fused rotary embedding + KV store equals torch's ops (`apply_rope`, then `store_kvcache`) exactly: the
    same q, the same cache contents, slot -1 left untouched."""
    g = torch.Generator().manual_seed(heads * head_dim)
    T, blocks, bs = 37, 8, 16
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (T,), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    slots[[3, 20]] = -1
    caches = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(cpu_ext, "rope_store", lambda: None)
        k_cache = torch.full((blocks, bs, kv_heads, head_dim), 7.0, dtype=dtype)
        v_cache = torch.full((blocks, bs, kv_heads, head_dim), 7.0, dtype=dtype)
        q = kernels.rope_and_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
        caches[fused] = (q, k_cache, v_cache)
    for a, b in zip(caches[True], caches[False]):
        assert torch.equal(a, b)
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert bool((caches[True][1].view(blocks * bs, -1)[untouched] == 7.0).all())


def test_argmax_follows_torch_rules():
    """Greedy sampling's argmax (C++): torch.argmax's answer on every row, ties (first index), NaN (first NaN wins),
    rows of -inf, +inf, and widths that are and are not multiples of the 16-lane vectors."""
    assert cpu_ext.argmax_rows() is not None
    g = torch.Generator().manual_seed(0)
    for shape in [(32, 49152), (1, 49152), (3, 17), (5, 1), (2, 100003), (7, 16)]:
        x = torch.randn(*shape, generator=g)
        assert torch.equal(kernels.argmax(x), x.argmax(-1)), shape
    x = torch.zeros(7, 1000)
    x[0, 999] = float("nan")                         # NaN in the scalar tail
    x[1, 5] = x[1, 7] = float("nan")                 # two NaNs in the vector body
    x[2, :] = float("-inf")
    x[3, 10] = x[3, 900] = 1.0                       # tie: the first
    x[4, :] = float("nan")
    x[5, 40], x[5, 3] = float("inf"), float("-inf")
    x[6] = torch.randn(1000, generator=g).round()    # many ties
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert kernels.argmax(x).tolist()[:6] == [999, 5, 0, 10, 0, 40]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_chunks_run_sdpa_flash_kernel(dtype):
    """Prefill chunks (GQA, with and without a cached prefix) must stay on CPU SDPA's flash kernel: its math fallback
    is 4-8x slower on 256-512 token chunks."""
    from torch.profiler import profile
    q, k_cache, v_cache, cu, seq_lens, tables = _batch([(40, 40), (12, 60)], 16, 3, 3, 64, dtype, seed=1)
    with profile() as prof:
        torch_ops.paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.125)
    names = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert not any("math" in n for n in names), sorted(names)


def test_concurrent_first_loads_all_get_the_ops():
    """The engine and Whisper's loader thread both ask for the ops at start-up. A second caller must wait for the
    build or load, not read an "unavailable" placeholder and run the slower torch path (with other rounding) for good.
    A fresh process, since this one has loaded them already."""
    import subprocess
    import sys
    code = ("import threading\nfrom kernels import cpu_ext\nres = []\n"
            "ts = [threading.Thread(target=lambda: res.append(cpu_ext.ops())) for _ in range(4)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "print(sum(r is None for r in res), len(res))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-2:] == ["0", "4"], out.stdout + out.stderr


def test_worker_threads_keep_their_own_thread_count():
    """The engine thread keeps its intra-op threads when the Whisper worker (started later) sets one for itself, and
    a thread started after both takes its own. Plain torch.set_num_threads would not do it: a thread takes the last
    value set by any thread on its first parallel op. A fresh process, since lazy initialisation is per thread."""
    import subprocess
    import sys
    code = ("import threading, torch, kernels\nres = {}\nstarted, whisper_set = threading.Event(), threading.Event()\n"
            "def engine():\n    kernels.set_thread_count(2); started.set(); whisper_set.wait()\n"
            "    res['engine'] = torch.get_num_threads()\n"
            "def whisper():\n    started.wait(); kernels.set_thread_count(1); whisper_set.set()\n"
            "    res['whisper'] = torch.get_num_threads()\n"
            "ts = [threading.Thread(target=engine), threading.Thread(target=whisper)]\n"
            "[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "t = threading.Thread(target=lambda: (kernels.set_thread_count(2), res.update(late=torch.get_num_threads())))\n"
            "t.start(); t.join()\nprint(res['engine'], res['whisper'], res['late'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-3:] == ["2", "1", "2"], out.stdout + out.stderr


@pytest.mark.parametrize("quantization", ["gguf", None], ids=["gguf", "dense-bf16"])
def test_decode_stack_is_the_python_layers_bit_for_bit(quantization):
    """A decode-only step runs all layers in one C++ call (kernels/csrc/decode_stack.cpp). Its hidden states and the
    KV cache it writes must be exactly the Python layers' at every batch size, whichever kernel each size picks (torch's
    4-bit kernel at 1-2 rows, AMX to 64, oneDNN beyond)."""
    from engine.model_runner import load_model
    from engine.models.gguf_q4 import attach_gguf_q4
    from engine.models.llama import AttentionMetadata
    from engine.models.loader import default_model_path, resolve_model_dir

    model = load_model(resolve_model_dir(None), torch.bfloat16, torch.device("cpu"))
    if quantization == "gguf":
        attach_gguf_q4(model, default_model_path(), resolve_model_dir(None))
    model.pack_weights()
    gen = torch.Generator().manual_seed(0)
    bs, num_blocks = 16, 1400
    kv = torch.randn(len(model.layers), 2, num_blocks, bs, model.num_kv_heads, model.head_dim, generator=gen)
    kv = kv.to(torch.bfloat16)
    for batch in (1, 2, 3, 8, 65):
        ctx = torch.randint(1, 300, (batch,), generator=gen).tolist()
        nb = max(c // bs + 1 for c in ctx)
        tables = torch.randperm(num_blocks, generator=gen)[:batch * nb].view(batch, nb).int()
        for i, c in enumerate(ctx):
            tables[i, c // bs + 1:] = -1
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([int(tables[i, c // bs]) * bs + c % bs for i, c in enumerate(ctx)]),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.tensor([c + 1 for c in ctx], dtype=torch.int32), block_tables=tables)
        ids, pos = torch.randint(0, model.config["vocab_size"], (batch,), generator=gen), torch.tensor(ctx)
        outs = []
        for stack in (None, False):          # None: built on first use; False: the Python layers
            model._stack = stack
            cache = kv.clone()
            with torch.inference_mode():
                outs.append((model(ids, pos, meta, cache), cache))
            if stack is None:
                assert isinstance(model._stack, tuple), "the decode stack must apply to this model"
        assert torch.equal(outs[0][0], outs[1][0]), batch
        assert torch.equal(outs[0][1], outs[1][1]), batch
