"""Turns one scheduler step into one forward pass: flatten, run, pick the rows that sample.

The runner owns the model and the KV cache tensor. Each step it builds vLLM's flat inputs (`input_ids`, `positions`,
`slot_mapping`, `cu_seqlens_q`, `seq_lens`, `block_tables`), runs the model once for the whole mixed batch, and computes
logits only at the last position of requests whose chunk reaches their end.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import kernels
from engine.cuda_graph import DecodeGraphs
from engine.errors import ModelLoadError
from engine.layers.rotary_embedding import rope_inv_freq
from engine.models.gguf_weights import attach_gguf_linears
from engine.models.llama import AttentionMetadata, LlamaForCausalLM
from engine.models.loader import check_architecture
from engine.request import Request
from engine.scheduler import ScheduledRequest
from kernels import cpu_ext

log = logging.getLogger("rtserve.engine")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = check_architecture(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):                # no init work: every parameter is assigned from the file below
        model = LlamaForCausalLM(config)
    model.load_hf_state_dict(state)
    model.inv_freq = torch.empty(0)            # the meta buffer has no data; set for real after the dtype cast
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = rope_inv_freq(config, model.head_dim).to(device)  # rope angles stay fp32 whatever the dtype
    return model


class ModelRunner:
    def __init__(self, model_dir: Path, dtype: str, device: str, page_size: int, kv_cache_memory: int,
                 gguf_file: Path | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(DTYPES)}")
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        t0 = time.perf_counter()
        self.model = load_model(model_dir, self.dtype, self.device)
        log.info("weights loaded in %.1f s (%s on %s)", time.perf_counter() - t0, dtype, device)
        if self.device.type == "cpu":
            cpu_ext.ops()   # build (first run on a machine) or load the C++ ops now, not mid-request
        t1 = time.perf_counter()
        if gguf_file is not None:
            if self.device.type != "cpu":
                raise ModelLoadError("quantization='gguf' runs on the CPU only (torch's 4-bit kernel for CPU)")
            attach_gguf_linears(self.model, gguf_file, model_dir)
        if self.device.type == "cpu":
            self.model.pack_weights()
        self.load_seconds = time.perf_counter() - t0
        if self.device.type == "cpu":
            log.info("weights packed for the CPU kernels in %.1f s%s", time.perf_counter() - t1,
                     " (decode on the GGUF file's Q4_1 blocks)" if gguf_file is not None else "")
        self.config = self.model.config
        self.page_size = page_size
        num_layers = len(self.model.layers)
        per_page = 2 * num_layers * page_size * self.model.num_kv_heads * self.model.head_dim * self.dtype.itemsize
        self.num_pages = int(kv_cache_memory // per_page)
        if self.num_pages < 2:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes holds fewer than 2 pages of {per_page} bytes")
        self.kv_cache = kernels.empty_kv_cache((num_layers, 2, self.num_pages, page_size, self.model.num_kv_heads,
                                                self.model.head_dim), self.dtype, self.device)
        log.info("KV cache: %d tokens (%d pages of %d, %.0f MiB)", self.num_pages * page_size, self.num_pages,
                 page_size, self.num_pages * per_page / 2**20)
        self.graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> bool:
        """CUDA graphs for decode steps (engine/cuda_graph.py): only on CUDA with the Triton backend, whose kernels
        never read device values on the host. `capture=False` runs the padded static-buffer path eagerly (tests)."""
        if capture and (self.device.type != "cuda" or kernels.resolve_backend(self.device) != "triton"):
            return False
        max_pages = -(-max_model_len // self.page_size)
        try:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, max_num_seqs, max_pages, capture=capture)
        except Exception as e:  # noqa: BLE001 - a GPU or driver that cannot capture still serves, eagerly
            if not capture:
                raise
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s", str(e).splitlines()[0][:300])
            self.graphs = None
            torch.cuda.synchronize()
            return False
        return True

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns fp32 logits for the sampling rows and the indices (into `scheduled`) they belong to: one
        row per sampling request, or 1 + len(spec_token_ids) consecutive rows for a request with drafts."""
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        cu = [0]
        seq_lens: list[int] = []
        logit_rows: list[int] = []
        sampling: list[int] = []
        scored: list[tuple[Request, int, int]] = []   # (request, prompt position, row) for prompt logprobs
        max_pages = 0
        seq_tables: list[list[int]] = []      # the block table of each attention sequence (cu / seq_lens entry)
        for i, s in enumerate(scheduled):
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            num_spec = len(s.spec_token_ids)
            input_ids.extend(req.token_ids[start:start + n - num_spec])
            input_ids.extend(s.spec_token_ids)
            pos = np.arange(start, start + n)
            positions.append(pos)
            table = np.asarray(req.block_table, dtype=np.int64)
            slots.append(table[pos // ps] * ps + pos % ps)
            max_pages = max(max_pages, len(req.block_table))
            if num_spec and n == num_spec + 1:
                # a decode with drafts: each query token is a one-token sequence over the same pages, with its own
                # length (which keeps it causal), so all of them take the decode kernels instead of a prefill chunk's
                # gather + SDPA; the step stores every new token's KV before attention reads it
                for j in range(n):
                    cu.append(cu[-1] + 1)
                    seq_lens.append(start + j + 1)
                    seq_tables.append(req.block_table)
            else:
                cu.append(cu[-1] + n)
                seq_lens.append(start + n)
                seq_tables.append(req.block_table)
            if s.samples:   # the last known token's position, then one row per draft
                logit_rows.extend(range(cu[-1] - 1 - num_spec, cu[-1]))
                sampling.append(i)
            for pos in req.params.prompt_logprob_positions or ():
                if start < pos <= start + n and pos < req.num_prompt_tokens:   # its logits come from pos - 1
                    scored.append((req, pos, cu[-2] + pos - 1 - start))
        tables = np.full((len(seq_tables), max_pages), -1, dtype=np.int32)
        for i, t in enumerate(seq_tables):
            tables[i, :len(t)] = t
        if self.graphs is not None and len(input_ids) == len(scheduled) == len(sampling) == len(logit_rows) \
                <= self.graphs.max_bs and not scored:
            return self.graphs.run(input_ids, np.concatenate(positions), np.concatenate(slots), seq_lens,
                                   tables), sampling   # a decode-only step: one token per sequence, all sampling
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
        )
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long, device=dev),
                            torch.from_numpy(np.concatenate(positions)).to(dev), meta, self.kv_cache)
        rows = logit_rows + [row for _, _, row in scored]
        if not rows:
            return torch.empty(0, self.config["vocab_size"]), []
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)]).cpu()
        if scored:   # the same forward pass: a few more rows of logits, no step of their own
            logprobs = logits[len(logit_rows):].float().log_softmax(-1)
            for j, (req, pos, _) in enumerate(scored):
                req.prompt_logprobs[pos] = float(logprobs[j, req.token_ids[pos]])
                if req.params.prompt_logprobs:
                    top = logprobs[j].topk(req.params.prompt_logprobs)
                    req.prompt_top_logprobs[pos] = list(zip(top.indices.tolist(), top.values.tolist()))
            logits = logits[:len(logit_rows)]
        return logits, sampling
