"""Per-logical-page key min/max beside the pool: incremental updates equal a recomputation from the
keys, stale stats of reused pages never leak, and eviction is followed by a rebuild."""

from __future__ import annotations

import pytest
import torch

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.summaries import PageSummaries


def append(seq, summaries, n, gen):
    """Reserve n tokens in every (layer, head), write random keys and fold them into the stats."""
    pool = seq.pool
    slots = seq.reserve(n)
    for layer in range(pool.num_layers):
        k = torch.randn(pool.num_kv_heads * n, pool.head_dim, generator=gen)
        flat = slots[layer].reshape(-1)
        pool.write(layer, flat, k, torch.zeros_like(k))
        summaries.update(layer, flat, k)


def brute_stats(seq, layer, logical):
    """Per head, [n_log, D] max and min computed from the head's keys in order."""
    k, _, _ = seq.gather(layer)
    out = []
    for h in range(seq.pool.num_kv_heads):
        keys = k[h, : seq.lengths[layer, h]]
        chunks = keys.split(logical)
        out.append((torch.stack([c.amax(0) for c in chunks]), torch.stack([c.amin(0) for c in chunks])))
    return out


def check(seq, summaries, layer=0):
    table = seq.device_table()[layer][None, :, : int(seq.num_pages[layer].max())]
    kmax, kmin = summaries.gather(layer, table)
    for h, (bmax, bmin) in enumerate(brute_stats(seq, layer, summaries.logical_page)):
        n = len(bmax)
        torch.testing.assert_close(kmax[0, h, :n], bmax)
        torch.testing.assert_close(kmin[0, h, :n], bmin)


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_incremental_updates_equal_recomputation(page_size):
    gen = torch.Generator().manual_seed(0)
    pool = PagePool(2, 2, 8, num_pages=64, page_size=page_size)
    summaries = PageSummaries(pool, logical_page=16)
    seq = SequenceKV(pool)
    for n in (5, 30, 1, 1, 1, 40, 17, 1):  # chunks that start and end inside logical pages
        append(seq, summaries, n, gen)
        for layer in range(2):
            check(seq, summaries, layer)


def test_reused_pages_do_not_keep_old_stats():
    gen = torch.Generator().manual_seed(1)
    pool = PagePool(1, 2, 8, num_pages=16, page_size=16)
    summaries = PageSummaries(pool)
    old = SequenceKV(pool)
    append(old, summaries, 100, gen)
    pool.k.mul_(50)  # the old keys' extremes are far out: a leak would show
    summaries.rebuild_sequence(old)
    old.free()
    new = SequenceKV(pool)
    for n in (3, 20, 1):
        append(new, summaries, n, gen)
        check(new, summaries)


def test_rebuild_after_eviction():
    gen = torch.Generator().manual_seed(2)
    pool = PagePool(1, 2, 8, num_pages=32, page_size=16)
    summaries = PageSummaries(pool)
    seq = SequenceKV(pool)
    append(seq, summaries, 90, gen)
    seq.keep(0, [torch.arange(0, 90, 3), torch.arange(40, 90)])  # heads now differ in length
    summaries.rebuild_sequence(seq)
    check(seq, summaries)
    append(seq, summaries, 7, gen)  # and updates continue correctly after the rebuild
    check(seq, summaries)


def test_pool_pages_must_hold_whole_logical_pages():
    with pytest.raises(ValueError, match="whole logical pages"):
        PageSummaries(PagePool(1, 1, 8, num_pages=4, page_size=8), logical_page=16)
