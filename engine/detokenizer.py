"""Incremental detokenization with stop strings.

Byte-level BPE splits multi-byte characters across tokens, so decoding one token at a time would emit broken UTF-8 (shown
as U+FFFD). We decode a small window (`prefix_offset..`) and only emit text once it no longer ends in U+FFFD. Stop strings
are never emitted, even partly: text that could still be the start of a stop string is held back until it cannot be.
With min_tokens (vLLM's rule), the text of the first min_tokens output tokens cannot end the output: a stop string
counts only if it ends after that text.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-6:])   # a little context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""            # everything decoded so far (output only)
        self.emitted = 0          # chars of self.text already sent
        self.stop = stop or []
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.stopped_by: str | None = None
        self.min_tokens = min_tokens
        self.num_tokens = 0       # output tokens fed
        self.stop_from = 0        # a stop string must end past this many chars of self.text (min_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        self.num_tokens += 1
        if self.num_tokens <= self.min_tokens:
            self.stop_from = len(self.text)
        return self._release()

    def _release(self) -> str:
        end = len(self.text)
        if self.stop:
            search_from = max(0, self.emitted - self.max_stop + 1)
            hits = [(i, s) for s in self.stop
                    if (i := self.text.find(s, max(search_from, self.stop_from - len(s) + 1))) >= 0]
            if hits:
                i, s = min(hits)
                self.stopped_by = s
                self.text = self.text[:i]
                end = i
            else:
                end -= self._held_back()
        delta = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of the request: release any held-back text (it did not become a stop string)."""
        if self.stopped_by is not None:
            return ""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
