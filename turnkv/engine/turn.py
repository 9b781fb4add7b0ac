"""The one turn driver. Every caller (Conversation.send/stream, LLM.generate, the server's scheduler,
the quality benchmark's lockstep runner, `turnkv bench speed`) runs a turn through TurnRun:

    turn = TurnRun(conv, TurnInput(...), generation, tiers)
    turn.begin()                       # restore the state, roll back what may not be reused
    logits = turn.prefill(size)        # the prompt, in slices; the recipe's hooks at its boundaries
    turn.take(logits)                  # the first token
    turn.settle()                      # the after-prompt hook, where prefill(defer_prompt_hook=True) left it
    decode_loop.step / decode_loop.decode over turns   # each step: after_step(logits row)
    reply = turn.finish()              # the recipe's turn end, the history, the tiers
    turn.abandon()                     # or: undo whatever the turn wrote
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from turnkv.engine import prefix
from turnkv.engine.generation import Generation, Reply
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.step_context import StepContext


@dataclass
class TurnInput:
    """What a turn adds, worked out from the rendered history.

    keep: tokens of the conversation's history this turn may reuse (its first `keep` tokens);
    new_ids: the tokens after them; segment_end: on a first turn, the absolute position where its
    finished segments end, which a turn policy (FlowKV) compresses at once the prompt is in: the
    system prompt's end in a chat (0: no system prompt), the whole prompt for a raw prompt; context_end: the
    absolute position where a separate context ends, compressed before the rest is prefilled (a
    recipe with schedule=context), or None. messages / full_text: the history with this turn's
    message and its rendering, kept as the conversation's once the turn ends; None for raw prompts
    (LLM.generate, /v1/completions), which keep no history. prefix_end: on a first chat turn with a
    system prompt, the absolute position where it ends (0: none): a clean boundary where the prefill
    stops, the recipe closes the prefix (Recipe.after_prefix) and the engine's prefix index keeps or
    gives its KV (turnkv/engine/prefix.py). share_prefixes: whether the turn may take KV from the
    prefix index and give its boundaries to it; False: the turn prefills everything it does not
    reuse from its own conversation, and the index neither gives nor keeps anything of it.
    """

    keep: int
    new_ids: list[int]
    segment_end: int = 0
    context_end: int | None = None
    messages: list[dict] | None = None
    full_text: str = ""
    prefix_end: int = 0
    share_prefixes: bool = True


class TurnRun:
    """One turn of one conversation, from restore to finish or undo.

    tiers: the state tiers' hooks (before_turn / after_turn / abort_turn), or None where the caller
    keeps the conversation's state itself (the server's store, one-shot generation)."""

    def __init__(self, conv, inputs: TurnInput, gen: Generation, tiers=None):
        self.conv, self.inputs, self.gen, self.tiers = conv, inputs, gen, tiers
        self.recipe, self.state = conv.recipe, conv.method_state
        self.inv_freq = conv.llm.model.inv_freq
        self.number = len(conv.turns) + 1  # 1 for the first turn
        self.prompt: list[int] = []
        self.cached = 0
        self.prefilled = 0
        self.started = False  # something was written that an undo must take back
        self.finished = False
        self.window_before = None
        self.segment_end = 0
        self.prefix_at = 0  # absolute end of a prefix still to prefill and close (0: none)
        self.rollback_to = 0  # where an undo takes the KV back to
        self.watch = None  # called as watch(turn, index, token, logits) before a token is accepted
        self.prompt_hook_due = False  # the prompt is in and its after-prompt hook waits for settle()

    # ---- the turn's parts ------------------------------------------------------------------------
    @property
    def seq(self) -> SequenceKV:
        return self.conv.kv

    @property
    def context(self) -> StepContext:
        return self.state.context

    @property
    def prefill_left(self) -> int:
        return len(self.prompt) - self.prefilled

    @property
    def done(self) -> bool:
        return self.gen.done

    def begin(self) -> TurnRun:
        """Bring the state back (tiers), drop the kept KV this turn may not reuse, and work out the
        tokens to prefill. A turn that ends inside the kept history (a regenerated reply) feeds its
        last token again: sampling needs the logits after it."""
        conv, inputs = self.conv, self.inputs
        if self.tiers is not None:
            self.tiers.before_turn(conv, len(inputs.new_ids) + self.gen.params.max_new_tokens)
        conv._roll_back_to_reusable(inputs.keep)
        if not inputs.new_ids and conv.kv.next_position >= inputs.keep:
            conv._roll_back(inputs.keep - 1)
        self.cached = self.rollback_to = conv.kv.next_position
        self.prompt = conv.tokens[self.cached : inputs.keep] + inputs.new_ids
        self.segment_end = self.cached if conv.turns else inputs.segment_end
        window = self.state.window
        self.window_before = window.snapshot() if window is not None else None
        if not conv.turns and inputs.prefix_end > self.cached:
            self.prefix_at = inputs.prefix_end
        if not conv.turns and self.cached == 0 and inputs.messages is not None and inputs.share_prefixes:
            # A chat's first turn: the index may hold its system prompt, or earlier turns it carries.
            attached = prefix.attach(conv, self.prompt, inputs.prefix_end)
            if attached:
                self.started, self.prefix_at = True, 0
                self.cached, self.prompt = attached, self.prompt[attached:]
        return self

    def prefill(self, size: int | None = None, defer_prompt_hook: bool = False) -> torch.Tensor | None:
        """Prefill the next `size` prompt tokens (None: all that is left). The recipe compresses the
        context where it ends, and runs its after-prompt hook once the prompt is in; with
        defer_prompt_hook, that hook waits for settle(), so the first token can be sampled and sent
        first (the logits do not depend on it). Returns the logits [V] after the last prompt token
        once it is in, else None."""
        runner, kv = self.conv.llm.runner, self.conv.kv
        budget = self.prefill_left if size is None else size
        logits = None
        while budget > 0 and self.prefill_left:
            chunk = self.next_chunk(budget)
            self.started = True
            logits = runner.prefill(kv, chunk, context=self.context)
            self._advance(len(chunk))
            budget -= len(chunk)
        if self.prefill_left:
            return None
        self._prompt_in(defer_prompt_hook)
        return logits

    def _prompt_in(self, defer: bool) -> None:
        self.prompt_hook_due = True
        if not defer:
            self.settle()

    def settle(self) -> None:
        """Run the recipe's after-prompt hook if a prefill deferred it. decode_loop.step/decode and
        finish() call it first (the server's scheduler right after the first token), so the hook
        always runs before the turn's first decode forward."""
        if self.prompt_hook_due:
            self.recipe.after_prompt(self.conv.kv, self.state, self.segment_end, self.inv_freq, self.number)
            self.prompt_hook_due = False

    def next_chunk(self, size: int) -> list[int]:
        """The prompt tokens one forward of at most `size` tokens prefills next: it stops where a
        separate context ends (the recipe compresses there before the rest is prefilled) and where a
        shareable prefix ends (it is closed and published there)."""
        stop = len(self.prompt)
        context_at, prefix_at = self._context_at, self._prefix_at
        if context_at is not None and self.prefilled < context_at:
            stop = context_at
        if prefix_at is not None and self.prefilled < prefix_at:
            stop = min(stop, prefix_at)
        return self.prompt[self.prefilled : min(stop, self.prefilled + size)]

    def chunk_prefilled(self, n: int, logits: torch.Tensor, defer_prompt_hook: bool = False) -> torch.Tensor | None:
        """A forward the caller ran (a mixed step, engine/mixed.py) wrote next_chunk()'s `n` tokens and
        their recipe observations, as prefill() would have; `logits` [V] are at its last token. Runs the
        hooks prefill() runs at that point; returns `logits` once the prompt is in, else None."""
        self.started = True
        self._advance(n)
        if self.prefill_left:
            return None
        self._prompt_in(defer_prompt_hook)
        return logits

    @property
    def _context_at(self) -> int | None:
        """Prompt index where a separate context ends (None: no separate context)."""
        return None if self.inputs.context_end is None else self.inputs.context_end - self.cached

    @property
    def _prefix_at(self) -> int | None:
        """Prompt index where a shareable prefix ends (None: none left to close)."""
        return self.prefix_at - self.cached if self.prefix_at else None

    def _advance(self, n: int) -> None:
        self.prefilled += n
        if self.prefill_left:
            self.recipe.after_slice(self.conv.kv)
        if self.prefilled == self._prefix_at:
            self.recipe.after_prefix(self.conv.kv, self.state, self.prefix_at, self.inv_freq, self.number)
            if self.cached == 0 and self.inputs.share_prefixes:
                prefix.publish(self.conv, self.prompt[: self._prefix_at])
        if self.prefilled == self._context_at:
            self.recipe.after_context(self.conv.kv, self.state, self.inputs.context_end, self.inv_freq, self.number)

    def prefilled_elsewhere(self) -> None:
        """The caller filled the whole prompt's KV (and the recipe's observations of it) itself, as
        prefill() would have (a copy of the same forward): the turn goes on from there."""
        self.started = True
        self.prefilled = len(self.prompt)
        self._prompt_in(defer=False)

    def take(self, logits: torch.Tensor) -> str:
        """Sample (or force) the next token from logits [V] and accept it; returns the text it made final."""
        token = self.gen.sample(logits)
        if self.watch is not None:
            self.watch(self, len(self.gen.token_ids), token, logits)
        return self.gen.accept(token)

    def after_step_hook(self) -> None:
        """The recipe's per-decode-step hook (decode-schedule eviction, the streaming heads' trim)."""
        self.recipe.after_decode_step(self.conv.kv, self.state, self.inv_freq, self.number)

    def after_step(self, logits: torch.Tensor) -> str:
        """A decode step ran for this turn: the recipe's hook, then the token from its logits row."""
        self.after_step_hook()
        return self.take(logits)

    def finish(self) -> Reply:
        """The recipe's turn-end hook, the reply, and the conversation's history (chat turns)."""
        conv = self.conv
        self.settle()  # a turn whose first token ended it
        self.recipe.at_turn_end(conv.kv, self.state, self.inv_freq, self.number)
        reply = self.gen.reply(prompt_tokens=len(self.prompt), cached_tokens=self.cached)
        if self.inputs.messages is not None:
            conv._record_turn(self.inputs, self.cached, reply)
            if self.inputs.share_prefixes:
                prefix.publish_turn_end(conv)
        self.finished = True
        if self.tiers is not None:
            self.tiers.after_turn(conv)
        return reply

    def abandon(self) -> None:
        """Undo what the turn wrote (failure, disconnect, an abandoned stream): the KV and the
        recipe's bookkeeping go back to where the turn found them (tokens a recipe already evicted
        stay evicted)."""
        if self.finished:
            return
        self.finished = True
        if self.started:
            self.conv._roll_back(self.rollback_to, self.window_before)
        if self.tiers is not None:
            self.tiers.abort_turn(self.conv)

    def continued_by(self, conv, gen: Generation) -> TurnRun:
        """This turn, at its current point, carried on by `conv` (a copy of this conversation, its
        state tiers' turn begun) with generation `gen`; an undo takes the copy back to the turn's start."""
        twin = type(self)(conv, self.inputs, gen, self.tiers)
        twin.number, twin.prompt, twin.cached = self.number, self.prompt, self.cached
        twin.prefilled, twin.segment_end, twin.started = self.prefilled, self.segment_end, True
        twin.prefix_at, twin.rollback_to = self.prefix_at, self.rollback_to
        twin.prompt_hook_due = self.prompt_hook_due
        return twin
