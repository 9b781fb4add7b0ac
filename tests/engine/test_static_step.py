"""The CUDA-graph decode step's host side (one metadata upload, the table cells that changed, padding
rows, rows that change sequence or lose pages to eviction), run without a graph on CPU against the
eager step: same greedy tokens."""

from __future__ import annotations

import pytest

import turnkv


@pytest.fixture(scope="module")
def pair(chat_model_dir):
    """(eager engine, engine whose decode steps run the graphs' host side without a graph)."""
    from turnkv.engine.cuda_graphs import GraphedDecode

    a = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
    b = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
    b.runner.graphs = GraphedDecode(b.model, b.pool, b.max_model_len, max_batch=8)
    return a, b


class TestStaticStepOnCPU:

    def test_batch_whose_rows_finish_at_different_times(self, pair):
        eager, static = pair
        prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
        budgets = [7, 30, 19]  # rows leave the batch one by one: the rest move up a row
        a = [eager.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, budgets)]
        b = [static.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, budgets)]
        assert a == b
        batched = static.generate(prompts, max_new_tokens=30, ignore_eos=True)
        assert [r.token_ids for r in batched] == [eager.generate(p, max_new_tokens=30, ignore_eos=True).token_ids
                                                   for p in prompts]

    def test_eviction_between_steps(self, pair):
        eager, static = pair
        prompts = [list(range(7, 7 + n)) for n in (25, 9)]
        recipe = "snapkv budget=12 schedule=decode every=5"
        a, b = (llm.generate(prompts, recipe=recipe, max_new_tokens=30, ignore_eos=True) for llm in pair)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        trash = static.pool.num_layers * static.pool.page_bytes  # the padding rows' page, one per layer
        assert static.pool.bytes_in_use() - trash == eager.pool.bytes_in_use() == eager.prefix_cache_bytes()

    def test_streaming_ring_page_drops_reach_the_graph_tables(self, pair, tmp_path):
        """Streaming heads drop their ring's oldest page every 4 steps (page_size 4): the shifted table
        cells reach the graph's tables (rewritten before the step, outside the graph), which then
        equal the host tables, and every step's logits equal the eager step's."""
        import numpy as np
        import torch

        from turnkv.kv.sequence import SequenceKV
        from turnkv.methods.lserve.pattern import HeadPattern
        from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill

        eager, static = pair
        graphs = static.runner.graphs
        path = tmp_path / "pattern.json"
        HeadPattern(np.array([[True, False], [False, True]])).save_json(path)
        method = StreamingHeadsPrefill(pattern=str(path), sink=8, local=8)  # 2 + 2 pages of 4 tokens
        method.bind(2)
        seqs = [SequenceKV(llm.pool) for llm in pair]
        rewritten = []
        upload = graphs._upload_rewrites

        def spy(k):
            if graphs.rewrites is not None:
                rewritten.append((seqs[1].next_position, len(graphs.rewrites[0])))
            upload(k)

        graphs._upload_rewrites = spy
        try:
            for llm, seq in zip(pair, seqs):
                llm.runner.prefill(seq, list(range(5, 45)))
                method.trim(seq)  # 40 tokens: the ring keeps 8 of its 32
            assert seqs[1].lengths.tolist() == [[16, 40], [40, 16]]
            for step in range(14):
                token = 7 + 3 * step
                a = eager.runner.decode([seqs[0]], eager._token_tensor([token]))
                b = static.runner.decode([seqs[1]], static._token_tensor([token]))
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
                seq = seqs[1]
                for layer in range(2):
                    for head in range(2):
                        n = int(seq.num_pages[layer, head])
                        assert graphs.tables[layer, 0, head, :n].tolist() == seq.table[layer, head, :n].tolist()
                for s in seqs:
                    method.trim(s)
                np.testing.assert_array_equal(seqs[0].lengths, seqs[1].lengths)
        finally:
            del graphs._upload_rewrites
            for s in seqs:
                s.free()
        # Drops after the steps that brought the ring to 12 tokens (positions 44, 48, 52); the next step
        # rewrites each streaming head's columns 2..4 (the ring's 3 pages): 2 heads x 3 cells.
        assert rewritten == [(45, 6), (49, 6), (53, 6)]


def test_table_changes_bring_a_copy_of_the_table_up_to_date():
    """The host side of the graph's table upload, as a pure function: after appends and page drops
    (random), applying the appended cells and rewritten ranges to a copy makes it equal the table;
    only edited heads are rewritten, from their first rewritten column; a head that grew by more than
    one page without an edit asks for a whole copy."""
    import random

    import numpy as np

    from turnkv.engine.cuda_graphs import table_changes
    from turnkv.kv.pool import PagePool
    from turnkv.kv.sequence import SequenceKV

    rng = random.Random(5)
    pool = PagePool(2, 3, 4, 200, 4)
    seq = SequenceKV(pool)
    seq.reserve(30)
    copy = seq.table.copy()
    pages, edits = seq.num_pages.copy(), seq.table_edits.copy()
    rewrites = 0
    for step in range(80):
        seq.reserve_on_host(1)
        if rng.random() < 0.3:
            layer, head = rng.randrange(2), rng.randrange(3)
            full = int(seq.lengths[layer, head]) // 4
            if full > 2:
                seq.drop_pages(layer, head, 1, rng.randint(1, full - 1))
        appended, (e_layer, e_head, lo, hi) = table_changes(seq, pages, edits)
        if copy.shape != seq.table.shape:  # the table grew: the copy has room for it
            grown = np.zeros_like(seq.table)
            grown[:, :, : copy.shape[2]] = copy
            copy = grown
        layer, head, col = appended
        assert (col == pages[layer, head]).all() and not set(zip(layer, head)) & set(zip(e_layer, e_head))
        copy[layer, head, col] = seq.table[layer, head, col]
        for l, h, a, b in zip(e_layer, e_head, lo, hi):
            assert a == min(pages[l, h], seq.edited_from[l, h]) and b == seq.num_pages[l, h]
            copy[l, h, a:b] = seq.table[l, h, a:b]
            rewrites += 1
        pages[layer, head] += 1
        pages[e_layer, e_head] = seq.num_pages[e_layer, e_head]
        edits = seq.table_edits.copy()
        np.testing.assert_array_equal(pages, seq.num_pages)
        for l in range(2):
            for h in range(3):
                n = seq.num_pages[l, h]
                assert copy[l, h, :n].tolist() == seq.table[l, h, :n].tolist(), (step, l, h)
    assert rewrites > 10
    seq.reserve_on_host(8)  # two pages at once, no edit: a prefill's growth
    assert table_changes(seq, pages, edits) is None
