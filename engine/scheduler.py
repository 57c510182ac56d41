"""vLLM-v1-style scheduler: no prefill or decode phases.

Each request simply wants `num_tokens - num_computed_tokens` more tokens computed. Every step hands out up to
`max_num_batched_tokens` of them: first to running requests (a decode costs 1, a long prompt is chunked to what is left of
the budget), then to waiting requests, best priority first, while KV pages and `max_num_seqs` allow. Chunked prefill, prefix
hits and decodes all fall out of that one rule. When pages run out, the lowest-priority (then newest) running request is
preempted: its pages are freed and it is recomputed later from its tokens (prompt + output so far), so it resumes with the
same tokens.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last position yields the next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[tuple[int, float, int, Request]] = []    # heap by (priority, arrival)
        self.running: list[Request] = []
        self._seq = itertools.count()
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (req.priority, req.arrival_time, next(self._seq), req))

    @property
    def num_waiting(self) -> int:
        return sum(1 for *_, r in self.waiting if not r.status.finished)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running requests, best priority first; preempt from the worst end when pages run out
        self.running.sort(key=lambda r: r.sort_key)
        scheduled_ids: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not bm.allocate_slots(req, num_new):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    # alone and still no room: the pool cannot hold this request any longer
                    req.status = RequestStatus.FINISHED_LENGTH
                    req.stop_reason = "kv_cache_full"
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new))
                scheduled_ids.add(id(req))
                budget -= num_new
                i += 1
                continue
            if req.status.finished:
                out.preempted.append(req)       # surfaced to the engine, which finishes it and frees its pages
                self.running.remove(req)
            # req was preempted (or finished); the list shrank, so i now points at the next one
        # 2. waiting requests, if nothing was preempted this step (preemption means memory pressure)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            *_, req = self.waiting[0]
            if req.status.finished:                 # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            cached = bm.find_cached_pages(req)
            num_cached = len(cached) * bm.page_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not bm.allocate_slots(req, num_new, cached):
                break
            heapq.heappop(self.waiting)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                bm.record_prefix_query(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if not req.status.finished:
            self.add(req)
            req.status = RequestStatus.PREEMPTED
        out.preempted.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release pages (the engine pins session blocks before calling this)."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        self.block_manager.free(req)
