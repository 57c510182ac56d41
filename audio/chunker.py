"""``SentenceChunker``: streaming LLM text deltas → speakable pieces for TTS.

The first piece is cut early, at a clause boundary once it has a few words (or, with
``first_max_words``, at a word boundary after that many words when no punctuation came), so the first
audio does not wait for a whole sentence; later pieces end at sentence boundaries (synthesis of a full
sentence sounds better and the audio already playing hides the wait).  A boundary is only taken
once the character after it has arrived, so "3.14", "e.g." or "Dr. Smith" are not split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_SENTENCE_END = re.compile(r"[.!?…]+[\"')\]]*(?=\s)|\n+")
_CLAUSE_END = re.compile(r"[,;:—–]+(?=\s)|\s+-\s+")
# a first piece cut at a word boundary does not end on a word that leans on the next one
_LEANING = {"a", "an", "the", "of", "to", "in", "on", "at", "by", "for", "from", "with", "and", "or", "but", "as",
            "than", "that", "my", "your", "his", "her", "its", "our", "their", "this", "these", "those", "very", "not"}
_ABBREV = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "no", "fig", "approx"}


def _word_count(s: str) -> int:
    return len(s.split())


@dataclass(slots=True)
class SentenceChunker:
    """Feed deltas with ``push``; get pieces back; ``flush`` at the end of the response."""

    first_min_words: int = 4
    first_max_words: int | None = None  # cut the first piece at a word boundary after this many words if no clause came
    max_chars: int = 300  # a run-on sentence is cut at a clause (or word) boundary past this
    _buf: str = ""
    _emitted: int = field(default=0)  # pieces emitted so far

    def push(self, delta: str) -> list[str]:
        self._buf += delta
        out: list[str] = []
        while True:
            piece = self._next_piece()
            if piece is None:
                break
            if piece.strip():
                out.append(piece.strip())
                self._emitted += 1
        return out

    def flush(self) -> list[str]:
        rest, self._buf = self._buf.strip(), ""
        if rest:
            self._emitted += 1
            return [rest]
        return []

    def cut_now(self, min_words: int = 3) -> list[str]:
        """A piece out of what has arrived, mid-sentence if need be (its listener is about to run out of audio): up to
        the last clause boundary, else after the last complete word that does not lean on the next one; nothing while
        fewer than ``min_words`` words are complete."""
        buf, cut = self._buf, None
        for m in _CLAUSE_END.finditer(buf):
            if _word_count(buf[: m.start()]) >= min_words:
                cut = m.end()
        if cut is None:
            ends = [m.end() for m in re.finditer(r"\S+(?=\s)", buf)]
            for i in range(len(ends) - 1, min_words - 2, -1):
                if buf[: ends[i]].split()[-1].lower().strip("\"'()") not in _LEANING:
                    cut = ends[i]
                    break
        piece = buf[:cut].strip() if cut is not None else ""
        if not piece:
            return []
        self._buf = buf[cut:].lstrip()
        self._emitted += 1
        return [piece]

    def _next_piece(self) -> str | None:
        buf = self._buf
        cut = self._sentence_cut(buf)
        if cut is None and self._emitted == 0:
            cut = self._clause_cut(buf, self.first_min_words)
            if cut is None and self.first_max_words:
                cut = self._word_cut(buf, self.first_max_words)
        if cut is None and len(buf) > self.max_chars:
            cut = self._clause_cut(buf[: self.max_chars], 1) or self._space_cut(buf[: self.max_chars])
        if cut is None:
            return None
        self._buf = buf[cut:].lstrip()
        return buf[:cut]

    @staticmethod
    def _sentence_cut(buf: str) -> int | None:
        for m in _SENTENCE_END.finditer(buf):
            before = buf[: m.start()]
            word = before.split()[-1].lower().lstrip("(\"'") if before.split() else ""
            if m.group().startswith(".") and (word in _ABBREV or (len(word) == 1 and word.isalpha())):
                continue  # "Dr." / "e.g." / an initial, not a sentence end
            if buf[: m.end()].strip():
                return m.end()
        return None

    @staticmethod
    def _clause_cut(buf: str, min_words: int) -> int | None:
        for m in _CLAUSE_END.finditer(buf):
            if _word_count(buf[: m.start()]) >= min_words:
                return m.end()
        return None

    @staticmethod
    def _word_cut(buf: str, n: int) -> int | None:
        """After the n-th complete word (one followed by whitespace), or the next few words while the last one is a
        leaning word ("of", "the", ...); None until such a word is complete."""
        ends = [m.end() for m in re.finditer(r"\S+(?=\s)", buf)]
        for i in range(n - 1, min(len(ends), n + 3)):
            word = buf[: ends[i]].split()[-1].lower().strip("\"'()")
            if word not in _LEANING:
                return ends[i]
        return None

    @staticmethod
    def _space_cut(buf: str) -> int | None:
        i = buf.rstrip().rfind(" ")
        return i if i > 0 else None
