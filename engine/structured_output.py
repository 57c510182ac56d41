"""Grammar-constrained decoding (JSON schema, regex, choice, EBNF, structural tag) on xgrammar, batched.

Three pieces, as in vLLM v1:
- `compile()`: a `StructuredOutputsParams` -> xgrammar `CompiledGrammar`, cached by (kind, spec). The compiler is built
  once per tokenizer (on first use, so engines that never see a constrained request never pay for it). It is
  thread-safe, so the async front end compiles off the engine thread and the engine's own `add()` hits the cache.
- a `GrammarMatcher` per constrained request, created at admission and dropped when the request finishes or is aborted.
  Preemption recomputes the KV of the tokens the request already has and keeps them, so the matcher, which has accepted
  exactly those output tokens, stays valid as is.
- `mask_logits()`: for the sampling rows that carry a matcher, fill one shared token bitmask and apply it to the logits
  in place before sampling; `accept()` then advances each matcher by its sampled token. A batch without constrained rows
  never reaches this module (the engine checks `num_active` first).

JSON schemas (and json_object, as the schema {"type": "object"}, and the JSON-schema parts of a structural tag) compile
with `any_whitespace=False`: the separators are fixed (", " and ": "), because with free whitespace a small model at
temperature 1 can fill its whole budget with newlines inside an otherwise valid object.
"""
from __future__ import annotations

import json
import threading
import time

import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputsParams

_BIT = torch.arange(32, dtype=torch.int32)


@torch.inference_mode()   # the runner's logits are inference tensors
def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` whose token bit is 0 in that row of xgrammar's packed bitmask (bit j
    of int32 word w is token 32 * w + j).

    xgrammar's CPU kernel skips all-allowed words, so it is the fast one for masks that allow most of the vocabulary
    (inside a JSON string), but it writes -inf one token at a time, several times slower than unpacking the bits with
    torch ops and one masked_fill_ when a mask allows few tokens (keys, numbers, enums). Pick by the share of
    all-allowed words."""
    n, vocab = len(rows), logits.shape[1]
    whole = n == logits.shape[0] and rows[-1] == n - 1
    idx = None if whole else torch.tensor(rows)
    bits = bitmask[:n] if whole else bitmask[idx]
    if (bits == -1).sum().item() * 2 > bits.numel():
        xgr.apply_token_bitmask_inplace(logits, bitmask[:logits.shape[0]], indices=rows, backend="cpu")
        return
    banned = ((bits.unsqueeze(-1) >> _BIT) & 1).view(n, -1)[:, :vocab] == 0
    if whole:
        logits.masked_fill_(banned, float("-inf"))
    else:
        logits[idx] = logits[idx].masked_fill_(banned, float("-inf"))


def grammar_key(so: StructuredOutputsParams) -> tuple[str, str]:
    kind = so.kind
    if kind == "structural_tag":   # key order kept: the tag's JSON schemas generate properties in their own order
        tag = so.structural_tag
        return kind, tag if isinstance(tag, str) else json.dumps(tag, separators=(",", ":"))
    if kind == "json":
        # key order kept: xgrammar generates properties in the schema's order (as OpenAI's strict mode does)
        spec = so.json if isinstance(so.json, str) else json.dumps(so.json, separators=(",", ":"))
    elif kind == "choice":
        spec = json.dumps(so.choice, ensure_ascii=False)
    elif kind == "json_object":
        spec = ""
    else:
        spec = getattr(so, kind)
    return kind, spec


def choice_grammar(choices: list[str]) -> str:
    # an EBNF string literal takes JSON's escapes (\" \\ \n \uXXXX), so json.dumps quotes each choice exactly
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _fixed_separators(node):
    """A structural tag with each JSON-schema content replaced by its grammar with fixed separators, the same policy as
    the json kind (xgrammar's structural tags otherwise let whitespace run free inside the JSON)."""
    if isinstance(node, list):
        return [_fixed_separators(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" and "json_schema" in node:
        schema = node["json_schema"]
        grammar = xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                               any_whitespace=False)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _fixed_separators(v) for k, v in node.items()}


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size          # the logits' width, which may exceed the tokenizer's vocabulary
        self._stop_token_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()          # compile() runs on worker threads as well as the engine thread
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None
        self.mask_seconds = 0.0                # time spent filling + applying masks (stats: structured_mask_s)
        self.mask_steps = 0                    # steps that had at least one constrained sampling row

    @property
    def num_active(self) -> int:
        return len(self.matchers)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def compile(self, so: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache); a spec xgrammar rejects raises InvalidRequestError naming the field."""
        key = grammar_key(so)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        compiler = self._get_compiler()
        kind, spec = key
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(spec, any_whitespace=False)
            elif kind == "json_object":
                # any object, with the same fixed separators (the builtin JSON grammar allows free whitespace)
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                        strict_mode=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(json.dumps(_fixed_separators(json.loads(spec))))
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(so.choice))
            else:
                compiled = compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = str(e).strip().splitlines()
            reason = reason[-1] if reason else type(e).__name__
            # xgrammar prefixes "[hh:mm:ss] /path/file.cc:line: "; keep the message itself
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
            raise InvalidRequestError(f"invalid structured_outputs.{kind}: {reason}",
                                      param=f"structured_outputs.{kind}") from None
        with self._lock:
            self._cache[key] = compiled
        return compiled

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    # ---- per request ------------------------------------------------------------------------------------------------
    def add(self, request_id: str, so: StructuredOutputsParams) -> None:
        self.matchers[request_id] = xgr.GrammarMatcher(self.compile(so))

    def remove(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def mask_logits(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Row j of `logits` belongs to request_ids[j]; mask, in place, the rows whose request has a matcher."""
        t0 = time.perf_counter()
        rows = []
        n = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), self._vocab_size)
        for j, rid in enumerate(request_ids):
            m = self.matchers.get(rid)
            if m is not None and not m.is_terminated():
                m.fill_next_token_bitmask(self._bitmask, j)
                rows.append(j)
        if rows:
            apply_bitmask(logits, self._bitmask, rows)
            self.mask_steps += 1
        self.mask_seconds += time.perf_counter() - t0

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher; True when the grammar is finished (its stop token was accepted) or the token
        is not one it allows (only a stop token from outside the grammar's mask, e.g. `stop_token_ids`, can be)."""
        m = self.matchers.get(request_id)
        if m is None:
            return False
        t0 = time.perf_counter()
        ok = m.accept_token(token)
        self.mask_seconds += time.perf_counter() - t0
        return not ok or m.is_terminated()
