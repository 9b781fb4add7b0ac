"""SequenceKV over a PagePool, token by token: append/gather round trips, uneven per-head eviction,
truncation, keep() validation and a random mix of all of them. Every check compares against an
independent model of what each (layer, KV head) should hold (tests/kv/conftest.py)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from turnkv.errors import KVCacheFullError
from turnkv.kv.sequence import SequenceKV
from tests.kv.conftest import (PS, D, Expected, append, assert_pool_same, assert_same, check, check_pool,
                              make_pool, pool_snapshot, snapshot)


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


# ---- 3. truncate -------------------------------------------------------------------------------

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


# ---- 4. keep() validation ---------------------------------------------------------------------

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
