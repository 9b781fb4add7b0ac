"""Decode selection inside the CUDA-graph decode (engine/graph_selection.py), run on CPU without a
graph (the static buffers filled and read as the replay would): for Quest, LServe (streaming heads,
per-query-head and per-KV-head selection, reuse) and LoopServe's progressive decode, every step reads
the same tokens and gives the same logits as the eager step (Step + engine/selection.py), over steps
that cross reuse and re-selection boundaries, at batch 1 and 3 with conversations of different
lengths (within and over budget), and when conversations leave the batch (rows move). Also the
selection kernels against their torch references under TRITON_INTERPRET=1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import turnkv
from turnkv.attention import decode as decode_module
from turnkv.engine import graph_paged, graph_progressive
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe

# The kernel tests run on the GPU when there is one (Triton compiles for CUDA tensors only), else in
# Triton's interpreter on CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_kernel_device(*tensors):
    return [t.to(KERNEL_DEVICE) for t in tensors]


@pytest.fixture(scope="module")
def pair(chat_model_dir):
    from turnkv.engine.cuda_graphs import GraphedDecode

    eager = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    graphed = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    graphed.runner.graphs = GraphedDecode(graphed.model, graphed.pool, graphed.max_model_len, max_batch=4)
    return eager, graphed


@pytest.fixture(scope="module")
def mixed_pattern(tmp_path_factory):
    """One streaming and one selecting KV head in each layer of the tiny model."""
    from turnkv.methods.lserve.pattern import HeadPattern

    path = tmp_path_factory.mktemp("pattern") / "pattern.json"
    HeadPattern(np.array([[True, False], [False, True]])).save_json(path)
    return path


def spy_reads(monkeypatch, llm_box):
    """Per indexed_decode call: per sequence, per query head, the positions of the keys it reads
    (positions, not slots: the two engines' pools hand out different pages)."""
    calls = []
    real = decode_module.indexed_decode

    def spy(q, k_cache, v_cache, table, lengths, *args, **kwargs):
        pool = llm_box[0].pool
        layer = next(i for i in range(pool.num_layers) if pool.k[i].data_ptr() == k_cache.data_ptr())
        page, Hq = k_cache.shape[1], q.shape[1]
        rows_per = lengths.shape[1]
        per_seq = []
        for b in range(llm_box[1]):  # live rows only (a graph bucket pads)
            rows = []
            for r in range(rows_per):
                j = torch.arange(int(lengths[b, r]))
                slots = table[b, r, j // page].long() * page + j % page
                rows += [pool.positions[layer].view(-1)[slots].tolist()] * (Hq // rows_per)
            per_seq.append(rows)
        calls.append((layer, per_seq))
        return real(q, k_cache, v_cache, table, lengths, *args, **kwargs)

    monkeypatch.setattr(decode_module, "indexed_decode", spy)
    return calls


def drive(llm, recipe: str, lengths: list[int], steps: int, monkeypatch, leave: dict | None = None, seed: int = 0):
    """Prefill len(lengths) conversations (random prompts), then `steps` batched decode steps with the
    recipe's decode selection. leave: {step: index of the conversation that leaves before it}.
    -> per step (logits [B, V], reads per layer); per conversation the selection counters; eager
    decode steps run."""
    recipe = Recipe.parse(recipe)
    box = [llm, len(lengths)]
    calls = spy_reads(monkeypatch, box)
    eager_steps = []
    real_forward = llm.runner.forward

    def forward(*args, **kwargs):
        if kwargs.get("decoding"):
            eager_steps.append(step)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", forward)
    gen = torch.Generator().manual_seed(seed)
    seqs = [SequenceKV(llm.pool) for _ in lengths]
    states = [recipe.new_state(llm.config.num_layers) for _ in lengths]
    live = list(range(len(lengths)))
    out = []
    try:
        last = []
        for seq, st, n in zip(seqs, states, lengths):
            ids = torch.randint(0, 300, (n,), generator=gen).tolist()
            last.append(llm.runner.prefill(seq, ids, context=st.context))
            recipe.after_prompt(seq, st, n, llm.model.inv_freq, turn=1)
        tokens = torch.stack(last).argmax(-1)
        for step in range(steps):
            if leave and step in leave:
                keep = [i for i, c in enumerate(live) if c != leave[step]]
                live, tokens = [live[i] for i in keep], tokens[keep]
            box[1] = len(live)
            calls.clear()
            logits = llm.runner.decode([seqs[c] for c in live], tokens, [states[c].context for c in live])
            for c in live:
                recipe.after_decode_step(seqs[c], states[c], llm.model.inv_freq, turn=1)
            out.append((list(live), logits.clone(), [(layer, per_seq) for layer, per_seq in calls]))
            tokens = logits.argmax(-1)
        counters = []
        for st in states:
            d = st.decode
            counters.append(list(d.state.selections) if hasattr(d, "state") else (d.selections, d.steps))
        return out, counters, eager_steps
    finally:
        monkeypatch.undo()
        for s in seqs:
            s.free()


def assert_same(a, b, atol=1e-5):
    out_a, counters_a, _ = a
    out_b, counters_b, _ = b
    assert len(out_a) == len(out_b)
    for step, ((live_a, logits_a, reads_a), (live_b, logits_b, reads_b)) in enumerate(zip(out_a, out_b)):
        assert live_a == live_b
        torch.testing.assert_close(logits_a, logits_b, atol=atol, rtol=0, msg=f"step {step}")
        assert [layer for layer, _ in reads_a] == [layer for layer, _ in reads_b]
        for (layer, x), (_, y) in zip(reads_a, reads_b):
            assert x == y, f"step {step} layer {layer}: different keys read"
    assert counters_a == counters_b


def read_counts(result, conv: int, layer: int) -> list[list[int]]:
    """Per step, per query head, how many keys conversation `conv` read in `layer`."""
    out = []
    for live, _, reads in result[0]:
        if conv in live:
            per_seq = [x for lay, x in reads if lay == layer][0]
            out.append([len(r) for r in per_seq[live.index(conv)]])
    return out


PAGED = {
    "quest": "decode=quest(budget=64,dense_layers=1)",
    "lserve_random": "lserve decode=lserve(budget=64,physical_page=32,reuse=3) "
                     "prefill=streaming_heads(pattern=random,ratio=0.5,sink=16,local=32)",
    "lserve_dynamic_kv": "decode=lserve(budget=64,physical_page=32,reuse=4,group=max)",
}
# A prompt within budget that crosses it after 7 steps: Quest reads 4 pages of 16, LServe 3 of 32.
SHORT = {"quest": 57, "lserve_random": 89, "lserve_dynamic_kv": 89}


@pytest.mark.parametrize("name", list(PAGED))
@pytest.mark.parametrize("batch", [1, 3])
def test_paged_selection_in_graph_equals_eager(pair, monkeypatch, name, batch):
    recipe = PAGED[name]
    lengths = [300, SHORT[name], 190][:batch]
    steps = 14
    a = drive(pair[0], recipe, lengths, steps, monkeypatch)
    b = drive(pair[1], recipe, lengths, steps, monkeypatch)
    assert_same(a, b)
    assert b[2] == []  # every step replayed the graph path
    assert a[2] == list(range(steps))
    # Selection happened: the longest conversation reads a budget, not its history (layer 1 selects
    # in every recipe here but the random pattern's, where layer 0 does).
    layer = 0 if name == "lserve_random" else 1
    assert max(max(c) for c in read_counts(b, 0, layer)) < 200
    assert sum(b[1][0]) > 0
    if batch == 3:  # the short conversation reads everything until it crosses the budget
        counts = [max(c) for c in read_counts(b, 1, layer)]
        assert counts[:7] == list(range(SHORT[name] + 1, SHORT[name] + 8)) and counts[7] < counts[6]


def test_lserve_with_streaming_and_selecting_heads_in_each_layer(pair, monkeypatch, mixed_pattern):
    recipe = (f"lserve decode=lserve(budget=64,physical_page=32,reuse=3) "
              f"prefill=streaming_heads(pattern={mixed_pattern},sink=16,local=32)")
    lengths = [300, 90, 190]
    a = drive(pair[0], recipe, lengths, 12, monkeypatch)
    b = drive(pair[1], recipe, lengths, 12, monkeypatch)
    assert_same(a, b)
    assert b[2] == []
    for layer in (0, 1):
        assert b[1][0][layer] > 0  # both layers select in the long conversation


def test_streaming_heads_holding_more_than_the_budget(pair, monkeypatch, mixed_pattern):
    """A streaming head reads its whole ring, here longer than the selecting heads' budget (16 + 96 kept
    against 64): the graph's expanded tables are wide enough for it (too narrow, the step read past its
    table: an illegal address on a GPU)."""
    recipe = (f"lserve decode=lserve(budget=64,physical_page=32,reuse=3) "
              f"prefill=streaming_heads(pattern={mixed_pattern},sink=16,local=96)")
    lengths = [300, 190]
    a = drive(pair[0], recipe, lengths, 6, monkeypatch)
    b = drive(pair[1], recipe, lengths, 6, monkeypatch)
    assert_same(a, b)
    assert b[2] == []
    streaming_reads = [c[0] for c in read_counts(b, 0, 0)]  # layer 0's head 0 streams
    assert min(streaming_reads) > 64


@pytest.mark.parametrize("name", ["quest", "lserve_random"])
def test_paged_rows_move_when_conversations_leave(pair, monkeypatch, name):
    lengths = [300, SHORT[name], 190]
    leave = {4: 0, 9: 1}  # the first row leaves, then the (new) first: the others move up
    a = drive(pair[0], PAGED[name], lengths, 13, monkeypatch, leave=leave)
    b = drive(pair[1], PAGED[name], lengths, 13, monkeypatch, leave=leave)
    assert_same(a, b)
    assert b[2] == []


@pytest.mark.parametrize("in_graph", [True, False], ids=["rescore_in_graph", "rescore_eager"])
@pytest.mark.parametrize("granularity", ["query", "kv"])
@pytest.mark.parametrize("lengths", [[300], [300, 30, 190]], ids=["batch1", "batch3"])
def test_progressive_decode_in_graph_equals_eager(pair, monkeypatch, granularity, lengths, in_graph):
    recipe = f"loopserve-d decode=loopserve(budget=40,warmup=3,interval=4,granularity={granularity})"
    steps = 15
    a = drive(pair[0], recipe, lengths, steps, monkeypatch)
    monkeypatch.setattr(graph_progressive, "RESCORE_IN_GRAPH", in_graph)
    b = drive(pair[1], recipe, lengths, steps, monkeypatch)
    assert_same(a, b)
    # Decode step n (1-based) re-selects at n = 3, 7, 11, 15: inside the graph, or eagerly.
    assert b[2] == ([] if in_graph else [2, 6, 10, 14])
    counts = read_counts(b, 0, 1)
    assert counts[0] == [301] * 4 and counts[3] == [42] * 4  # warm-up reads all; then 40 + the new ones
    if len(lengths) == 3:
        assert read_counts(b, 1, 0)[3] == [30 + 4] * 4  # history within budget: everything


@pytest.mark.parametrize("in_graph", [True, False], ids=["rescore_in_graph", "rescore_eager"])
def test_progressive_rows_move_when_conversations_leave(pair, monkeypatch, in_graph):
    recipe = "loopserve-d decode=loopserve(budget=40,warmup=3,interval=4,sinks=4)"
    lengths = [300, 30, 190]
    leave = {4: 0, 9: 1}  # between re-selections: the rows' buffers move with them
    a = drive(pair[0], recipe, lengths, 13, monkeypatch, leave=leave)
    monkeypatch.setattr(graph_progressive, "RESCORE_IN_GRAPH", in_graph)
    b = drive(pair[1], recipe, lengths, 13, monkeypatch, leave=leave)
    assert_same(a, b)
    assert b[2] == ([] if in_graph else [2, 6, 10])


def test_progressive_window_longer_than_the_interval(pair, monkeypatch):
    """A window of 6 queries at the first selection after 2 steps holds 4 prompt queries: the graph's
    window buffer is filled from the conversation's."""
    recipe = "loopserve-d decode=loopserve(budget=40,warmup=2,interval=3,window=6)"
    a = drive(pair[0], recipe, [200, 90], 9, monkeypatch)
    b = drive(pair[1], recipe, [200, 90], 9, monkeypatch)
    assert_same(a, b)
    assert b[2] == []


def test_generate_and_conversations_take_the_graphed_path(pair, mixed_pattern):
    """Through the public API: same greedy tokens, batched and across turns."""
    eager, graphed = pair
    prompts = [list(range(7, 7 + n)) for n in (260, 40, 150)]
    for recipe in (PAGED["quest"], PAGED["lserve_random"], "loopserve-d decode=loopserve(budget=40,warmup=3,interval=4)"):
        a, b = (llm.generate(prompts, recipe=recipe, max_new_tokens=12, ignore_eos=True) for llm in pair)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        replies = []
        for llm in pair:
            conv = llm.conversation(recipe=recipe)
            try:
                replies.append([conv.send(m, max_new_tokens=9, ignore_eos=True).token_ids
                                for m in ("The river flows past the old mill " * 12, "And then?")])
            finally:
                conv.close()
        assert replies[0] == replies[1]
    assert graphed.runner.graphs.selection is not None and graphed.runner.graphs.selection.handlers


# ---- the kernels ------------------------------------------------------------------------------------


@pytest.mark.parametrize("physical, logical, pool_page, group", [
    (64, 16, 16, "query"), (16, 16, 16, "max"), (32, 16, 16, "sum"), (64, 32, 32, "query"), (32, 16, 32, "max"),
    (48, 16, 16, "query")])
def test_page_score_kernel_matches_reference(physical, logical, pool_page, group):
    pytest.importorskip("triton")
    from turnkv.attention.triton import page_select
    from turnkv.methods.lserve.selector import SelectorConfig, graph_page_scores_reference

    gen = torch.Generator().manual_seed(0)
    B, H, G, D, P = 2, 2, 4, 16, 12
    cfg = SelectorConfig(physical_page=physical, logical_page=logical, token_budget=3 * physical, group=group)
    pages = 64
    rows = pages * (pool_page // logical)
    kmax = torch.randn(rows + 1, D, generator=gen)
    kmin = kmax - torch.rand(rows + 1, D, generator=gen)
    table = torch.randperm(pages, generator=gen)[: B * H * P].view(B, H, P).to(torch.int32)
    lengths = torch.tensor([[P * pool_page - 3, 17], [0, 2 * physical + 1]], dtype=torch.int32)
    q = torch.randn(B, H * G, D, generator=gen)
    num_phys = -(-P * pool_page // physical)
    got = page_select.page_scores(*on_kernel_device(q, kmax, kmin, table, lengths), num_phys, physical, logical,
                                  pool_page, group).cpu()
    want = graph_page_scores_reference(q, kmax, kmin, table, lengths, num_phys, cfg, pool_page)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    empty = want[1, : G if group == "query" else 1]  # sequence 1's first head holds nothing
    assert torch.isinf(empty).all() and torch.isfinite(want[0, 0, : num_phys - 1]).all()


def test_fold_kernel_matches_reference():
    pytest.importorskip("triton")
    from turnkv.attention.triton import page_select
    from turnkv.kv.pool import PagePool
    from turnkv.methods.lserve.summaries import PageSummaries

    gen = torch.Generator().manual_seed(1)
    pool = PagePool(2, 2, 16, num_pages=16, page_size=32, device=KERNEL_DEVICE)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    ref, got = PageSummaries(pool, 16), PageSummaries(pool, 16)
    for s in (ref, got):
        s.kmax.copy_(torch.randn(s.kmax.shape, generator=gen.manual_seed(2)))
        s.kmin.copy_(s.kmax - 1)
    # Page starts (reset) and middles, at most one slot per logical page of 16 in a layer (a decode
    # step's): the kernel's programs update their pages' rows without atomics.
    slots = torch.tensor([[0, 33, 63, 80], [16, 100, 5, 200]], device=KERNEL_DEVICE)
    ref.fold_reference(slots)
    page_select.fold_keys(pool.k, slots, got.kmax, got.kmin, 16)
    # (the reference also resets its scratch row, the last: no page's)
    assert torch.equal(ref.kmax[:, :-1], got.kmax[:, :-1]) and torch.equal(ref.kmin[:, :-1], got.kmin[:, :-1])
    assert not torch.equal(ref.kmax[:, :-1].cpu(), torch.randn(ref.kmax.shape, generator=gen.manual_seed(2))[:, :-1])


@pytest.mark.parametrize("per_kv, sinks, window", [(False, 0, 16), (True, 0, 16), (False, 5, 6)])
def test_window_score_kernel_matches_reference(per_kv, sinks, window):
    pytest.importorskip("triton")
    from turnkv.attention.triton import window_scores as kernel
    from turnkv.methods.loopserve.decode import window_scores

    gen = torch.Generator().manual_seed(3)
    B, H, G, D, ps, P = 2, 2, 2, 16, 8, 12
    pages = B * H * P
    k_pool = torch.randn(pages, ps, D, generator=gen)
    table = torch.randperm(pages, generator=gen).view(B, H, P).to(torch.int32)
    lengths = torch.tensor([[P * ps - 5, 40], [1, 77]], dtype=torch.int32)
    kpos_pool = torch.zeros(pages, ps, dtype=torch.int64)
    for b in range(B):  # each head holds positions 0, 1, .. (head 1 of sequence 0 has evicted: gaps)
        for h in range(H):
            n = int(lengths[b, h])
            pos = torch.arange(n) * (2 if (b, h) == (0, 1) else 1)
            j = torch.arange(n)
            kpos_pool.view(-1)[table[b, h, j // ps].long() * ps + j % ps] = pos
    last = torch.tensor([P * ps - 6, 76])  # the current token's position per sequence
    qpos = last[:, None] - torch.arange(window - 1, -1, -1)
    qpos[1, :3] = -1  # empty window slots
    q = torch.randn(B, window, H * G, D, generator=gen)
    cap = P * ps
    got = kernel.window_scores(*on_kernel_device(q, qpos, k_pool, kpos_pool, table, lengths), cap, per_kv=per_kv,
                               sinks=sinks, num_splits=3, block_n=16).cpu()
    want = window_scores(q, qpos, k_pool, kpos_pool, table, lengths, cap, per_kv=per_kv, sinks=sinks)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got > 0, want > 0)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-4)
    assert finite.sum() > 100 and torch.isneginf(want[1, : (1 if per_kv else G)]).all()  # a 1-token head: no history


@pytest.mark.parametrize("select", [False, True])
def test_expand_kernel_matches_torch(pair, chat_model_dir, select):
    """The paged handler's expansion (and, selecting, its commit of the refreshed rows) by the Triton
    kernel against the torch path, on random buffers."""
    pytest.importorskip("triton")
    from turnkv.attention import top_k
    from turnkv.attention.triton import page_select
    from turnkv.attention.triton import top_k as top_k_kernels
    from turnkv.methods.lserve.selector import SelectorConfig

    graphs = pair[1].runner.graphs
    if torch.cuda.is_available():  # the compiled kernel reads CUDA buffers; the interpreter reads the CPU ones
        from turnkv.engine.cuda_graphs import GraphedDecode

        cuda = turnkv.LLM(str(chat_model_dir), device="cuda", kv_memory="64MiB")
        graphs = GraphedDecode(cuda.model, cuda.pool, cuda.max_model_len, max_batch=4)
    cfg = SelectorConfig(physical_page=32, logical_page=16, token_budget=96, group="query")
    h = graph_paged.PagedHandler(graphs, cfg, graphs.queries.shape[2])
    gen = torch.Generator().manual_seed(4)
    L, P = h.L, h.P
    saved = graphs.tables.clone(), graphs.lengths.clone()
    try:
        graphs.tables.copy_(torch.randint(0, 1000, graphs.tables.shape, generator=gen, dtype=torch.int32))
        graphs.lengths.copy_(torch.randint(1, P * 16, graphs.lengths.shape, generator=gen, dtype=torch.int32))
        h.chosen.copy_(torch.randint(0, P // 2, h.chosen.shape, generator=gen))
        h.whole.copy_(torch.randint(0, 2, h.whole.shape, generator=gen))
        h.read.copy_(torch.randint(0, 500, h.read.shape, generator=gen))
        h.refresh.copy_(torch.randint(0, 2, h.refresh.shape, generator=gen))
        batch, kw = 3, 4
        if not select:
            want = h.expand(slice(None), batch, kw)
            got = page_select.expand_pages(h.chosen, h.whole, h.read, graphs.tables, graphs.lengths, 0, L, batch, kw,
                                           h.r, cfg.physical_page)
        else:
            # The refreshed rows merge the top-k's candidates of their scores in the kernel.
            scores = torch.randn(batch, h.R, h.num_phys, generator=gen).to(h.chosen.device)
            top = top_k.top_k_ascending(scores, h.K - 1)
            chosen = h.chosen.clone()
            got = page_select.expand_pages(h.chosen, h.whole, h.read, graphs.tables, graphs.lengths, 1, 1, batch, kw,
                                           h.r, cfg.physical_page, candidates=top_k_kernels.candidates(scores, h.K),
                                           refresh=h.refresh)
            got_chosen, h.chosen = h.chosen, chosen
            newest = (graphs.lengths[1, :batch].long() + 31) // 32 - 1
            fresh = torch.cat([top, newest.index_select(1, h.head_of_row)[..., None]], -1)
            keep = h.refresh[1, :batch, None, None] == 0
            h.chosen[1, :batch] = torch.where(keep, h.chosen[1, :batch], fresh)
            assert torch.equal(got_chosen, h.chosen)
            want = h.expand(1, batch, kw)
            got = got[0][0], got[1][0]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        graphs.tables.copy_(saved[0])
        graphs.lengths.copy_(saved[1])


def test_commit_slots_kernel_matches_reference():
    """LoopServe's re-selection commit (attention/triton/token_slots.py) against the torch path: the
    refreshed rows' tokens as pool slots through their head's table, indices past the history kept
    last, the other rows untouched."""
    pytest.importorskip("triton")
    from turnkv.attention.triton import token_slots
    from turnkv.engine.graph_progressive import commit_slots_reference

    gen = torch.Generator().manual_seed(5)
    B, H, G, P, ps, K, W = 3, 2, 2, 10, 16, 24, 40
    capacity = P * ps
    lengths = torch.tensor([[P * ps, 30], [1, 90], [50, 60]], dtype=torch.int32)
    tables = torch.randint(0, 1000, (B, H, P), generator=gen, dtype=torch.int32)
    top = torch.stack([torch.randperm(capacity, generator=gen)[:K].sort().values for _ in range(B * H * G)]).view(B, H * G, K)
    refresh = torch.tensor([1, 1, 0])
    out = torch.randint(0, 1 << 20, (B, H * G, W), generator=gen, dtype=torch.int32)
    want = out.clone()
    commit_slots_reference(top, lengths, tables, refresh, want, capacity, ps)
    got_dev, = on_kernel_device(out)
    token_slots.commit_slots(*on_kernel_device(top, lengths, tables, refresh), got_dev, capacity, ps)
    assert torch.equal(got_dev.cpu(), want)
    assert torch.equal(want[2], out[2]) and torch.equal(want[:, :, K:], out[:, :, K:])  # rows not refreshed, columns past K
    tokens = top[0, 2]  # sequence 0, head 1 (rows 2-3): a history of 29 tokens
    valid = tokens < 29
    assert valid.any() and not valid.all()
    assert torch.equal(want[0, 2, :K][valid], tables[0, 1, tokens[valid] // ps] * ps + (tokens[valid] % ps).int())
