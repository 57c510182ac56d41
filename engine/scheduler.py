"""vLLM-v1-style scheduler: no prefill or decode phases, one rule for the step's token budget.

Each request simply wants `num_tokens - num_computed_tokens` more tokens computed. A step's budget (up to
`max_num_batched_tokens`, smaller when `StepBudget` keeps running streams under their `max_itl_ms` target) is handed
out by one rule:

1. every running decode (1 token each, plus its draft tokens under speculative decoding) first, best priority first: a
   stream that is generating never waits behind a prompt; drafts only take budget left after every decode's own token;
2. then prefill work, running chunks and waiting prompts alike, by priority: a waiting priority-0 request is
   scheduled before a running priority-1 request's next prefill chunk, so a long HTTP prompt is chunked around Realtime
   work. Within a priority, prompts whose whole remaining prefill fits this step go first (a session's next turn, mostly
   cached, gets its first token now instead of queueing behind other sessions' long cold prompts, which each lose at
   most that step's share); then first come, first served;
3. while more than one request has prefill work, no request gets more than `long_prefill_token_threshold` prefill
   tokens in one step (vLLM's knob of that name), so one huge prompt does not own the engine;
4. with a latency target (`StepBudget.max_itl_ms`), a step that carries prefill of one priority carries none of a worse
   one: the lower-priority chunk would lengthen the step that ends in the better request's first token. The paused
   prompt goes on in the next step; without a target, steps are filled for throughput instead.

Waiting requests are admitted while KV pages and `max_num_seqs` allow, and only in steps that preempted nothing (a
preemption means memory pressure). When a running request's pages run out, the worst running request (lowest priority,
then newest) is preempted, even one already scheduled in this step: its pages are freed and it is recomputed later from
its tokens (prompt + output so far), so it resumes with the same tokens.

Identical prefixes in flight are computed once: a waiting request whose first uncached block is being computed right
now by a running request (same chained block hash, so same tokens and cache salt) of no lower priority, or by a waiting
request ahead of it in this step, waits; once those blocks are computed they are in the prefix cache and it hits them.
It waits only for the blocks they share: where the prompts differ the hashes differ and it goes its own way.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus
from engine.step_budget import StepBudget


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int                    # query tokens in this step, drafts included (as vLLM counts them)
    spec_token_ids: list[int] = field(default_factory=list)   # drafts verified after its last known token

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so its last position yields the next token
        (and each draft position one more)."""
        return (self.request.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
                == self.request.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_decodes: int = 0              # running streams that got their one token in this step
    num_spec_tokens: int = 0          # draft tokens verified in this step (on top of the decodes' own tokens)
    token_budget: int = 0             # what the step was allowed to batch
    num_deferred: int = 0             # waiting requests that wait for a shared prefix in flight


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int = 0, step_budget: StepBudget | None = None,
                 share_inflight_prefixes: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.step_budget = step_budget or StepBudget(max_num_batched_tokens)
        self.share_inflight_prefixes = share_inflight_prefixes
        self.waiting: list[tuple[int, float, int, Request]] = []    # heap by (priority, arrival)
        self.running: list[Request] = []
        self._seq = itertools.count()
        self.num_preemptions = 0
        self.num_deferred_admissions = 0      # times a waiting request waited for a prefix in flight

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
        bm = self.block_manager
        self.running.sort(key=lambda r: r.sort_key)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefill_priorities = [r.priority for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        prefill_priorities += [r.priority for *_, r in self.waiting if not r.status.finished]
        out.token_budget = self.step_budget.tokens(
            len(decodes), background_only=bool(prefill_priorities) and min(prefill_priorities) > 0)

        # 1. decodes, each with the drafts that fit once every later decode has its one token
        for i, req in enumerate(decodes):
            if out.num_batched_tokens >= out.token_budget:
                break
            room = out.token_budget - out.num_batched_tokens - 1 - (len(decodes) - i - 1)
            drafts = req.spec_token_ids[:max(0, room)]
            if drafts and bm.pages_for(req.num_computed_tokens + 1 + len(drafts)) - len(req.block_table) > bm.num_free:
                drafts = []           # drafts only take free pages: they never preempt a request or unpin a session
            if req in self.running and self._allocate_or_preempt(req, 1 + len(drafts), out):
                self._schedule(req, 1 + len(drafts), out, drafts)

        # 2. prefill work, running chunks and waiting prompts, by (priority, arrival)
        candidates: list[tuple[tuple[int, float, int], Request]] = [
            ((r.priority, r.arrival_time, 0), r) for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        followers = self._followers(candidates, out)
        candidates.extend(((p, t, seq), r) for p, t, seq, r in self.waiting
                          if not r.status.finished and id(r) not in followers)
        threshold = self.long_prefill_token_threshold
        cap = threshold if threshold > 0 and len(candidates) > 1 else out.token_budget
        room = min(out.token_budget - out.num_batched_tokens, cap)
        candidates.sort(key=lambda c: (c[0][0], self._remaining_prefill(c[1]) > room, c[0][1:]))
        admitted: set[int] = set()                        # seq numbers of the waiting entries admitted
        admitting = not out.preempted
        pause_after: int | None = None                    # worse priorities than this wait for the next step
        for key, req in candidates:
            if pause_after is not None and key[0] > pause_after:
                break
            budget = min(out.token_budget - out.num_batched_tokens, cap)
            if budget <= 0:
                if out.num_batched_tokens >= out.token_budget:
                    break
                continue
            if req.status == RequestStatus.RUNNING:
                if req not in self.running:               # preempted as a victim earlier in this step
                    continue
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if self._allocate_or_preempt(req, num_new, out):
                    self._schedule(req, num_new, out)
                    admitting = admitting and not out.preempted
                    pause_after = key[0] if self.step_budget.enabled else None
                continue
            if not admitting or len(self.running) >= self.max_num_seqs:
                continue
            cached = bm.find_cached_pages(req)
            num_cached = len(cached) * bm.page_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not bm.allocate_slots(req, num_new, cached):
                admitting = False                          # no room: later (worse) requests wait as well
                continue
            admitted.add(key[2])
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                bm.record_prefix_query(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._schedule(req, num_new, out)
            pause_after = key[0] if self.step_budget.enabled else None

        decode_ids = {id(r) for r in decodes}
        out.num_decodes = sum(1 for s in out.scheduled if id(s.request) in decode_ids)
        # admitted and aborted requests leave the waiting heap (requests preempted in this step were pushed onto it)
        if admitted or any(r.status.finished for *_, r in self.waiting):
            self.waiting = [e for e in self.waiting if e[2] not in admitted and not e[3].status.finished]
            heapq.heapify(self.waiting)
        return out

    def _remaining_prefill(self, req: Request) -> int:
        if req.status == RequestStatus.RUNNING:
            return req.num_tokens - req.num_computed_tokens
        return req.num_tokens - len(self.block_manager.find_cached_pages(req)) * self.block_manager.page_size

    def _followers(self, running_prefills: list, out: SchedulerOutput) -> set[int]:
        """Waiting requests whose first uncached block is being computed by a request ahead of them: they wait for it
        and then hit the prefix cache, instead of computing the same blocks at the same time."""
        bm = self.block_manager
        if not (self.share_inflight_prefixes and bm.enable_prefix_caching) or not self.waiting:
            return set()
        bs = bm.block_size
        in_flight: dict[int, int] = {}                    # block hash -> best priority of a request computing it
        for r in self.running:
            for h in r.block_hashes[r.num_computed_tokens // bs:]:
                in_flight[h] = min(in_flight.get(h, r.priority), r.priority)
        followers: set[int] = set()
        for p, _, _, req in sorted(self.waiting):
            if req.status.finished:
                continue
            first = len(bm.find_cached_pages(req)) // bm.pages_per_block   # index of its first uncached block
            if first < (req.num_tokens - 1) // bs and in_flight.get(req.block_hashes[first], p + 1) <= p:
                followers.add(id(req))
                continue
            for h in req.block_hashes[first:]:            # what it will compute if admitted in this step
                in_flight[h] = min(in_flight.get(h, p), p)
        out.num_deferred = len(followers)
        self.num_deferred_admissions += len(followers)
        return followers

    def _schedule(self, req: Request, num_new: int, out: SchedulerOutput, drafts: list[int] | None = None) -> None:
        out.scheduled.append(ScheduledRequest(req, num_new, drafts or []))
        out.num_batched_tokens += num_new
        out.num_spec_tokens += len(drafts or ())

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Pages for req's next num_new tokens, preempting the worst running requests until they fit. False when req
        itself was preempted, or finished because the pool cannot hold it even alone."""
        while not self.block_manager.allocate_slots(req, num_new):
            victim = max(self.running, key=lambda r: r.sort_key)
            if victim is req and len(self.running) == 1:
                # alone and still no room: the pool cannot hold this request any longer
                req.status = RequestStatus.FINISHED_LENGTH
                req.stop_reason = "kv_cache_full"
                self.running.remove(req)
                out.preempted.append(req)       # surfaced to the engine, which finishes it and frees its pages
                return False
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        for i, s in enumerate(out.scheduled):  # scheduled earlier in this step: its tokens go back to the budget
            if s.request is req:
                out.num_batched_tokens -= s.num_new_tokens
                out.num_spec_tokens -= len(s.spec_token_ids)
                del out.scheduled[i]
                break
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
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
