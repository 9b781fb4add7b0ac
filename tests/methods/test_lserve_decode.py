"""The decode axis `quest` / `lserve` in the engine: dense-exact within budget, the number of tokens a
selecting decode reads, a needle far back found through the page statistics, batching, and the
statistics kept exact across eviction and rollback."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.attention import decode as decode_module
from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.decode.quest import QuestDecode
from turnkv.methods.lserve.decode import LServeDecode, summaries_for
from turnkv.methods.lserve.summaries import PageSummaries
from turnkv.methods.step_context import StepContext

PROMPTS = ["The river flows past the old mill where the miller counts sacks of grain every morning before dawn.",
           "Mountains rise over the valley; snow covers the peaks while shepherds lead goats to the high meadows."]
LONG = " ".join(PROMPTS * 3)


def spy_reads(monkeypatch):
    calls = []
    real = decode_module.indexed_decode

    def spy(q, k_cache, v_cache, table, lengths, *args, **kwargs):
        calls.append((k_cache.shape[1] == 1, lengths.clone(), table.clone()))
        return real(q, k_cache, v_cache, table, lengths, *args, **kwargs)

    monkeypatch.setattr(decode_module, "indexed_decode", spy)
    return calls


def run_turns(llm, recipe, messages, new=8):
    conv = llm.conversation(system="Answer briefly.", recipe=recipe)
    out = []
    try:
        for message in messages:
            for _ in conv.stream(message, max_new_tokens=new, ignore_eos=True, logprobs=True):
                pass
            out.append((conv.last_reply.token_ids, conv.last_reply.logprobs))
        return out, conv.method_stats
    finally:
        conv.close()


def test_budget_over_history_equals_dense_decode(chat_llm):
    dense, _ = run_turns(chat_llm, None, PROMPTS)
    for recipe in ("decode=quest(budget=100000,dense_layers=0)", "decode=lserve(budget=100032)"):
        got, stats = run_turns(chat_llm, recipe, PROMPTS)
        for (ids, lp), (ref_ids, ref_lp) in zip(got, dense):
            assert ids == ref_ids
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
        assert [s["decode"]["selections"] for s in stats] == [0, 0]  # within budget: never selects


def expected_read(length: int, page: int, pages_budget: int) -> int:
    pages = -(-length // page)
    if pages <= pages_budget:
        return length
    return (pages_budget - 1) * page + length - (pages - 1) * page


@pytest.mark.parametrize("recipe, page, pages_budget, reuse", [
    ("decode=quest(budget=32,dense_layers=0)", 16, 3, 1),  # 3 pages: LServe's floor of 3 pages
    ("decode=lserve(budget=64,physical_page=32,reuse=3)", 32, 3, 3),
])
def test_small_budget_reads_only_the_selected_pages(chat_llm, monkeypatch, recipe, page, pages_budget, reuse):
    calls = spy_reads(monkeypatch)
    new = 10
    conv = chat_llm.conversation(recipe=recipe)
    try:
        reply = conv.send(LONG, max_new_tokens=new, ignore_eos=True)
        stats = conv.method_stats[-1]["decode"]
    finally:
        conv.close()
    L, Hq = chat_llm.config.num_layers, chat_llm.config.num_heads
    prompt = reply.prompt_tokens
    assert prompt > pages_budget * page  # the case selects
    assert len(calls) == (new - 1) * L
    for step in range(1, new):
        length = prompt + step
        for slots, lengths, _ in calls[(step - 1) * L : step * L]:
            assert slots and lengths.shape == (1, Hq)
            assert lengths.flatten().tolist() == [expected_read(length, page, pages_budget)] * Hq
    assert stats["steps"] == new - 1
    if reuse == 1:  # every layer selects at every step
        assert stats["selections"] == (new - 1) * L
    else:
        assert 0 < stats["selections"] < (new - 1) * L  # reused, refreshed when a new page opens


def test_a_needle_far_back_is_found():
    """One key far back matches the query strongly; every other key is noise. With a budget of 3 of
    13 pages the decode must still read the needle's page, and its output is the needle's value."""
    torch.manual_seed(0)
    D, T, needle = 16, 200, 5
    pool = PagePool(1, 1, D, 64, page_size=16)
    seq = SequenceKV(pool)
    sel = QuestDecode(budget=32, dense_layers=0).new_state(1)
    k = torch.randn(1, T, 1, D) * 0.1
    v = torch.randn(1, T, 1, D)
    k[0, needle, 0] = 0
    k[0, needle, 0, 0] = 12.0
    v[0, needle, 0] = 7.0
    q = torch.randn(1, T, 1, D) * 0.1
    slots = seq.reserve(T)
    step = Step(pool, [seq], [slots], torch.arange(T)[None], contexts=[StepContext(selector=sel)], decoding=False)
    step.attention(0, q, k, v)
    q1 = torch.zeros(1, 1, 1, D)
    q1[0, 0, 0, 0] = 4.0
    k1, v1 = torch.randn(1, 1, 1, D) * 0.1, torch.randn(1, 1, 1, D)
    slots = seq.reserve(1)
    step = Step(pool, [seq], [slots], torch.tensor([[T]]), contexts=[StepContext(selector=sel)], decoding=True)
    out = step.attention(0, q1, k1, v1)[0, 0, 0]
    entries, counts = sel.entries(0, seq)
    read = entries[0, : counts[0]].tolist()
    assert needle in read and T in read and len(read) == 2 * 16 + (T + 1 - 12 * 16)
    # Exact attention over the entries read, and close to the needle's value (it takes the mass).
    keys, values = torch.cat([k[0, :, 0], k1[0, 0]]), torch.cat([v[0, :, 0], v1[0, 0]])
    ref = ((keys[read] @ q1.flatten()) * D**-0.5).softmax(0) @ values[read]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert (out - 7.0).abs().max() < 0.5


def test_batch_of_two_equals_one_by_one(chat_llm):
    recipe = "decode=lserve(budget=64,physical_page=32,reuse=3)"
    prompts = [LONG, PROMPTS[1] + " " + LONG]  # different lengths
    batched = chat_llm.generate(prompts, recipe=recipe, max_new_tokens=9, ignore_eos=True)
    for prompt, reply in zip(prompts, batched):
        alone = chat_llm.generate(prompt, recipe=recipe, max_new_tokens=9, ignore_eos=True)
        assert reply.token_ids == alone.token_ids


def assert_statistics_exact(pool, kv, heads=None):
    """The shared statistics of the conversation's heads (default all) equal a rebuild from the pool,
    bit for bit, over every logical page the head wrote."""
    shared = summaries_for(pool, 16)
    fresh = PageSummaries(pool, 16)
    fresh.rebuild_sequence(kv)
    for layer in range(pool.num_layers):
        tables = torch.from_numpy(kv.table[layer][None, :, : int(kv.num_pages[layer].max())])
        (a_max, a_min), (b_max, b_min) = shared.gather(layer, tables), fresh.gather(layer, tables)
        lengths = kv.lengths[layer]
        for h in range(len(lengths)) if heads is None else np.flatnonzero(heads[layer]):
            n = -(-int(lengths[h]) // 16)  # the head's written logical pages
            assert torch.equal(a_max[0, h, :n], b_max[0, h, :n]) and torch.equal(a_min[0, h, :n], b_min[0, h, :n])


def test_statistics_stay_exact_across_eviction_and_rollback(chat_llm):
    conv = chat_llm.conversation(recipe="snapkv budget=40 decode=quest(budget=32,dense_layers=0)")
    try:
        conv.send(PROMPTS[0], max_new_tokens=6, ignore_eos=True)
        stream = conv.stream(LONG, max_new_tokens=20, ignore_eos=True)
        next(stream)
        stream.close()  # abandoned: the turn is rolled back (truncate)
        conv.send(PROMPTS[1], max_new_tokens=6, ignore_eos=True)  # evicts after the prompt, then decodes
        assert conv.kv.moves.any()
        assert_statistics_exact(chat_llm.pool, conv.kv)
    finally:
        conv.close()


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_statistics_after_chunked_prefills_equal_a_rebuild(chat_llm, monkeypatch, tmp_path, kernel, streaming):
    """Prompts prefilled in chunks of 24 tokens (chunks that begin and end inside logical pages),
    over a fresh sequence and over a kept history, then decode steps: the selecting heads' shared
    statistics equal a rebuild from the pool after each. With streaming heads (one per layer, whose
    keys are not folded) or without; through the fold kernel (here in Triton's interpreter), which
    reads the step's keys in place, or through update()."""
    from turnkv.attention.triton import page_fold
    from turnkv.methods.lserve import summaries as summaries_module
    from turnkv.methods.lserve.pattern import HeadPattern

    if kernel:
        pytest.importorskip("triton")
    monkeypatch.setattr(summaries_module, "FORCE", kernel)
    monkeypatch.setattr(chat_llm.runner, "prefill_chunk", 24)
    folds = []
    real_fold = page_fold.fold_runs
    monkeypatch.setattr(page_fold, "fold_runs", lambda k, *a, **kw: folds.append(k.shape[1]) or real_fold(k, *a, **kw))
    pattern = np.array([[True, False], [False, True]]) if streaming else np.zeros((2, 2), dtype=bool)
    recipe = "decode=lserve(budget=64,physical_page=32,reuse=4)"
    if streaming:
        HeadPattern(pattern).save_json(tmp_path / "pattern.json")
        recipe = f"lserve prefill=streaming_heads(pattern={tmp_path / 'pattern.json'},sink=4,local=8) " + recipe
    conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        conv.send(LONG, max_new_tokens=1, ignore_eos=True)  # the prompt's chunks, no decode step
        assert conv.turns[-1].prompt_end > 3 * 24
        assert_statistics_exact(chat_llm.pool, conv.kv, ~pattern)
        conv.send(PROMPTS[1], max_new_tokens=7, ignore_eos=True)  # chunks over the kept history, decode
        assert_statistics_exact(chat_llm.pool, conv.kv, ~pattern)
    finally:
        conv.close()
    # The kernel folded the prompts' chunks (24 tokens) and the decode steps (one), in every layer.
    assert (24 in folds and 1 in folds) if kernel else not folds


def test_options_are_checked():
    from turnkv.errors import InvalidRequestError
    from turnkv.methods.recipe import Recipe

    for bad in ("decode=lserve(budget=100)", "decode=lserve(group=avg)", "decode=quest(page=0)"):
        with pytest.raises(InvalidRequestError):
            Recipe.parse(bad)
    assert isinstance(Recipe.parse("decode=lserve").decode, LServeDecode)
    assert np.isclose(LServeDecode().selector_config().pages_budget, 64)


def test_lserve_streaming_heads_read_their_window_and_dense_heads_select(chat_llm, monkeypatch, tmp_path):
    from turnkv.methods.lserve.pattern import HeadPattern

    path = tmp_path / "pattern.json"
    streaming = np.array([[True, False], [False, True]])
    HeadPattern(streaming).save_json(path)
    sink, local, new = 4, 8, 8
    recipe = (f"lserve prefill=streaming_heads(pattern={path},sink={sink},local={local}) "
              f"decode=lserve(budget=64,physical_page=32,reuse=4)")
    calls = spy_reads(monkeypatch)
    conv = chat_llm.conversation(recipe=recipe)
    try:
        reply = conv.send(LONG, max_new_tokens=new, ignore_eos=True)
        stats = conv.method_stats[-1]["decode"]
        assert conv.method_state.decode.static is conv.recipe.prefill
    finally:
        conv.close()
    L, G = chat_llm.config.num_layers, chat_llm.config.num_heads // chat_llm.config.num_kv_heads
    ps = chat_llm.pool.page_size
    for step in range(1, new):
        length = reply.prompt_tokens + step
        # A streaming head reads its sink, its ring as trimmed at the step before (the last local ..
        # local + page_size - 1 tokens: whole pages leave it) and the step's own token.
        ring = local + (length - 1 - sink - local) % ps
        for layer, (slots, lengths, _) in enumerate(calls[(step - 1) * L : step * L]):
            want = [sink + ring + 1 if s else expected_read(length, 32, 3) for s in np.repeat(streaming[layer], G)]
            assert slots and lengths.flatten().tolist() == want
    # Streaming heads' trimming each step moves only them: the dense heads' selection is still reused.
    assert 0 < stats["selections"] < (new - 1) * L


def test_presets():
    from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill
    from turnkv.methods.recipe import preset

    assert isinstance(preset("quest").decode, QuestDecode)
    assert isinstance(preset("duo-attention").prefill, StreamingHeadsPrefill)
    assert not preset("duo-attention").selects_decode
    lserve = preset("lserve")
    assert isinstance(lserve.prefill, StreamingHeadsPrefill) and isinstance(lserve.decode, LServeDecode)
    assert lserve.decode.budget == 4096 and lserve.prefill.sink == 128 and lserve.prefill.local == 256
    assert isinstance(preset("lserve-dynamic").decode, LServeDecode)
    assert isinstance(preset("lserve-static").prefill, StreamingHeadsPrefill)


def test_selections_count_every_layer_when_the_last_is_all_streaming(chat_llm, tmp_path):
    from turnkv.methods.lserve.pattern import HeadPattern

    path = tmp_path / "pattern.json"
    HeadPattern(np.array([[False, False], [True, True]])).save_json(path)  # layer 1: streaming heads only
    new = 6
    conv = chat_llm.conversation(recipe=f"lserve prefill=streaming_heads(pattern={path},sink=4,local=8) "
                                        f"decode=lserve(budget=64,physical_page=32,reuse=1)")
    try:
        conv.send(LONG, max_new_tokens=new, ignore_eos=True)
        state = conv.method_state.decode.state
        stats = conv.method_stats[-1]["decode"]
    finally:
        conv.close()
    assert state.selections[-1] == 0 and state.selections[0] == new - 1  # reuse=1: layer 0 selects each step
    assert stats["selections"] == new - 1
