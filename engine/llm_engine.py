"""The engine step and the offline `LLM` API.

`LLMEngine.step()` = schedule → one forward for the mixed batch → sample → detokenize → finished requests release (or
pin) their blocks. It is synchronous and single-threaded; `AsyncEngine` runs it in a thread of its own.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

import kernels
from engine.block_manager import BlockManager
from engine.config import EngineArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.model_runner import ModelRunner
from engine.models.loader import gguf_source, resolve_model_dir
from engine.ngram_proposer import NgramProposer, next_num_drafts
from engine.rejection_sampler import RejectionSampler
from engine.request import Request, RequestStatus
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.step_budget import StepBudget
from engine.structured_output import StructuredOutputManager


log = logging.getLogger("rtserve.engine")


class EngineStepError(RuntimeError):
    """A step raised and the fault could not be pinned on any request in it: the engine cannot serve on."""


class InjectedFault(RuntimeError):
    """Raised by the test-only fault-injection hook (LLMEngine.inject_fault)."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the delta, and totals so far."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list | None = None
    error: str | None = None      # finish_reason "error": why the step failed this request
    # SamplingParams.prompt_logprob_positions: position -> logprob of the prompt's token there, in the request's
    # first output (a position the prefill never computed, e.g. after a preemption, is absent)
    prompt_logprobs: dict[int, float] | None = None
    # SamplingParams.prompt_logprobs: position -> the top-n (token id, logprob) of the distribution there, likewise
    prompt_top_logprobs: dict[int, list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    ttft_s: float = 0.0        # arrival -> first token
    decode_s: float = 0.0      # first token -> finish
    logprobs: list = field(default_factory=list)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None, vocab_size: int,
                     max_model_len: int, kv_slots: int) -> None:
    """The request checks of `LLMEngine.validate`, on plain values, so a client of an engine core in another process
    (engine/core_client.py) refuses bad input before it crosses."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidRequestError(f"cache_salt must be a string, got {type(cache_salt).__name__}",
                                  param="cache_salt")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}", param="params")
    params.validate()
    if not prompt_token_ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids):
        raise InvalidRequestError(f"prompt has token ids outside [0, {vocab_size})", param="prompt")
    n = len(prompt_token_ids)
    if any(pos >= n for pos in params.prompt_logprob_positions or ()):
        raise InvalidRequestError(f"prompt_logprob_positions must be below the prompt's {n} tokens",
                                  param="prompt_logprob_positions")
    if n + 1 > max_model_len:
        raise PromptTooLongError(f"prompt has {n} tokens; the model context is {max_model_len} "
                                 f"(including at least one output token)", param="prompt")
    if n + 1 > kv_slots:
        raise PromptTooLongError(f"prompt has {n} tokens but the whole KV cache holds {kv_slots}; "
                                 f"raise --kv-cache-memory", param="prompt")


class LLMEngine:
    def __init__(self, **engine_args):
        args = EngineArgs.from_kwargs(**engine_args)
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        if args.attention_backend:
            kernels.set_backend(args.attention_backend)
        self.model_dir = resolve_model_dir(args.model)
        self.model_name = args.model or "SmolLM2-135M-Instruct"
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        q4_gguf = gguf_source(args.model) if args.quantization == "gguf" else None
        self.runner = ModelRunner(self.model_dir, args.dtype, args.device, args.page_size, args.kv_cache_memory,
                                  q4_gguf)
        cfg = self.runner.config
        self.max_model_len = min(args.max_model_len or cfg.get("max_position_embeddings", 2048),
                                 cfg.get("max_position_embeddings", 1 << 30))
        self.vocab_size = cfg["vocab_size"]
        if not args.enforce_eager:
            self.runner.enable_decode_graphs(args.max_num_seqs, self.max_model_len)
        eos = cfg.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        num_pages = self.runner.num_pages
        self.block_manager = BlockManager(num_pages, args.block_size, args.page_size, args.enable_prefix_caching,
                                          max_pinned_pages=int(num_pages * args.pinned_blocks_fraction))
        self.step_budget = StepBudget(args.max_num_batched_tokens, args.max_itl_ms)
        self.scheduler = Scheduler(self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.long_prefill_token_threshold, self.step_budget,
                                   args.share_inflight_prefixes)
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler(self.sampler)
        spec = args.speculative_config
        self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) \
            if spec is not None else None
        self.spec_num_drafts = 0               # verifications: (request, step) pairs that carried drafts
        self.spec_num_draft_tokens = 0         # draft tokens verified
        self.spec_num_accepted_tokens = 0      # of which the target model accepted
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                                  max_threads=max(1, min(2, torch.get_num_threads())))
        self.requests: dict[str, Request] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.generated_tokens_total = 0
        self.prompt_tokens_total = 0
        self.peak_kv_waste = (0, 0)            # (allocated slots, stored tokens) at the step with most allocated slots
        self._ids = itertools.count()
        self.last_step: SchedulerOutput | None = None     # what the last step scheduled (stats and tests)
        self.fault_injection: dict[str, str] = {}         # request id -> phase; tests only (inject_fault)

    # ---- requests -----------------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None) -> None:
        """Everything a step will touch of this request, checked before it is queued, so that bad input fails the
        request here and never reaches a step."""
        validate_request(prompt_token_ids, params, cache_salt, self.vocab_size, self.max_model_len,
                         self.block_manager.num_slots)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None, session_id: str | None = None) -> str:
        prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params, cache_salt)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        req = Request(request_id, prompt_ids, params, priority=priority, cache_salt=cache_salt, session_id=session_id)
        req.stop_token_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                                 else frozenset(self.eos_token_ids))
        if params.structured_outputs is not None:   # compile errors raise here, before the request is queued
            self.structured.add(request_id, params.structured_outputs)
        self.requests[request_id] = req
        self.detoks[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                                         min_tokens=params.min_tokens)
        self.scheduler.add(req)
        self.prompt_tokens_total += len(prompt_ids)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return self._output(req, [], "", None)

    def release_session(self, session_id: str) -> None:
        self.block_manager.unpin(session_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. A fault is isolated to the request(s) that cause it (see `_forward`, `_sample` and the output
        loop): they finish with finish_reason "error" and the rest of the batch goes on. A fault that cannot be pinned
        on a request raises `EngineStepError`."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for req in sched.preempted:            # requests the pool can no longer hold at all
            if req.status.finished:
                self._finish(req, req.status)
                outputs.append(self._output(req, [], self.detoks[req.request_id].flush(), None))
        if not sched.scheduled:
            return outputs
        self.num_steps += 1
        self.last_step = sched
        self._track_waste()
        scheduled, logits, rows = self._forward(sched.scheduled, outputs)
        for s in scheduled:   # drafts count as computed only once accepted (_accept_tokens)
            s.request.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
        sampled = [scheduled[i] for i in rows]
        tokens, logprobs = self._sample(logits, sampled, outputs)
        now = time.monotonic()
        for s in scheduled:
            if not s.request.status.finished:
                self.block_manager.cache_full_blocks(s.request)
        for j, s in enumerate(sampled):
            req = s.request
            if req.status.finished:              # failed in sampling
                continue
            if s.spec_token_ids:
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += len(s.spec_token_ids)
                self.spec_num_accepted_tokens += len(tokens[j]) - 1
                req.num_spec_allowed = next_num_drafts(req.num_spec_allowed or self.proposer.num_speculative_tokens,
                                                       len(s.spec_token_ids), len(tokens[j]) - 1,
                                                       self.proposer.num_speculative_tokens)
            try:
                self._inject("output", [req])
                outputs.append(self._accept_tokens(req, tokens[j], logprobs[j] if logprobs else None, now,
                                                   bool(s.spec_token_ids)))
            except Exception as e:               # its detokenizer, stop strings or grammar: its own fault
                outputs.append(self._fail(req, "output", e))
        if self.proposer is not None:
            self._propose(s.request for s in sampled)
        self.step_budget.observe(sched.num_batched_tokens, time.perf_counter() - t0,
                                 carried_prefill=sched.num_batched_tokens > sched.num_decodes + sched.num_spec_tokens)
        return outputs

    def _accept_tokens(self, req: Request, toks: list[int], logprobs: list | None, now: float,
                       verified_drafts: bool) -> RequestOutput:
        """Append the step's tokens one by one (one, or the accepted drafts and the token after them), each through
        the stop checks, so EOS, max_tokens, a stop string or the grammar's end inside an accepted run ends the
        request exactly where plain decoding would, and the tokens after it are dropped."""
        detok = self.detoks[req.request_id]
        if req.first_token_time is None:
            req.first_token_time = now
        delta = ""
        status = None
        new: list[int] = []
        for tok in toks:
            req.token_ids.append(tok)
            new.append(tok)
            self.generated_tokens_total += 1
            status = self._check_stop(req, tok)
            if req.params.structured_outputs is not None and self.structured.accept(req.request_id, tok) \
                    and status is None:
                status = RequestStatus.FINISHED_STOPPED    # the grammar is complete (its stop token was accepted)
                req.stop_reason = tok
            delta += "" if status == RequestStatus.FINISHED_STOPPED else detok.add(tok)   # a stop token has no text
            if detok.stopped_by is not None:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = detok.stopped_by
            if status is not None:
                break
        if verified_drafts:
            # the KV of every appended token but the last was computed in this step (they were drafts or the token
            # before them); the slots of rejected drafts go back to the pool
            req.num_computed_tokens += len(new) - 1
            if status is None:
                self.block_manager.trim(req, req.num_tokens)
            self.block_manager.cache_full_blocks(req)
        if status is not None:
            delta += detok.flush()
            self._finish(req, status)
        if logprobs is not None and logprobs[0] is None:   # this request did not ask for them
            logprobs = None
        return self._output(req, new, delta, logprobs[:len(new)] if logprobs is not None else None)

    def _propose(self, reqs) -> None:
        """Drafts for each request that just sampled and decodes next: never for grammar-constrained requests (their
        drafts would need the grammar's mask at every draft position), and never past max_tokens or the context."""
        for req in reqs:
            req.spec_token_ids = []
            if req.status.finished or req.params.structured_outputs is not None \
                    or req.num_tokens - req.num_computed_tokens != 1:
                continue
            room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens,
                       (req.num_spec_allowed or self.proposer.num_speculative_tokens) + 1) - 1
            if room > 0:
                req.spec_token_ids = self.proposer.propose(req.token_ids, room)

    # ---- fault isolation ----------------------------------------------------------------------------------------
    def _forward(self, batch: list[ScheduledRequest], outputs: list[RequestOutput]
                 ) -> tuple[list[ScheduledRequest], torch.Tensor, list[int]]:
        """Run the batch; if the forward raises, bisect it to find the requests that fail even alone, fail those,
        and return the survivors' logits. Re-running is sound because a forward only writes the KV of the batch's
        new positions (each request's own pages past its computed tokens, never a cached block) and num_computed_tokens
        advances only after it returns, so a rerun rewrites the same slots. If no request of the step succeeds, the
        fault is the engine's, not a request's: EngineStepError."""
        try:
            self._inject("forward", [s.request for s in batch])
            logits, rows = self.runner.execute(batch)
            return batch, logits, rows
        except Exception as e:
            first_error = e
        done: list[tuple[list[ScheduledRequest], torch.Tensor, list[int]]] = []
        culprits: list[tuple[Request, BaseException]] = []

        def bisect(part: list[ScheduledRequest]) -> None:
            try:
                self._inject("forward", [s.request for s in part])
                logits, rows = self.runner.execute(part)
                done.append((part, logits, rows))
            except Exception as e:
                if len(part) == 1:
                    culprits.append((part[0].request, e))
                else:
                    bisect(part[:len(part) // 2])
                    bisect(part[len(part) // 2:])

        if len(batch) > 1:
            bisect(batch[:len(batch) // 2])
            bisect(batch[len(batch) // 2:])
        if not done:
            raise EngineStepError(f"engine step failed for every request in it: {first_error!r}") from first_error
        for req, e in culprits:
            outputs.append(self._fail(req, "forward", e))
        scheduled: list[ScheduledRequest] = []
        rows: list[int] = []
        parts = []
        for part, logits, part_rows in done:
            rows.extend(len(scheduled) + i for i in part_rows)
            scheduled.extend(part)
            if part_rows:
                parts.append(logits)
        logits = torch.cat(parts) if parts else torch.empty(0, self.vocab_size)
        return scheduled, logits, rows

    def _sample(self, logits: torch.Tensor, sampled: list[ScheduledRequest], outputs: list[RequestOutput]
                ) -> tuple[list[list[int]], list | None]:
        """Sample the batch (and verify its drafts: engine/rejection_sampler.py); per request, the tokens it emits. If
        that raises, sample each request alone (with the random generators rewound to where the batch started, so
        seeded rows draw what they would have drawn) and fail the requests that raise alone. A failure here is always
        the request's own (its sampling settings or grammar): the forward already succeeded. Failed requests get no
        tokens and are skipped by the caller (their status is finished)."""
        if not sampled:
            return [], None
        reqs = [s.request for s in sampled]
        drafts = [s.spec_token_ids for s in sampled]
        gens = {id(g): g for g in (r.generator or self.sampler.generator for r in reqs if not r.params.greedy)}
        states = {k: g.get_state() for k, g in gens.items()}
        try:
            self._inject("sample", reqs)
            return self.rejection_sampler(logits, reqs, drafts, self._grammar_mask(reqs, drafts))
        except Exception:
            for k, g in gens.items():
                g.set_state(states[k])
        tokens: list[list[int]] = []
        logprobs: list = []
        start = 0
        for req, ds in zip(reqs, drafts):
            rows = logits[start:start + len(ds) + 1]
            start += len(ds) + 1
            try:
                self._inject("sample", [req])
                tok, lp = self.rejection_sampler(rows, [req], [ds], self._grammar_mask([req], [ds]))
                tokens.append(tok[0])
                logprobs.append(lp[0] if lp else None)
            except Exception as e:
                outputs.append(self._fail(req, "sampling", e))
                tokens.append([])
                logprobs.append(None)
        return tokens, logprobs if any(lp is not None for lp in logprobs) else None

    def _grammar_mask(self, reqs: list[Request], drafts: list[list[int]]):
        if not self.structured.num_active:      # unconstrained batches skip the grammar entirely
            return None
        ids = [r.request_id for r, ds in zip(reqs, drafts) for _ in range(len(ds) + 1)]   # one per logits row
        return lambda lg: self.structured.mask_logits(lg, ids)

    def _fail(self, req: Request, phase: str, exc: BaseException) -> RequestOutput:
        log.warning("request %s failed in the engine step (%s), the others go on: %r", req.request_id, phase, exc)
        req.stop_reason = f"engine step failed on this request ({phase}): {exc!r}"
        self._finish(req, RequestStatus.FINISHED_ERROR)
        out = self._output(req, [], "", None)
        out.error = req.stop_reason
        return out

    def inject_fault(self, request_id: str, phase: str) -> None:
        """FAULT INJECTION, for tests only: from now on, any `phase` ("forward", "sample" or "output") of a step whose
        batch holds `request_id` raises InjectedFault, exactly as a bug triggered by that request's data would. It
        exercises the isolation above end to end (scheduler, model, sampler untouched); nothing in the product calls
        it."""
        if phase not in ("forward", "sample", "output"):
            raise ValueError(f"unknown phase {phase!r}")
        self.fault_injection[request_id] = phase

    def _inject(self, phase: str, reqs: list[Request]) -> None:
        if self.fault_injection:
            for r in reqs:
                if self.fault_injection.get(r.request_id) == phase:
                    raise InjectedFault(f"injected {phase} fault for request {r.request_id}")

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        if tok in req.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.finish_time = time.monotonic()
        if req.session_id is not None and status not in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            self.block_manager.pin(req.session_id, req)
        self.scheduler.finish(req, status)
        self.structured.remove(req.request_id)
        self.requests.pop(req.request_id, None)

    def _output(self, req: Request, new_ids: list[int], delta: str, logprobs: list | None) -> RequestOutput:
        """`logprobs`: one (logprob, top-n) entry per token of new_ids, or None."""
        finished = req.status.finished
        if finished:
            self.detoks.pop(req.request_id, None)
        out = RequestOutput(req.request_id, new_ids, delta, finished, req.status.value if finished else None,
                            req.num_prompt_tokens, max(req.num_cached_tokens, 0), req.num_output_tokens,
                            logprobs)
        if req.params.prompt_logprob_positions and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True
            out.prompt_logprobs = dict(req.prompt_logprobs)
            if req.params.prompt_logprobs:
                out.prompt_top_logprobs = dict(req.prompt_top_logprobs)
        return out

    def _track_waste(self) -> None:
        running = self.scheduler.running
        allocated = sum(len(r.block_table) for r in running) * self.block_manager.page_size
        if allocated > self.peak_kv_waste[0]:
            # tokens whose KV will be stored once this step runs
            stored = sum(min(r.num_tokens, len(r.block_table) * self.block_manager.page_size) for r in running)
            self.peak_kv_waste = (allocated, stored)

    def stats(self) -> dict:
        s = self.block_manager.stats()
        s.update(requests_running=len(self.scheduler.running), requests_waiting=self.scheduler.num_waiting,
                 generated_tokens_total=self.generated_tokens_total, prompt_tokens_total=self.prompt_tokens_total,
                 num_steps=self.num_steps, num_preemptions=self.scheduler.num_preemptions,
                 inflight_prefix_waits=self.scheduler.num_deferred_admissions,
                 structured_requests=self.structured.num_active,
                 structured_mask_steps=self.structured.mask_steps,
                 structured_mask_s=self.structured.mask_seconds,
                 spec_decode_num_drafts=self.spec_num_drafts,
                 spec_decode_num_draft_tokens=self.spec_num_draft_tokens,
                 spec_decode_num_accepted_tokens=self.spec_num_accepted_tokens,
                 spec_decode_acceptance_rate=(self.spec_num_accepted_tokens / self.spec_num_draft_tokens
                                              if self.spec_num_draft_tokens else 0.0),

                 # the calling thread's (AsyncEngine: the engine thread's): what its steps run on, whatever was asked
                 intra_op_threads=torch.get_num_threads())
        return s


class LLM:
    """Offline batch generation: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(model=model, **engine_args)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None, use_tqdm: bool = False) -> list[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("need one SamplingParams per prompt", param="params")
        results: dict[str, CompletionOutput] = {}
        order = []
        arrival = {}
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            rid = self.engine.add_request(p, sp, priority=priority[i] if priority else 0)
            req = self.engine.requests[rid]
            results[rid] = CompletionOutput(rid, list(req.prompt_token_ids))
            arrival[rid] = req
            order.append(rid)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.text += out.text_delta
                if out.logprobs:
                    res.logprobs.extend(out.logprobs)
                if out.finished:
                    req = arrival[out.request_id]
                    res.finish_reason = out.finish_reason
                    res.num_cached_tokens = out.num_cached_tokens
                    first = req.first_token_time or req.finish_time
                    res.ttft_s = first - req.arrival_time
                    res.decode_s = req.finish_time - first
        return [results[r] for r in order]
