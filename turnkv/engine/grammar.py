"""Grammars a generation must follow (structured output, constrained tool calls), through xgrammar.

A Grammars object is built once per tokenizer; compiling a grammar (a JSON schema, the tool-call
format) takes milliseconds to seconds and happens off the model worker, and each request then gets a
GrammarConstraint: a matcher that writes the allowed-token bitmask into its own row of logits [V]
before sampling (engine/logits.py) and advances with each accepted token. xgrammar is an optional
dependency (the `structured` extra); without it, asking for a grammar raises InvalidRequestError.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import torch

from turnkv.errors import InvalidRequestError

CACHE_SIZE = 64  # compiled grammars kept per tokenizer, least recently used dropped


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError("structured output needs xgrammar: pip install 'turnkv[structured]'") from None
    return xgrammar


class Compiled:
    """A compiled grammar, shared by every request that asks for the same one."""

    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self)


class Grammars:
    """Compiles grammars for one tokenizer (thread-safe; results cached by their source)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Compiled] = OrderedDict()

    def _get_compiler(self):
        xgr = _xgrammar()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def _cached(self, key: str, build) -> Compiled:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        try:
            compiled = Compiled(compiler.compile_grammar(build(_xgrammar())), self.vocab_size)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"cannot build a grammar from it: {e}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def json_schema(self, schema: dict, strict: bool = True) -> Compiled:
        """Output that is one JSON value matching `schema` (compact: no free whitespace, so a
        generation cannot wander in blanks)."""
        text = json.dumps(schema)
        return self._cached(f"schema:{strict}:{text}", lambda xgr: xgr.Grammar.from_json_schema(
            text, any_whitespace=False, strict_mode=strict))

    def json_object(self) -> Compiled:
        """Output that is one JSON object (OpenAI's response_format json_object)."""
        return self.json_schema({"type": "object"}, strict=False)

    def wrapped(self, prefix: str, schemas: list[dict], suffix: str, leads: list[str] | None = None) -> Compiled:
        """`prefix`, then one JSON value matching any of `schemas`, then `suffix` (a tool call in a
        chat format: e.g. "<tool_call>\\n" + {"name": ..., "arguments": {...}} + "\\n</tool_call>").
        With `leads`, the value matching schemas[i] comes after the text leads[i] (a function's
        name before its arguments)."""
        texts = [json.dumps(s) for s in schemas]
        key = "wrapped:" + json.dumps([prefix, texts, suffix, leads])

        def one(xgr, i, text):
            value = xgr.Grammar.from_json_schema(text, any_whitespace=False)
            if not leads:
                return value
            return xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(leads[i])}"), value)

        def build(xgr):
            body = xgr.Grammar.union(*[one(xgr, i, t) for i, t in enumerate(texts)])
            parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in (prefix, suffix)]
            return xgr.Grammar.concat(*([parts[0]] if prefix else []), body, *([parts[1]] if suffix else []))

        return self._cached(key, build)


class GrammarConstraint:
    """One request's matcher over a Compiled grammar (engine/logits.py's Constraint)."""

    def __init__(self, compiled: Compiled):
        xgr = _xgrammar()
        self.xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled.compiled)
        self.vocab_size = compiled.vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self.matcher.fill_next_token_bitmask(self.bitmask)
        logits = logits.clone()
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits[None], bitmask, vocab_size=min(self.vocab_size, logits.shape[-1]))
        return logits

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)

    @property
    def finished(self) -> bool:
        return self.matcher.is_terminated()
