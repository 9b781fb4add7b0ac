"""Each token's raw bytes and text, for the log-probabilities the routes return.

OpenAI's chat `logprobs` give every token its UTF-8 `bytes`, so that a client joins them into the
reply even where a character spans several tokens (an emoji, most CJK characters under a byte-level
vocabulary), and `token`, its text. A token holding part of a character has no text of its own:
`token` then writes the bytes that do not decode as `\\xNN` escapes, as OpenAI does.

The legacy completions `logprobs` give each token a piece of the reply's text instead (`tokens`, which
join into the text, and `text_offset`): a token that completes a character carries it, the tokens
before it inside that character carry "" (CompletionText).

A token's bytes come from the vocabulary entry, read as its decoder writes it: byte-level BPE (GPT-2,
Llama 3, Qwen, SmolLM2) maps each character of the entry to one byte; SentencePiece with byte fallback
(Llama 2, Mistral) writes a byte as `<0xNN>` and a space as `▁`. A special token the reply's text
skips (skip_special_tokens) adds no bytes; its `token` is its name. Other tokenizers fall back on the
token's own decoded text.
"""

from __future__ import annotations

import json
import re

from turnkv.engine.detokenizer import IncrementalDetokenizer

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """The bytes and text of each token id of `tokenizer` (a transformers tokenizer); built once per
    server, each id worked out on first use and kept."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: a model that takes token ids only (its tokens have no bytes)
        self.kind = decoder_kind(tokenizer)
        self.byte_of_char = {}
        if self.kind == "byte_level":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.byte_of_char = {char: byte for byte, char in bytes_to_unicode().items()}
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, tuple[bytes, str]] = {}

    def of(self, token: int) -> tuple[bytes, str]:
        """(the bytes the token adds to the reply, its `token` text)."""
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._work_out(token)
        return found

    def _work_out(self, token: int) -> tuple[bytes, str]:
        if self.tokenizer is None:
            return b"", ""
        if token in self.added:
            name = self.added[token]
            if self.tokenizer.decode([token], skip_special_tokens=True) == "":  # the reply's text skips it
                return b"", name
            return name.encode("utf-8"), name
        raw = self._raw(token)
        return raw, raw.decode("utf-8", errors="backslashreplace")

    def _raw(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if self.kind == "byte_level" and all(c in self.byte_of_char for c in piece):
                return bytes(self.byte_of_char[c] for c in piece)
            if self.kind == "sentencepiece":
                byte = BYTE_PIECE.fullmatch(piece)
                return bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")


def decoder_kind(tokenizer) -> str:
    """"byte_level", "sentencepiece" (byte fallback, ▁ for a space) or "text" (neither: a token's
    bytes are those of its decoded text), from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return "text"
    kinds, todo = set(), [decoder]
    while todo:
        part = todo.pop()
        kinds.add(part.get("type"))
        todo.extend(part.get("decoders") or [])
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    return "text"


class CompletionText:
    """The piece of a reply's text each generated token made final, token by token, as the engine's
    own detokenizer makes it (so the pieces join into the reply, and a character that spans tokens
    goes with the token that completes it); `offset` counts the characters given out so far."""

    def __init__(self, tokenizer):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None  # None: no text
        self.offset = 0

    def pieces(self, tokens: list[int]) -> tuple[list[str], list[int]]:
        """(each token's text, the character offset where each starts) for the next tokens."""
        texts, offsets = [], []
        for token in tokens:
            offsets.append(self.offset)
            texts.append(self.detok.push(token) if self.detok is not None else "")
            self.offset += len(texts[-1])
        return texts, offsets


def clip(texts: list[str], text: str) -> list[str]:
    """`texts` cut so that they join into `text`, a prefix of their join (a reply a stop string
    ended holds less than its tokens decode to)."""
    out, left = [], len(text)
    for piece in texts:
        out.append(piece[:left])
        left -= len(out[-1])
    return out
