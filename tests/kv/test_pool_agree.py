"""Reservations agreed across the ranks of a tensor-parallel engine (PagePool.room and its `agree` hook),
without processes: two pools in two threads stand for two ranks, their hook the elementwise max over
both threads' values, as turnkv.parallel.launch.Membership.agree is over the ranks. Each rank's pool
holds its own heads, so one can be fuller than the other: every reserve must then raise
KVCacheFullError on both, at the same point, changing nothing. Also the cache drops a reservation
makes (the prefix index's), counted before they are made."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from turnkv.errors import KVCacheFullError
from turnkv.kv.pool import PagePool
from turnkv.kv.prefix_index import PrefixIndex
from turnkv.kv.sequence import SequenceKV, reserve_step

L, H, D, PS, PAGES = 2, 1, 8, 4, 12


class Ranks:
    """The agree hooks of two pools used from two threads; calls[r]: how often rank r's was called."""

    def __init__(self, size: int = 2):
        self.barrier = threading.Barrier(size, timeout=10)
        self.sent = [None] * size
        self.calls = [0] * size

    def hook(self, rank: int):
        def agree(values: list[int]) -> list[int]:
            self.calls[rank] += 1
            self.sent[rank] = [int(v) for v in values]
            self.barrier.wait()
            out = [max(column) for column in zip(*self.sent)]
            self.barrier.wait()
            return out

        return agree


def pools() -> list[PagePool]:
    """Two ranks' pools, alike until a test sets them apart."""
    return [PagePool(L, H, D, PAGES, PS) for _ in range(2)]


def agreeing(pools_: list[PagePool]) -> Ranks:
    """From now on the pools' reservations agree (in_step runs them, one thread a rank)."""
    ranks = Ranks(len(pools_))
    for rank, pool in enumerate(pools_):
        pool.agree = ranks.hook(rank)
    return ranks


def in_step(*calls) -> list:
    """calls[r]() on thread r, at once: each one's result, or the exception it raised."""
    results = [None] * len(calls)

    def run(rank):
        try:
            results[rank] = calls[rank]()
        except Exception as e:  # noqa: BLE001 - compared by the test
            results[rank] = e

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results


def state(pool: PagePool, *seqs: SequenceKV) -> tuple:
    """What a failed reservation must leave as it was."""
    return (pool._top.tolist(), pool.refs.tolist(),
            [(s.lengths.tolist(), s.num_pages.tolist(), s.next_position, s.table.tolist()) for s in seqs])


def ballast(pool: PagePool, pages: int) -> None:
    """Take `pages` pages per layer for good: the rank's heads keep more tokens elsewhere."""
    pool.allocate_flat([pages] * L)


def test_a_reserve_one_rank_cannot_make_raises_on_both_and_changes_nothing():
    pools_ = pools()
    ballast(pools_[1], PAGES - 2)  # rank 1: 2 pages free per layer, rank 0: 12
    seqs = [SequenceKV(p) for p in pools_]
    ranks = agreeing(pools_)
    before = [state(p, s) for p, s in zip(pools_, seqs)]
    results = in_step(*(lambda s=s: s.reserve(3 * PS) for s in seqs))  # 3 pages each
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert "another rank" in str(results[0]) and "layer 0 needs 3 pages and has 2 free" in str(results[1])
    assert [state(p, s) for p, s in zip(pools_, seqs)] == before
    assert ranks.calls == [1, 1]
    # What fits on both is reserved on both, with one agreement each.
    results = in_step(*(lambda s=s: s.reserve_on_host(2 * PS) for s in seqs))
    assert all(isinstance(r, np.ndarray) for r in results) and ranks.calls == [2, 2]
    assert [s.next_position for s in seqs] == [2 * PS] * 2


def test_the_copy_of_a_shared_last_page_counts_and_reserve_layout_agrees():
    pools_ = pools()
    owners = [SequenceKV(p) for p in pools_]
    for owner in owners:
        owner.reserve(PS + 1)  # a full page and a partial one
    sharers = [SequenceKV(p) for p in pools_]
    for sharer, owner in zip(sharers, owners):
        sharer.share_from(owner)
    ballast(pools_[1], PAGES - 2 - 1)  # rank 1: 1 page free per layer; rank 0: 10
    ranks = agreeing(pools_)
    before = [state(p, s) for p, s in zip(pools_, sharers)]
    # Three more tokens fit the partial page, but it is shared: its copy takes the one free page, and
    # the fourth token's page has none left on rank 1.
    results = in_step(*(lambda s=s: s.reserve(4) for s in sharers))
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert [state(p, s) for p, s in zip(pools_, sharers)] == before
    results = in_step(*(lambda s=s: s.reserve(3) for s in sharers))  # the copy alone: fits on both
    assert not any(isinstance(r, Exception) for r in results)
    assert all(p.free_pages(0) == f for p, f in zip(pools_, (9, 0)))
    # A restore's layout (heads may differ) is agreed too.
    fresh = [SequenceKV(p) for p in pools_]
    results = in_step(*(lambda s=s: s.reserve_layout(np.full((L, H), PS), PS) for s in fresh))
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert all(s.num_pages.sum() == 0 for s in fresh)
    assert ranks.calls == [3, 3]


def test_a_decode_step_agrees_once_on_the_first_sequence_that_does_not_fit():
    pools_ = pools()
    batches = [[SequenceKV(p) for _ in range(3)] for p in pools_]
    for batch in batches:
        for s in batch:
            s.reserve(PS)  # one full page each
    ballast(pools_[1], PAGES - 3 - 1)  # rank 1: 1 page per layer left: the first sequence's next token
    ranks = agreeing(pools_)
    results = in_step(*(lambda b=b: reserve_step(b) for b in batches))
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert ranks.calls == [1, 1]  # one agreement for the step, not one per sequence
    assert "another rank" in str(results[0]) and "layer 0 needs 1 pages and has 0 free" in str(results[1])
    for batch in batches:  # the first gave its token back: none holds one more, on either rank
        assert [s.next_position for s in batch] == [PS] * 3 and all((s.lengths == PS).all() for s in batch)
    assert [p.free_pages(0) for p in pools_] == [PAGES - 3, 1]


def test_a_decode_step_that_does_not_fit_reserves_nothing_on_one_device_too():
    """The sequences before the one that does not fit give their token back: its position was never
    written, so a truncate by position would keep it (a stale token in the KV)."""
    pool = PagePool(L, H, D, 3, PS)
    a, b = SequenceKV(pool), SequenceKV(pool)
    a.reserve(PS)
    b.reserve(PS)
    with pytest.raises(KVCacheFullError):
        reserve_step([a, b])  # a's next page is the last free one; b has none
    for s in (a, b):
        s.truncate(PS)  # what the runner does after a failed step: nothing to do
        assert s.next_position == PS and (s.lengths == PS).all() and (s.num_pages == 1).all()
    assert pool.free_pages(0) == 1


def test_a_compaction_s_page_copies_are_agreed_in_lockstep():
    pools_ = pools()
    owners = [SequenceKV(p) for p in pools_]
    for owner in owners:
        owner.reserve(3 * PS)
    sharers = [SequenceKV(p) for p in pools_]
    for sharer, owner in zip(sharers, owners):
        sharer.share_from(owner)
    ballast(pools_[1], PAGES - 3)  # rank 1: no page free for the copies
    ranks = agreeing(pools_)
    mask = torch.ones(L, H, 3 * PS, dtype=torch.bool)
    mask[:, :, 0] = False  # every kept token moves down by one: all three pages are written
    before = [state(p, s) for p, s in zip(pools_, sharers)]
    results = in_step(*(lambda s=s: s.keep_masks(list(range(L)), mask, lockstep=True) for s in sharers))
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert [state(p, s) for p, s in zip(pools_, sharers)] == before
    # A compaction that copies nothing on either rank still agrees, once.
    results = in_step(*(lambda s=s: s.keep_masks(list(range(L)), torch.ones(L, H, 3 * PS, dtype=torch.bool),
                                                 lockstep=True) for s in owners))
    assert results == [None, None] and ranks.calls == [2, 2]


def indexed(pool: PagePool, entries: int) -> PrefixIndex:
    """A prefix index over `pool` holding `entries` entries of one page per layer each, oldest first."""
    index = PrefixIndex(pool, 1 << 30)
    pool.cache = index
    for i in range(entries):
        s = SequenceKV(pool)
        s.reserve(PS)
        index.insert("m", [i] * PS, s, {})
        s.free()
    return index


def test_the_cache_drops_the_same_entries_on_every_rank():
    pools_ = pools()
    indexes = [indexed(p, 4) for p in pools_]  # 4 pages per layer held by the index, 8 free
    ballast(pools_[1], 6)  # rank 1: 2 free
    seqs = [SequenceKV(p) for p in pools_]
    agreeing(pools_)
    results = in_step(*(lambda s=s: s.reserve(4 * PS) for s in seqs))  # rank 1 needs two entries gone
    assert not any(isinstance(r, Exception) for r in results)
    assert [len(i) for i in indexes] == [2, 2]  # rank 0 dropped them too: the indexes stay alike
    assert [i.get("m", [0] * PS) for i in indexes] == [None, None] and all(i.get("m", [2] * PS) for i in indexes)
    # A reservation that cannot fit on rank 1 even without the cache drops every entry on both.
    results = in_step(*(lambda s=s: s.reserve(4 * PS) for s in seqs))
    assert all(isinstance(r, KVCacheFullError) for r in results)
    assert [len(i) for i in indexes] == [0, 0]


def dropped_one_by_one(pool: PagePool, index: PrefixIndex) -> list[list[int]]:
    """Free pages per layer gained after dropping the k oldest entries, k = 0..len (drops them all)."""
    start = [pool.free_pages(layer) for layer in range(L)]
    out = [[0] * L]
    while len(index):
        index.drop_oldest(1)
        out.append([pool.free_pages(layer) - start[layer] for layer in range(L)])
    return out


def test_freed_by_drops_counts_what_dropping_frees():
    pool = PagePool(L, H, D, PAGES, PS)
    index = PrefixIndex(pool, 1 << 30)
    a = SequenceKV(pool)
    a.reserve(2 * PS)
    index.insert("m", [1] * 2 * PS, a, {})  # the oldest entry: 2 pages
    a.reserve(PS)
    index.insert("m", [1] * 3 * PS, a, {})  # a later turn end: those 2 pages and 1 more
    a.free()
    b = SequenceKV(pool)
    b.reserve(PS)
    index.insert("m", [2] * PS, b, {})  # b keeps holding its page
    # The first entry's pages are the second's too: dropping it frees none; the second frees all 3.
    assert index.freed_by_drops()[:, 0].tolist() == [0, 0, 3, 3]
    c = SequenceKV(pool)
    c.share_from(index.get("m", [1] * 3 * PS).kv)  # a conversation holds the second entry's pages
    assert index.freed_by_drops().tolist() == [[0] * L] * 4
    c.free()
    b.free()
    counted = index.freed_by_drops().tolist()
    assert counted == dropped_one_by_one(pool, index) == [[0] * L, [0] * L, [3] * L, [4] * L]
    assert pool.free_pages(0) == PAGES
