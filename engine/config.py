"""Engine arguments, named like the CLI flags (`--kv-cache-memory 2GiB` == `kv_cache_memory="2GiB"`)."""
from __future__ import annotations

import json
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
DEFAULT_PAGE_SIZE = 4   # a sequence leaves less than one page unused, so small pages waste little KV memory


SPECULATIVE_METHODS = ("ngram",)


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's `--speculative-config` JSON spelling. Only vLLM's `ngram` method (prompt lookup,
    engine/ngram_proposer.py): drafts come from the request's own tokens, so there is no draft model to load."""
    method: str = "ngram"
    num_speculative_tokens: int = 0        # drafts proposed per request per step (required, >= 1)
    prompt_lookup_max: int | None = None   # longest n-gram matched against the context
    prompt_lookup_min: int | None = None   # shortest n-gram that still counts as a match

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str") -> "SpeculativeConfig":
        """From the CLI's JSON text, a dict, or an instance; any problem is one InvalidRequestError naming the flag."""
        if isinstance(value, cls):
            value.validate()
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"speculative_config is not valid JSON ({e.msg} at char {e.pos}); "
                                          f'example: {{"method": "ngram", "num_speculative_tokens": 4}}',
                                          param="speculative_config") from None
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a JSON object", param="speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config has unknown key {unknown[0]!r} (known: {sorted(known)})",
                                      param="speculative_config")
        obj = cls(**value)
        obj.validate()
        return obj

    def validate(self) -> None:
        def bad(why: str):
            raise InvalidRequestError(f"speculative_config: {why}", param="speculative_config")

        if self.method not in SPECULATIVE_METHODS:
            bad(f"method must be one of {list(SPECULATIVE_METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                bad(f"{name} must be an integer, got {v!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            bad(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens!r}")
        # vLLM's defaults: neither given -> 5 and 5; one given -> the other equals it
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                f"{self.prompt_lookup_max}")


@dataclass(slots=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "float32"
    kv_cache_memory: int | str = "1GiB"
    block_size: int = 16                # tokens per prefix-cache block (engine/block_manager.py)
    page_size: int | None = None        # KV slots per page, the unit of memory; None: 4, or less to divide block_size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # prefill tokens any one request gets per step while another request has prefill work too (0: no cap)
    long_prefill_token_threshold: int = 0
    # target inter-token gap of running streams: steps carrying prefill are sized to it (engine/step_budget.py);
    # None: off, every step may batch max_num_batched_tokens (best throughput, what offline batches want)
    max_itl_ms: float | None = None
    share_inflight_prefixes: bool = True   # identical uncached prefixes in flight are computed once (scheduler.py)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    pinned_blocks_fraction: float = 0.5
    attention_backend: str | None = None
    device: str = "cpu"
    num_threads: int | None = None
    quantization: str | None = None     # "gguf": linears on the GGUF file's own blocks (engine/layers/gguf_linear.py)
    enforce_eager: bool = False         # on CUDA + Triton, decode steps replay CUDA graphs unless True (engine/cuda_graph.py)
    # speculative decoding (vLLM's --speculative-config: a JSON string, a dict or a SpeculativeConfig); None: off
    speculative_config: SpeculativeConfig | dict | str | None = None

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)
        if int(self.long_prefill_token_threshold) < 0:
            raise InvalidRequestError("long_prefill_token_threshold must be >= 0", param="long_prefill_token_threshold")
        if self.max_itl_ms is not None and not self.max_itl_ms >= 0:
            raise InvalidRequestError("max_itl_ms must be >= 0 (0 or None: off)", param="max_itl_ms")
        if self.page_size is None:
            self.page_size = math.gcd(self.block_size, DEFAULT_PAGE_SIZE)
        if int(self.page_size) < 1 or self.block_size % self.page_size:
            raise InvalidRequestError(f"page_size ({self.page_size}) must be >= 1 and divide block_size "
                                      f"({self.block_size})", param="page_size")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
                                      param="quantization")
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not 0.0 <= self.pinned_blocks_fraction <= 1.0:
            raise InvalidRequestError("pinned_blocks_fraction must be in [0, 1]", param="pinned_blocks_fraction")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs)
