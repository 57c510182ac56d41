"""A request as the scheduler sees it: token ids, how many of them have KV in the cache, and where that KV lives."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"               # a step raised on this request's account (engine/llm_engine.py)

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0                      # lower runs first (realtime 0, HTTP batch 1)
    cache_salt: str | None = None          # isolates tenants in the prefix cache
    session_id: str | None = None          # blocks stay pinned for this session after finishing
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)      # prompt + output; the scheduler's only notion of work
    num_computed_tokens: int = 0           # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)    # its KV pages in token order (what the kernels read)
    block_hashes: list[int] = field(default_factory=list)   # chained hashes of the full blocks of token_ids
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens proposed for its next decode step
    num_spec_allowed: int | None = None    # most drafts it gets next (engine/ngram_proposer.py); None: k
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int = -1            # prefix-cache hit at first scheduling (-1: not scheduled yet)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()   # EOS (unless ignore_eos) + params.stop_token_ids, set at admission
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: dict[int, float] = field(default_factory=dict)   # position -> logprob (params' positions)
    prompt_top_logprobs: dict[int, list[tuple[int, float]]] = field(default_factory=dict)   # and its top-n there
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def first_scored_position(self) -> int | None:
        """The first prompt position whose logprob is asked for: the prefix cache may serve only tokens before it
        minus one, since the logits that score it come from the position before."""
        positions = self.params.prompt_logprob_positions
        return min(positions) if positions else None

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
