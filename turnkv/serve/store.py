"""Conversations kept between requests, and how a request finds the one it continues.

A request reuses a stored conversation's KV up to its last clean boundary (a token count where its
tokens were made by one encode call or one reply) inside the text the two share, and is encoded from
there: reuse never serves stale KV nor changes tokenization. With X-Session-Id it continues the pinned
conversation; otherwise the idle unpinned one sharing the longest prefix (keeping its first prompt), or
under a compressing recipe only one it extends exactly. Idle conversations leave a full pool LRU-first
through a TierHook, and are dropped (counted) when the tiers are full too.
Design: docs/architecture.md#the-serving-store"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from turnkv.engine.conversation import Conversation
from turnkv.serve.engine_ops import EngineOps

if TYPE_CHECKING:
    from turnkv.engine.llm import LLM


class TierHook(Protocol):
    """Where idle conversations go when the KV pool fills, and where they come back from."""

    names: tuple[str, ...]  # the tiers below the pool, as /metrics labels them
    durable: bool  # whether one of them outlives the process

    def begin(self, conv: Conversation) -> list[str]:
        """A request starts on the conversation: bring its state back into the pool if it left, and
        keep it there until end(). All or nothing; may raise KVCacheFullError (the store then evicts
        another conversation and retries). Returns "offloaded" for each idle conversation it moved
        out of the pool to make room."""

    def end(self, conv: Conversation) -> None:
        """The request on the conversation ended (finished, failed or undone)."""

    def offload(self, conv: Conversation, durable: bool = False) -> bool:
        """Move an idle conversation's state out of the pool (durable: into a tier that outlives the
        process). True: it is kept there; False: no tier can take it, and nothing changed."""

    def discard(self, conv: Conversation) -> None:
        """The store forgets the conversation: free what the tiers hold of it."""

    def settle(self, block: bool = False) -> int:
        """Finish the moves out of the pool that run in the background (a pack on its own thread):
        the pages of each one done go back to the pool. With block, wait for one first when none is
        done. Returns how many it finished; until then a moving conversation's pages count as used,
        and begin() on it raises PackInFlight."""

    def packing(self) -> int:
        """Moves out of the pool running in the background (packs in flight): pages that come back
        to the pool as settle() takes them."""

    def watch_packs(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call fn() (from another thread) whenever a move running in the background finishes, so a
        caller waiting for room can settle() then; returns what stops that."""

    def where(self, conv: Conversation) -> str:
        """"gpu" (in the pool) or one of `names`."""

    def stored_bytes(self, conv: Conversation) -> int:
        """Bytes the tiers hold for a conversation that is in one of them."""

    def kept(self) -> list[tuple[Conversation, float]]:
        """Conversations an earlier process left in a durable tier, with the time.time() of their
        last use."""


def session_key(session: str) -> str:
    """The tier key of the conversation pinned to `session` (letters, digits and '-', as the disk
    tier's file names need)."""
    return "session-" + hashlib.sha256(session.encode()).hexdigest()[:40]


@dataclass(eq=False)
class Entry:
    conv: Conversation
    recipe_key: str
    session: str | None = None  # session_key() of the session that pins it
    marks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # clean boundaries (tokens, chars)
    anchor: int = 0  # chars of the first turn's prompt: what an unpinned request must keep to continue it
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def reusable(self, text: str) -> tuple[int, int, bool]:
        """(tokens, chars) of the last clean boundary inside the prefix `text` shares with this
        conversation, and whether `text` extends the conversation exactly."""
        own = self.conv.text
        if text.startswith(own):
            return len(self.conv.tokens), len(own), True
        lo, hi = 0, len(self.marks) - 1  # marks[0] = (0, 0) is always shared
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if text.startswith(own[: self.marks[mid][1]]):
                lo = mid
            else:
                hi = mid - 1
        return *self.marks[lo], False

    def cut(self, ops, tokens: int, chars: int) -> None:
        """Roll the conversation back to the clean boundary (tokens, chars) (ops: the EngineOps)."""
        ops.cut(self.conv, tokens, chars)
        self.marks = [m for m in self.marks if m[0] <= tokens]
        if chars < self.anchor:  # inside the first prompt: the next turn's prompt becomes the anchor
            self.anchor = 0

    def record_turn(self, system: tuple[int, int] | None, prompt: tuple[int, int]) -> None:
        """A turn finished: its prompt and its reply end on clean boundaries."""
        if system is not None:
            self.marks.append(system)
        if self.anchor == 0:
            self.anchor = prompt[1]
        self.marks += [prompt, (len(self.conv.tokens), len(self.conv.text))]


@dataclass
class Claim:
    entry: Entry
    keep: int  # stored tokens that stay valid for the request
    keep_chars: int  # the text they render to


class ConversationStore:
    """Only the worker thread changes it; metrics read its counts from the HTTP thread."""

    def __init__(self, llm: LLM, reuse: bool = True, tiers: TierHook | None = None, idle_ttl_s: float | None = None,
                 on_evict: Callable[[str], None] | None = None, ops: EngineOps | None = None):
        """ops: the seam every change to the engine goes through (engine_ops.py; made here over `tiers`
        unless given, and then `tiers` is ops.tiers)."""
        self.ops = ops or EngineOps(llm, tiers)
        self.llm, self.reuse, self.tiers, self.idle_ttl_s = llm, reuse, self.ops.tiers, idle_ttl_s
        self.on_evict = on_evict or (lambda how: None)  # each conversation leaving the pool: "offloaded", "dropped"
        self.tier_names = ("gpu", *(self.tiers.names if self.tiers is not None else ()))
        self.entries: list[Entry] = []
        self.sessions: dict[str, Entry] = {}  # by session_key()

    # ---- claiming ---------------------------------------------------------------------------------
    def session_busy(self, session: str | None) -> bool:
        entry = self.sessions.get(session_key(session)) if session is not None and self.reuse else None
        return entry is not None and entry.busy

    def claim(self, text: str, recipe, recipe_key: str, session: str | None) -> Claim:
        """The conversation a request with rendered chat `text` continues (rolled back to what stays
        valid), or a new one. The caller has checked that the session is not busy."""
        compressing = recipe.evict is not None
        if not self.reuse:
            return self._take(self._new(recipe, recipe_key, None), 0, 0)
        if session is not None:
            key = session_key(session)
            entry = self.sessions.get(key)
            if entry is None or entry.recipe_key != recipe_key:
                if entry is not None:
                    self._drop(entry)
                entry = self._new(recipe, recipe_key, key)
            tokens, chars, exact = entry.reusable(text)
            if compressing and not exact:
                tokens, chars = 0, 0
        else:
            best = None
            for e in self.entries:
                if e.busy or e.session is not None or e.recipe_key != recipe_key:
                    continue
                tokens, chars, exact = e.reusable(text)
                if chars < e.anchor or (compressing and not exact):
                    continue
                if best is None or (tokens, e.last_used) > (best[1], best[0].last_used):
                    best = (e, tokens, chars)
            if best is None:
                return self._take(self._new(recipe, recipe_key, None), 0, 0)
            entry, tokens, chars = best
        return self._take(entry, tokens, chars)

    def _take(self, entry: Entry, tokens: int, chars: int) -> Claim:
        if tokens == 0:  # nothing reused: start clean (also resets a compressing recipe's state and
            self.ops.reset(entry.conv)  # forgets a stored copy, which then needs no restore)
            entry.marks, entry.anchor = [(0, 0)], 0
        if self.tiers is not None:  # before the cut: it may fail for room, and then nothing changed
            for how in self.tiers.begin(entry.conv):
                self.on_evict(how)
        entry.busy = True
        if tokens:
            entry.cut(self.ops, tokens, chars)
        return Claim(entry, tokens, chars)

    def _new(self, recipe, recipe_key: str, session: str | None) -> Entry:
        entry = Entry(self.ops.new_conversation(recipe, recipe_key, session), recipe_key, session)
        if session is not None:
            self.sessions[session] = entry
        self.entries.append(entry)
        return entry

    def release(self, entry: Entry) -> None:
        """The request on `entry` ended (finished, failed or abandoned)."""
        if self.tiers is not None:
            self.tiers.end(entry.conv)
        entry.busy = False
        entry.last_used = time.monotonic()
        if not self.reuse or not entry.conv.turns:
            self._drop(entry)

    # ---- memory ------------------------------------------------------------------------------------
    def where(self, entry: Entry) -> str:
        """The tier the entry's state is in: "gpu" (the KV pool) or one of the hook's names."""
        return "gpu" if self.tiers is None else self.tiers.where(entry.conv)

    def settle(self, block: bool = False) -> int:
        """Finish the tiers' background moves out of the pool (TierHook.settle); how many finished."""
        return self.tiers.settle(block) if self.tiers is not None else 0

    def packing(self) -> int:
        """Moves out of the pool in flight (TierHook.packing)."""
        return self.tiers.packing() if self.tiers is not None else 0

    def watch_packs(self, fn: Callable[[], None]) -> Callable[[], None]:
        """TierHook.watch_packs (without tiers nothing moves in the background: fn is never called)."""
        return self.tiers.watch_packs(fn) if self.tiers is not None else (lambda: None)

    def evict_one(self, wait: bool = True) -> bool:
        """Take the least recently used idle conversation off the pool; False when no idle conversation
        holds pages. When the tiers cannot take it, the least recently used idle conversation is
        dropped: a stored one older than it (then the offload is tried again), or else this one.
        With no idle conversation in the pool, finish a background move out of it (with wait, waiting
        for one when none is done)."""
        idle = [e for e in self.entries if not e.busy and self.where(e) == "gpu"]
        if not idle:
            return self.settle(block=wait) > 0
        victim = min(idle, key=lambda e: e.last_used)
        while self.tiers is not None:
            if self.tiers.offload(victim.conv):
                self.ops.free(victim.conv)  # a hook may copy the KV out and leave the pages to the store
                self.on_evict("offloaded")
                return True
            older = [e for e in self.entries
                     if not e.busy and e.last_used < victim.last_used and self.where(e) != "gpu"]
            if not older:
                break
            self._drop(min(older, key=lambda e: e.last_used))
            self.on_evict("dropped")
        self._drop(victim)
        self.on_evict("dropped")
        return True

    def expire(self, now: float | None = None) -> int:
        """Drop idle conversations unused for idle_ttl_s; returns how many."""
        if self.idle_ttl_s is None:
            return 0
        now = time.monotonic() if now is None else now
        old = [e for e in self.entries if not e.busy and now - e.last_used > self.idle_ttl_s]
        for e in old:
            self._drop(e)
        return len(old)

    def flush(self) -> tuple[int, int]:
        """Drop every idle conversation (from every tier) and every entry of the engine's prefix
        index; returns (conversations, index entries) dropped. Running requests keep their KV, shared
        pages included. With none running, the pool then holds only what the engine keeps for itself."""
        idle = [e for e in self.entries if not e.busy]
        for e in idle:
            self._drop(e)
        return len(idle), self.ops.clear_index()

    def shutdown(self) -> tuple[int, int]:
        """The server stops (no request runs): idle conversations go to the durable tier when there is
        one, where a server started over it continues them; the others are dropped, so the engine's
        memory goes back to what it was. Returns (kept, dropped)."""
        durable = self.reuse and self.tiers is not None and self.tiers.durable
        kept = dropped = 0
        for e in [e for e in self.entries if not e.busy]:
            if durable and self.tiers.offload(e.conv, durable=True):
                self.ops.free(e.conv)
                self.entries.remove(e)  # forgotten here, not discarded: the disk keeps it
                self.sessions.pop(e.session, None)
                kept += 1
            else:
                self._drop(e)
                dropped += 1
        return kept, dropped

    def adopt(self) -> int:
        """Take back the conversations an earlier server left in the durable tier (at start-up, before
        the worker runs); returns how many."""
        if not self.reuse or self.tiers is None:
            return 0
        tokenizer = self.llm.tokenizer
        wall, now = time.time(), time.monotonic()
        for conv, used in sorted(self.tiers.kept(), key=lambda item: item[1]):
            entry = Entry(conv, str(conv.recipe), last_used=now - max(0.0, wall - used))
            entry.marks, entry.anchor = clean_marks(conv, tokenizer)
            self.ops.adopt(conv)
            if conv.id.startswith("session-"):
                entry.session = conv.id
                self.sessions[conv.id] = entry
            self.entries.append(entry)
        return len(self.entries)

    def _drop(self, entry: Entry) -> None:
        if self.tiers is not None and self.where(entry) != "gpu":
            self.tiers.discard(entry.conv)
        self.ops.close(entry.conv)
        if entry in self.entries:
            self.entries.remove(entry)
        if entry.session is not None and self.sessions.get(entry.session) is entry:
            del self.sessions[entry.session]

    # ---- what metrics read (from the HTTP thread, while the worker moves things) ------------------
    def _snapshot(self, tier: str) -> list[Entry]:
        out = []
        for e in list(self.entries):
            try:
                if not e.busy and self.where(e) == tier:
                    out.append(e)
            except (KeyError, OSError, ValueError):  # it moved while we looked
                pass
        return out

    def count(self, tier: str) -> int:
        return len(self._snapshot(tier))

    def kv_bytes(self, tier: str) -> int:
        """Bytes the idle conversations in `tier` hold: KV pages in the pool, what their state strategy
        stored in the other tiers."""
        total = 0
        for e in self._snapshot(tier):
            try:
                total += e.conv.kv.bytes() if tier == "gpu" else self.tiers.stored_bytes(e.conv)
            except (KeyError, OSError, ValueError):
                pass
        return total

    def bytes_saved(self, dense_bytes_per_token: int) -> int:
        return sum(max(0, e.conv.kv.next_position * dense_bytes_per_token - e.conv.kv.bytes())
                   for e in self._snapshot("gpu") if e.conv.recipe.evict is not None)


def clean_marks(conv: Conversation, tokenizer) -> tuple[list[tuple[int, int]], int]:
    """The clean boundaries (and anchor) of a conversation taken back from a tier, which keeps its
    turns but not the store's marks: the ends of each turn's system prompt, prompt and reply, each
    kept only where its tokens decode to the start of the conversation's text, so a request is never
    served from a boundary the text does not confirm."""
    marks, anchor = [(0, 0)], None
    for i, turn in enumerate(conv.turns):
        ends = ([turn.system_end] if i == 0 and turn.system_end else []) + [turn.prompt_end, turn.end]
        for n in ends:
            text = tokenizer.decode(conv.tokens[:n], skip_special_tokens=False)
            if n > marks[-1][0] and conv.text.startswith(text):
                marks.append((n, len(text)))
                if i == 0 and n == turn.prompt_end:
                    anchor = len(text)
    # Without a confirmed first prompt, an unpinned request must extend the whole conversation.
    return marks, len(conv.text) if anchor is None else anchor
