"""Eviction through the paged store: Eviction.compress over a SequenceKV filled with random K/V frees
real pages, keeps exactly the budget per layer (uniform, Ada-KV, keep_ratio, PyramidKV schedule), and
attention over the compacted cache equals dense attention with the evicted keys masked out. GQA keeps
one K/V per KV head. A tiny random llama (chat_llm) runs the same through conversations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turnkv.attention import reference
from turnkv.engine.step import Step
from turnkv.errors import InvalidRequestError
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.eviction import Eviction
from turnkv.methods.evict.knorm import KnormScorer
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.evict.pyramidkv import PyramidKVScorer
from turnkv.methods.evict.snapkv import SnapKVScorer
from turnkv.methods.evict.streaming_llm import StreamingLLMScorer
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.turns.recompress import RecompressTurns
from turnkv.methods.window import QueryWindow

L, H, HQ, D, PS = 2, 2, 4, 8, 4
G = HQ // H
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
TOL = {"rtol": 1e-5, "atol": 1e-5}


# ---- helpers ------------------------------------------------------------------------------------

def filled_store(n: int, layers: int = L, seed: int = 0, head_scale=(3.0, 0.4), extra_pages: int = 8):
    """A SequenceKV holding n random tokens in every (layer, head). Head 0's keys are large (peaked
    attention), head 1's small (dispersed), so the heads of a layer differ the way Ada-KV exploits.
    Returns the pool, the sequence and fp32 copies of everything written: K, V [layers, H, n, D]."""
    pool = PagePool(layers, H, D, num_pages=H * -(-n // PS) + extra_pages, page_size=PS)
    seq = SequenceKV(pool)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, H, n, D, generator=g) * torch.tensor(head_scale)[None, :, None, None]
    v = torch.randn(layers, H, n, D, generator=g)
    slots = seq.reserve(n)
    for layer in range(layers):
        pool.write(layer, slots[layer].reshape(-1), k[layer].reshape(-1, D), v[layer].reshape(-1, D))
    return pool, seq, k.clone(), v.clone()


def window_for(n: int, W: int, layers: int = L, seed: int = 1) -> QueryWindow:
    """An observation window of W random queries [W, Hq, D] at positions n-W .. n-1, per layer."""
    g = torch.Generator().manual_seed(seed)
    window = QueryWindow(layers, W)
    for layer in range(layers):
        window.record(layer, torch.randn(W, HQ, D, generator=g), torch.arange(n - W, n))
    return window


def kept_positions(seq: SequenceKV, layer: int) -> list[list[int]]:
    _, _, pos = seq.gather(layer)
    return [pos[h, : seq.lengths[layer, h]].tolist() for h in range(H)]


def full_view(k, v, layer, window, next_position, target=0) -> LayerView:
    n = k.shape[2]
    return LayerView(layer=layer, num_layers=k.shape[0], keys=k[layer], values=v[layer],
                     positions=torch.arange(n).expand(H, n).clone(), valid=torch.ones(H, n, dtype=torch.bool),
                     queries=window.queries[layer] if window else None,
                     query_positions=window.positions[layer] if window else None, attention_mass=None,
                     inv_freq=INV_FREQ, next_position=next_position, target=target)


def naive_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [Hq, D]; keys/values: per KV head the [S_h, D] rows it attends to. Explicit fp64 softmax."""
    out = []
    for qh in range(q.shape[0]):
        kk, vv = keys[qh // G].double(), values[qh // G].double()
        w = torch.exp((kk @ q[qh].double()) / math.sqrt(D) - (kk @ q[qh].double()).max() / math.sqrt(D))
        out.append((w / w.sum()) @ vv)
    return torch.stack(out).float()


def page_accounting_holds(pool: PagePool, seq: SequenceKV) -> None:
    pages = -(-seq.lengths // PS)
    assert (seq.num_pages == pages).all()
    assert seq.bytes() == int(pages.sum()) * pool.page_bytes == int(seq.bytes_per_head().sum())
    for layer in range(pool.num_layers):
        assert pool.used_pages(layer) == int(pages[layer].sum())
        assert pool.free_pages(layer) == pool.num_pages - int(pages[layer].sum())


# ---- memory and budgets -----------------------------------------------------------------------------

def test_ada_snapkv_frees_pages_and_keeps_exactly_the_layer_budget():
    n, W, B = 40, 4, 10
    pool, seq, k, v = filled_store(n)
    window = window_for(n, W)
    before_bytes = seq.bytes()
    assert before_bytes == L * H * (n // PS) * pool.page_bytes
    # Scores and counts the compression must act on, computed from the untouched copies.
    expected_scores = [SnapKVScorer(window=W).score(full_view(k, v, layer, window, n, B)) for layer in range(L)]
    entry = Eviction(SnapKVScorer(window=W), AdaKVAllocator(), budget=B).compress(
        seq, RecompressTurns(), 0, n, window, INV_FREQ)

    assert entry["budget_per_layer"] == [H * B] * L
    assert entry["kept_per_head"] == seq.lengths.tolist()
    assert (seq.lengths.sum(axis=1) == H * B).all()  # window included
    assert len(set(seq.lengths.flatten().tolist())) > 1  # heads hold different token counts
    page_accounting_holds(pool, seq)
    assert entry["kv_bytes"] == seq.bytes() < before_bytes
    # every page past ceil(len / page_size) went back to the pool: 10 pages per head before
    freed = sum(pool.free_pages(layer) for layer in range(L)) - L * (pool.num_pages - H * n // PS)
    assert freed == L * H * (n // PS) - int((-(-seq.lengths // PS)).sum()) > 0

    for layer in range(L):
        scores = expected_scores[layer]
        assert seq.lengths[layer].tolist() == AdaKVAllocator().allocate(scores, H * B).tolist()
        for h, kept in enumerate(kept_positions(seq, layer)):
            assert kept == sorted(kept)  # ascending original positions
            assert set(range(n - W, n)) <= set(kept)  # the window always stays
            evicted = sorted(set(range(n)) - set(kept))
            # per-head top-k: no evicted token outscores a kept one
            assert float(scores[h, kept].min()) >= float(scores[h, evicted].max())
            # the kept rows are the very K/V that were written at those positions
            K, V, _ = seq.gather(layer)
            assert torch.equal(K[h, : len(kept)], k[layer, h, kept])
            assert torch.equal(V[h, : len(kept)], v[layer, h, kept])


def test_uniform_snapkv_keeps_the_budget_in_every_head():
    n, W, B = 40, 4, 10
    pool, seq, _k, _v = filled_store(n, seed=3)
    Eviction(SnapKVScorer(window=W), UniformAllocator(), budget=B).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    assert (seq.lengths == B).all()
    page_accounting_holds(pool, seq)
    assert seq.bytes() == L * H * math.ceil(B / PS) * pool.page_bytes  # 3 pages per head instead of 10


def test_streaming_llm_keeps_sinks_and_the_most_recent_tokens():
    n, B = 30, 9
    pool, seq, _k, _v = filled_store(n, seed=4)
    Eviction(StreamingLLMScorer(), AdaKVAllocator(), budget=B).compress(seq, RecompressTurns(), 0, n, None, INV_FREQ)
    for layer in range(L):
        assert kept_positions(seq, layer) == [[0, 1, 2, 3, *range(n - 5, n)]] * H
    page_accounting_holds(pool, seq)


@pytest.mark.parametrize("allocator", [UniformAllocator(), AdaKVAllocator()])
def test_keep_ratio_budget_is_a_fraction_of_the_positions(allocator):
    n, W = 41, 4
    pool, seq, _k, _v = filled_store(n, seed=5, extra_pages=2)
    entry = Eviction(SnapKVScorer(window=W), allocator, keep_ratio=0.37).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    assert entry["budget_per_layer"] == [H * 15] * L  # floor(0.37 * 41) = 15 per head
    assert (seq.lengths.sum(axis=1) == H * 15).all()
    page_accounting_holds(pool, seq)
    # a second compression at the same number of positions is a no-op: the cache is at its budget
    before = seq.lengths.copy()
    Eviction(SnapKVScorer(window=W), allocator, keep_ratio=0.37).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    assert (seq.lengths == before).all()


def test_knorm_eviction_keeps_the_smallest_key_norms_per_head():
    n, B = 24, 7
    _pool, seq, k, _v = filled_store(n, seed=6)
    Eviction(KnormScorer(), UniformAllocator(), budget=B).compress(seq, RecompressTurns(), 0, n, None, INV_FREQ)
    for layer in range(L):
        for h, kept in enumerate(kept_positions(seq, layer)):
            assert kept == sorted(k[layer, h].norm(dim=-1).argsort()[:B].tolist())


def test_more_protected_tokens_than_budget_keeps_the_budget():
    # window 8 > budget 5: the window's tokens compete among themselves; the count is still exact
    n, W, B = 24, 8, 5
    _pool, seq, _k, _v = filled_store(n, seed=7)
    Eviction(SnapKVScorer(window=W), UniformAllocator(), budget=B).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    assert (seq.lengths == B).all()
    for layer in range(L):
        for kept in kept_positions(seq, layer):
            assert set(kept) <= set(range(n - W, n))


def test_compression_span_leaves_tokens_outside_it_alone():
    # Only [8, 32) may lose tokens; before and after it everything stays, and the budget counts what
    # is kept before the span (Recompress "matched"): H*B - H*8 candidates survive.
    n, W, B = 40, 4, 14
    pool, seq, _k, _v = filled_store(n, seed=8)
    window = QueryWindow(L, W)
    g = torch.Generator().manual_seed(0)
    for layer in range(L):
        window.record(layer, torch.randn(W, HQ, D, generator=g), torch.arange(28, 32))
    Eviction(SnapKVScorer(window=W), AdaKVAllocator(), budget=B).compress(
        seq, RecompressTurns(), 8, 32, window, INV_FREQ)
    for layer in range(L):
        assert (seq.count_positions(layer, 0, 8) == 8).all()
        assert (seq.count_positions(layer, 32, 40) == 8).all()
        assert int(seq.count_positions(layer, 8, 32).sum()) == H * B - H * 8
    page_accounting_holds(pool, seq)


# ---- exactness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("allocator", [UniformAllocator(), AdaKVAllocator(), AdaKVAllocator(alpha=0.0)])
def test_attention_over_compacted_cache_equals_masked_dense_attention(allocator):
    n, W, B = 40, 4, 9
    _pool, seq, k, v = filled_store(n, seed=9)
    Eviction(SnapKVScorer(window=W), allocator, budget=B).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    g = torch.Generator().manual_seed(10)
    for layer in range(L):
        kept = kept_positions(seq, layer)
        q = torch.randn(1, HQ, 1, D, generator=g)
        # dense attention over the uncompressed K/V with the evicted keys masked out
        mask = torch.zeros(1, H, 1, n, dtype=torch.bool)
        for h in range(H):
            mask[0, h, 0, kept[h]] = True
        dense = reference.attention(q, k[layer][None], v[layer][None], mask)
        # the same query over what the store holds now
        K, V, _ = seq.gather(layer)
        valid = (torch.arange(K.shape[1]) < torch.from_numpy(seq.lengths[layer])[:, None])[None, :, None]
        compact = reference.attention(q, K[None], V[None], valid)
        torch.testing.assert_close(compact, dense, **TOL)
        naive = naive_attention(q[0, :, 0], [k[layer, h, kept[h]] for h in range(H)],
                                [v[layer, h, kept[h]] for h in range(H)])
        torch.testing.assert_close(compact[0, :, 0], naive, **TOL)


def test_decode_step_after_ada_eviction_attends_over_uneven_heads_exactly():
    n, W, B = 36, 4, 8
    pool, seq, k, v = filled_store(n, seed=11)
    Eviction(SnapKVScorer(window=W), AdaKVAllocator(alpha=0.0), budget=B).compress(
        seq, RecompressTurns(), 0, n, window_for(n, W), INV_FREQ)
    assert len(set(seq.lengths.flatten().tolist())) > 1
    kept = [kept_positions(seq, layer) for layer in range(L)]
    g = torch.Generator().manual_seed(12)
    slots = seq.reserve(1)
    step = Step(pool, [seq], [slots], torch.tensor([[n]]))
    assert all(step.padded)  # heads of different lengths in every layer: the masked, padded path
    for layer in range(L):
        q = torch.randn(1, 1, HQ, D, generator=g)
        kn, vn = torch.randn(1, 1, H, D, generator=g), torch.randn(1, 1, H, D, generator=g)
        out = step.attention(layer, q, kn, vn)  # [1, 1, Hq, D]
        keys = [torch.cat([k[layer, h, kept[layer][h]], kn[0, 0, h][None]]) for h in range(H)]
        values = [torch.cat([v[layer, h, kept[layer][h]], vn[0, 0, h][None]]) for h in range(H)]
        torch.testing.assert_close(out[0, 0], naive_attention(q[0, 0], keys, values), **TOL)
    assert (seq.lengths.sum(axis=1) == H * B + H).all()
    page_accounting_holds(pool, seq)


# ---- PyramidKV's layer schedule ------------------------------------------------------------------

def test_pyramid_schedule_matches_a_worked_example():
    # B_avg=1024, win=32, L=32 -> b=992, min=49, max=1935, steps=60, b_0=1935 ... b_31=75
    p = PyramidKVScorer(window=32)
    targets = [p.layer_target(1024, layer, 32, available=100_000) for layer in range(32)]
    assert [t - 32 for t in targets] == [1935 - 60 * layer for layer in range(32)]
    assert targets[0] - 32 == 1935 and targets[-1] - 32 == 75
    assert sum(targets) / 32 == 1037  # the floor in `steps` leaves the average 13 above 1024
    assert abs(sum(targets) / 32 - 1024) / 1024 < 0.015


def test_pyramid_schedule_clamps_to_what_the_layer_holds():
    p = PyramidKVScorer(window=8)
    # b = 56: min 2, max 110 >= 80 - 8 -> max = 72, min = 40, steps = 32 // 3 = 10
    assert [p.layer_target(64, layer, 4, available=80) for layer in range(4)] == [80, 70, 60, 50]
    # a budget at or under the window, or a single layer, is left as it is
    assert p.layer_target(8, 2, 4, available=80) == 8
    assert p.layer_target(64, 0, 1, available=80) == 64


@pytest.mark.parametrize("allocator", [UniformAllocator(), AdaKVAllocator()])
def test_pyramid_eviction_keeps_its_per_layer_targets(allocator):
    layers, n, W, B = 4, 40, 4, 12
    pool, seq, _k, _v = filled_store(n, layers=layers, seed=13)
    # b = 8: min 0, max 16, steps 5 -> per-head targets 20, 15, 10, 5 (average 12.5)
    entry = Eviction(PyramidKVScorer(window=W), allocator, budget=B).compress(seq, RecompressTurns(), 0, n,
                                                                        window_for(n, W, layers), INV_FREQ)
    assert entry["budget_per_layer"] == [H * 20, H * 15, H * 10, H * 5]
    assert seq.lengths.sum(axis=1).tolist() == [H * 20, H * 15, H * 10, H * 5]
    page_accounting_holds(pool, seq)


# ---- GQA: one K/V per KV head ------------------------------------------------------------------

def test_gqa_store_holds_one_kv_per_kv_head(chat_llm):
    c = chat_llm.config
    assert (c.num_heads, c.num_kv_heads) == (4, 2)
    pool = chat_llm.pool
    assert pool.num_kv_heads == 2
    assert pool.k.shape == (c.num_layers, pool.num_pages, pool.page_size, c.head_dim) == pool.v.shape
    assert pool.page_bytes == 2 * pool.page_size * c.head_dim * pool.k.element_size()
    seq = SequenceKV(pool)
    try:
        chat_llm.runner.prefill(seq, list(range(100, 137)))
        assert seq.lengths.shape == (c.num_layers, 2) and (seq.lengths == 37).all()
        assert seq.bytes() == c.num_layers * 2 * math.ceil(37 / pool.page_size) * pool.page_bytes
        keys, values, _pos = seq.gather(0)
        assert keys.shape == values.shape == (2, 37, c.head_dim)
    finally:
        seq.free()


# ---- through a conversation ------------------------------------------------------------------------

LONG = ("The lighthouse keeper counted ships every night, wrote their names in a blue book, and in the "
        "morning walked down to the harbour to ask the fishermen where each of them had been going.")


def test_ada_snapkv_preset_is_snapkv_scores_with_adakv_budgets():
    from turnkv.methods.recipe import Recipe

    evict = Recipe.parse("ada-snapkv budget=64").evict
    assert isinstance(evict.scorer, SnapKVScorer) and isinstance(evict.allocator, AdaKVAllocator)
    assert (evict.scorer.window, evict.scorer.kernel, evict.scorer.pooling) == (32, 7, "max")
    assert (evict.allocator.alpha, evict.allocator.rule, evict.budget, evict.schedule) == (0.2, "code", 64, "prefill")


def test_prompt_schedule_compresses_the_running_turn_as_generate_compresses_a_prompt(chat_llm):
    """schedule=prompt: a turn's whole prompt but its observation window goes to the budget right
    after its prefill (SnapKV's code on one prompt), which is what LLM.generate does; the preset's
    prefill schedule keeps the running turn whole until the next message."""
    recipe = "evict=snapkv(window=8)+adakv budget=24 schedule=prompt"
    conv = chat_llm.conversation(recipe=recipe)
    try:
        reply = conv.send(LONG, max_new_tokens=6)
        prompt_end = conv.turns[0].prompt_end
        assert [e["event"] for e in conv.compression_log] == ["prompt"]
        assert list(conv.compression_log[0]["span"]) == [0, prompt_end]
        H_ = chat_llm.config.num_kv_heads
        for layer in range(chat_llm.config.num_layers):
            assert int(conv.kv.count_positions(layer, 0, prompt_end).sum()) == H_ * 24
        alone = chat_llm.generate(conv.tokens[:prompt_end], recipe=recipe, max_new_tokens=6)
        assert alone.token_ids == reply.token_ids
        later = conv.send("And then?", max_new_tokens=6)  # the next prompt is compressed again, with the history
        assert [e["event"] for e in conv.compression_log] == ["prompt", "prompt"] and later.token_ids
        for layer in range(chat_llm.config.num_layers):
            assert int(conv.kv.count_positions(layer, 0, conv.turns[1].prompt_end).sum()) == H_ * 24
    finally:
        conv.close()
    whole = chat_llm.conversation(recipe="evict=snapkv(window=8)+adakv budget=24")
    try:
        whole.send(LONG, max_new_tokens=6)
        assert whole.compression_log == []  # the default schedule waits for a finished segment
    finally:
        whole.close()
    with pytest.raises(InvalidRequestError, match="flowkv keeps the running turn whole"):
        chat_llm.conversation(recipe="snapkv budget=24 schedule=prompt turns=flowkv")


def test_conversation_with_ada_snapkv_keeps_budget_and_frees_memory(chat_llm):
    pool = chat_llm.pool
    # The prefix index keeps full's turn ends: pages that only it holds once full wrote past them.
    # Counted without it, before and after.
    chat_llm.prefix_index.clear()
    used_before = [pool.used_pages(layer) for layer in range(pool.num_layers)]
    conv = chat_llm.conversation(recipe="evict=snapkv(window=8)+adakv budget=24")
    full = chat_llm.conversation()
    try:
        for c in (conv, full):
            c.send(LONG, max_new_tokens=6)
            c.send("And then?", max_new_tokens=6)
        log = conv.compression_log
        assert [e["event"] for e in log] == ["prefill"]  # turn 1 has nothing finished to compress
        lo, hi = log[0]["span"]
        assert lo == 0 and hi == conv.turns[1].start and hi > 24
        kv, H_ = conv.kv, chat_llm.config.num_kv_heads
        assert log[0]["budget_per_layer"] == [H_ * 24] * chat_llm.config.num_layers
        for layer in range(chat_llm.config.num_layers):
            assert int(kv.count_positions(layer, 0, hi).sum()) == H_ * 24
            # the running turn (and what follows it) is untouched
            assert (kv.count_positions(layer, hi, kv.next_position) == kv.next_position - hi).all()
        assert len(set(np.asarray(log[0]["kept_per_head"]).flatten().tolist())) > 1  # Ada: uneven heads
        assert kv.bytes() == int((-(-kv.lengths // pool.page_size)).sum()) * pool.page_bytes
        assert kv.bytes() < full.kv.bytes()
        assert full.kv.tokens() > kv.tokens()
        chat_llm.prefix_index.clear()
        used = [pool.used_pages(layer) - used_before[layer] for layer in range(pool.num_layers)]
        assert used == (kv.num_pages.sum(axis=1) + full.kv.num_pages.sum(axis=1)).tolist()
    finally:
        conv.close()
        full.close()
    assert [pool.used_pages(layer) for layer in range(pool.num_layers)] == used_before


def test_abandoned_stream_leaves_no_trace_in_the_observation_window(chat_llm):
    states = []
    for abandon in (False, True):
        conv = chat_llm.conversation(recipe="evict=snapkv(window=32) budget=24 schedule=turn_end")
        try:
            conv.send("The keeper counted ships every night and wrote their names down.", max_new_tokens=6)
            if abandon:  # undone: the KV goes back to where it was, the recipe compresses only at turn end
                stream = conv.stream("Tell me more about it please, in a lot of detail, about every ship.",
                                     max_new_tokens=20)
                next(stream), next(stream)
                stream.close()
            conv.send("Why?", max_new_tokens=3)
            kept = [[pos[h, : conv.kv.lengths[layer, h]].tolist() for h in range(H)]
                    for layer in range(chat_llm.config.num_layers) for pos in [conv.kv.gather(layer)[2]]]
            states.append((conv.tokens, conv.kv.next_position, conv.method_state.window.positions[0].tolist(), kept))
        finally:
            conv.close()
    (tokens0, next0, window0, kept0), (tokens1, next1, window1, kept1) = states
    if tokens0 != tokens1 or next0 != next1:  # the premise: the same history in both conversations
        raise RuntimeError("the two conversations should hold the same tokens")
    # The window must only hold queries of tokens that are in the history...
    assert max(window1) < next1, f"window positions {window1} reach past the history ({next1} positions)"
    # ... so the same history scores and keeps the same tokens.
    assert window1 == window0
    assert kept1 == kept0
