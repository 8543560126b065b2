"""Incremental detokenization for streaming: text deltas as blocks commit, with stop strings applied.

A delta never contains text that a later block could still change: a trailing U+FFFD (an incomplete UTF-8
sequence of a byte-level tokenizer) and a trailing prefix of a stop string are held back until the next block or
the end. When a stop string appears, the text is cut before it and `stopped` turns True, so the caller can cancel
the rest of the generation.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""          # the text so far (cut at a stop string once one is found)
        self.sent = 0           # characters of self.text already returned as deltas
        self.stopped = False    # a stop string was found

    def add(self, new_ids: list[int], finished: bool = False) -> str:
        """Append a committed block's token ids; return the new text that is safe to show."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
            end = len(text)
        elif finished:
            end = len(text)
        else:
            end = len(text) - self._holdback(text)
        self.text = text
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta

    def flush(self) -> str:
        """The rest of the text (call once generation has ended)."""
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        n = len(text) - len(text.rstrip(REPLACEMENT))
        body = text[: len(text) - n]
        longest = 0
        for s in self.stop:          # the longest suffix of the text that a stop string starts with
            for k in range(min(len(s) - 1, len(body)), longest, -1):
                if body.endswith(s[:k]):
                    longest = k
                    break
        return n + longest
