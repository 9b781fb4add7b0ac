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
from turnkv.engine.logits import TokenLogprob
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import ContextLengthError, InvalidRequestError


@dataclass
class Outcome:
    text: str
    finish_reason: str
    prompt_tokens: int  # the whole prompt, reused tokens included (OpenAI's usage.prompt_tokens)
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # per generated token (but an end-of-sequence token), if asked


@dataclass
class Delta:
    """A "text" event: text that became final, and the log-probabilities of the tokens generated
    since the last event (when the request asked for them)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Rendered:
    """A chat as its template renders it, worked out on the HTTP side (off the model worker)."""

    text: str  # the whole chat with the generation prompt
    system_text: str | None  # the system message alone (a first message with role "system"), or None


def render_chat(tokenizer, messages: list[dict], **template_options) -> Rendered:
    text = chat_template.render(tokenizer, messages, **template_options)
    system = None
    if messages[0]["role"] == "system":
        system = chat_template.render(tokenizer, messages[:1], add_generation_prompt=False, **template_options)
    return Rendered(text, system)


class Job:
    """Created on the HTTP side; claim(), ready() and the methods after them run on the worker
    thread, encode() on the scheduler's encoder thread (tokenizing never stalls decode steps)."""

    def __init__(self, sink: Callable[[str, object], None], sampling: dict, max_tokens: int | None,
                 default_max_tokens: int, recipe, recipe_key: str, messages: list[dict] | None = None,
                 prompt: str | list[int] | None = None, session: str | None = None,
                 rendered: Rendered | None = None, grammar=None,
                 fields: tuple[str, str] = ("messages", "max_tokens")):
        self.sink, self.sampling = sink, sampling
        self.max_tokens, self.default_max_tokens = max_tokens, default_max_tokens
        self.recipe, self.recipe_key, self.session = recipe, recipe_key, session
        self.messages, self.prompt_input, self.rendered = messages, prompt, rendered
        self.grammar = grammar  # a compiled grammar (engine/grammar.py) the reply must follow, or None
        # The request's fields its errors name: the prompt's ("messages" or "prompt") and the reply
        # length's ("max_tokens" or "max_completion_tokens").
        self.prompt_field, self.max_tokens_field = fields
        self.arrived = time.perf_counter()
        self.cancelled = False  # set by the HTTP side when the client goes away
        self.entry = None  # the store's entry for chat requests
        self.conv: Conversation | None = None
        self.turn: TurnRun | None = None
        self.last_token_at: float | None = None
        self.pieces: list = []  # what encode() tokenizes: text pieces, or the raw prompt
        self.encoding = None  # the encoder's future while the request is tokenized
        self.logprobs_sent = 0  # generated tokens whose log-probabilities went out in a "text" event
        self.share_prefixes = True  # whether the turn may take KV from the prefix index (the store's reuse)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    # ---- admission ---------------------------------------------------------------------------------
    def claim(self, llm, store) -> None:
        """Find the conversation (worker thread) and decide what is left to tokenize after its kept
        prefix: the first turn of a chat with a system prompt in two pieces, so that the system prompt
        ends on a token boundary a recipe (FlowKV) can compress at, as Conversation.stream does.
        Under a store that does not reuse (--no-reuse), the turn takes nothing from the prefix index
        either: every token of the prompt is prefilled by this request."""
        self.share_prefixes = store.reuse
        self.ops = store.ops  # every change to the engine goes through it (engine_ops.py)
        if not self.is_chat:
            self.conv = self.ops.new_conversation(self.recipe, self.recipe_key)  # a container for the KV and recipe state
            self.keep, self.system_chars, self.pieces = 0, None, [self.prompt_input]
            return
        llm.turn_parts.require_tokenizer()
        text, system = self.rendered.text, self.rendered.system_text
        claim = store.claim(text, self.recipe, self.recipe_key, self.session)
        self.entry, self.conv, self.keep = claim.entry, claim.entry.conv, claim.keep
        self.system_chars = None
        kept_chars = claim.keep_chars
        if (not self.conv.turns and system is not None and kept_chars < len(system)
                and text.startswith(system)):
            self.system_chars = len(system)
            self.pieces = [text[kept_chars : len(system)], text[len(system) :]]
        else:
            self.pieces = [text[kept_chars:]]

    def encode(self, llm) -> list[list[int]]:
        """The token ids of each piece claim() left (encoder thread; touches nothing shared)."""
        if not self.is_chat:
            return [llm.encode(self.pieces[0])]
        return [llm.turn_parts.check_ids(chat_template.encode(llm.tokenizer, piece)) for piece in self.pieces]

    def ready(self, llm, encoded: list[list[int]]) -> None:
        """Check the tokens fit and begin the turn (worker thread)."""
        total = self.keep + sum(len(ids) for ids in encoded)
        room = llm.max_model_len - total
        if room < 1:
            raise ContextLengthError(f"the prompt is {total} tokens and the model's context is {llm.max_model_len}; "
                                     f"shorten the {self.prompt_field}")
        capacity = llm.pool.sequence_capacity
        if total >= capacity:
            raise ContextLengthError(f"the prompt is {total} tokens and the whole KV pool holds {capacity} tokens of "
                                     f"one conversation: it can never fit; shorten the {self.prompt_field} (or start "
                                     f"the server with more --kv-memory)")
        if self.max_tokens is not None and self.max_tokens > room:
            raise FieldContextError(self.max_tokens_field,
                                    f"{self.max_tokens_field} is {self.max_tokens} but the prompt ({total} tokens) "
                                    f"leaves room for {room} in the model's context of {llm.max_model_len}")
        self.new_ids = [t for ids in encoded for t in ids]
        self.system_mark = None
        if self.system_chars is not None:
            self.system_mark = (self.keep + len(encoded[0]), self.system_chars)
        self.full_text = self.rendered.text if self.is_chat else ""
        parts = llm.turn_parts
        params = parts.sampling_params(**self.sampling, max_new_tokens=self.max_tokens or min(self.default_max_tokens, room))
        if self.is_chat:
            segment_end = self.system_mark[0] if self.system_mark else 0
        else:
            segment_end = len(self.new_ids)  # a raw prompt is one finished segment, as in LLM.generate
        prefix_end = segment_end if self.is_chat else 0  # the system prompt's end: a shareable prefix
        inputs = TurnInput(self.keep, self.new_ids, segment_end, None, self.messages if self.is_chat else None,
                           self.full_text, prefix_end=prefix_end, share_prefixes=self.share_prefixes)
        constraint = None if self.grammar is None else self.grammar.constraint()
        self.turn = self.ops.begin_turn(self.conv, inputs, parts.new_generation(self.conv.kv, params, constraint=constraint))

    # ---- running -----------------------------------------------------------------------------------
    @property
    def prefill_left(self) -> int:
        return self.turn.prefill_left

    def prefill(self, size: int) -> tuple[str, bool]:
        """Prefill the next `size` prompt tokens; after the last slice, sample the first token.
        Returns (text made final, done)."""
        logits = self.ops.prefill(self.turn, size)  # the scheduler settles after the first token
        if logits is None:
            return "", False
        return self.ops.take(self.turn, logits), self.turn.done

    # ---- ending ------------------------------------------------------------------------------------
    def emit(self, piece: str) -> None:
        """Send the text a step made final, with the log-probabilities of the tokens since the last
        event when the request asked for them."""
        entries = self._logprobs(self.logprobs_sent)
        self.logprobs_sent = len(self.turn.gen.token_ids)
        if piece or entries:
            self.sink("text", Delta(piece, entries))

    def _logprobs(self, start: int) -> list[TokenLogprob]:
        gen = self.turn.gen
        if gen.token_logprobs is None:
            return []
        return [e for e in gen.token_logprobs[start:] if e.token not in gen.eos_ids]

    def finish(self, store) -> Outcome:
        reply = self.ops.finish(self.turn)
        logprobs = self._logprobs(0) if self.turn.gen.token_logprobs is not None else None
        outcome = Outcome(reply.text, reply.finish_reason, self.keep + len(self.new_ids), self.turn.cached,
                          reply.completion_tokens, logprobs)
        if not self.is_chat:
            self.ops.close(self.conv)
            return outcome
        prompt_end = self.keep + len(self.new_ids)
        self.entry.record_turn(self.system_mark, (prompt_end, len(self.full_text)))
        store.release(self.entry)
        return outcome

    def abandon(self, store) -> None:
        """Undo whatever this request wrote (failure or disconnect) and give the conversation back;
        the job can then be admitted again from the start."""
        self.encoding = None
        if self.conv is None:
            return
        if self.turn is not None:
            self.ops.abandon(self.turn)
        if self.entry is not None:
            store.release(self.entry)
        else:
            self.ops.close(self.conv)
        self.conv, self.entry, self.turn = None, None, None


def check_max_tokens(value: int | None, max_model_len: int, name: str = "max_tokens") -> int | None:
    """Reject a reply length no prompt could satisfy before the request is queued; `name` is the
    request's field it came from."""
    if value is None:
        return None
    if value < 1:
        raise InvalidRequestError(f"{name} must be at least 1, got {value}")
    if value >= max_model_len:
        raise InvalidRequestError(f"{name} is {value} but the model's context is {max_model_len} tokens")
    return value


class FieldContextError(ContextLengthError):
    """A turn would not fit in the context because of the request's field `param` (the reply length
    it asks for), not its prompt."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
