"""Conversations kept between requests, and how a request finds the one it continues.

A request's messages render (chat template) to a text. A stored conversation knows the text its
tokens render to and its *clean boundaries*: token counts where its tokens were made by one encode
call or one reply (the start, the end of the system prompt, the end of each turn's prompt, the end of
each reply). A request reuses the conversation's KV up to the last boundary inside the text the two
share; the conversation is rolled back to it, and the rest of the request is encoded from there, as
a turn-by-turn run would encode it. So reuse never serves stale KV and never changes how a request is
tokenized: an edited earlier message is served from the longest valid prefix.

Who may continue what:
- with an X-Session-Id header, the conversation pinned to that session, wherever the request
  diverges from it;
- otherwise the idle, unpinned conversation sharing the longest prefix, if the request keeps at least
  its first turn's prompt: a new chat that only shares the system prompt starts a conversation of its
  own instead of cutting short another client's;
- under a compressing recipe, only a request that extends the conversation exactly (the usual case:
  the client sends back the reply it got). Its kept tokens were chosen with the later text in view,
  so after an edit they are not what a fresh run would keep, and the request starts afresh.

When the KV pool fills, idle conversations leave it least recently used first: through a TierHook
(issue #8's CPU/disk tiers plug in there) or, without one, they are dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from turnkv.engine.conversation import Conversation

if TYPE_CHECKING:
    from turnkv.engine.llm import LLM


class TierHook(Protocol):
    """Where idle conversations go when the KV pool fills, and where they come back from."""

    def offload(self, conv: Conversation) -> bool:
        """Copy the conversation's KV and recipe state out of the pool. True: it is kept there, and
        the store frees its pages; False: the store drops the conversation."""

    def restore(self, conv: Conversation) -> None:
        """Put the KV back into the pool before a request continues the conversation. All or nothing;
        may raise KVCacheFullError (the store then evicts another conversation and retries)."""

    def discard(self, conv: Conversation) -> None:
        """The store forgets the conversation: free what the tier holds of it."""


@dataclass(eq=False)
class Entry:
    conv: Conversation
    recipe_key: str
    session: str | None = None
    marks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # clean boundaries (tokens, chars)
    anchor: int = 0  # chars of the first turn's prompt: what an unpinned request must keep to continue it
    busy: bool = False
    offloaded: bool = False
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

    def cut(self, tokens: int, chars: int) -> None:
        """Roll the conversation back to the clean boundary (tokens, chars)."""
        conv = self.conv
        if conv.kv.next_position > tokens:
            conv._roll_back(tokens)
        conv.tokens, conv.text = conv.tokens[:tokens], conv.text[:chars]
        conv.turns = [t for t in conv.turns if t.end <= tokens]
        self.marks = [m for m in self.marks if m[0] <= tokens]
        if not conv.turns:
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

    TIERS = ("gpu", "offloaded")

    def __init__(self, llm: LLM, reuse: bool = True, tiers: TierHook | None = None, idle_ttl_s: float | None = None):
        self.llm, self.reuse, self.tiers, self.idle_ttl_s = llm, reuse, tiers, idle_ttl_s
        self.entries: list[Entry] = []
        self.sessions: dict[str, Entry] = {}

    # ---- claiming ---------------------------------------------------------------------------------
    def session_busy(self, session: str | None) -> bool:
        entry = self.sessions.get(session) if session is not None and self.reuse else None
        return entry is not None and entry.busy

    def claim(self, text: str, recipe, recipe_key: str, session: str | None) -> Claim:
        """The conversation a request with rendered chat `text` continues (rolled back to what stays
        valid), or a new one. The caller has checked that the session is not busy."""
        compressing = recipe.evict is not None
        if not self.reuse:
            return Claim(self._new(recipe, recipe_key, None), 0, 0)
        if session is not None:
            entry = self.sessions.get(session)
            if entry is None or entry.recipe_key != recipe_key:
                if entry is not None:
                    self._drop(entry)
                entry = self._new(recipe, recipe_key, session)
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
        if entry.offloaded:
            self.tiers.restore(entry.conv)  # before anything changes: it may fail for room
            entry.offloaded = False
        entry.busy = True
        if tokens == 0:  # nothing reused: start clean (also resets a compressing recipe's state)
            entry.conv.reset()
            entry.marks, entry.anchor = [(0, 0)], 0
        else:
            entry.cut(tokens, chars)
        return Claim(entry, tokens, chars)

    def _new(self, recipe, recipe_key: str, session: str | None) -> Entry:
        entry = Entry(Conversation(self.llm, None, recipe), recipe_key, session)
        self.entries.append(entry)
        if session is not None:
            self.sessions[session] = entry
        return entry

    def release(self, entry: Entry) -> None:
        """The request on `entry` ended (finished, failed or abandoned)."""
        entry.busy = False
        entry.last_used = time.monotonic()
        if not self.reuse or not entry.conv.turns:
            self._drop(entry)

    # ---- memory ------------------------------------------------------------------------------------
    def evict_one(self) -> str | None:
        """Take the least recently used idle conversation off the pool; returns how ("offloaded",
        "dropped"), or None when no idle conversation holds pages."""
        idle = [e for e in self.entries if not e.busy and not e.offloaded]
        if not idle:
            return None
        entry = min(idle, key=lambda e: e.last_used)
        if self.tiers is not None and self.tiers.offload(entry.conv):
            entry.conv.kv.free()
            entry.offloaded = True
            return "offloaded"
        self._drop(entry)
        return "dropped"

    def expire(self, now: float | None = None) -> int:
        """Drop idle conversations unused for idle_ttl_s; returns how many."""
        if self.idle_ttl_s is None:
            return 0
        now = time.monotonic() if now is None else now
        old = [e for e in self.entries if not e.busy and now - e.last_used > self.idle_ttl_s]
        for e in old:
            self._drop(e)
        return len(old)

    def flush(self) -> int:
        """Drop every idle conversation; returns how many."""
        idle = [e for e in self.entries if not e.busy]
        for e in idle:
            self._drop(e)
        return len(idle)

    def persist_idle(self) -> int:
        """At shutdown: hand every idle conversation to the tiers (the disk tier survives a restart)."""
        if self.tiers is None:
            return 0
        kept = 0
        for e in self.entries:
            if not e.busy and not e.offloaded and self.tiers.offload(e.conv):
                e.conv.kv.free()
                e.offloaded = True
                kept += 1
        return kept

    def _drop(self, entry: Entry) -> None:
        if entry.offloaded and self.tiers is not None:
            self.tiers.discard(entry.conv)
        entry.conv.close()
        if entry in self.entries:
            self.entries.remove(entry)
        if entry.session is not None and self.sessions.get(entry.session) is entry:
            del self.sessions[entry.session]

    # ---- what metrics read ----------------------------------------------------------------------
    def _snapshot(self, tier: str) -> list[Entry]:
        return [e for e in list(self.entries) if not e.busy and e.offloaded == (tier == "offloaded")]

    def count(self, tier: str) -> int:
        return len(self._snapshot(tier))

    def kv_bytes(self, tier: str) -> int:
        return sum(e.conv.kv.bytes() for e in self._snapshot(tier))

    def bytes_saved(self, dense_bytes_per_token: int) -> int:
        return sum(max(0, e.conv.kv.next_position * dense_bytes_per_token - e.conv.kv.bytes())
                   for e in self._snapshot("gpu") if e.conv.recipe.evict is not None)
