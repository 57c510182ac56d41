"""Verifying draft tokens: which of a request's k drafts the target model accepts, and the token after them.

A request with drafts d_0..d_{k-1} is verified in one forward pass (k + 1 query positions), giving k + 1 rows of logits:
row i is the target model's distribution p_i for the position after the context + d_0..d_{i-1}. The rule, as in vLLM's
rejection sampler with n-gram drafts (a draft's probability under the proposer is 1):

- greedy: accept d_i while it is the argmax of row i; the first row that disagrees gives its argmax, and when all k
  agree row k gives a bonus token. The output is token for token what plain greedy decoding gives.
- temperature > 0: accept d_i with probability p_i(d_i); on rejection, draw from p_i with d_i removed and renormalized;
  when all k are accepted, draw the bonus token from p_k.

With a draft probability of 1 the second rule is exactly "draw x_i ~ p_i; accept d_i when x_i == d_i, else emit x_i":
P(x_i == d_i) = p_i(d_i), and given x_i != d_i, x_i is distributed as p_i without d_i, renormalized. So every row goes
through the engine's own `Sampler` (penalties, the grammar mask, temperature, top-k / top-p / min-p, logprobs, the
request's seeded generator: whatever the sampler applies applies here), and row i sees the context extended by the drafts
before it, so the penalties count them as plain decoding would once they are accepted.

Seeded requests: each output token uses one uniform number from the request's generator in plain decoding. Row i draws
the i-th number after the step's start, and afterwards the generator is rewound and advanced by exactly the number of
tokens emitted, so the token at each position is drawn with the same number as without speculation, and a seeded
request gives the same tokens with or without drafts (up to rounding differences in the logits).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from engine.request import Request
from engine.sampler import Sampler


def expand_rows(requests: list[Request], drafts: list[list[int]]) -> list[Request]:
    """One sampling row per position to verify: request r with d drafts has d + 1 rows, and row i sees r's tokens
    followed by drafts[:i] (a shallow copy of the request with a longer token list; the generator is shared)."""
    rows: list[Request] = []
    for req, ds in zip(requests, drafts):
        rows.append(req)
        for i in range(1, len(ds) + 1):
            view = copy.copy(req)
            view.token_ids = req.token_ids + ds[:i]
            rows.append(view)
    return rows


def accepted_tokens(drafts: list[int], row_tokens: list[int]) -> list[int]:
    """The tokens a request emits in this step: its drafts up to the first one its row's sample disagrees with, then
    that row's sample (the recovered token), or all drafts and the bonus token from the last row."""
    out: list[int] = []
    for d, x in zip(drafts, row_tokens):
        out.append(x)
        if x != d:
            return out
    out.append(row_tokens[len(drafts)])
    return out


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                 grammar_mask: Callable[[torch.Tensor], None] | None = None
                 ) -> tuple[list[list[int]], list[list] | None]:
        """`logits` holds len(drafts[j]) + 1 consecutive rows per request j. Returns, per request, the tokens it emits
        (1 to len(drafts[j]) + 1 of them) and, when any request asked for logprobs, their (logprob, top-n) entries."""
        rows = expand_rows(requests, drafts)
        seeded = {j: r.generator.get_state() for j, (r, ds) in enumerate(zip(requests, drafts))
                  if ds and r.generator is not None and not r.params.greedy}
        row_tokens, row_logprobs = self.sampler(logits, rows, grammar_mask)
        tokens: list[list[int]] = []
        logprobs: list[list] | None = [] if row_logprobs is not None else None
        start = 0
        for ds in drafts:
            out = accepted_tokens(ds, row_tokens[start:start + len(ds) + 1])
            tokens.append(out)
            if logprobs is not None:
                logprobs.append(row_logprobs[start:start + len(out)])
            start += len(ds) + 1
        for j, state in seeded.items():
            gen = requests[j].generator
            gen.set_state(state)
            for _ in tokens[j]:    # one number per emitted token, as plain decoding draws (sampler.uniforms)
                torch.rand(1, generator=gen)
        return tokens, logprobs
