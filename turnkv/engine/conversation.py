"""A conversation that keeps its KV between turns: each turn prefills only its new tokens."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from turnkv.engine import chat_template, decode_loop
from turnkv.engine.generation import Reply
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.errors import ContextLengthError, InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.snapshot import export_kv, import_kv
from turnkv.parallel.mirror import mirrored

if TYPE_CHECKING:
    from turnkv.engine.llm import LLM


NOT_STORED = ("logprobs", "token_times", "token_logprobs")  # Reply fields a stored record leaves out


@dataclass
class Turn:
    """Where a turn's tokens sit in the history: [start, prompt_end) its prompt, then its reply."""

    start: int
    prompt_end: int
    end: int
    reply: Reply
    system_end: int = 0  # first turn: where the system prompt's tokens end


class Conversation:
    """A multi-turn chat on an engine that keeps its KV between turns: each turn prefills only the
    tokens the chat template adds after what is kept. Made by LLM.conversation() (or LLM.resume()).

    llm: the engine. system: the system prompt, or None. recipe: how the KV is compressed and
    stored (anything LLM.resolve_recipe takes; None: the engine's default recipe). history: earlier
    turns to continue from ({"role": "user" | "assistant", "content": str} dicts, in order), which
    the first send prefills with its message (taking what the prefix index holds of them).
    Attributes: id (the key of its stored state; resume() takes it), messages (the chat so far,
    OpenAI-style dicts), turns (per turn: its token span and Reply), last_reply, recipe, kv."""

    def __init__(self, llm: LLM, system: str | None = None, recipe=None, history: list[dict] | None = None):
        self.llm = llm
        self.system = system
        self.history = _checked_history(history)
        self.recipe = llm.resolve_recipe(recipe)
        self.id = uuid.uuid4().hex  # the key of its stored state in the CPU and disk tiers
        self.kv = SequenceKV(llm.pool)
        self.closed = False  # close() frees everything; a closed conversation takes no more turns
        self.reset()

    @mirrored
    def reset(self) -> None:
        """Forget every turn and free the KV, wherever it is stored (back to the system prompt and the
        history it was made with)."""
        self.llm.state.discard(self)  # first: a pack of the pages running in the background ends
        self.kv.free()
        system = [{"role": "system", "content": self.system}] if self.system else []
        self.messages: list[dict] = system + [dict(m) for m in self.history]
        self.tokens: list[int] = []  # the whole history as the model saw it
        self.text = ""  # what `tokens` render to
        self.turns: list[Turn] = []
        self.last_reply: Reply | None = None
        self.method_state = self.recipe.new_state(self.llm.config.num_layers, self.llm.model.inv_freq,
                                                   self.llm.pool.shard)

    @property
    def compression_log(self) -> list[dict]:
        """One entry per compression: the turn, the event, the span of positions, the budget per layer
        and the tokens each (layer, head) kept afterwards."""
        return self.method_state.log

    @property
    def method_stats(self) -> list[dict]:
        """Per turn, what a sparse prefill pattern computed (density, lines per head, recovered mass,
        seconds per stage) and what a decode selection did; empty for dense recipes."""
        return self.method_state.stats

    def segment_counts(self) -> np.ndarray:
        """Tokens held per segment [segments, layers, kv_heads]; segment 0 is what precedes the first
        turn's prompt (the system prompt), segment i the tokens of turn i."""
        bounds = [0] + [t.start for t in self.turns[1:]] + [self.kv.next_position]
        if self.turns:
            bounds[0:1] = [0, self.turns[0].system_end]
        L = self.llm.config.num_layers
        out = np.zeros((len(bounds) - 1, L, self.llm.config.num_kv_heads), np.int64)
        for i in range(len(bounds) - 1):
            for layer in range(L):
                out[i, layer] = self.kv.count_positions(layer, bounds[i], bounds[i + 1])
        return out

    @mirrored
    def close(self) -> None:
        """Free the KV and whatever the state tiers hold of this conversation; a later send or stream
        raises InvalidRequestError."""
        self.llm.state.discard(self)  # first: a pack of the pages running in the background ends
        self.kv.free()
        self.closed = True

    @mirrored
    def offload(self, tier: str = "cpu") -> str:
        """Move this conversation's state off the GPU now, to "cpu" or "disk", in the form the
        recipe's state strategy stores; the next turn brings it back. Returns the tier it is in."""
        return self.llm.state.offload(self, tier)

    @property
    def location(self) -> str | None:
        """Where the state is: "gpu", "cpu", "disk", or None before the first turn."""
        return self.llm.state.where(self)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V pages this conversation holds in the page pool, shared ones included (what
        compression frees shows here); kv_sharing splits them."""
        return self.kv.bytes()

    @property
    def kv_sharing(self) -> tuple[int, int]:
        """(own bytes, shared share): bytes of the pages only this conversation holds, and its share
        of pages it holds with other conversations or the prefix index (a page's bytes over its holders)."""
        return self.kv.sharing()

    @mirrored
    def send(self, message: str, **sampling) -> Reply:
        """Add a user message, generate the reply, and return it with its stats (Reply: text,
        token_ids, finish_reason, prompt_tokens prefilled, cached_tokens reused, ttft_s, tokens_per_s,
        kv_bytes, ...). Takes stream()'s keywords: sampling parameters (SamplingParams)
        max_new_tokens=256, temperature=0.0 (greedy), top_p=1.0, top_k=0 (no cut), seed=None,
        stop=[] (strings that end the reply), ignore_eos=False; and context, force, logprobs.
        A turn that fails (InvalidRequestError, ContextLengthError, KVCacheFullError) is undone.
        An empty message is a turn like any other (as over HTTP). ContextLengthError when the history,
        the message and max_new_tokens (when given) do not fit the model's context; without it, the
        reply stops at the context's end (finish_reason "length")."""
        for _ in self.stream(message, **sampling):
            pass
        return self.last_reply

    @mirrored
    def stream(self, message: str, context: str | None = None, force: list[int] | None = None,
               logprobs: bool = False, **sampling) -> Iterator[str]:
        """Like send, yielding the reply's text as it is generated; the Reply lands in last_reply.
        Abandoning the iterator early undoes the turn (tokens a recipe already evicted stay evicted).

        With `context`, the user message is the context, a blank line, then `message`; a recipe with
        schedule=context compresses the context before the question is prefilled.

        `force` feeds the given reply tokens instead of sampling them (teacher forcing), and
        `logprobs` keeps each step's log-softmax in the Reply: together they measure how far a
        compressed conversation's distributions drift from a reference along the same answer."""
        parts = self.llm.turn_parts
        params = parts.sampling_params(**sampling)
        inputs = self._turn_input(message, context)
        if "max_new_tokens" in sampling:  # as the server refuses a max_tokens the context has no room for
            parts.check_room(inputs.keep + len(inputs.new_ids), params.max_new_tokens)
        if force is not None and (not force or not all(isinstance(t, int) for t in force)):
            raise InvalidRequestError("force must be a non-empty list of token ids")
        gen = parts.new_generation(self.kv, params, forced=force, keep_logprobs=logprobs)
        return self._run(TurnRun(self, inputs, gen, self.llm.state))

    def _turn_input(self, message: str, context: str | None = None) -> TurnInput:
        """What a turn with this user message (and separate context) adds to the history: the
        kept tokens it reuses and the new tokens, split where the system prompt and the context end.
        Raises InvalidRequestError (a closed conversation, a message that is not text, an empty
        context) or ContextLengthError (over the model's context)."""
        if self.closed:
            raise InvalidRequestError("this conversation is closed: close() freed its KV and stored state; start a "
                                      "new one with llm.conversation()")
        if not isinstance(message, str):
            raise InvalidRequestError(f"the message must be text, not {type(message).__name__}")
        if context is not None and (not isinstance(context, str) or not context.strip()):
            raise InvalidRequestError("the context is empty")
        tokenizer = self.llm.turn_parts.require_tokenizer()
        content = message if context is None else f"{context}\n\n{message}"
        messages = [*self.messages, {"role": "user", "content": content}]
        full_text = chat_template.render(tokenizer, messages)
        keep, new_ids = chat_template.continuation(tokenizer, self.tokens, self.text, full_text)
        # Where the new tokens split into segments: the system prompt (first turn only), and the
        # context (when given), so that both end on token boundaries a recipe can compress at.
        cuts = [self._system_text(full_text)] if not self.turns else []
        if context is not None:
            cuts.append(full_text.index(content) + len(context))
        new_ids, boundaries = self._split_at(full_text, keep, new_ids, cuts)
        self.llm.turn_parts.check_ids(new_ids)
        total = keep + len(new_ids)
        if total + 1 > self.llm.max_model_len:
            raise ContextLengthError(
                f"this turn needs {total} tokens of context plus one to generate, and the model holds "
                f"{self.llm.max_model_len}; start a new conversation or /reset"
            )
        system_end = boundaries[0] if (not self.turns and self.system and boundaries) else 0
        return TurnInput(keep, new_ids, system_end, boundaries[-1] if context is not None else None, messages,
                         full_text, prefix_end=system_end)

    def _run(self, turn: TurnRun) -> Iterator[str]:
        turn.begin()  # restores the state: counts in TTFT
        try:
            # The first token goes out before the recipe's after-prompt hook (a compression), which
            # decode() or finish() runs first.
            piece = turn.take(turn.prefill(defer_prompt_hook=True))
            if piece:
                yield piece
            for _, piece in decode_loop.decode(self.llm, [turn]):
                if piece:
                    yield piece
            turn.finish()
        finally:
            turn.abandon()  # nothing to undo once finished

    def _system_text(self, full_text: str) -> int:
        """Characters of full_text that render the system prompt alone (0 without one)."""
        if not self.system:
            return 0
        system_text = chat_template.render(self.llm.tokenizer, self.messages[:1], add_generation_prompt=False)
        return len(system_text) if full_text.startswith(system_text) else 0

    def _split_at(self, full_text, keep, new_ids, cuts):
        """Re-encode the new text in pieces at character offsets `cuts`; returns the new tokens and
        the absolute positions where the pieces before the last end."""
        kept_len = len(self.text) if keep == len(self.tokens) else len(
            self.llm.tokenizer.decode(self.tokens[:keep], skip_special_tokens=False))
        cuts = sorted(c for c in cuts if c > kept_len)
        if not cuts:
            return new_ids, []
        ids, boundaries, start = [], [], kept_len
        for cut in cuts + [len(full_text)]:
            ids += chat_template.encode(self.llm.tokenizer, full_text[start:cut])
            boundaries.append(keep + len(ids))
            start = cut
        return ids, boundaries[:-1]

    # ---- what the turn driver (engine/turn.py) and the server's store change ----------------------
    def _roll_back(self, position: int, window_snapshot=None) -> None:
        """Drop the KV from `position` on, and the recipe's bookkeeping of it. An undone turn gets its
        observation window back as it was before the turn (window_snapshot)."""
        self.kv.truncate(position)
        st = self.method_state
        st.frozen_upto = min(st.frozen_upto, position)
        st.since_compression = 0
        if st.window is not None and window_snapshot is not None:
            st.window.restore(window_snapshot)
        elif st.window is not None:
            st.window.truncate(position)

    def _roll_back_to_reusable(self, keep: int) -> None:
        """Drop the kept KV a turn may not reuse: what the template no longer renders (past `keep`),
        and the previous reply when the recipe prefills it again (answer=reprefill)."""
        if self.kv.next_position > keep:
            self._roll_back(keep)
        if self.recipe.answer == "reprefill" and self.turns:
            reply_start = self.turns[-1].prompt_end
            if self.kv.next_position > reply_start:
                self._roll_back(reply_start)

    def _cut(self, tokens: int, chars: int) -> None:
        """Forget the history from token `tokens` (character `chars` of its text) on: a clean
        boundary where a turn's prompt or reply ends."""
        if self.kv.next_position > tokens:
            self._roll_back(tokens)
        self.tokens, self.text = self.tokens[:tokens], self.text[:chars]
        self.turns = [t for t in self.turns if t.end <= tokens]

    def _record_turn(self, inputs: TurnInput, cached: int, reply: Reply) -> None:
        """A turn ended: its message and reply join the history."""
        self.tokens = self.tokens[: inputs.keep] + inputs.new_ids + reply.token_ids
        self.text = inputs.full_text + self._reply_text(reply)
        self.messages = [*inputs.messages, {"role": "assistant", "content": reply.text}]
        self.turns.append(Turn(cached, inputs.keep + len(inputs.new_ids), len(self.tokens), reply, inputs.segment_end))
        self.last_reply = reply

    def _reply_text(self, reply: Reply) -> str:
        """The reply's part of `text`: the text its client was sent, so that a client sending the reply
        back continues every kept token. Special tokens generated inside the reply render as nothing
        (a reply's text skips them), but for a stop token ending it whose text the chat template writes
        after an assistant message (SmolLM2's <|im_end|>; not another end id a model config names).
        A reply whose text is not its tokens' (a stop string cut it) renders its tokens in full, and
        the next turn rolls back to what the template confirms."""
        decode, ids = self.llm.tokenizer.decode, reply.token_ids
        if not reply.text_complete:
            return decode(ids, skip_special_tokens=False)
        end = decode(ids[-1:], skip_special_tokens=False) if ids and ids[-1] in self.llm.eos_ids else ""
        return reply.text + (end if end and self.llm.reply_end.startswith(end) else "")

    @mirrored
    def clone(self, copy_decode: bool = False) -> Conversation:
        """A new conversation of the same class in this one's state: the KV copied into its own pages,
        the observation window, the recipe's bookkeeping and the history (as of the last finished
        turn: a turn under way adds to the history when it ends). copy_decode: copy the decode
        selection's state too (valid only for a selection that names kept entries by index, which a
        copied KV keeps, not pages); otherwise the copy's selection starts afresh."""
        twin = type(self)(self.llm, self.system, self.recipe, self.history)
        import_kv(twin.kv, *export_kv(self.kv))
        st, tw = self.method_state, twin.method_state
        if st.window is not None:
            tw.window.restore(st.window.snapshot())
        if copy_decode and st.decode is not None:
            tw.decode = copy.deepcopy(st.decode)
        tw.frozen_upto, tw.since_compression = st.frozen_upto, st.since_compression
        tw.log, tw.stats, tw.pattern_stats = list(st.log), list(st.stats), list(st.pattern_stats)
        twin.messages, twin.tokens, twin.text = list(self.messages), list(self.tokens), self.text
        twin.turns, twin.last_reply = list(self.turns), self.last_reply
        return twin

    # ---- records: what it takes to rebuild a conversation around a stored state -----------------
    def to_record(self) -> dict:
        """The conversation's history and recipe as JSON (the state tiers store it beside the KV)."""
        return {
            "system": self.system, "recipe": str(self.recipe), "messages": self.messages, "tokens": self.tokens,
            "text": self.text, "frozen_upto": self.method_state.frozen_upto,
            "since_compression": self.method_state.since_compression,
            "turns": [{"start": t.start, "prompt_end": t.prompt_end, "end": t.end, "system_end": t.system_end,
                       "reply": {f.name: getattr(t.reply, f.name) for f in fields(t.reply) if f.name not in NOT_STORED}}
                      for t in self.turns],
        }

    @classmethod
    def from_record(cls, llm: LLM, conversation_id: str, record: dict) -> Conversation:
        """The conversation `to_record` described, under its id; its KV comes back at its next turn."""
        conv = cls(llm, record["system"], record["recipe"])
        conv.id = conversation_id
        conv.messages, conv.tokens, conv.text = record["messages"], record["tokens"], record["text"]
        conv.turns = [Turn(t["start"], t["prompt_end"], t["end"], Reply(**t["reply"]), t["system_end"])
                      for t in record["turns"]]
        conv.last_reply = conv.turns[-1].reply if conv.turns else None
        conv.method_state.frozen_upto = record["frozen_upto"]
        conv.method_state.since_compression = record.get("since_compression", 0)
        return conv


def _checked_history(history) -> list[dict]:
    """`history` as a list of {"role", "content"} dicts; InvalidRequestError for anything else."""
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise InvalidRequestError("history must be a list of {'role': 'user' | 'assistant', 'content': str} messages")
    out = []
    for i, m in enumerate(history):
        if (not isinstance(m, dict) or m.get("role") not in ("user", "assistant")
                or not isinstance(m.get("content"), str) or set(m) - {"role", "content"}):
            raise InvalidRequestError(f"history[{i}] must be {{'role': 'user' | 'assistant', 'content': str}}; "
                                      f"the system prompt is the system argument")
        out.append({"role": m["role"], "content": m["content"]})
    return out
