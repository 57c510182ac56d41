"""Draft tokens by prompt lookup (vLLM's `ngram` speculative method): no draft model, only the request's own tokens.

If the last n tokens of the context (prompt + output so far) occurred earlier in it, the tokens that followed that
earlier occurrence are a guess at what comes next. This hits when a reply quotes its prompt (extraction, editing,
"repeat after me", code with repeated identifiers) and costs almost nothing when it misses: no draft, a plain decode.

As vLLM does: the longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins, and for that n the earliest
occurrence, whose continuation is the longest stretch of context that can follow it.

How many drafts a request gets adapts to how its drafts fared, with HF transformers' "heuristic" schedule for
assisted generation: +2 after a verification that accepted every draft, -1 (down to 1) after one that rejected some.
Why: a verified draft costs a query row whether it is accepted or not, and where the text stops repeating the prompt
most drafts are rejected; there a request falls back to one draft per step, which costs least, and climbs back to k
as soon as the drafts hit again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class NgramProposer:
    num_speculative_tokens: int   # k: the most drafts proposed for one request
    prompt_lookup_min: int
    prompt_lookup_max: int

    def propose(self, token_ids: list[int] | np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) tokens that followed the earliest earlier occurrence of the longest matching
        suffix n-gram, or [] when no suffix of length >= prompt_lookup_min occurred before."""
        k = self.num_speculative_tokens if max_drafts is None else min(self.num_speculative_tokens, max_drafts)
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        if k <= 0 or total <= self.prompt_lookup_min:
            return []
        # candidate starts: every earlier position whose token equals the context's last token is where an n-gram
        # match ends, so one comparison over the context narrows the search before the longer n-grams are checked
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(ends) == 0:
            return []
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            starts = ends[ends >= n - 1] - (n - 1)      # the n-gram tokens[s:s + n] ends at one of `ends`
            if len(starts) == 0:
                continue
            suffix = tokens[total - n:]
            match = np.ones(len(starts), dtype=bool)
            for j in range(n - 1):                      # the last token matches by construction
                match &= tokens[starts + j] == suffix[j]
            hits = starts[match]
            if len(hits):
                first = int(hits[0]) + n                # the earliest occurrence's continuation
                return tokens[first:first + k].tolist()
        return []


def next_num_drafts(allowed: int, num_drafts: int, num_accepted: int, k: int) -> int:
    """The draft allowance after a verification of `num_drafts` drafts of which `num_accepted` were accepted."""
    return min(k, allowed + 2) if num_accepted == num_drafts else max(1, allowed - 1)
