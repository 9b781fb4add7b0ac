"""The CUDA-graph decode step's host side (one metadata upload, the table cells that changed, padding
rows, rows that change sequence or lose pages to eviction), run without a graph on CPU against the
eager step: same greedy tokens."""

from __future__ import annotations

import pytest

import turnkv


class TestStaticStepOnCPU:

    @pytest.fixture(scope="class")
    def pair(self, chat_model_dir):
        from turnkv.engine.cuda_graphs import GraphedDecode

        a = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
        b = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
        b.runner.graphs = GraphedDecode(b.model, b.pool, b.max_model_len, max_batch=8)
        return a, b

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
        assert static.pool.bytes_in_use() - trash == eager.pool.bytes_in_use() == 0
