"""SequenceKV over a PagePool: round trips, uneven per-head eviction, reuse, accounting, exhaustion,
truncation and keep() validation. Every check compares against an independent model of what each
(layer, KV head) should hold."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from turnkv.errors import KVCacheFullError
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV

PS, D = 4, 8


# ---- helpers ----------------------------------------------------------------------------------

class Expected:
    """What each (layer, head) of one sequence should hold, in order: K rows, V rows, positions."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        L, H = pool.num_layers, pool.num_kv_heads
        self.k = [[torch.zeros(0, pool.head_dim, dtype=pool.dtype) for _ in range(H)] for _ in range(L)]
        self.v = [[torch.zeros(0, pool.head_dim, dtype=pool.dtype) for _ in range(H)] for _ in range(L)]
        self.pos = [[torch.zeros(0, dtype=torch.int64) for _ in range(H)] for _ in range(L)]
        self.next_position = 0

    def lengths(self) -> np.ndarray:
        return np.array([[len(p) for p in layer] for layer in self.pos], dtype=np.int64)

    def append(self, k, v):  # k, v [L, H, T, D]
        T = k.shape[2]
        new_pos = torch.arange(self.next_position, self.next_position + T)
        for layer in range(len(self.k)):
            for head in range(len(self.k[layer])):
                self.k[layer][head] = torch.cat([self.k[layer][head], k[layer, head]])
                self.v[layer][head] = torch.cat([self.v[layer][head], v[layer, head]])
                self.pos[layer][head] = torch.cat([self.pos[layer][head], new_pos])
        self.next_position += T

    def keep(self, layer, indices):
        for head, idx in enumerate(indices):
            idx = torch.as_tensor(idx, dtype=torch.int64).sort().values
            self.k[layer][head] = self.k[layer][head][idx]
            self.v[layer][head] = self.v[layer][head][idx]
            self.pos[layer][head] = self.pos[layer][head][idx]

    def truncate(self, n):
        if n >= self.next_position:
            return
        for layer in range(len(self.k)):
            for head in range(len(self.k[layer])):
                sel = self.pos[layer][head] < n
                self.k[layer][head] = self.k[layer][head][sel]
                self.v[layer][head] = self.v[layer][head][sel]
                self.pos[layer][head] = self.pos[layer][head][sel]
        self.next_position = n

    def free(self):
        self.__init__(self.pool)


def make_pool(layers=2, heads=2, num_pages=16, page_size=PS, head_dim=D, dtype=torch.float32, device="cpu"):
    return PagePool(layers, heads, head_dim, num_pages, page_size, dtype=dtype, device=device)


def append(seq: SequenceKV, expected: Expected, T: int, gen: torch.Generator):
    """Reserve T tokens, write random K/V in the slots layout [L, H, T] (head, token order per layer)."""
    pool = seq.pool
    L, H = pool.num_layers, pool.num_kv_heads
    k = torch.randn(L, H, T, pool.head_dim, generator=gen).to(pool.dtype)
    v = torch.randn(L, H, T, pool.head_dim, generator=gen).to(pool.dtype)
    slots = seq.reserve(T)
    assert slots.shape == (L, H, T) and slots.dtype == torch.int64 and slots.device.type == pool.device.type
    for layer in range(L):
        pool.write(layer, slots[layer].reshape(-1), k[layer].reshape(-1, pool.head_dim).to(pool.device),
                   v[layer].reshape(-1, pool.head_dim).to(pool.device))
    expected.append(k, v)
    return slots, k, v


def check(seq: SequenceKV, expected: Expected):
    """Gathered K/V/positions, lengths, pages and next_position match the model exactly."""
    pool = seq.pool
    ps = pool.page_size
    lengths = expected.lengths()
    np.testing.assert_array_equal(seq.lengths, lengths)
    np.testing.assert_array_equal(seq.num_pages, -(-lengths // ps))
    assert seq.next_position == expected.next_position
    assert seq.tokens() == int(lengths.sum())
    # the (possibly device-side, lazily refreshed) table agrees with the host table where it is used
    table = seq.device_table().cpu()
    for layer in range(pool.num_layers):
        for head in range(pool.num_kv_heads):
            n = seq.num_pages[layer, head]
            assert table[layer, head, :n].tolist() == seq.table[layer, head, :n].tolist()
        k, v, pos = (t.cpu() for t in seq.gather(layer))
        S = int(lengths[layer].max(initial=0))
        assert k.shape == (pool.num_kv_heads, S, pool.head_dim) and v.shape == k.shape
        assert pos.shape == (pool.num_kv_heads, S)
        for head in range(pool.num_kv_heads):
            n = lengths[layer, head]
            assert seq.num_pages[layer, head] == math.ceil(n / ps)
            assert torch.equal(k[head, :n], expected.k[layer][head]), (layer, head)
            assert torch.equal(v[head, :n], expected.v[layer][head]), (layer, head)
            assert torch.equal(pos[head, :n], expected.pos[layer][head]), (layer, head)
            # positions ascend strictly and stay below the uncompressed count
            if n:
                assert bool((pos[head, 1:n] > pos[head, : n - 1]).all())
                assert int(pos[head, n - 1]) < seq.next_position


def owned_pages(seq: SequenceKV, layer: int) -> list[int]:
    return [int(p) for head in range(seq.pool.num_kv_heads)
            for p in seq.table[layer, head, : seq.num_pages[layer, head]]]


def check_pool(pool: PagePool, seqs: list[SequenceKV]):
    """Pages are owned by at most one (sequence, head), the free list is the rest, bytes add up."""
    for layer in range(pool.num_layers):
        owned = [p for s in seqs for p in owned_pages(s, layer)]
        assert len(owned) == len(set(owned)), f"layer {layer}: a page is owned twice: {sorted(owned)}"
        assert all(0 <= p < pool.num_pages for p in owned)
        assert len(owned) + pool.free_pages(layer) == pool.num_pages
        assert pool.used_pages(layer) == len(owned)
        # the free pages are exactly the ones nobody owns (allocate + release restores the stack)
        free = pool.allocate([pool.free_pages(l) if l == layer else 0 for l in range(pool.num_layers)])[layer]
        pool.release(layer, free)
        assert sorted(free.tolist() + owned) == list(range(pool.num_pages))
    assert pool.bytes_in_use() == sum(s.bytes() for s in seqs)


def snapshot(seq: SequenceKV):
    return dict(
        lengths=seq.lengths.copy(),
        num_pages=seq.num_pages.copy(),
        next_position=seq.next_position,
        tables=[[seq.table[l, h, : seq.num_pages[l, h]].copy() for h in range(seq.pool.num_kv_heads)]
                for l in range(seq.pool.num_layers)],
        gathered=[tuple(t.clone() for t in seq.gather(l)) for l in range(seq.pool.num_layers)],
        bytes=seq.bytes(),
    )


def pool_snapshot(pool: PagePool):
    return dict(free=[pool.free_pages(l) for l in range(pool.num_layers)], k=pool.k.clone(), v=pool.v.clone(),
                positions=pool.positions.clone(), bytes=pool.bytes_in_use())


def assert_same(a, b):
    np.testing.assert_array_equal(a["lengths"], b["lengths"])
    np.testing.assert_array_equal(a["num_pages"], b["num_pages"])
    assert a["next_position"] == b["next_position"]
    assert a["bytes"] == b["bytes"]
    for ta, tb in zip(a["tables"], b["tables"]):
        for ha, hb in zip(ta, tb):
            np.testing.assert_array_equal(ha, hb)
    for ga, gb in zip(a["gathered"], b["gathered"]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)


def assert_pool_same(a, b):
    assert a["free"] == b["free"]
    assert a["bytes"] == b["bytes"]
    for key in ("k", "v", "positions"):
        assert torch.equal(a[key], b[key]), key


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ---- 1. append / gather round trips -----------------------------------------------------------

def test_fresh_sequence_is_empty():
    pool = make_pool()
    seq = SequenceKV(pool)
    assert seq.lengths.shape == (2, 2) and seq.num_pages.shape == (2, 2)
    assert seq.tokens() == 0 and seq.bytes() == 0 and seq.next_position == 0
    for layer in range(2):
        k, v, pos = seq.gather(layer)
        assert k.shape == (2, 0, D) and v.shape == (2, 0, D) and pos.shape == (2, 0)


def test_single_append_round_trip(gen):
    pool = make_pool(layers=3, heads=3)
    seq, exp = SequenceKV(pool), Expected(pool)
    slots, k, v = append(seq, exp, 7, gen)
    check(seq, exp)
    for layer in range(3):
        gk, gv, gpos = seq.gather(layer)
        assert torch.equal(gk, k[layer]) and torch.equal(gv, v[layer])
        assert torch.equal(gpos, torch.arange(7).expand(3, 7))
    # 7 tokens with page_size 4: 2 pages per (layer, head), 18 pages in all
    assert seq.num_pages.tolist() == [[2, 2, 2]] * 3
    assert [pool.free_pages(l) for l in range(3)] == [10, 10, 10]
    check_pool(pool, [seq])


def test_slots_layout_points_into_own_pages(gen):
    pool = make_pool(layers=2, heads=3)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 3, gen)
    slots = seq.reserve(6)  # lengths 3 -> 9: crosses two page boundaries
    assert slots.shape == (2, 3, 6)
    for layer in range(2):
        for head in range(3):
            index = np.arange(3, 9)
            want = seq.table[layer, head, index // PS] * PS + index % PS
            assert slots[layer, head].tolist() == want.tolist()
        assert len(set(slots[layer].reshape(-1).tolist())) == 18  # no slot shared between heads
    # reserve records positions 3..8 in every head even before any K/V is written
    for layer in range(2):
        _, _, pos = seq.gather(layer)
        assert pos.tolist() == [list(range(9))] * 3
    assert seq.next_position == 9


@pytest.mark.parametrize("sizes", [[3, 1, 5, 4, 2], [4, 4, 4], [1] * 9, [13], [2, 7, 1, 6]])
def test_multiple_appends_cross_page_boundaries(gen, sizes):
    pool = make_pool(layers=2, heads=2, num_pages=16)
    seq, exp = SequenceKV(pool), Expected(pool)
    for T in sizes:
        append(seq, exp, T, gen)
        check(seq, exp)
        check_pool(pool, [seq])
    n = sum(sizes)
    assert seq.lengths.tolist() == [[n, n]] * 2
    assert seq.num_pages.tolist() == [[math.ceil(n / PS)] * 2] * 2
    assert seq.next_position == n


def test_reserve_zero_tokens_changes_nothing(gen):
    pool = make_pool()
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 5, gen)
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    slots = seq.reserve(0)
    assert slots.shape == (2, 2, 0)
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))


def test_two_sequences_interleaved_stay_independent(gen):
    pool = make_pool(layers=2, heads=2, num_pages=20)
    a, b = SequenceKV(pool), SequenceKV(pool)
    ea, eb = Expected(pool), Expected(pool)
    for ta, tb in [(3, 5), (2, 1), (6, 4), (1, 3)]:
        append(a, ea, ta, gen)
        append(b, eb, tb, gen)
        check(a, ea)
        check(b, eb)
        check_pool(pool, [a, b])
    assert a.next_position == 12 and b.next_position == 13


# ---- 2. uneven per-head lengths -----------------------------------------------------------------

def test_keep_uneven_then_append(gen):
    pool = make_pool(layers=2, heads=3, num_pages=16)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 6, gen)
    append(seq, exp, 5, gen)  # 11 tokens, positions 0..10, 3 pages per head
    assert [pool.free_pages(l) for l in range(2)] == [7, 7]
    orig_k, orig_v, orig_pos = (t.clone() for t in seq.gather(0))

    keep = [torch.tensor([10, 0, 5, 2]), list(range(1, 10)), []]  # unsorted input is kept in order
    seq.keep(0, keep)
    exp.keep(0, keep)
    check(seq, exp)
    assert seq.lengths.tolist() == [[4, 9, 0], [11, 11, 11]]
    assert seq.num_pages.tolist() == [[1, 3, 0], [3, 3, 3]]
    # layer 0 went from 9 pages to 4: five pages back in the pool; layer 1 untouched
    assert [pool.free_pages(l) for l in range(2)] == [12, 7]
    assert seq.bytes() == (4 + 9) * pool.page_bytes
    k, v, pos = seq.gather(0)
    assert k.shape == (3, 9, D)
    for head, idx in enumerate([[0, 2, 5, 10], list(range(1, 10)), []]):
        n = len(idx)
        assert torch.equal(k[head, :n], orig_k[head, idx])
        assert torch.equal(v[head, :n], orig_v[head, idx])
        assert pos[head, :n].tolist() == idx  # original positions are kept
    check_pool(pool, [seq])

    # new tokens continue from the uncompressed count and land after the kept ones
    _, new_k, new_v = append(seq, exp, 6, gen)
    check(seq, exp)
    assert seq.next_position == 17
    assert seq.lengths.tolist() == [[10, 15, 6], [17, 17, 17]]
    assert seq.num_pages.tolist() == [[3, 4, 2], [5, 5, 5]]
    assert [pool.free_pages(l) for l in range(2)] == [16 - 9, 16 - 15]
    k, v, pos = seq.gather(0)
    for head, kept in enumerate([4, 9, 0]):
        assert pos[head, kept:kept + 6].tolist() == list(range(11, 17))
        assert torch.equal(k[head, kept:kept + 6], new_k[0, head])
        assert torch.equal(v[head, kept:kept + 6], new_v[0, head])
    check_pool(pool, [seq])


def test_repeated_evictions_compound(gen):
    pool = make_pool(layers=2, heads=2, num_pages=24)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 10, gen)
    for layer, keep in [(0, [[1, 3, 4, 8, 9], [0, 9]]), (1, [list(range(0, 10, 3)), list(range(10))])]:
        seq.keep(layer, keep)
        exp.keep(layer, keep)
        check(seq, exp)
    append(seq, exp, 7, gen)
    check(seq, exp)
    # second eviction over a mix of old (sparse) and new tokens
    keep = [[0, 4, 5, 11], [1, 2, 3, 8]]
    seq.keep(0, keep)
    exp.keep(0, keep)
    check(seq, exp)
    _, _, pos = seq.gather(0)
    assert pos[0, :4].tolist() == [1, 9, 10, 16]
    assert pos[1, :4].tolist() == [9, 10, 11, 16]
    append(seq, exp, 3, gen)
    check(seq, exp)
    check_pool(pool, [seq])


def test_keep_everything_is_identity_and_keep_nothing_frees_all(gen):
    pool = make_pool(layers=2, heads=2, num_pages=8)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 7, gen)
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    seq.keep(1, [torch.arange(7), np.arange(7)])
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))

    seq.keep(1, [[], []])
    exp.keep(1, [[], []])
    check(seq, exp)
    assert seq.num_pages.tolist() == [[2, 2], [0, 0]]
    assert [pool.free_pages(l) for l in range(2)] == [4, 8]
    append(seq, exp, 2, gen)  # a head emptied by eviction can grow again
    check(seq, exp)
    _, _, pos = seq.gather(1)
    assert pos.tolist() == [[7, 8], [7, 8]]
    check_pool(pool, [seq])


def test_keep_accepts_tensor_numpy_and_list_indices(gen):
    pool = make_pool(layers=1, heads=3, num_pages=9)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 9, gen)
    keep = [torch.tensor([8, 1]), np.array([3, 4, 5]), [6]]
    seq.keep(0, keep)
    exp.keep(0, keep)
    check(seq, exp)
    _, _, pos = seq.gather(0)
    assert [pos[h, :n].tolist() for h, n in enumerate([2, 3, 1])] == [[1, 8], [3, 4, 5], [6]]


# ---- 3. pages freed and reused ----------------------------------------------------------------

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


# ---- 4. exact accounting ----------------------------------------------------------------------

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


# ---- 5. pool exhaustion ------------------------------------------------------------------------

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


# ---- 6. truncate -------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 4, 5, 8, 10, 12, 13])
def test_truncate_without_eviction(gen, n):
    pool = make_pool(layers=2, heads=2, num_pages=8)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 7, gen)
    append(seq, exp, 6, gen)
    k_all, v_all = [seq.gather(l)[0].clone() for l in range(2)], [seq.gather(l)[1].clone() for l in range(2)]
    seq.truncate(n)
    exp.truncate(n)
    check(seq, exp)
    kept = min(n, 13)
    assert seq.next_position == kept
    assert seq.lengths.tolist() == [[kept, kept]] * 2
    assert [pool.free_pages(l) for l in range(2)] == [8 - 2 * math.ceil(kept / PS)] * 2
    for l in range(2):
        k, v, _ = seq.gather(l)
        assert torch.equal(k, k_all[l][:, :kept]) and torch.equal(v, v_all[l][:, :kept])
    # appending after a rollback continues from n
    append(seq, exp, 3, gen)
    check(seq, exp)
    assert seq.gather(0)[2][0, kept:].tolist() == [kept, kept + 1, kept + 2]
    check_pool(pool, [seq])


def test_truncate_at_or_past_next_position_is_a_no_op(gen):
    pool = make_pool()
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 6, gen)
    seq.keep(0, [[1, 2], [5]])
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    seq.truncate(6)
    seq.truncate(100)
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))


def test_truncate_after_eviction_uses_sparse_positions(gen):
    pool = make_pool(layers=2, heads=3, num_pages=16)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 10, gen)
    keep = [[0, 2, 5, 9], [6, 7, 8, 9], list(range(10))]
    seq.keep(0, keep)
    exp.keep(0, keep)
    append(seq, exp, 5, gen)  # positions 10..14
    # layer 0 positions: head0 [0,2,5,9,10..14], head1 [6,7,8,9,10..14], head2 [0..14]
    assert seq.lengths.tolist() == [[9, 9, 15], [15, 15, 15]]
    free_before = [pool.free_pages(l) for l in range(2)]
    assert free_before == [16 - 3 - 3 - 4, 16 - 12]

    seq.truncate(6)
    exp.truncate(6)
    check(seq, exp)
    assert seq.lengths.tolist() == [[3, 0, 6], [6, 6, 6]]
    assert seq.num_pages.tolist() == [[1, 0, 2], [2, 2, 2]]
    _, _, pos = seq.gather(0)
    assert pos[0, :3].tolist() == [0, 2, 5] and pos[2].tolist() == list(range(6))
    assert seq.next_position == 6
    assert [pool.free_pages(l) for l in range(2)] == [16 - 3, 16 - 6]
    check_pool(pool, [seq])

    append(seq, exp, 2, gen)
    check(seq, exp)
    _, _, pos = seq.gather(0)
    assert pos[0, :5].tolist() == [0, 2, 5, 6, 7]
    assert pos[1, :2].tolist() == [6, 7]


def test_truncate_inside_evicted_gap(gen):
    pool = make_pool(layers=1, heads=2, num_pages=8)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 12, gen)
    seq.keep(0, [[0, 1, 10, 11], [3]])
    exp.keep(0, [[0, 1, 10, 11], [3]])
    seq.truncate(7)  # no kept token has a position in 4..9; drops 10 and 11 only
    exp.truncate(7)
    check(seq, exp)
    assert seq.lengths.tolist() == [[2, 1]] and seq.next_position == 7


# ---- 7. keep() validation ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([[0, 6], [0]], id="index-equal-to-length"),
        pytest.param([[0], [-1, 2]], id="negative"),
        pytest.param([[1, 1], [0]], id="duplicate"),
        pytest.param([[3, 0, 3], [0]], id="duplicate-unsorted"),
        pytest.param([[0, 1, 2], [0, 1, 99]], id="second-head-out-of-range"),
        pytest.param([[0]], id="too-few-heads"),
        pytest.param([[0], [1], [2]], id="too-many-heads"),
    ],
)
def test_keep_rejects_bad_indices_without_changing_anything(gen, bad):
    pool = make_pool(layers=2, heads=2, num_pages=8)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 6, gen)
    before, pool_before = snapshot(seq), pool_snapshot(pool)
    with pytest.raises(ValueError):
        seq.keep(0, bad)
    assert_same(before, snapshot(seq))
    assert_pool_same(pool_before, pool_snapshot(pool))
    check(seq, exp)


def test_keep_validates_against_current_not_original_length(gen):
    pool = make_pool(layers=1, heads=2, num_pages=8)
    seq, exp = SequenceKV(pool), Expected(pool)
    append(seq, exp, 8, gen)
    seq.keep(0, [[0, 1, 2], list(range(8))])
    exp.keep(0, [[0, 1, 2], list(range(8))])
    before = snapshot(seq)
    with pytest.raises(ValueError, match=r"head 0.*\[0, 3\)"):
        seq.keep(0, [[3], [0]])  # head 0 now holds 3 tokens
    assert_same(before, snapshot(seq))
    seq.keep(0, [[2], [7]])
    exp.keep(0, [[2], [7]])
    check(seq, exp)


# ---- randomized mix of everything --------------------------------------------------------------

@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_random_operation_mix_matches_model(device):
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(layers=2, heads=3, num_pages=14, device=device)
    seqs = [SequenceKV(pool) for _ in range(2)]
    exps = [Expected(pool) for _ in range(2)]
    failures = 0
    for _ in range(120):
        i = rng.randrange(2)
        seq, exp = seqs[i], exps[i]
        op = rng.random()
        if op < 0.5:
            T = rng.randint(1, 7)
            before = [snapshot(s) for s in seqs]
            pool_before = pool_snapshot(pool)
            try:
                append(seq, exp, T, gen)
            except KVCacheFullError:
                failures += 1
                for a, s in zip(before, seqs):
                    assert_same(a, snapshot(s))
                assert_pool_same(pool_before, pool_snapshot(pool))
        elif op < 0.8:
            layer = rng.randrange(2)
            keep = [sorted(rng.sample(range(n), rng.randint(0, n))) for n in seq.lengths[layer]]
            seq.keep(layer, keep)
            exp.keep(layer, keep)
        elif op < 0.95:
            n = rng.randint(0, seq.next_position)
            seq.truncate(n)
            exp.truncate(n)
        else:
            seq.free()
            exp.free()
        for s, e in zip(seqs, exps):
            check(s, e)
        check_pool(pool, seqs)
    assert failures > 0  # the pool was small enough to hit exhaustion along the way


def test_truncate_rejects_negative_and_keep_rejects_float_indices():
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    pool = PagePool(1, 2, 4, 8, 4)
    seq = SequenceKV(pool)
    seq.reserve(5)
    with pytest.raises(ValueError, match="truncate"):
        seq.truncate(-3)
    with pytest.raises(ValueError, match="integers"):
        seq.keep(0, [[0.9, 2.2], [1, 2]])
    assert seq.next_position == 5 and seq.lengths.tolist() == [[5, 5]]


# ---- drop_pages: whole pages out of a head's list (the streaming heads' ring) ------------------

def drop_expected(seq: SequenceKV, exp: Expected, layer: int, head: int, first: int, count: int):
    """What drop_pages(layer, head, first, count) must leave: the head's tokens outside the pages."""
    H = seq.pool.num_kv_heads
    keep = [list(range(int(n))) for n in exp.lengths()[layer]]
    keep[head] = [i for i in keep[head] if not first * PS <= i < (first + count) * PS]
    exp.keep(layer, keep)
    assert len(keep) == H


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
