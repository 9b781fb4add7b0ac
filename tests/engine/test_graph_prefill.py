"""The CUDA-graph prefill of short chunks (engine/graph_prefill.py): its host side (one upload, left
padding into row buckets, the trash page, the table copy) run without a graph on CPU against the eager
step, turn by turn; which chunks it takes; all-or-nothing on a full pool. On a GPU, the replayed graphs
against the engine without graphs (marked gpu)."""

from __future__ import annotations

import pytest
import torch

import turnkv
from turnkv.engine import graph_prefill
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.engine.graph_prefill import ROW_BUCKETS, GraphedPrefill
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.step_context import StepContext


def with_prefill_graphs(llm) -> GraphedPrefill:
    """Install the graphs' host side on a CPU engine (the runner makes them on CUDA only)."""
    llm.runner.graphs = GraphedDecode(llm.model, llm.pool, llm.max_model_len, max_batch=4)
    llm.runner.prefill_graphs = GraphedPrefill(llm.runner.graphs)
    return llm.runner.prefill_graphs


@pytest.fixture(scope="module")
def pair(chat_model_dir):
    eager = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
    graphed = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4)
    with_prefill_graphs(graphed)
    return eager, graphed


def count_calls(monkeypatch, graphs: GraphedPrefill) -> list[int]:
    calls = []
    run = graphs._run_chunk

    def spy(seq, token_ids, slots, before):
        calls.append(len(token_ids))
        return run(seq, token_ids, slots, before)

    monkeypatch.setattr(graphs, "_run_chunk", spy)
    return calls


def test_turns_match_the_eager_step_turn_by_turn(pair, monkeypatch):
    """Turns of 1 to 200 tokens (fresh first, histories off the page size, exact bucket sizes and one
    past) give the eager step's logits, and the sequence then holds the same K/V and positions."""
    eager, graphed = pair
    calls = count_calls(monkeypatch, graphed.runner.prefill_graphs)
    seqs = [SequenceKV(eager.pool), SequenceKV(graphed.pool)]
    sizes = [7, 1, 16, 17, 64, 3, 129, 200]
    try:
        for i, n in enumerate(sizes):
            tokens = [(11 * i + 3 * j) % 400 + 5 for j in range(n)]
            a = eager.runner.prefill(seqs[0], tokens)
            b = graphed.runner.prefill(seqs[1], tokens)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"turn {i + 1} ({n} tokens)")
            assert seqs[1].next_position == seqs[0].next_position
            assert (seqs[1].lengths == seqs[0].lengths).all()
        assert calls == sizes
        for layer in range(eager.pool.num_layers):
            ka, va, pa = seqs[0].gather(layer)
            kb, vb, pb = seqs[1].gather(layer)
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)
            assert torch.equal(pb, pa)
    finally:
        for s in seqs:
            s.free()


def test_padding_rows_write_only_the_trash_page(pair):
    """A 3-token chunk runs as 16 rows: its 13 padding rows write the trash page, and no page the
    sequence holds changes but the three new tokens' slots."""
    _, graphed = pair
    pool = graphed.pool
    seq = SequenceKV(pool)
    try:
        graphed.runner.prefill(seq, list(range(5, 30)))  # 25 tokens: a partial last page
        before_k = pool.k.clone()
        graphed.runner.prefill(seq, [40, 41, 42])
        changed = (pool.k != before_k).any(-1)  # [L, pages, page_size]: the slots written
        for layer in range(pool.num_layers):
            written = set(torch.nonzero(changed[layer].flatten()).flatten().tolist())
            new = {int(seq.table[layer, h, j // pool.page_size]) * pool.page_size + j % pool.page_size
                   for h in range(pool.num_kv_heads) for j in range(25, 28)}
            trash = int(graphed.runner.graphs.trash_pages[layer]) * pool.page_size
            assert new <= written
            assert written - new <= {trash}, f"layer {layer}: writes outside the new slots and the trash slot"
    finally:
        seq.free()


def test_takes_chunks_without_other_hooks_up_to_the_largest_bucket(pair, monkeypatch):
    _, graphed = pair
    graphs = graphed.runner.prefill_graphs
    seq = SequenceKV(graphed.pool)
    try:
        assert graphs.takes(seq, 1, None) and graphs.takes(seq, ROW_BUCKETS[-1], None)
        assert not graphs.takes(seq, ROW_BUCKETS[-1] + 1, None)
        assert not graphs.takes(seq, 0, None)
        for hook in (dict(window=object()), dict(pattern=object()), dict(selector=object()), dict(accumulate=True)):
            assert not graphs.takes(seq, 8, StepContext(**hook)), hook
        assert graphs.takes(seq, 8, StepContext())
        graphed.runner.prefill(seq, list(range(5, 25)))
        seq.next_position = graphs.capacity - 4  # near the context limit: the graphs' tables end there
        assert graphs.takes(seq, 4, None) and not graphs.takes(seq, 5, None)
        seq.next_position = 20
        monkeypatch.setattr(graph_prefill, "ENABLED", False)  # TURNKV_PREFILL_GRAPHS=0
        assert not graphs.takes(seq, 8, None)
    finally:
        seq.free()


def test_runner_keeps_hooked_and_all_logit_prefills_eager(pair, monkeypatch):
    eager, graphed = pair
    calls = count_calls(monkeypatch, graphed.runner.prefill_graphs)
    seq = SequenceKV(graphed.pool)
    try:
        graphed.runner.prefill(seq, list(range(5, 15)), all_logits=True)
        # Windows the graphs' buffer cannot fill: longer than WINDOW_ROWS, or with moments.
        for recipe in ("evict=snapkv(window=100) budget=16", "expected-attention budget=16", "h2o budget=16"):
            reply = graphed.generate(list(range(5, 40)), recipe=recipe, max_new_tokens=2, ignore_eos=True)
            assert len(reply.token_ids) == 2
        assert calls == []
        graphed.generate(list(range(5, 40)), max_new_tokens=2, ignore_eos=True)
        assert calls == [35]
    finally:
        seq.free()


@pytest.mark.parametrize("recipe", ["snapkv budget=24", "ada-snapkv budget=24",
                                    "evict=snapkv(compat=kvpress) budget=24"])
def test_eviction_windows_filled_after_the_replay_match_the_eager_step(pair, monkeypatch, recipe):
    """An eviction recipe's observation window (32 or 64 queries) is filled from the graphs' buffer:
    over turns of 5 to 70 tokens, every turn's reply, kept lengths and window equal the eager step's."""
    eager, graphed = pair
    calls = count_calls(monkeypatch, graphed.runner.prefill_graphs)
    convs = [llm.conversation(recipe=recipe) for llm in pair]
    try:
        for i, text in enumerate(["Hi", "Tell me about the sea and its many colours, please, in detail." * 5,
                                  "Ok", "And the mountains?"]):
            a, b = (c.send(text, max_new_tokens=6, ignore_eos=True) for c in convs)
            assert b.token_ids == a.token_ids, f"turn {i + 1}"
            assert (convs[1].kv.lengths == convs[0].kv.lengths).all(), f"turn {i + 1}"
            wa, wb = convs[0].method_state.window, convs[1].method_state.window
            for layer in range(eager.pool.num_layers):
                torch.testing.assert_close(wb.queries[layer], wa.queries[layer], rtol=1e-5, atol=1e-5)
                assert torch.equal(wb.positions[layer].cpu(), wa.positions[layer].cpu())
        assert len(calls) == 4
    finally:
        for c in convs:
            c.close()


def test_buckets_flash_attention_takes_read_the_pages_through_it(pair, monkeypatch):
    """Where FA4 takes a bucket's rows over the history, the graph attends through flash.paged (a
    stand-in following FA4's contract here), left padding included: the eager step's logits; the
    stand-in saw one call per layer with the bucket's rows. A quantized pool or a window keeps the
    paged kernel."""
    from tests.attention.test_flash import StandIn

    eager, graphed = pair
    graphs = graphed.runner.prefill_graphs
    fake = StandIn()
    monkeypatch.setattr(graph_prefill.flash, "_interface", lambda: (fake.flash_attn_func, fake.flash_attn_varlen_func))
    monkeypatch.setattr(graph_prefill.flash, "usable", lambda *a: True)
    monkeypatch.setattr(graph_prefill.flash, "takes_chunk", lambda device, bh, group, rows, longest: rows >= 64)
    assert graphs.uses_flash(64, 100) and not graphs.uses_flash(32, 100)
    seqs = [SequenceKV(eager.pool), SequenceKV(graphed.pool)]
    try:
        for n in (90, 20, 40):  # 90 as 128 rows and 40 as 64 through the stand-in, 20 as 32 on the kernel
            tokens = list(range(9, 9 + n))
            b = graphed.runner.prefill(seqs[1], tokens)
            with monkeypatch.context() as m:
                m.setattr(graph_prefill.flash, "usable", lambda *a: False)  # the eager engine's own paths
                a = eager.runner.prefill(seqs[0], tokens)
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        L, H = graphed.pool.num_layers, graphed.pool.num_kv_heads
        G, D = graphed.config.num_heads // H, graphed.pool.head_dim
        assert fake.calls == [("paged", (H, 128, G, D))] * L + [("paged", (H, 64, G, D))] * L
        monkeypatch.setattr(graphs, "sliding_window", 8)
        assert not graphs.uses_flash(64, 100)
    finally:
        for s in seqs:
            s.free()


def test_a_full_pool_leaves_the_sequence_and_pool_as_they_were(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", page_size=4)
    graphs = with_prefill_graphs(llm)
    pool, L = llm.pool, llm.pool.num_layers
    seq = SequenceKV(pool)
    hog = pool.allocate([pool.free_pages(layer) - 20 for layer in range(L)])  # 20 pages (80 tokens) per layer left
    try:
        llm.runner.prefill(seq, list(range(5, 20)))
        free = [pool.free_pages(layer) for layer in range(L)]
        held = seq.num_pages.copy()
        assert graphs.takes(seq, 100, None)
        with pytest.raises(turnkv.errors.KVCacheFullError):
            llm.runner.prefill(seq, [7] * 100)
        assert seq.next_position == 15 and (seq.num_pages == held).all()
        assert [pool.free_pages(layer) for layer in range(L)] == free
        # The sequence goes on as if nothing happened.
        fresh = SequenceKV(pool)
        expected = llm.runner.forward([fresh], torch.tensor([list(range(5, 20)) + [9, 10]]))[0]
        fresh.free()
        got = llm.runner.prefill(seq, [9, 10])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        seq.free()
        for layer, pages in enumerate(hog):
            pool.release(layer, pages)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_pool_matches_the_eager_step(chat_model_dir, kv_dtype):
    eager = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4, kv_dtype=kv_dtype)
    graphed = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", page_size=4, kv_dtype=kv_dtype)
    graphs = with_prefill_graphs(graphed)
    with pytest.MonkeyPatch.context() as m:  # FA4 reads a pool of the compute dtype only
        m.setattr(graph_prefill.flash, "usable", lambda *a: True)
        m.setattr(graph_prefill.flash, "takes_chunk", lambda *a: True)
        assert not graphs.uses_flash(64, 100)
    seqs = [SequenceKV(eager.pool), SequenceKV(graphed.pool)]
    try:
        for n in (9, 21, 40):
            tokens = list(range(6, 6 + n))
            torch.testing.assert_close(graphed.runner.prefill(seqs[1], tokens), eager.runner.prefill(seqs[0], tokens),
                                       rtol=1e-5, atol=1e-5)
    finally:
        for s in seqs:
            s.free()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graphs are captured and replayed")
def test_replayed_turns_match_the_engine_without_graphs(chat_model_dir):
    """A conversation's short turns replayed from graphs give the eager engine's logits (bf16 rounding)
    and the same greedy replies; one graph per row bucket is captured, then replayed."""
    kwargs = dict(device="cuda", dtype="bfloat16", kv_memory="256MiB")
    eager = turnkv.LLM(str(chat_model_dir), cuda_graphs=False, **kwargs)
    graphed = turnkv.LLM(str(chat_model_dir), **kwargs)
    graphs = graphed.runner.prefill_graphs
    assert graphs is not None
    seqs = [SequenceKV(eager.pool), SequenceKV(graphed.pool)]
    try:
        for i, n in enumerate([40, 5, 16, 17, 200, 3, 3]):
            tokens = [(7 * i + j) % 300 + 5 for j in range(n)]
            a = eager.runner.prefill(seqs[0], tokens)
            b = graphed.runner.prefill(seqs[1], tokens)
            torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
            assert int(a.argmax()) == int(b.argmax())
        assert set(graphs.graphs_by_key) == {(16, False), (32, False), (64, False), (256, False)}
    finally:
        for s in seqs:
            s.free()
    replies = []
    for llm in (eager, graphed):
        conv = llm.conversation()
        replies.append([conv.send(text, max_new_tokens=8, ignore_eos=True).token_ids
                        for text in ("Hello there", "And then?", "One more")])
    assert replies[0] == replies[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graphs are captured and replayed")
@pytest.mark.parametrize("recipe", ["ada-snapkv budget=48", "evict=snapkv(compat=kvpress) budget=48"])
def test_replayed_eviction_turns_match_the_engine_without_graphs(chat_model_dir, recipe):
    """An eviction recipe's turns replayed from graphs (fp32, so that rounding picks no other token):
    the eager engine's replies, kept lengths and observation windows, turn by turn."""
    kwargs = dict(device="cuda", dtype="float32", kv_memory="256MiB")
    engines = [turnkv.LLM(str(chat_model_dir), cuda_graphs=False, **kwargs), turnkv.LLM(str(chat_model_dir), **kwargs)]
    convs = [llm.conversation(recipe=recipe) for llm in engines]
    calls = []
    graphs = engines[1].runner.prefill_graphs
    run = graphs._run_chunk
    graphs._run_chunk = lambda *a: calls.append(1) or run(*a)
    try:
        for i, text in enumerate(["Hello there", "Tell me about the sea, please, in some detail." * 4, "Ok", "More?"]):
            a, b = (c.send(text, max_new_tokens=8, ignore_eos=True) for c in convs)
            assert b.token_ids == a.token_ids, f"turn {i + 1}"
            assert (convs[1].kv.lengths == convs[0].kv.lengths).all()
            wa, wb = convs[0].method_state.window, convs[1].method_state.window
            for layer in range(engines[0].pool.num_layers):
                torch.testing.assert_close(wb.queries[layer], wa.queries[layer], rtol=1e-3, atol=1e-3)
        assert len(calls) == 4
    finally:
        for c in convs:
            c.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graphs are captured and replayed")
def test_replayed_turns_through_real_flash_attention_match_the_eager_engine(tmp_path, monkeypatch):
    """With flash-attn-4 installed: a model of head dim 128 whose short turns replay from graphs that
    attend through FA4 (takes_chunk lowered so that this small shape qualifies; left-padded rows) gives
    the eager engine's logits on its own kernels, bf16 rounding apart."""
    from tests.conftest import save_tiny
    from turnkv.attention import flash

    if not flash.usable(torch.device("cuda"), torch.bfloat16, 128):
        pytest.skip("needs flash-attn-4 on a Hopper or Blackwell GPU")
    save_tiny(tmp_path, "llama", hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
              num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=4096)
    kwargs = dict(device="cuda", dtype="bfloat16", kv_memory="256MiB", tokenizer=None)
    eager = turnkv.LLM(str(tmp_path), cuda_graphs=False, **kwargs)
    graphed = turnkv.LLM(str(tmp_path), **kwargs)
    monkeypatch.setattr(flash, "takes_chunk", lambda device, bh, group, rows, longest: rows >= 128 and longest > 1000)
    graphs = graphed.runner.prefill_graphs
    seqs = [SequenceKV(eager.pool), SequenceKV(graphed.pool)]
    try:
        history = torch.randint(5, 300, (1500,), generator=torch.Generator().manual_seed(0)).tolist()
        for llm, seq in zip((eager, graphed), seqs):
            llm.runner.prefill(seq, history)
        for n in (100, 250, 30):
            tokens = torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            with monkeypatch.context() as m:
                m.setattr(flash, "ENABLED", False)
                a = eager.runner.prefill(seqs[0], tokens)
            b = graphed.runner.prefill(seqs[1], tokens)
            assert ((a - b).norm() / a.norm()).item() < 2e-2, n
        assert set(graphs.graphs_by_key) == {(128, True), (256, True), (32, False)}
    finally:
        for s in seqs:
            s.free()
