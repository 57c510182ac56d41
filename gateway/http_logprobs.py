"""Engine logprobs -> OpenAI's shapes: chat's `logprobs.content` entries and the legacy completions object; and
Whisper's transcript tokens -> a transcription's `logprobs` (HTTP `include[]=logprobs`, Realtime's `include`).

The engine gives, per output token, (the chosen token's logprob, [(token id, logprob)] of the top n) from the model's
raw distribution (engine/sampler.py). A token's text is that token decoded alone, as vLLM reports it (a byte-level
piece of a multi-byte character decodes to U+FFFD; its `bytes` are those of the decoded text).
"""
from __future__ import annotations

import functools

LOGPROB_FLOOR = -9999.0   # vLLM's floor: JSON has no -inf


@functools.lru_cache(maxsize=1 << 16)
def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _lp(v: float) -> float:
    return max(v, LOGPROB_FLOOR)


def chat_entries(tokenizer, token_ids: list[int], logprobs: list[tuple]) -> list[dict]:
    """`choices[i].logprobs.content` for these tokens (openai.types.chat.ChatCompletionTokenLogprob)."""
    def entry(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    return [{**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in top]}
            for tid, (lp, top) in zip(token_ids, logprobs)]


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[tuple], offset: int) -> tuple[dict, int]:
    """The completions `logprobs` object (openai.types.completion_choice.Logprobs) for these tokens, their text
    starting at character `offset` of the choice's text; and the offset after them. Each step's `top_logprobs` holds
    the top n and the chosen token, as vLLM's."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, (lp, top) in zip(token_ids, logprobs):
        text = token_text(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(_lp(lp))
        step = {token_text(tokenizer, t): _lp(v) for t, v in top}
        step.setdefault(text, _lp(lp))
        out["top_logprobs"].append(step)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def transcript_entries(tokens) -> list[dict]:
    """A transcription's `logprobs` (openai.types.audio.transcription.Logprob, Realtime's LogProbProperties) from
    `audio.whisper.TokenLogprob`s."""
    return [{"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.token.encode())} for t in tokens or ()]
