"""Hierarchical page selection: scores against a brute force, Quest's upper bound, the budget and
newest-page rules, the pool-page mapping, reuse with per-conversation timers, and batching."""

from __future__ import annotations

import pytest
import torch

from turnkv.attention import reference
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.selector import PageSelector, SelectionState, SelectorConfig, page_scores
from turnkv.methods.lserve.summaries import PageSummaries

H, G, D = 2, 2, 8


def make(num_pages=256, page_size=16):
    pool = PagePool(1, H, D, num_pages=num_pages, page_size=page_size)
    return pool, PageSummaries(pool)


def append(seq, summaries, n, gen, scale=1.0):
    slots = seq.reserve(n)[0].reshape(-1)
    k = torch.randn(H * n, D, generator=gen) * scale
    v = torch.randn(H * n, D, generator=gen)
    seq.pool.write(0, slots, k, v)
    summaries.update(0, slots, k)


def batch(seqs):
    width = max(int(s.num_pages[0].max()) for s in seqs)
    tables = [s.device_table()[0, :, :width] for s in seqs]
    tables = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])
    lengths = torch.stack([torch.from_numpy(s.lengths[0]) for s in seqs])
    return tables, lengths


def brute_scores(seq, q, cfg):
    """[H, G, n_phys] from the keys themselves, with Python loops."""
    k, _, _ = seq.gather(0)
    out = {}
    for h in range(H):
        keys = k[h, : seq.lengths[0, h]]
        for g in range(G):
            qq = q[h * G + g]
            for p, phys in enumerate(keys.split(cfg.physical_page)):
                best = max(sum(max(qq[d] * c[:, d].max(), qq[d] * c[:, d].min()) for d in range(D))
                           for c in phys.split(cfg.logical_page))
                out[h, g, p] = float(best)
    return out


def test_scores_equal_brute_force_and_bound_every_key():
    gen = torch.Generator().manual_seed(0)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 300, gen)
    seq.keep(0, [torch.arange(300), torch.arange(0, 300, 2)])  # heads of different lengths
    summaries.rebuild_sequence(seq)
    cfg = SelectorConfig(token_budget=128)
    q = torch.randn(1, H * G, D, generator=gen)
    tables, lengths = batch([seq])
    n_phys = -(-int(lengths.max()) // 64)
    tables = torch.nn.functional.pad(tables, (0, n_phys * 4 - tables.shape[2]))
    kmax, kmin = summaries.gather(0, tables)
    scores = page_scores(q, kmax, kmin, lengths, cfg)[0]
    brute = brute_scores(seq, q[0], cfg)
    k, _, _ = seq.gather(0)
    for (h, g, p), value in brute.items():
        assert scores[h, g, p].item() == pytest.approx(value, rel=1e-5, abs=1e-5)
        # Quest's property: no key of the page has a larger q·k than the page's score.
        keys = k[h, p * 64: min((p + 1) * 64, int(lengths[0, h]))]
        assert (keys @ q[0, h * G + g]).max().item() <= value + 1e-5
    assert torch.isinf(scores[1, :, -1]).all()  # past the shorter head's pages: -inf


def read_positions(pool, tables, lengths):
    """Positions of the tokens indexed_decode visits, per (b, x): table[j // ps] at offset j % ps."""
    out = {}
    for b in range(tables.shape[0]):
        for x in range(tables.shape[1]):
            j = torch.arange(int(lengths[b, x]))
            pages = tables[b, x, j // pool.page_size].long()
            out[b, x] = pool.positions[0][pages, j % pool.page_size].tolist()
    return out


def test_selection_rules_and_pool_page_mapping():
    gen = torch.Generator().manual_seed(1)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 1000, gen)  # 16 physical pages of 64, the last one partial (40 tokens)
    cfg = SelectorConfig(token_budget=256, reuse_interval=1)  # 4 physical pages
    q = torch.randn(1, H * G, D, generator=gen)
    tables, lengths = batch([seq])
    sel_tables, sel_lengths = PageSelector(cfg).select(0, q, tables, lengths, summaries, [SelectionState(1)])
    assert sel_tables.shape[:2] == (1, H * G) and sel_tables.dtype == torch.int32
    assert (sel_lengths == 3 * 64 + 40).all()  # 3 full pages + the partial newest, within the budget
    kmax, kmin = summaries.gather(0, torch.nn.functional.pad(tables, (0, 64 - tables.shape[2])))
    scores = page_scores(q, kmax, kmin, lengths, cfg)[0].reshape(H * G, -1)
    for (b, x), positions in read_positions(pool, sel_tables, sel_lengths).items():
        pages = sorted({p // 64 for p in positions})
        # Each chosen physical page is read whole: its 4 pool pages of 16, in order.
        expected = [t for p in pages for t in range(p * 64, min(p * 64 + 64, 1000))]
        assert positions == expected
        assert pages[-1] == 15  # the newest page, always
        top3 = scores[x, :15].topk(3).indices.sort().values.tolist()
        assert pages[:-1] == top3


def test_within_budget_reads_everything_and_decode_matches():
    gen = torch.Generator().manual_seed(2)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 250, gen)
    cfg = SelectorConfig(token_budget=256)
    q = torch.randn(1, H * G, D, generator=gen)
    tables, lengths = batch([seq])
    sel_tables, sel_lengths = PageSelector(cfg).select(0, q, tables, lengths, summaries, [SelectionState(1)])
    full = reference.indexed_decode(q, pool.k[0], pool.v[0], tables.to(torch.int32), lengths.to(torch.int32))
    got = reference.indexed_decode(q, pool.k[0], pool.v[0], sel_tables, sel_lengths)
    torch.testing.assert_close(got, full)


def test_decode_over_selection_equals_attention_over_selected_tokens():
    gen = torch.Generator().manual_seed(3)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 700, gen)
    cfg = SelectorConfig(token_budget=192, group="max")  # per KV head: tables [B, H, .]
    q = torch.randn(1, H * G, D, generator=gen)
    tables, lengths = batch([seq])
    sel_tables, sel_lengths = PageSelector(cfg).select(0, q, tables, lengths, summaries, [SelectionState(1)])
    assert sel_tables.shape[1] == H
    out = reference.indexed_decode(q, pool.k[0], pool.v[0], sel_tables, sel_lengths)
    k, v, pos = seq.gather(0)
    for h, positions in ((h, p) for (_, h), p in read_positions(pool, sel_tables, sel_lengths).items()):
        idx = torch.tensor(positions)
        assert len(positions) <= 192 and positions[-1] == 699
        for g in range(G):
            weights = (k[h, idx] @ q[0, h * G + g] * D**-0.5).softmax(0)
            torch.testing.assert_close(out[0, h * G + g], weights @ v[h, idx])


def test_important_far_page_is_found():
    gen = torch.Generator().manual_seed(4)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 1024, gen, scale=0.1)
    q = torch.zeros(1, H * G, D)
    q[..., 0] = 1.0
    needle = 300  # physical page 4
    pool.k[0][seq.table[0, :, needle // 16], needle % 16, 0] = 20.0
    summaries.rebuild_sequence(seq)
    tables, lengths = batch([seq])
    cfg = SelectorConfig(token_budget=192)
    sel_tables, sel_lengths = PageSelector(cfg).select(0, q, tables, lengths, summaries, [SelectionState(1)])
    for positions in read_positions(pool, sel_tables, sel_lengths).values():
        assert needle in positions


def test_reuse_for_interval_and_refresh_on_new_page():
    gen = torch.Generator().manual_seed(5)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 64 * 10 + 20, gen)
    cfg = SelectorConfig(token_budget=192, reuse_interval=4)
    selector, state = PageSelector(cfg), SelectionState(1)

    def step(q):
        tables, lengths = batch([seq])
        sel = selector.select(0, q, tables, lengths, summaries, [state])
        return read_positions(pool, *sel)

    qs = [torch.randn(1, H * G, D, generator=gen) for _ in range(6)]
    first = step(qs[0])
    for i in range(1, 4):  # steps 2-4 reuse the pages chosen at step 1, whatever the query
        append(seq, summaries, 1, gen)
        got = step(qs[i])
        assert state.selections[0] == 1
        assert {k: sorted({p // 64 for p in v}) for k, v in got.items()} == \
               {k: sorted({p // 64 for p in v}) for k, v in first.items()}
        assert all(v[-1] == 64 * 10 + 20 + i - 1 for v in got.values())  # the newest token is read
    append(seq, summaries, 1, gen)
    step(qs[4])
    assert state.selections[0] == 2  # step 5: a fresh selection
    # A new physical page forces a refresh before the interval is over.
    append(seq, summaries, 64 * 11 - seq.lengths[0, 0] + 1, gen)  # first token of page 11
    got = step(qs[5])
    assert state.selections[0] == 3
    assert all(sorted({p // 64 for p in v})[-1] == 11 for v in got.values())


def test_batch_of_two_conversations_keeps_separate_timers():
    gen = torch.Generator().manual_seed(6)
    pool, summaries = make(num_pages=512)
    a, b = SequenceKV(pool), SequenceKV(pool)
    append(a, summaries, 900, gen)
    append(b, summaries, 60 + 64 * 5, gen)  # 380 tokens
    cfg = SelectorConfig(token_budget=192, reuse_interval=4)
    selector, states = PageSelector(cfg), [SelectionState(1), SelectionState(1)]
    q = torch.randn(2, H * G, D, generator=gen)
    tables, lengths = batch([a, b])
    sel = selector.select(0, q, tables, lengths, summaries, states)
    # Each row equals selecting that conversation alone.
    for row, seq in enumerate((a, b)):
        t, l = batch([seq])
        alone = PageSelector(cfg).select(0, q[row:row + 1], t, l, summaries, [SelectionState(1)])
        assert read_positions(pool, sel[0][row:row + 1], sel[1][row:row + 1]) == read_positions(pool, *alone)
    # b opens a new page (380 -> 384 + 1) while a keeps its selection.
    append(a, summaries, 1, gen)
    append(b, summaries, 5, gen)
    tables, lengths = batch([a, b])
    selector.select(0, q, tables, lengths, summaries, states)
    assert [s.selections[0] for s in states] == [1, 2]
    states[0].invalidate()
    selector.select(0, q, tables, lengths, summaries, states)
    assert [s.selections[0] for s in states] == [2, 2]


def test_streaming_heads_and_quest():
    gen = torch.Generator().manual_seed(7)
    pool, summaries = make()
    seq = SequenceKV(pool)
    append(seq, summaries, 500, gen)
    tables, lengths = batch([seq])
    q = torch.randn(1, H * G, D, generator=gen)
    cfg = SelectorConfig(token_budget=128)
    t, l = PageSelector(cfg).select(0, q, tables, lengths, summaries, [SelectionState(1)],
                                    dense=torch.tensor([True, False]))
    # Dense head 0: LServe's floor of 3 pages (128 // 64 = 2 < 3), the newest holding 52 tokens.
    assert (l[0, :G] == 2 * 64 + 500 - 7 * 64).all()
    assert (l[0, G:] == 500).all()  # streaming head 1: its whole table
    assert read_positions(pool, t, l)[0, G] == list(range(500))
    quest = SelectorConfig.quest(token_budget=64)
    assert (quest.physical_page, quest.logical_page, quest.pages_budget) == (16, 16, 4)
    t, l = PageSelector(quest).select(0, q, tables, lengths, summaries, [SelectionState(1)])
    assert (l == 500).all()  # layer 0 < dense_layers: Quest keeps its first two layers dense
    t, l = PageSelector(SelectorConfig.quest(64, dense_layers=0)).select(0, q, tables, lengths, summaries,
                                                                      [SelectionState(1)])
    for positions in read_positions(pool, t, l).values():
        assert len(positions) == 3 * 16 + 4 and positions[-4:] == [496, 497, 498, 499]


@pytest.mark.parametrize("kwargs", [dict(token_budget=100), dict(physical_page=48), dict(reuse_interval=0),
                                    dict(group="mean")])
def test_config_errors(kwargs):
    with pytest.raises(ValueError):
        SelectorConfig(**kwargs)
