"""Batched sampling with per-request settings.

Logits arrive as one fp32 [B, vocab] tensor. Penalties are applied per row (only rows that ask for them), then temperature;
top-k, top-p and min-p keep a subset of each row (found among its largest logits when they hold it, by a sort otherwise),
and each row draws one uniform number from its own generator when it has a seed, so a seeded request gives the same tokens
whatever else shares its batch (and after a preemption).
"""
from __future__ import annotations

from typing import Callable

import torch

import kernels
from engine.request import Request


def apply_penalties(logits: torch.Tensor, req: Request) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        out = req.output_token_ids
        if out:
            ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
            logits[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


def mask_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """min_tokens (vLLM's MinTokensLogitsProcessor): a row whose request has fewer output tokens than its min_tokens
    cannot draw EOS or its stop_token_ids. A grammar that allows nothing but a stop token (its output is complete)
    wins: that row is left as it was, so the output ends rather than drawing a token the grammar forbids."""
    for row, r in enumerate(requests):
        if r.num_output_tokens >= r.params.min_tokens or not r.stop_token_ids:
            continue
        ids = torch.tensor(sorted(t for t in r.stop_token_ids if t < logits.shape[1]), dtype=torch.long)
        kept = logits[row, ids].clone()
        logits[row, ids] = float("-inf")
        if torch.isneginf(logits[row]).all():
            logits[row, ids] = kept


# top-k / top-p / min-p look at this many of a row's largest logits first; a row whose kept set lies inside them (its
# top-k is no wider, or these candidates already hold its top-p mass) is settled without sorting the whole vocabulary
TOP_CANDIDATES = 128


def _candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor):
    """Each row's `TOP_CANDIDATES` largest logits and which of them its top-k / top-p / min-p keep.

    Returns (vals, idx, drop, settled, probs, k): the candidates in descending order, the ones dropped, and whether a
    row is settled on them (its top-k is no wider, or they already hold its top-p mass, so every token after them has
    at least that mass before it, which top-p drops); `probs` are the candidates' probabilities under the row's
    distribution renormalised over its top-k, `k` each row's top-k (the vocabulary size when off)."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    n = min(TOP_CANDIDATES, vocab)
    vals, idx, row_lse = kernels.top_candidates(logits, n)  # descending, like the sort's first n
    narrow = k <= n
    # the softmax normaliser over each row's top-k: its candidates' when k <= n, else the whole row's (k = vocab)
    kept = torch.arange(n).unsqueeze(0) < k.unsqueeze(1)
    norm = torch.where(narrow, vals.masked_fill(~kept, float("-inf")).logsumexp(-1), row_lse)
    probs = (vals - norm.unsqueeze(1)).exp().masked_fill(~kept, 0.0)
    settled = narrow | ((k == vocab) & (probs.sum(-1) >= top_p))
    drop = ~kept | ((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)) | (probs < min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    return vals, idx, drop, settled, probs, k


def top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens each row's top-k / top-p / min-p would drop. top_k <= 0 means off.

    The masks are those of a sort of the whole row (`_masks_by_sort`): top-k first, then top-p and min-p on the
    distribution renormalised over the top-k. A full sort per row and step costs far more than the rest of sampling,
    so each row's `TOP_CANDIDATES` largest logits come first (`_candidates`), and only the rows they do not settle
    (a flat distribution with top-p near 1, or a wide top-k) are sorted; each row's outcome depends on that row alone,
    so a seeded request samples the same whatever shares its batch."""
    vals, idx, drop, settled, _, k = _candidates(logits, top_k, top_p, min_p)
    out = torch.full_like(logits, float("-inf")).scatter_(1, idx, vals.masked_fill(drop, float("-inf")))
    rest = (~settled).nonzero().squeeze(1)
    if len(rest):
        out[rest] = _masks_by_sort(logits[rest], k[rest], top_p[rest], min_p[rest])
    return out


def sample_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                             uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn as `invert_cdf(top_k_top_p_min_p(logits, ...), uniforms)` draws it, without building
    the masked rows when it can.

    A settled row's kept tokens all lie among its candidates, so its CDF over the whole vocabulary (in vocabulary
    order, zero steps where masked) is the CDF over its kept candidates put in vocabulary order: the same uniform picks
    the same token from a few hundred numbers instead of a softmax and cumsum over the vocabulary. Rows that are not
    settled go through the masks and the full CDF."""
    _, idx, drop, settled, probs, _ = _candidates(logits, top_k, top_p, min_p)
    order = idx.argsort(-1)  # the candidates in vocabulary order
    cdf = probs.masked_fill(drop, 0.0).gather(1, order).cumsum_(-1)
    pick = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True).clamp_(max=idx.shape[1] - 1)
    tokens = idx.gather(1, order.gather(1, pick)).squeeze(1)
    rest = (~settled).nonzero().squeeze(1)
    if len(rest):
        tokens[rest] = invert_cdf(top_k_top_p_min_p(logits[rest], top_k[rest], top_p[rest], min_p[rest]),
                                  uniforms[rest])
    return tokens


def _masks_by_sort(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`top_k_top_p_min_p` by a sort of each whole row (`k`: each row's top-k, the vocabulary size when off)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    drop = torch.arange(logits.shape[-1]).unsqueeze(0) >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p is kept)
    cum_before = probs.cumsum(-1) - probs
    drop |= cum_before >= top_p.unsqueeze(1)
    # min-p: drop tokens below min_p * p(max)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


def uniforms(generators: list[torch.Generator]) -> torch.Tensor:
    """One uniform number in [0, 1) per row, from that row's generator, in row order: every draw of a step takes
    exactly these, so a seeded request's n-th token always uses its generator's n-th number."""
    return torch.cat([torch.rand(1, generator=g) for g in generators])


def invert_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab] (already tempered and masked), drawn from softmax(logits) by
    inverting its CDF (in vocabulary order) at that row's uniform number `u`.

    Why not torch.multinomial: for one sample it draws an exponential variate per vocabulary entry (the Gumbel trick),
    a random number for every entry of every row; the CDF takes one random number and one cumsum a row. A token whose
    probability is 0 (masked) is never drawn: its CDF step is flat."""
    cdf = logits.softmax(-1).cumsum_(-1)
    return torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)


class Sampler:
    def __init__(self):
        self.generator = torch.Generator().manual_seed(torch.seed() % (2**63))

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 grammar_mask: Callable[[torch.Tensor], None] | None = None) -> tuple[list[int], list | None]:
        """Returns one token per row, and per row (token logprob, top-n list) when any request asked for logprobs.
        `grammar_mask` masks, in place, the tokens each constrained row's grammar forbids (after penalties, before
        greedy or random choice); logprobs stay those of the raw model distribution."""
        raw = logits
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = raw.log_softmax(-1) if want_logprobs else None
        penalties = any(r.params.needs_penalties for r in requests)
        min_tokens = any(r.num_output_tokens < r.params.min_tokens for r in requests)
        logits = logits.clone() if penalties or min_tokens else logits
        if penalties:
            for row, r in enumerate(requests):
                if r.params.needs_penalties:
                    apply_penalties(logits[row], r)
        if grammar_mask is not None:
            grammar_mask(logits)
        if min_tokens:
            mask_stop_tokens(logits, requests)
        tokens = kernels.argmax(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            sub = logits[rows] / torch.tensor([requests[i].params.temperature for i in random_rows]).unsqueeze(1)
            ps = [requests[i].params for i in random_rows]
            u = uniforms([requests[i].generator or self.generator for i in random_rows])
            if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in ps):
                tokens[rows] = sample_top_k_top_p_min_p(sub, torch.tensor([p.top_k for p in ps]),
                                                        torch.tensor([p.top_p for p in ps]),
                                                        torch.tensor([p.min_p for p in ps]), u)
            else:
                tokens[rows] = invert_cdf(sub, u)
        token_list = tokens.tolist()
        lp_out = None
        if want_logprobs:
            lp_out = []
            for row, r in enumerate(requests):
                n = r.params.logprobs
                if n is None:
                    lp_out.append(None)
                    continue
                top = logprobs[row].topk(n) if n > 0 else None
                lp_out.append((float(logprobs[row, token_list[row]]),
                               list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []))
        return token_list, lp_out
