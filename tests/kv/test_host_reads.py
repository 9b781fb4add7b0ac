"""The state tiers' copies out of and back into the pages, and LServe's statistics rebuild, queue their
work without waiting for the device: no value is read back per layer (tests/host_reads.py). Each of
these runs inside a step on a GPU, where a read would stall the step behind everything queued."""

from __future__ import annotations

import numpy as np
import torch

from tests.host_reads import HostReads
from tests.kv.test_tiers import contents, evicted_sequence
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.kv.snapshot import export_kv, import_kv, layout_of
from turnkv.methods.lserve.summaries import PageSummaries


def test_the_counter_sees_what_waits():
    with HostReads() as reads:
        t = torch.arange(5)
        torch.repeat_interleave(t, t)
        torch.repeat_interleave(t, t, output_size=10)  # told its size: no read
        t.repeat_interleave(2)  # a constant: no read
        t[t > 2]
        bool(t.sum())
    assert reads.by_op == {"repeat_interleave without output_size": 1, "boolean indexing": 1, "__bool__": 1}


def test_export_and_import_of_uneven_heads_read_nothing_back_but_the_layout_flags():
    pool = PagePool(4, 2, 8, num_pages=96, page_size=4)
    seq = evicted_sequence(pool)
    before = contents(seq)
    with HostReads() as reads:
        meta, tensors = export_kv(seq)
    assert reads.by_op == {"cpu": 1, "tolist": 1}, reads.by_op  # the layout's [L, 2] flags, once
    seq.free()
    restored = SequenceKV(pool)
    with HostReads() as reads:
        import_kv(restored, meta, tensors)
    assert reads.count == 0, reads.by_op
    for a, b in zip(before, contents(restored)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_layout_flags_name_gaps_and_masses_per_layer():
    pool = PagePool(3, 2, 8, num_pages=64, page_size=4)
    seq = SequenceKV(pool)
    slots = seq.reserve(9)
    pool.attention_mass[1].view(-1).index_fill_(0, slots[1].reshape(-1)[:3], 0.5)
    seq.keep(2, [np.array([0, 2, 5]), np.arange(9)])  # layer 2, head 0: positions with gaps
    layout = layout_of(seq)
    assert [p is None for p in layout.positions] == [True, True, False]
    assert layout.positions[2].tolist() == [0, 2, 5, *range(9)]
    assert [m is None for m in layout.masses] == [True, False, True]
    assert layout.masses[1][:3].tolist() == [0.5] * 3 and float(layout.masses[1][3:].abs().sum()) == 0.0


def test_lserve_statistics_rebuild_reads_nothing_back():
    pool = PagePool(2, 2, 8, num_pages=64, page_size=16)
    seq = SequenceKV(pool)
    slots = seq.reserve(40)
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        s = slots[layer].reshape(-1)
        pool.write(layer, s, torch.randn(len(s), 8, generator=gen), torch.randn(len(s), 8, generator=gen))
    summaries = PageSummaries(pool)
    with HostReads() as reads:
        summaries.rebuild_sequence(seq)
    assert reads.count == 0, reads.by_op
    k = pool.rows(1, slots[1, 1].reshape(-1), "k")  # layer 1, head 1: 40 tokens, 3 logical pages
    page = int(seq.table[1, 1, 2])
    assert torch.equal(summaries.kmax[1, page], k[32:40].amax(0))  # the last, partial page
    assert torch.equal(summaries.kmin[1, page], k[32:40].amin(0))


def test_the_load_strategys_restore_of_uneven_heads_reads_nothing_back():
    """pack_split / restore_split with every row loaded (the load strategy: starts all 0), over a layout
    with gaps (an eviction's or LServe's streaming heads'): the general restore, with no mask to read."""
    from types import SimpleNamespace

    from turnkv.state.split import pack_split, restore_split

    pool = PagePool(3, 2, 8, num_pages=64, page_size=4)
    seq = evicted_sequence(pool)
    before = contents(seq)
    with HostReads() as reads:
        meta, tensors = pack_split(seq, [0] * pool.num_layers)
    assert reads.by_op == {"cpu": 1, "tolist": 1}, reads.by_op  # the layout's [L, 2] flags, once
    seq.free()
    restored = SequenceKV(pool)
    with HostReads() as reads:
        stream = restore_split(SimpleNamespace(model=None), restored, list(range(37)), meta, tensors, gate=False)
        stream.wait_all()
    assert reads.count == 0, reads.by_op
    for a, b in zip(before, contents(restored)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
