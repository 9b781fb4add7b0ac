"""One request inside the worker thread: the turn it runs on a kept (or new) conversation.

The request's turn is the engine's TurnRun (engine/turn.py), as Conversation.stream runs it; the
scheduler interleaves its prefill slices with the batched decode steps of other requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from turnkv.engine import chat_template
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import ContextLengthError, InvalidRequestError


@dataclass
class Outcome:
    text: str
    finish_reason: str
    prompt_tokens: int  # the whole prompt, reused tokens included (OpenAI's usage.prompt_tokens)
    cached_tokens: int
    completion_tokens: int


class Job:
    """Created on the HTTP side; every method after __init__ runs on the worker thread."""

    def __init__(self, sink: Callable[[str, object], None], sampling: dict, max_tokens: int | None,
                 default_max_tokens: int, recipe, recipe_key: str, messages: list[dict] | None = None,
                 prompt: str | list[int] | None = None, session: str | None = None):
        self.sink, self.sampling = sink, sampling
        self.max_tokens, self.default_max_tokens = max_tokens, default_max_tokens
        self.recipe, self.recipe_key, self.session = recipe, recipe_key, session
        self.messages, self.prompt_input = messages, prompt
        self.arrived = time.perf_counter()
        self.cancelled = False  # set by the HTTP side when the client goes away
        self.entry = None  # the store's entry for chat requests
        self.conv: Conversation | None = None
        self.turn: TurnRun | None = None
        self.last_token_at: float | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    # ---- admission ---------------------------------------------------------------------------------
    def prepare(self, llm, store) -> None:
        """Find the conversation, work out the tokens to prefill, and check they fit."""
        if self.is_chat:
            tokenizer = llm._require_tokenizer()
            self.full_text = chat_template.render(tokenizer, self.messages)
            claim = store.claim(self.full_text, self.recipe, self.recipe_key, self.session)
            self.entry, self.conv = claim.entry, claim.entry.conv
            self.keep = claim.keep
            self.new_ids, self.system_mark = self._encode_rest(tokenizer, claim.keep_chars)
        else:
            self.conv = Conversation(llm, None, self.recipe)  # a container for the KV and recipe state
            self.keep, self.new_ids, self.system_mark = 0, llm.encode(self.prompt_input), None
        total = self.keep + len(self.new_ids)
        room = llm.max_model_len - total
        if room < 1:
            raise ContextLengthError(f"the prompt is {total} tokens and the model's context is {llm.max_model_len}; "
                                     f"shorten the messages")
        if self.max_tokens is not None and self.max_tokens > room:
            raise ContextLengthError(f"max_tokens is {self.max_tokens} but the prompt ({total} tokens) leaves room for "
                                     f"{room} in the model's context of {llm.max_model_len}")
        params = llm._sampling_params(**self.sampling, max_new_tokens=self.max_tokens or min(self.default_max_tokens, room))
        if self.is_chat:
            segment_end = self.system_mark[0] if self.system_mark else 0
        else:
            segment_end = len(self.new_ids)  # a raw prompt is one finished segment, as in LLM.generate
        inputs = TurnInput(self.keep, self.new_ids, segment_end, None, self.messages if self.is_chat else None,
                           self.full_text if self.is_chat else "")
        self.turn = TurnRun(self.conv, inputs, llm._new_generation(self.conv.kv, params)).begin()

    def _encode_rest(self, tokenizer, kept_chars: int):
        """The tokens after the kept prefix. A conversation's first turn is encoded in two pieces, the
        system prompt and the rest, so the system prompt ends on a token boundary a recipe (FlowKV)
        can compress at; Conversation.stream does the same."""
        text = self.full_text
        if not self.conv.turns and self.messages[0]["role"] == "system":
            system_text = chat_template.render(tokenizer, self.messages[:1], add_generation_prompt=False)
            if kept_chars < len(system_text) and text.startswith(system_text):
                head = chat_template.encode(tokenizer, text[kept_chars : len(system_text)])
                tail = chat_template.encode(tokenizer, text[len(system_text) :])
                return head + tail, (self.keep + len(head), len(system_text))
        return chat_template.encode(tokenizer, text[kept_chars:]), None

    # ---- running -----------------------------------------------------------------------------------
    @property
    def prefill_left(self) -> int:
        return self.turn.prefill_left

    def prefill(self, size: int) -> tuple[str, bool]:
        """Prefill the next `size` prompt tokens; after the last slice, sample the first token.
        Returns (text made final, done)."""
        logits = self.turn.prefill(size)
        if logits is None:
            return "", False
        return self.turn.take(logits), self.turn.done

    # ---- ending ------------------------------------------------------------------------------------
    def finish(self, store) -> Outcome:
        reply = self.turn.finish()
        outcome = Outcome(reply.text, reply.finish_reason, self.keep + len(self.new_ids), self.turn.cached,
                          reply.completion_tokens)
        if not self.is_chat:
            self.conv.close()
            return outcome
        prompt_end = self.keep + len(self.new_ids)
        self.entry.record_turn(self.system_mark, (prompt_end, len(self.full_text)))
        store.release(self.entry)
        return outcome

    def abandon(self, store) -> None:
        """Undo whatever this request wrote (failure or disconnect) and give the conversation back;
        the job can then be admitted again from the start."""
        if self.conv is None:
            return
        if self.turn is not None:
            self.turn.abandon()
        if self.entry is not None:
            store.release(self.entry)
        else:
            self.conv.close()
        self.conv, self.entry, self.turn = None, None, None


def check_max_tokens(value: int | None, max_model_len: int) -> int | None:
    """Reject a max_tokens no prompt could satisfy before the request is queued."""
    if value is None:
        return None
    if value < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {value}")
    if value >= max_model_len:
        raise InvalidRequestError(f"max_tokens is {value} but the model's context is {max_model_len} tokens")
    return value
