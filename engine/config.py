"""Engine arguments, named like the CLI flags (`--kv-cache-memory 2GiB` == `kv_cache_memory="2GiB"`)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from engine.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30}


def parse_size(value: int | float | str) -> int:
    """Bytes from 1073741824, "1GiB", "512MiB", "1.5GB"."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r} (examples: 2GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


QUANTIZATIONS = (None, "gguf")
DEFAULT_PAGE_SIZE = 4   # a sequence's last page is half empty on average: ~1.5 slots, against ~7.5 in pages of 16


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "float32"
    kv_cache_memory: int | str = "1GiB"
    block_size: int = 16                # tokens per prefix-cache block (engine/block_manager.py)
    page_size: int | None = None        # KV slots per page, the unit of memory; None: 4, or less to divide block_size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    pinned_blocks_fraction: float = 0.5
    attention_backend: str | None = None
    device: str = "cpu"
    num_threads: int | None = None
    quantization: str | None = None     # "gguf": decode batches on the GGUF's own 4-bit blocks (engine/layers/gguf_linear.py)
    enforce_eager: bool = False         # on CUDA + Triton, decode steps replay CUDA graphs unless True (engine/cuda_graph.py)

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)
        if self.page_size is None:
            self.page_size = math.gcd(self.block_size, DEFAULT_PAGE_SIZE)
        if int(self.page_size) < 1 or self.block_size % self.page_size:
            raise InvalidRequestError(f"page_size ({self.page_size}) must be >= 1 and divide block_size "
                                      f"({self.block_size})", param="page_size")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
                                      param="quantization")
        if not 0.0 <= self.pinned_blocks_fraction <= 1.0:
            raise InvalidRequestError("pinned_blocks_fraction must be in [0, 1]", param="pinned_blocks_fraction")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)
