"""Admission by memory: whether a request whose tokens are known may start its prefill now.

--max-running is a ceiling on requests; under it, a request starts once the KV pool can hold what it
will add at its largest, under its recipe, beside the headroom every running request still needs.
A compressing recipe's conversation is smaller after its prompt (ada-snapkv keep_ratio=0.1 keeps a
tenth), so more of them run together than dense ones.

Everything is counted in pages per layer, with the tokens of a (layer, KV head) spread evenly over
the heads (a head-wise allocation such as Ada-KV's keeps the same total):

    peak(job)     = pages after its prompt before compression, or after its reply, whichever is larger
                  = pages(max(held + prompt, resident(recipe, held + prompt) + max_new_tokens))
    headroom(job) = max(0, peak(job) - pages it holds now)           for every running request
    available     = free pages + pages of idle conversations in the pool (they can go to the tiers)

A request fits when headroom(it) + sum(headroom(running)) <= available. Requests start in arrival
order: one that does not fit holds the longer ones behind it, so a long prompt is never starved by
long ones, and only short prompts (one prefill chunk at most) pass it; the scheduler (scheduler.py)
says why they do not delay it. With none running, requests whose conversation is back in the pool
pass it too (their pages are what it lacks), and when none fits one starts anyway (a prompt no pool
can hold was refused at ready()), unless the pages it lacks are coming back: held by packs in flight
(the pages of a conversation leaving the pool count as used until its pack lands,
state/background.py) or by requests still encoding.

LServe's streaming heads count as what their trim leaves at most (sink and a ring; during the prompt
the prefill window and the slice being prefilled), dense heads as every token, in the layer with the
most dense heads. Conservative where a recipe frees less than its budget says: decode-schedule
eviction counts as keeping everything it is given.
"""

from __future__ import annotations

import math

import numpy as np

from turnkv.engine import mixed


def resident_tokens(recipe, positions: int, prompt: int) -> int:
    """Tokens per KV head a conversation of `positions` positions keeps once its recipe compressed
    the prompt it just prefilled (`prompt` tokens of them are this turn's)."""
    evict = recipe.evict
    if evict is None or evict.schedule not in ("prefill", "prompt", "context"):
        return positions
    kept = evict.budget if evict.budget is not None else math.ceil(evict.keep_ratio * positions)
    if recipe.turns.name == "flowkv":  # FlowKV keeps the running turn whole
        kept += prompt
    return min(positions, kept)


class MemoryGate:
    """Reads the pool and the store; changes nothing. `job` is a serve Job after ready()."""

    def __init__(self, pool, store, slice_tokens: int = 0):
        self.pool, self.store = pool, store
        self.slice_tokens = slice_tokens  # the longest prefill slice: what a trimmed head adds before its next trim

    def pages(self, tokens: int, recipe=None, prompt_open: bool = False) -> int:
        """Pages per layer that `tokens` tokens in every KV head take (under `recipe`'s static
        heads, which keep at most their trim's bound: in the layer with the most heads that keep all)."""
        ps = self.pool.page_size
        static = recipe.static_sparsity if recipe is not None else None
        bound = static.kept_at_most(prompt_open, ps) if static is not None else None
        if bound is None:
            return self.pool.num_kv_heads * -(-tokens // ps)
        if prompt_open:
            bound += self.slice_tokens
        streaming = static.flags(self.pool.num_layers, self.pool.num_kv_heads).sum(axis=1)
        most = int(self.pool.num_kv_heads - streaming.min())  # whole heads in the layer with the most
        return most * -(-tokens // ps) + (self.pool.num_kv_heads - most) * -(-min(tokens, bound) // ps)

    def held(self, job) -> int:
        """Pages per layer the request's conversation holds now (its most-used layer)."""
        num_pages = job.conv.kv.num_pages
        return int(num_pages.sum(axis=1).max()) if num_pages.size else 0

    def peak(self, job) -> int:
        """Pages per layer the request's conversation holds at its largest during this turn."""
        turn = job.turn
        lengths = job.conv.kv.lengths
        held = int(np.ceil(lengths.mean(axis=1).max())) if lengths.size else 0
        prompt = turn.prefill_left
        after = resident_tokens(turn.recipe, turn.seq.next_position + prompt, prompt)
        grow = max(0, turn.gen.params.max_new_tokens - len(turn.gen.token_ids))
        recipe = turn.recipe
        return max(self.pages(held + prompt, recipe, prompt_open=prompt > 0), self.pages(after + grow, recipe))

    def headroom(self, job) -> int:
        return max(0, self.peak(job) - self.held(job))

    def available(self) -> int:
        free = min(self.pool.free_pages(layer) for layer in range(self.pool.num_layers))
        idle = self.store.kv_bytes("gpu") // (self.pool.page_bytes * self.pool.num_layers)
        return free + idle

    def fits(self, job, running: list) -> bool:
        return self.headroom(job) + sum(self.headroom(j) for j in running) <= self.available()


def pick_slices(prefilling: list, budget: int, slice_size) -> list:
    """(job, part) of the prefill slices a mixed step carries beside its decode tokens: whole slices of
    the prefilling jobs (slice_size(job) tokens at most each) in arrival order while they fit in
    `budget` tokens (the first always goes; a slice that does not fit lets shorter ones by), and of
    the slices that end a prompt whose recipe then compresses it, only the first: every running stream
    waits for those compressions, so a step runs at most one."""
    slices, compressing = [], False
    for job in prefilling:
        part = mixed.slice_part(job.turn, slice_size(job))
        ends_compressing = part.width >= job.prefill_left and job.turn.recipe.compresses_after_prompt
        if slices and (part.size > budget or (compressing and ends_compressing)):
            continue
        slices.append((job, part))
        budget -= part.size
        compressing |= ends_compressing
    return slices
