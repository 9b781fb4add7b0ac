"""A conversation that keeps its KV between turns: each turn prefills only its new tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from turnkv.engine import chat_template
from turnkv.engine.generation import Generation, Reply
from turnkv.errors import ContextLengthError, InvalidRequestError
from turnkv.kv.sequence import SequenceKV

if TYPE_CHECKING:
    from turnkv.engine.llm import LLM


@dataclass
class Turn:
    """Where a turn's tokens sit in the history: [start, prompt_end) its prompt, then its reply."""

    start: int
    prompt_end: int
    end: int
    reply: Reply


class Conversation:
    def __init__(self, llm: LLM, system: str | None = None):
        self.llm = llm
        self.system = system
        self.kv = SequenceKV(llm.pool)
        self.reset()

    def reset(self) -> None:
        """Forget every turn and free the KV."""
        self.kv.free()
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.tokens: list[int] = []  # the whole history as the model saw it
        self.text = ""  # what `tokens` render to
        self.turns: list[Turn] = []
        self.last_reply: Reply | None = None

    def close(self) -> None:
        self.kv.free()

    @property
    def kv_bytes(self) -> int:
        return self.kv.bytes()

    def send(self, message: str, **sampling) -> Reply:
        """Add a user message, generate the reply, and return it with its stats."""
        for _ in self.stream(message, **sampling):
            pass
        return self.last_reply

    def stream(self, message: str, **sampling) -> Iterator[str]:
        """Like send, yielding the reply's text as it is generated; the Reply lands in last_reply.
        Abandoning the iterator early undoes the turn."""
        if not isinstance(message, str) or not message.strip():
            raise InvalidRequestError("the message is empty")
        params = self.llm.sampling_params(**sampling)
        tokenizer = self.llm.require_tokenizer()
        messages = [*self.messages, {"role": "user", "content": message}]
        full_text = chat_template.render(tokenizer, messages)
        keep, new_ids = chat_template.continuation(tokenizer, self.tokens, self.text, full_text)
        total = keep + len(new_ids)
        if total + 1 > self.llm.max_model_len:
            raise ContextLengthError(
                f"this turn needs {total} tokens of context plus one to generate, and the model holds "
                f"{self.llm.max_model_len}; start a new conversation or /reset"
            )
        return self._run_turn(messages, full_text, keep, new_ids, params)

    def _run_turn(self, messages, full_text, keep, new_ids, params) -> Iterator[str]:
        if self.kv.next_position > keep:
            self.kv.truncate(keep)  # the template no longer renders part of what was kept
        cached = self.kv.next_position
        prompt = self.tokens[cached:keep] + new_ids
        gen = self.llm.new_generation(self.kv, params)
        finished = False
        try:
            logits = self.llm.runner.prefill(self.kv, prompt)
            while True:
                token = gen.sample(logits)
                piece = gen.accept(token)
                if piece:
                    yield piece
                if gen.done:
                    break
                logits = self.llm.runner.decode([self.kv], self.llm.token_tensor([token]))[0]
            finished = True
        finally:
            if not finished:
                self.kv.truncate(cached)
        reply = gen.reply(prompt_tokens=len(prompt), cached_tokens=cached)
        start = keep
        self.tokens = self.tokens[:keep] + new_ids + reply.token_ids
        self.text = full_text + self.llm.tokenizer.decode(reply.token_ids, skip_special_tokens=False)
        self.messages = [*messages, {"role": "assistant", "content": reply.text}]
        self.turns.append(Turn(start, keep + len(new_ids), len(self.tokens), reply))
        self.last_reply = reply
