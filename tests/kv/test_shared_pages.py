"""Pages shared between sequences: reference counts, copy on write, accounting, and the prefix index."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.kv.pool import PagePool
from turnkv.kv.prefix_index import PrefixIndex
from turnkv.kv.sequence import SequenceKV

L, H, D, PS = 2, 2, 8, 4


def _pool(pages: int = 64) -> PagePool:
    return PagePool(L, H, D, pages, PS)


def _append(seq: SequenceKV, n: int, seed: int) -> None:
    """Write n tokens of random K/V (V = K + 1) into every (layer, head)."""
    g = torch.Generator().manual_seed(seed)
    slots = seq.reserve(n)
    for layer in range(L):
        k = torch.randn(H * n, D, generator=g)
        seq.pool.write(layer, slots[layer].reshape(-1), k, k + 1)


def _rows(seq: SequenceKV) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in seq.gather(layer)) for layer in range(L)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_a_shared_page_is_counted_once_and_freed_by_its_last_holder():
    pool = _pool()
    a = SequenceKV(pool)
    _append(a, 8, 0)  # 2 full pages per (layer, head)
    b = SequenceKV(pool)
    b.share_from(a)
    assert pool.bytes_in_use() == L * H * 2 * pool.page_bytes  # once, not twice
    assert pool.shared_bytes() == pool.bytes_in_use()
    assert a.sharing() == (0, L * H * 2 * pool.page_bytes // 2) == b.sharing()
    assert _same(_rows(a), _rows(b))
    a.free()
    assert pool.bytes_in_use() == L * H * 2 * pool.page_bytes and pool.shared_bytes() == 0
    assert b.sharing() == (L * H * 2 * pool.page_bytes, 0)
    b.free()
    assert pool.bytes_in_use() == 0 and (pool.refs == 0).all()


def test_appending_into_a_shared_partial_page_copies_only_that_page():
    pool = _pool()
    a = SequenceKV(pool)
    _append(a, 6, 0)  # a full page and a partial one per (layer, head)
    b = SequenceKV(pool)
    b.share_from(a)
    before = _rows(a)
    _append(b, 3, 1)
    # b took a copy of each partial page (and one more page for the overflow); the full pages stay shared.
    assert (b.table[:, :, 0] == a.table[:, :, 0]).all() and (b.table[:, :, 1] != a.table[:, :, 1]).all()
    assert pool.used_pages(0) == H * (2 + 1 + 1)
    assert _same(_rows(a), before)
    kb, vb, pb = b.gather(0)
    assert torch.equal(kb[:, :6], before[0][0]) and pb[0].tolist() == list(range(9))
    _append(a, 2, 2)  # a's partial page is its own again: written in place
    assert pool.used_pages(0) == H * (2 + 1 + 1)


def test_compacting_a_head_with_shared_pages_leaves_the_other_holder_intact():
    pool = _pool()
    a = SequenceKV(pool)
    _append(a, 12, 0)  # 3 full pages per (layer, head)
    b = SequenceKV(pool)
    b.share_from(a)
    before = _rows(a)
    # Head 0 keeps tokens 0..3 and 8..11 (its first page is untouched), head 1 keeps all of them.
    b.keep(0, [torch.tensor([0, 1, 2, 3, 8, 9, 10, 11]), torch.arange(12)])
    assert _same(_rows(a), before)
    k, _, pos = b.gather(0)
    assert torch.equal(k[0, :8], torch.cat([before[0][0][0, :4], before[0][0][0, 8:12]]))
    assert pos[0, :8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    # Only the page written was copied: head 0's first page and head 1's pages are still shared.
    assert b.table[0, 0, 0] == a.table[0, 0, 0] and b.table[0, 0, 1] != a.table[0, 0, 1]
    assert (b.table[0, 1, :3] == a.table[0, 1, :3]).all()
    assert pool.used_pages(0) == 2 * 3 + 1
    a.free()
    b.free()
    assert pool.bytes_in_use() == 0


def test_truncating_then_appending_a_shared_sequence_copies_before_writing():
    pool = _pool()
    a = SequenceKV(pool)
    _append(a, 8, 0)
    b = SequenceKV(pool)
    b.share_from(a)
    before = _rows(a)
    b.truncate(5)
    _append(b, 4, 3)
    assert _same(_rows(a), before)
    assert b.gather(1)[2][0].tolist() == list(range(9))


def test_the_prefix_index_finds_the_longest_entry_and_drops_the_least_recently_used():
    pool = _pool(256)
    index = PrefixIndex(pool, max_bytes=L * H * 3 * pool.page_bytes)
    seqs = []
    for n, seed in ((8, 0), (4, 1)):
        s = SequenceKV(pool)
        _append(s, n, seed)
        seqs.append(s)
    long_entry = index.insert("m", list(range(8)), seqs[0], {"x": 1})
    short_entry = index.insert("m", list(range(4)), seqs[1], {"x": 2})
    assert index.lookup("m", list(range(10))) is long_entry
    assert index.lookup("m", list(range(10)), lengths={4}) is short_entry
    assert index.lookup("m", [0, 1, 2, 9]) is None and index.lookup("other", list(range(10))) is None
    assert index.lookup("m", [0, 1, 2, 3, 7]) is short_entry
    for s in seqs:
        s.free()
    assert pool.bytes_in_use() == index.bytes() == L * H * 3 * pool.page_bytes
    # A third prefix over the cap drops the least recently used entry (the long one, looked up first).
    s = SequenceKV(pool)
    _append(s, 4, 2)
    index.insert("m", [5, 5, 5, 5], s, {})
    s.free()
    assert index.get("m", list(range(8))) is None and index.get("m", list(range(4))) is short_entry
    assert pool.bytes_in_use() == index.bytes() == L * H * 2 * pool.page_bytes
    # The pool reclaims index entries when an allocation lacks room.
    pool.cache = index
    big = SequenceKV(pool)
    _append(big, pool.num_pages // H * PS, 4)
    assert len(index) == 0 and pool.free_pages(0) == 0
    big.free()
    assert (pool.refs == 0).all()


def test_a_prefix_entry_outlives_its_conversation_and_keeps_its_pages():
    pool = _pool()
    index = PrefixIndex(pool, 1 << 20)
    a = SequenceKV(pool)
    _append(a, 6, 0)
    before = _rows(a)
    index.insert("m", list(range(6)), a, {})
    _append(a, 5, 1)  # a writes on: its shared partial pages are copied first
    a.free()
    b = SequenceKV(pool)
    b.share_from(index.lookup("m", list(range(9))).kv)
    assert _same(_rows(b), before)
    b.free()
    index.clear()
    assert pool.bytes_in_use() == 0 and np.all(pool.refs == 0)


def test_releasing_a_page_nobody_holds_is_refused():
    pool = _pool()
    with pytest.raises(ValueError):
        pool.release(0, [3])


def test_an_append_copies_every_layers_shared_partial_pages_in_one_batch(monkeypatch):
    pool = _pool()
    a = SequenceKV(pool)
    _append(a, 6, 0)
    b = SequenceKV(pool)
    b.share_from(a)
    before = _rows(a)
    calls = []
    copy = pool.copy_pages
    monkeypatch.setattr(pool, "copy_pages", lambda *args: (calls.append(args), copy(*args)))
    shrinks, moves = b.shrinks, b.moves.copy()
    _append(b, 1, 1)
    assert len(calls) == 1 and sorted(np.asarray(calls[0][0]).tolist()) == [0] * H + [1] * H  # every layer's, once
    assert (b.table[:, :, 1] != a.table[:, :, 1]).all()
    assert (pool.refs[np.arange(L)[:, None], a.table[:, :, 1]] == 1).all()  # a's pages are a's alone again
    assert (b.moves == moves + 1).all() and b.shrinks == shrinks + 1  # one move per head, one change
    assert _same(_rows(a), before)
    for layer in range(L):
        kb, vb, pb = b.gather(layer)
        assert torch.equal(kb[:, :6], before[layer][0]) and torch.equal(vb[:, :6], before[layer][1])
        assert pb[0].tolist() == list(range(7))
