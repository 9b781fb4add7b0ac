"""Incremental detokenization with stop strings, for streaming.

Text is emitted only once it is final: a token that ends inside a multi-byte character waits for the
next one, and the tail that could still begin a stop string is held back.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0

    def push(self, token_id: int) -> str:
        """Add a generated token; return the text that became final."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        after = decode(self.ids[self._prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self.stop:
            hits = [i for i in (self.text.find(s, max(0, self._emitted - len(s))) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        final = len(self.text) if self.stopped else max(self._emitted, len(self.text) - self.holdback)
        out = self.text[self._emitted : final]
        self._emitted = final
        return out

    def flush(self) -> str:
        """The held-back tail, once generation is over."""
        out = self.text[self._emitted :]
        self._emitted = len(self.text)
        return out
