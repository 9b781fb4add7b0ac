"""A sequence's history as blocks read in place (kv/history_blocks.py): the runs found in page tables
by hand, and the blocks holding exactly the keys a gather reads, however the pages were handed out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.kv import history_blocks
from turnkv.kv.history_blocks import Run, page_runs
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV


def test_runs_of_a_table_by_hand():
    table = np.array([[0, 1, 2, 9, 20, 21, 30],
                      [3, 4, 5, 10, 23, 24, 31]])
    # Columns 0-2: head 1 three pages after head 0; column 3 a one-page run (a decode step's pages);
    # columns 4-5 a run with stride 3; column 6 breaks it (head 0 is not one page on).
    assert page_runs(table) == [Run(0, 3, 0, 3), Run(3, 1, 9, 1), Run(4, 2, 20, 3), Run(6, 1, 30, 1)]
    assert page_runs(table, min_pages=2) == [Run(0, 3, 0, 3), Run(4, 2, 20, 3)]
    # Heads not evenly spaced, or head 1 before head 0: no view covers them.
    assert page_runs(np.array([[0, 1], [2, 3], [5, 6]])) == []
    assert page_runs(np.array([[4, 5], [0, 1]])) == []
    assert page_runs(np.array([[7, 8, 9, 3]])) == [Run(0, 3, 7, 1), Run(3, 1, 3, 1)]  # one head
    assert page_runs(np.zeros((2, 0), dtype=np.int64)) == []


def ids_per_head(blocks) -> torch.Tensor:
    """The ids (column 0 of every row) of each head's keys across the blocks, sorted: [H, n]."""
    k = torch.cat([k for k, _ in blocks], dim=2)[0, :, :, 0]
    v = torch.cat([v for _, v in blocks], dim=2)[0, :, :, 0]
    assert torch.equal(k, -v)
    return k.sort(dim=-1).values


def filled_pool(kv_dtype=None, shuffle=False) -> PagePool:
    """A pool whose every slot's K row starts with its flat slot id (and V with minus it)."""
    pool = PagePool(2, 3, 8, 256, page_size=4, dtype=torch.float32, kv_dtype=kv_dtype)
    ids = torch.arange(2 * 256 * 4, dtype=torch.float32).view(2, 256, 4, 1) % (256 * 4)
    rows = torch.cat([ids, torch.randn(2, 256, 4, 7)], dim=-1)
    if kv_dtype is None:
        pool.k.copy_(rows)
        pool.v.copy_(-rows)
    if shuffle:
        pool._stack[:] = np.random.default_rng(0).permutation(256)
    return pool


@pytest.mark.parametrize("shuffle", [False, True])
def test_blocks_hold_the_gathered_keys_after_slices_and_decode_steps(monkeypatch, shuffle):
    monkeypatch.setattr(history_blocks, "MIN_RUN_TOKENS", 8)  # runs of two pages or more
    pool = filled_pool(shuffle=shuffle)
    seq = SequenceKV(pool)
    for n in (40, 1, 1, 1, 1, 1, 22, 3):  # prefill slices, decode steps, a later turn
        seq.reserve(n)
    length = seq.next_position  # 70: the last page partly filled
    for layer in range(2):
        table = seq.table[layer]
        blocks = history_blocks.history_blocks(pool, layer, table, seq.device_table()[layer][None], length)
        want = pool.gather(layer, seq.device_table()[layer][None], length, "k")[0, :, :, 0]
        assert torch.equal(ids_per_head(blocks), want.sort(dim=-1).values)
        assert len(set(want.flatten().tolist())) == want.numel()  # every slot read once
        views = [k for k, _ in blocks if k.data_ptr() >= pool.k.data_ptr()
                 and k.data_ptr() < pool.k.data_ptr() + pool.k.nbytes]
        # In order: the 40-token slice (10 pages) and the 22-token turn's whole pages are runs, read in
        # place; the decode steps' pages and the last, partial page are gathered in one block.
        assert len(views) == (0 if shuffle else 2) and len(blocks) == len(views) + 1
        if not shuffle:
            assert [v.shape[2] for v in views] == [40, 20] and blocks[-1][0].shape[2] == 10


def test_a_quantized_pool_and_short_runs_are_gathered():
    pool = filled_pool(kv_dtype="int8")
    seq = SequenceKV(pool)
    seq.reserve(100)
    blocks = history_blocks.history_blocks(pool, 0, seq.table[0], seq.device_table()[0][None], 100)
    assert len(blocks) == 1 and blocks[0][0].shape == (1, 3, 100, 8)  # the codes need their scales
    pool = filled_pool()
    seq = SequenceKV(pool)
    seq.reserve(100)  # 25 pages per head, shorter than MIN_RUN_TOKENS
    blocks = history_blocks.history_blocks(pool, 0, seq.table[0], seq.device_table()[0][None], 100)
    assert len(blocks) == 1 and blocks[0][0].is_contiguous()
