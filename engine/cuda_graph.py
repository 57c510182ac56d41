"""Decode steps replayed as CUDA graphs, one per batch-size bucket (vLLM's idea).

Why: on a GPU a decode step of a small model is a few hundred small kernel launches issued from Python, so an eager
step is bound by launches, not by the GPU (docs/benchmarks.md, "On a GPU"). A captured graph replays the whole forward
(and the logits) with one launch.

How: the inputs live in static tensors sized for the largest bucket. A decode-only step of n sequences pads to the
next bucket B: rows n..B-1 get slot -1 (their keys and values are never stored), context 1 and page 0 (a valid read
whose result is dropped). Capturing needs kernels that never read device values on the host; the Triton backend is
built that way, the torch backend is not (it plans from the tensors), so graphs are used only with Triton on CUDA.
`capture=False` runs the same padded static-buffer path eagerly: that is how the CPU tests check the padding.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.models.llama import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, max_num_seqs: int, max_pages: int, capture: bool = True):
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        self.buckets = [b for b in BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_bs = n = max_num_seqs
        dev = kv_cache.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_pages, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple] = {}
        if capture:
            self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b], cu_seqlens_q=self.cu_seqlens_q[:b + 1],
                                 seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b])

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:b], self.positions[:b], self._meta(b), self.kv_cache)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Largest bucket first, all graphs in one memory pool (a smaller graph reuses the larger one's memory)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):            # warm-up: Triton compiles, cuBLAS picks its kernels
            for b in self.buckets:
                self._forward(b)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b)
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, input_ids: list[int], positions: np.ndarray, slots: np.ndarray, seq_lens: list[int],
            tables: np.ndarray) -> torch.Tensor:
        """One decode step of n = len(input_ids) sequences; returns fp32 logits [n, vocab] on the CPU."""
        n = len(input_ids)
        b = self.bucket(n)
        width = tables.shape[1]
        self.input_ids[:n].copy_(torch.tensor(input_ids, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slots), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.block_tables[:n, :width].copy_(torch.from_numpy(tables).clamp_(min=0), non_blocking=True)
        if b > n:   # padding rows: no KV store, one key from page 0, their logits dropped
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        if self.capture:
            graph, logits = self.graphs[b]
            graph.replay()
        else:
            logits = self._forward(b)
        return logits[:n].cpu()
