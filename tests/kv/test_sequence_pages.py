"""SequenceKV over a PagePool, page by page: pages freed and reused, exact byte accounting, pool
exhaustion, and drop_pages (whole pages out of one head's list). Every check compares against an
independent model of what each (layer, KV head) should hold (tests/kv/conftest.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from turnkv.errors import KVCacheFullError
from turnkv.kv.sequence import SequenceKV, reserve_step
from tests.kv.conftest import (PS, D, Expected, append, assert_pool_same, assert_same, check, check_pool,
                              make_pool, owned_pages, pool_snapshot, snapshot)


# ---- 1. pages freed and reused ----------------------------------------------------------------

def test_free_returns_everything_and_pages_are_reused(gen):
    pool = make_pool(layers=2, heads=2, num_pages=10)
    a, ea = SequenceKV(pool), Expected(pool)
    append(a, ea, 6, gen)
    append(a, ea, 3, gen)  # 9 tokens: 3 pages per head, 6 per layer
    pages_a = [sorted(owned_pages(a, l)) for l in range(2)]
    assert pages_a == [[0, 1, 2, 3, 4, 5]] * 2
    assert pool.bytes_in_use() == 12 * pool.page_bytes

    a.free()
    ea.free()
    check(a, ea)
    assert a.bytes() == 0 and a.tokens() == 0 and a.next_position == 0
    assert pool.bytes_in_use() == 0
    assert [pool.free_pages(l) for l in range(2)] == [10, 10]

    b, eb = SequenceKV(pool), Expected(pool)
    append(b, eb, 9, gen)
    check(b, eb)
    assert [sorted(owned_pages(b, l)) for l in range(2)] == pages_a  # the same page ids, reused
    check_pool(pool, [a, b])

    # the freed sequence can start over from position 0 without disturbing b
    append(a, ea, 2, gen)
    check(a, ea)
    check(b, eb)
    assert [sorted(owned_pages(a, l)) for l in range(2)] == [[6, 7]] * 2
    check_pool(pool, [a, b])
    a.free()
    b.free()
    assert pool.bytes_in_use() == 0
    assert [pool.free_pages(l) for l in range(2)] == [10, 10]


def test_free_leaves_the_pool_as_freeing_layer_by_layer_would(gen):
    """free() releases every layer at once; the free stacks, references, moves and shrink count end
    as one release per layer (heads last to first) leaves them, so later pages are taken in the same order."""
    runs = []
    for one_release in (True, False):
        pool = make_pool(layers=3, heads=2, num_pages=24)
        other, eo = SequenceKV(pool), Expected(pool)
        seq, es = SequenceKV(pool), Expected(pool)
        append(other, eo, 5, gen.manual_seed(1))
        append(seq, es, 11, gen.manual_seed(2))
        append(other, eo, 7, gen.manual_seed(3))
        seq._shrink(1, np.array([4, 9]))  # uneven heads
        before = seq.shrinks
        if one_release:
            seq.free()
        else:
            for layer in range(pool.num_layers):
                seq._shrink(layer, np.zeros(pool.num_kv_heads, dtype=np.int64))
            seq.next_position = 0
        runs.append((pool._stack.copy(), pool._top.copy(), pool.refs.copy(), seq.moves.copy(),
                     seq.shrinks - before, seq.num_pages.copy(), seq.lengths.copy()))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_free_one_of_two_leaves_other_intact(gen):
    pool = make_pool(layers=2, heads=2, num_pages=12)
    a, b = SequenceKV(pool), SequenceKV(pool)
    ea, eb = Expected(pool), Expected(pool)
    append(a, ea, 5, gen)
    append(b, eb, 6, gen)
    b.keep(0, [[0, 5], [1, 2, 3, 4, 5]])
    eb.keep(0, [[0, 5], [1, 2, 3, 4, 5]])
    a.free()
    ea.free()
    check(b, eb)
    assert pool.bytes_in_use() == b.bytes() == (1 + 2 + 2 + 2) * pool.page_bytes
    # a new sequence fills the freed pages; b's content is still exact
    c, ec = SequenceKV(pool), Expected(pool)
    append(c, ec, 8, gen)
    check(b, eb)
    check(c, ec)
    check_pool(pool, [a, b, c])


def test_evicted_pages_are_reused_by_other_sequence(gen):
    pool = make_pool(layers=1, heads=2, num_pages=6)
    a, ea = SequenceKV(pool), Expected(pool)
    append(a, ea, 12, gen)  # 3 pages per head: the pool is full
    assert pool.free_pages(0) == 0
    a.keep(0, [[0, 1], [11]])  # frees 2 + 2 pages
    ea.keep(0, [[0, 1], [11]])
    assert pool.free_pages(0) == 4
    b, eb = SequenceKV(pool), Expected(pool)
    append(b, eb, 8, gen)  # needs exactly those 4 pages
    assert pool.free_pages(0) == 0
    check(a, ea)
    check(b, eb)
    check_pool(pool, [a, b])


# ---- 2. exact accounting ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype, element", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_accounting(gen, dtype, element):
    pool = make_pool(layers=3, heads=2, num_pages=20, dtype=dtype)
    assert pool.page_bytes == 2 * PS * D * element
    a, b = SequenceKV(pool), SequenceKV(pool)
    ea, eb = Expected(pool), Expected(pool)
    append(a, ea, 5, gen)  # 2 pages per (layer, head)
    append(b, eb, 9, gen)  # 3 pages per (layer, head)
    a.keep(2, [[0], [0, 1, 2, 3, 4]])  # layer 2: 1 + 2 pages
    ea.keep(2, [[0], [0, 1, 2, 3, 4]])
    check(a, ea)
    check(b, eb)  # bf16 contents survive exactly too

    assert a.num_pages.tolist() == [[2, 2], [2, 2], [1, 2]]
    assert a.bytes() == 11 * pool.page_bytes == 11 * 2 * PS * D * element
    assert a.bytes_per_layer().tolist() == [4 * pool.page_bytes, 4 * pool.page_bytes, 3 * pool.page_bytes]
    assert a.bytes_per_head().tolist() == (a.num_pages * pool.page_bytes).tolist()
    assert int(a.bytes_per_layer().sum()) == int(a.bytes_per_head().sum()) == a.bytes()
    assert b.bytes() == 18 * pool.page_bytes
    assert a.tokens() == 5 * 4 + 1 + 5 and b.tokens() == 9 * 6
    assert pool.bytes_in_use() == a.bytes() + b.bytes() == 29 * pool.page_bytes
    assert [pool.used_pages(l) for l in range(3)] == [10, 10, 9]
    check_pool(pool, [a, b])

    a.truncate(3)
    ea.truncate(3)
    check(a, ea)
    # 3 tokens per head (1 in layer 2 head 0): one page for each of the 6 (layer, head) pairs
    assert a.num_pages.tolist() == [[1, 1]] * 3
    assert a.bytes() == 6 * pool.page_bytes
    assert pool.bytes_in_use() == a.bytes() + b.bytes()
    b.free()
    assert pool.bytes_in_use() == a.bytes() == 6 * pool.page_bytes
    a.free()
    assert pool.bytes_in_use() == 0


# ---- 3. pool exhaustion ------------------------------------------------------------------------

def test_reserve_beyond_pool_raises_and_changes_nothing(gen):
    pool = make_pool(layers=2, heads=2, num_pages=7)
    a, b = SequenceKV(pool), SequenceKV(pool)
    ea, eb = Expected(pool), Expected(pool)
    append(a, ea, 5, gen)  # 2 pages per head: 4 per layer
    append(b, eb, 2, gen)  # 1 page per head: 2 per layer -> 1 free per layer
    snaps, pool_before = [snapshot(a), snapshot(b)], pool_snapshot(pool)

    with pytest.raises(KVCacheFullError) as info:
        b.reserve(4)  # 2 -> 6 tokens: one more page per head, two per layer, only one free
    message = str(info.value)
    assert "KV pool full" in message and "layer 0 needs 2 pages and has 1 free" in message
    assert "7 pages of 4 tokens per layer" in message
    assert_same(snaps[0], snapshot(a))
    assert_same(snaps[1], snapshot(b))
    assert_pool_same(pool_before, pool_snapshot(pool))
    check(a, ea)
    check(b, eb)

    with pytest.raises(KVCacheFullError):
        SequenceKV(pool).reserve(100)
    assert_pool_same(pool_before, pool_snapshot(pool))

    # the sequences remain usable: b can still add tokens into its half-full page
    append(b, eb, 2, gen)
    check(b, eb)
    assert b.next_position == 4 and [pool.free_pages(l) for l in range(2)] == [1, 1]
    check_pool(pool, [a, b])


def test_reserve_to_exact_capacity_then_one_more_fails(gen):
    pool = make_pool(layers=2, heads=2, num_pages=4)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 8, gen)  # 2 pages per head, 4 per layer: full
    assert [pool.free_pages(l) for l in range(2)] == [0, 0]
    assert pool.bytes_in_use() == pool.capacity_bytes()
    before = snapshot(seq)
    with pytest.raises(KVCacheFullError, match="needs 2 pages and has 0 free"):
        seq.reserve(1)
    assert_same(before, snapshot(seq))
    check(seq, exp)


def test_reserve_failing_in_one_layer_takes_nothing_from_others(gen):
    pool = make_pool(layers=3, heads=2, num_pages=6)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 9, gen)  # 3 pages per head: pools full in every layer
    seq.keep(0, [[0], [1]])  # layer 0: 4 pages free
    seq.keep(2, [[0, 1, 2, 3, 4], [5]])  # layer 2: 1 + 2 pages free = 3
    exp.keep(0, [[0], [1]])
    exp.keep(2, [[0, 1, 2, 3, 4], [5]])
    assert [pool.free_pages(l) for l in range(3)] == [4, 0, 3]
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    with pytest.raises(KVCacheFullError, match="layer 1 needs 2 pages and has 0 free"):
        seq.reserve(4)  # layer 0 and 2 have room, layer 1 does not
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))
    check(seq, exp)
    # freeing room in layer 1 makes the same reserve succeed
    seq.keep(1, [[0, 8], [3, 4, 5, 6]])
    exp.keep(1, [[0, 8], [3, 4, 5, 6]])
    append(seq, exp, 4, gen)
    assert [pool.free_pages(l) for l in range(3)] == [2, 2, 1]
    check(seq, exp)
    check_pool(pool, [seq])


# ---- drop_pages: whole pages out of a head's list (the streaming heads' ring) ------------------

def drop_expected(seq: SequenceKV, exp: Expected, layer: int, head: int, first: int, count: int):
    """What drop_pages(layer, head, first, count) must leave: the head's tokens outside the pages."""
    H = seq.pool.num_kv_heads
    keep = [list(range(int(n))) for n in exp.lengths()[layer]]
    keep[head] = [i for i in keep[head] if not first * PS <= i < (first + count) * PS]
    exp.keep(layer, keep)
    assert len(keep) == H


def test_drop_pages_releases_every_layer_at_once_in_per_layer_order(gen, monkeypatch):
    """Streaming heads drop the same pages in every layer: one pool.release for all the layers, which
    hands each layer's pages back in the order a release per layer would (its heads in order, each
    head's pages in table order), so the next allocation takes the same pages."""
    pool = make_pool(layers=3, heads=3, num_pages=30)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 22, gen)
    layers, heads = [0, 0, 1, 2, 2], [0, 2, 1, 0, 2]
    freed = [[int(p) for h in sorted(hs) for p in seq.table[layer, h, 1:3]]
             for layer, hs in ((0, [0, 2]), (1, [1]), (2, [0, 2]))]
    calls = []
    real = type(pool).release
    monkeypatch.setattr(type(pool), "release", lambda self, *a: calls.append(a) or real(self, *a))
    seq.drop_pages(layers, heads, 1, 2)
    assert len(calls) == 1
    for layer, hs in ((0, [0, 2]), (1, [1]), (2, [0, 2])):
        drop_expected_heads(seq, exp, layer, hs, 1, 2)
    check(seq, exp)
    check_pool(pool, [seq])
    taken = pool.allocate([len(f) for f in freed])
    assert [t.tolist() for t in taken] == freed  # the first freed page on top of each layer's stack
    for layer, pages in enumerate(taken):
        pool.release(layer, pages)


def drop_expected_heads(seq, exp, layer: int, heads: list[int], first: int, count: int):
    keep = [list(range(int(n))) for n in exp.lengths()[layer]]
    for head in heads:
        keep[head] = [i for i in keep[head] if not first * PS <= i < (first + count) * PS]
    exp.keep(layer, keep)


def test_drop_pages_shifts_the_table_frees_pages_and_moves_no_data(gen):
    pool = make_pool(layers=2, heads=3, num_pages=24)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 22, gen)  # 6 pages per head, the last half full
    k_before, v_before = pool.k.clone(), pool.v.clone()
    free_before = [pool.free_pages(l) for l in range(2)]
    table_before = seq.table.copy()
    shrinks = seq.shrinks
    # Layer 0: head 1 drops its pages 2..3, head 2 page 1; layer 1: head 0 pages 1..4 (to the partial page).
    seq.drop_pages([0, 0, 1], [1, 2, 0], [2, 1, 1], [2, 1, 4])
    for layer, head, first, count in [(0, 1, 2, 2), (0, 2, 1, 1), (1, 0, 1, 4)]:
        drop_expected(seq, exp, layer, head, first, count)
    check(seq, exp)
    check_pool(pool, [seq])
    assert [free_before[l] - pool.free_pages(l) for l in range(2)] == [-3, -4]  # 3 and 4 pages came back
    assert seq.lengths.tolist() == [[22, 14, 18], [6, 22, 22]]
    assert seq.num_pages.tolist() == [[6, 4, 5], [2, 6, 6]]
    assert seq.table[0, 1, :4].tolist() == table_before[0, 1, [0, 1, 4, 5]].tolist()  # shifted left
    assert seq.table[1, 0, :2].tolist() == table_before[1, 0, [0, 5]].tolist()
    assert torch.equal(pool.k, k_before) and torch.equal(pool.v, v_before)  # no K/V moved
    assert seq.shrinks == shrinks  # no page left a head's end: copies of the table need only the edits
    assert seq.moves.tolist() == [[0, 1, 1], [1, 0, 0]] and seq.table_edits.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert seq.edited_from[0, 1] == 2 and seq.edited_from[0, 2] == 1 and seq.edited_from[1, 0] == 1
    # The freed pages serve the next appends; positions still ascend.
    append(seq, exp, 5, gen)
    check(seq, exp)
    check_pool(pool, [seq])
    seq.drop_pages(0, 1, 1, 1)  # one more: edited_from keeps the lowest column ever rewritten
    drop_expected(seq, exp, 0, 1, 1, 1)
    check(seq, exp)
    check_pool(pool, [seq])
    assert seq.edited_from[0, 1] == 1 and seq.table_edits[0, 1] == 2
    seq.truncate(20)
    exp.truncate(20)
    check(seq, exp)
    seq.free()
    check_pool(pool, [seq])


@pytest.mark.parametrize("bad", [
    dict(layers=0, heads=0, first=4, count=2),   # reaches the partial page
    dict(layers=0, heads=0, first=-1, count=1),
    dict(layers=0, heads=5, first=0, count=1),
    dict(layers=2, heads=0, first=0, count=1),
    dict(layers=[0, 0], heads=[1, 1], first=0, count=1),  # the same head twice
    dict(layers=[0, 1], heads=[0, 1], first=0, count=[1, 6]),  # one bad: nothing changes
])
def test_drop_pages_rejects_bad_requests_without_changing_anything(gen, bad):
    pool = make_pool(layers=2, heads=2, num_pages=16)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 21, gen)  # 6 pages: 5 full + 1 token
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    with pytest.raises(ValueError, match="drop_pages"):
        seq.drop_pages(**bad)
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))
    assert not seq.moves.any() and not seq.table_edits.any()


def test_random_drop_pages_mixed_with_appends_keep_and_truncate():
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(layers=2, heads=3, num_pages=40)
    seqs = [SequenceKV(pool) for _ in range(2)]
    exps = [Expected(pool) for _ in range(2)]
    drops = 0
    for _ in range(150):
        i = rng.randrange(2)
        seq, exp = seqs[i], exps[i]
        op = rng.random()
        if op < 0.45:
            try:
                append(seq, exp, rng.randint(1, 9), gen)
            except KVCacheFullError:
                pass
        elif op < 0.8:
            layer, head = rng.randrange(2), rng.randrange(3)
            full = int(seq.lengths[layer, head]) // PS
            if full:
                first = rng.randrange(full)
                count = rng.randint(1, full - first)
                seq.drop_pages(layer, head, first, count)
                drop_expected(seq, exp, layer, head, first, count)
                drops += 1
        elif op < 0.9:
            layer = rng.randrange(2)
            keep = [sorted(rng.sample(range(n), rng.randint(0, n))) for n in seq.lengths[layer]]
            seq.keep(layer, keep)
            exp.keep(layer, keep)
        else:
            n = rng.randint(0, seq.next_position)
            seq.truncate(n)
            exp.truncate(n)
        for s, e in zip(seqs, exps):
            check(s, e)
        check_pool(pool, seqs)
    assert drops > 20


# ---- 4. a decode step's reservation, and the device copy of the page table ---------------------

def test_reserve_step_gives_what_reserve_gives():
    pools = [make_pool(layers=2, heads=3, num_pages=200) for _ in range(2)]
    pairs = [[SequenceKV(pool) for _ in range(3)] for pool in pools]
    for a, b in zip(*pairs):  # uneven heads, as after eviction
        for seq in (a, b):
            seq.reserve(20)
            seq.keep(0, [list(range(n)) for n in (3, 17, 20)])
    for _ in range(20):  # most steps place no page (nothing to allocate), some cross pages in a few heads
        slots = [s.reserve(1) for s in pairs[0]]
        assert [torch.equal(x, y) for x, y in zip(slots, reserve_step(pairs[1]))] == [True] * 3
        assert torch.equal(pools[0].positions, pools[1].positions)
        for seq, got in zip(pairs[1], slots):  # each head's new token at its last index, in its own pages
            n = seq.lengths - 1
            pages = seq.table[np.arange(2)[:, None], np.arange(3)[None, :], n // PS]
            assert np.array_equal(got.numpy()[..., 0], pages * PS + n % PS)
        check_pool(pools[1], pairs[1])
    assert [s.lengths.tolist() for s in pairs[0]] == [s.lengths.tolist() for s in pairs[1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_device_table_follows_every_edit_of_the_host_table():
    rng = random.Random(4)
    pool = make_pool(layers=2, heads=3, num_pages=300, device="cuda")
    seqs = [SequenceKV(pool) for _ in range(2)]
    for _ in range(300):
        seq = seqs[rng.randrange(2)]
        op = rng.random()
        try:
            if op < 0.4:
                reserve_step(seqs) if rng.random() < 0.5 else seq.reserve(rng.randint(1, 20))
            elif op < 0.6 and seq.next_position:
                layer = rng.randrange(2)
                seq.keep(layer, [sorted(rng.sample(range(n), rng.randint(0, n))) for n in seq.lengths[layer]])
            elif op < 0.8:
                layer, head = rng.randrange(2), rng.randrange(3)
                full = int(seq.lengths[layer, head]) // PS
                if full:
                    first = rng.randrange(full)
                    seq.drop_pages(layer, head, first, rng.randint(1, full - first))
            else:
                seq.truncate(rng.randint(0, seq.next_position))
        except KVCacheFullError:
            seq.truncate(0)
        for s in seqs:
            device = s.device_table().cpu().numpy()
            for layer in range(2):
                for head in range(3):
                    n = s.num_pages[layer, head]
                    assert (device[layer, head, :n] == s.table[layer, head, :n]).all()
