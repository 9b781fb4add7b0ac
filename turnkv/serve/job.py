"""One request inside the worker thread: the turn it runs on a kept (or new) conversation.

The steps mirror Conversation.stream (prefill the new tokens against the kept KV, let the recipe
compress at its scheduled points, sample, roll back on failure), cut apart so that the scheduler can
interleave prefill slices of some requests with batched decode steps of others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from turnkv.engine import chat_template
from turnkv.engine.conversation import Conversation, Turn
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
        self.prefilled = 0
        self.started = False  # anything written to the KV that failure must undo
        self.last_token_at: float | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    # ---- admission ---------------------------------------------------------------------------------
    def prepare(self, llm, store) -> None:
        """Find the conversation, work out the tokens to prefill, and check they fit."""
        if self.is_chat:
            tokenizer = llm.require_tokenizer()
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
        params = llm.sampling_params(**self.sampling, max_new_tokens=self.max_tokens or min(self.default_max_tokens, room))
        kv, state = self.conv.kv, self.conv.method_state
        self.conv._roll_back_to_reusable(self.keep)  # answer=reprefill prefills the last reply again
        if not self.new_ids and kv.next_position >= self.keep:
            # The request ends inside the kept history (a regenerated reply): its last token is fed
            # again, since sampling needs the logits after it.
            self.conv._roll_back(self.keep - 1)
        self.cached = kv.next_position
        self.prompt = self.conv.tokens[self.cached : self.keep] + self.new_ids
        self.turn = len(self.conv.turns) + 1
        system_end = self.system_mark[0] if self.system_mark else 0
        self.segment_end = self.cached if self.conv.turns else system_end
        self.window_before = state.window.snapshot() if state.window is not None else None
        self.gen = llm.new_generation(kv, params)

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
        return len(self.prompt) - self.prefilled

    def prefill(self, llm, size: int) -> tuple[str, bool]:
        """Prefill the next `size` prompt tokens; after the last slice, sample the first token.
        Returns (text made final, done)."""
        recipe, state = self.conv.recipe, self.conv.method_state
        chunk = self.prompt[self.prefilled : self.prefilled + size]
        self.started = True
        logits = llm.runner.prefill(self.conv.kv, chunk, window=state.window, accumulate=recipe.accumulates_attention,
                                    pattern=recipe.pattern_hook(state), selector=state.decode)
        self.prefilled += len(chunk)
        if self.prefill_left:
            return "", False
        recipe.after_prompt(self.conv.kv, state, self.segment_end, llm.model.inv_freq, self.turn)
        return self.accept(logits, llm)

    def accept(self, logits, llm) -> tuple[str, bool]:
        piece = self.gen.accept(self.gen.sample(logits))
        return piece, self.gen.done

    def after_decode(self, logits, llm) -> tuple[str, bool]:
        self.conv.recipe.after_decode_step(self.conv.kv, self.conv.method_state, llm.model.inv_freq, self.turn)
        return self.accept(logits, llm)

    @property
    def last_token(self) -> int:
        return self.gen.token_ids[-1]

    # ---- ending ------------------------------------------------------------------------------------
    def finish(self, llm, store) -> Outcome:
        conv = self.conv
        conv.recipe.at_turn_end(conv.kv, conv.method_state, llm.model.inv_freq, self.turn)
        reply = self.gen.reply(prompt_tokens=len(self.prompt), cached_tokens=self.cached)
        outcome = Outcome(reply.text, reply.finish_reason, self.keep + len(self.new_ids), self.cached,
                          reply.completion_tokens)
        if not self.is_chat:
            conv.close()
            return outcome
        prompt_end = self.keep + len(self.new_ids)
        conv.tokens = conv.tokens[: self.keep] + self.new_ids + reply.token_ids
        conv.text = self.full_text + llm.tokenizer.decode(reply.token_ids, skip_special_tokens=False)
        conv.messages = [*self.messages, {"role": "assistant", "content": reply.text}]
        system_end = self.system_mark[0] if self.system_mark else 0
        conv.turns.append(Turn(self.cached, prompt_end, len(conv.tokens), reply, system_end))
        conv.last_reply = reply
        self.entry.record_turn(self.system_mark, (prompt_end, len(self.full_text)))
        store.release(self.entry)
        return outcome

    def abandon(self, store) -> None:
        """Undo whatever this request wrote (failure or disconnect) and give the conversation back;
        the job can then be admitted again from the start."""
        if self.conv is None:
            return
        if self.started:
            self.conv._roll_back(self.cached, self.window_before)
        if self.entry is not None:
            store.release(self.entry)
        else:
            self.conv.close()
        self.conv, self.entry, self.prefilled, self.started = None, None, 0, False


def check_max_tokens(value: int | None, max_model_len: int) -> int | None:
    """Reject a max_tokens no prompt could satisfy before the request is queued."""
    if value is None:
        return None
    if value < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {value}")
    if value >= max_model_len:
        raise InvalidRequestError(f"max_tokens is {value} but the model's context is {max_model_len} tokens")
    return value
