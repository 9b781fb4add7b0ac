"""A radix tree over token ids of prefixes whose KV stays in the page pool for later conversations.

An entry is the KV of one conversation at a clean boundary (the end of its system prompt, or of a
turn under a recipe whose kept state depends on the token ids alone), kept
under a namespace (what else decides that KV: the model and the recipe's canonical string) and the
token ids before the boundary. The entry holds the conversation's pages as one more holder
(SequenceKV.share_from), so they stay when the conversation goes; a conversation that begins with the
same tokens takes them (`attach`) instead of prefilling them, and copies a page before writing into
it (turnkv/kv/sequence.py). `extra` carries what the recipe kept beside the KV at that point (its
observation window, its log), opaque here.

Entries are kept least recently used first, under `max_bytes` of the distinct pages they hold: the
successive turn ends of one conversation share their earlier pages, which count once. The pool
drops entries in the same order when an allocation lacks room (PagePool.room: `freed_by_drops` counts
what dropping them would free, `drop_oldest` drops them). Dropping an
entry releases its hold only: a page that a conversation still holds stays in the pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV


@dataclass
class PrefixEntry:
    namespace: str
    tokens: tuple[int, ...]
    kv: SequenceKV  # the index's hold on the pages
    extra: dict
    last_used: int = 0
    hits: int = 0
    flat_pages: np.ndarray | None = None  # its pages as layer * pool.num_pages + page (they never change)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this entry holds (pages other entries hold too included)."""
        return self.kv.bytes()


@dataclass
class _Node:
    edge: tuple[int, ...] = ()
    children: dict[int, _Node] = field(default_factory=dict)
    entry: PrefixEntry | None = None


class PrefixIndex:
    def __init__(self, pool: PagePool, max_bytes: int):
        self.pool, self.max_bytes = pool, int(max_bytes)
        self._roots: dict[str, _Node] = {}
        self._entries: dict[tuple[str, tuple[int, ...]], PrefixEntry] = {}
        self._clock = itertools.count(1)
        # Entries holding each page [layers, pages], and how many pages at least one holds.
        self._holds = np.zeros((pool.num_layers, pool.num_pages), dtype=np.int32)
        self._distinct = 0
        self.hits = self.misses = self.inserts = self.evictions = 0
        self.hit_tokens = 0  # tokens the hits gave (the entries' lengths, summed)

    # ---- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def bytes(self) -> int:
        """Bytes of the distinct pages the entries hold (a page several entries hold counts once)."""
        return self._distinct * self.pool.page_bytes

    def longest(self, namespace: str, tokens, lengths=None, at_least: int = 0) -> PrefixEntry | None:
        """The entry of `namespace` with the longest token ids that begin `tokens`, among those whose
        length is in `lengths` (None: any) and at least `at_least`; None when there is none. Not
        counted as a use."""
        best, node, at = None, self._roots.get(namespace), 0
        tokens = tuple(tokens)
        while node is not None:
            if tokens[at : at + len(node.edge)] != node.edge:
                break
            at += len(node.edge)
            if node.entry is not None and at >= at_least and (lengths is None or at in lengths):
                best = node.entry
            if at >= len(tokens):
                break
            node = node.children.get(tokens[at])
        return best

    def lookup(self, namespace: str, tokens, lengths=None, at_least: int = 0) -> PrefixEntry | None:
        """longest(), counted: a hit as a use of the entry (and in `hits`), none in `misses`."""
        best = self.longest(namespace, tokens, lengths, at_least)
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self.hit_tokens += len(best.tokens)
        best.hits += 1
        best.last_used = next(self._clock)
        return best

    def get(self, namespace: str, tokens) -> PrefixEntry | None:
        """The entry for exactly these token ids, or None (not counted as a use)."""
        return self._entries.get((namespace, tuple(tokens)))

    # ---- changes ----------------------------------------------------------------------------
    def insert(self, namespace: str, tokens, seq: SequenceKV, extra: dict) -> PrefixEntry | None:
        """Keep `seq`'s KV (it holds exactly `tokens`' positions) under (namespace, tokens); the
        existing entry when there is one. None when it alone is over the cap."""
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("a prefix needs at least one token")
        found = self._entries.get((namespace, tokens))
        if found is not None:
            return found
        if seq.bytes() > self.max_bytes:
            return None
        held = SequenceKV(self.pool)
        layers, pages = held.share_from(seq)
        entry = PrefixEntry(namespace, tokens, held, extra, next(self._clock),
                            flat_pages=layers * self.pool.num_pages + pages)
        self._place(self._roots.setdefault(namespace, _Node()), tokens, entry)
        self._entries[(namespace, tokens)] = entry
        self._count(entry, +1)
        self.inserts += 1
        self._shrink_to(self.max_bytes, keep=entry)
        return entry

    def remove(self, entry: PrefixEntry) -> None:
        key = (entry.namespace, entry.tokens)
        if self._entries.pop(key, None) is None:
            return
        node, at = self._roots[entry.namespace], 0
        while True:
            at += len(node.edge)
            if at == len(entry.tokens):
                node.entry = None
                break
            node = node.children[entry.tokens[at]]
        self._count(entry, -1)
        entry.kv.free()
        self.evictions += 1

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self.remove(entry)
        self._roots.clear()

    def freed_by_drops(self) -> np.ndarray:
        """[len + 1, layers]: the pages per layer that go back to the pool once the k least recently
        used entries are dropped (drop_oldest(k)), for k = 0..len; drops nothing. A page goes back
        with the entry that lets go of its last hold (the pool's refs count every holder)."""
        entries = self._oldest_first()
        freed = np.zeros((len(entries) + 1, self.pool.num_layers), dtype=np.int64)
        if not entries:
            return freed
        flat = np.concatenate([e.flat_pages for e in entries])
        owner = np.repeat(np.arange(len(entries)), [len(e.flat_pages) for e in entries])
        # How many of these entries, up to and including each one, hold each of its pages.
        order = np.argsort(flat, kind="stable")  # stable: a page's holds stay in age order
        ordered = flat[order]
        first = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1]
        runs = np.diff(np.r_[first, len(flat)])
        seen = np.empty_like(order)
        seen[order] = np.arange(len(flat)) - np.repeat(first, runs) + 1
        last = seen == self.pool.refs.reshape(-1)[flat]  # this entry's hold is the page's last
        np.add.at(freed, (owner[last] + 1, flat[last] // self.pool.num_pages), 1)
        return np.cumsum(freed, axis=0)

    def drop_oldest(self, count: int) -> None:
        """Drop the `count` least recently used entries (the order freed_by_drops counts in)."""
        for entry in self._oldest_first()[:count]:
            self.remove(entry)

    def _oldest_first(self) -> list[PrefixEntry]:
        return sorted(self._entries.values(), key=lambda e: e.last_used)

    # ---- internals --------------------------------------------------------------------------
    def _shrink_to(self, limit: int, keep: PrefixEntry | None = None) -> None:
        """Drop entries but `keep`, least recently used first, until the distinct pages fit `limit`."""
        for entry in self._oldest_first():
            if self.bytes() <= limit:
                return
            if entry is not keep:
                self.remove(entry)

    def _count(self, entry: PrefixEntry, step: int) -> None:
        """Add (+1) or take (-1) `entry`'s hold on its pages in the per-page counts."""
        holds = self._holds.reshape(-1)  # a view, indexed by flat page ids
        counts = holds[entry.flat_pages]
        before = np.count_nonzero(counts)
        counts += step
        holds[entry.flat_pages] = counts
        self._distinct += np.count_nonzero(counts) - before

    @staticmethod
    def _place(root: _Node, tokens: tuple[int, ...], entry: PrefixEntry) -> None:
        node, at = root, 0
        while True:
            if at == len(tokens):
                node.entry = entry
                return
            child = node.children.get(tokens[at])
            if child is None:
                node.children[tokens[at]] = _Node(tokens[at:], entry=entry)
                return
            limit = min(len(child.edge), len(tokens) - at)
            if child.edge[:limit] == tokens[at : at + limit]:
                common = limit
            else:  # where they part: the first position that differs
                common = int(np.flatnonzero(np.asarray(child.edge[:limit]) != np.asarray(tokens[at : at + limit]))[0])
            if common < len(child.edge):  # split the edge where it parts from tokens
                mid = _Node(child.edge[:common], {child.edge[common]: child})
                child.edge = child.edge[common:]
                node.children[tokens[at]] = mid
                child = mid
            node, at = child, at + common
