"""The prefill axis `streaming_heads`: its mask against brute force; the store's page ring (sink + the
last local .. local + page - 1 tokens, exact positions after every step); a multi-turn conversation
equal to one prefill of the whole history masked to exactly the positions the store held; the pages
the streaming heads free, by number; and trim's host-only bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.attention.lines import Keys
from turnkv.errors import InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.lserve.pattern import HeadPattern
from turnkv.methods.lserve.streaming_heads import StreamingHeadsPrefill
from turnkv.methods.protocols import Prefill
from turnkv.methods.recipe import Recipe
from turnkv.methods.step_context import StepContext

STREAMING = [[True, False], [False, True]]  # tiny model: 2 layers x 2 KV heads
MESSAGES = ["The river flows past the old mill where the miller counts sacks of grain every morning before dawn.",
            "Mountains rise over the valley; snow covers the peaks while shepherds lead goats to the high meadows.",
            "And then?"]


@pytest.fixture
def pattern_file(tmp_path):
    path = tmp_path / "pattern.json"
    HeadPattern(np.array(STREAMING)).save_json(path)
    return str(path)


def brute_force(q, k, v, q_pos, k_pos, streaming, sink, local, dense_window=None):
    """Per query head, softmax over keys with k_pos <= q_pos, and for streaming KV heads
    (k_pos < sink or q_pos - k_pos < local); dense KV heads likewise with dense_window = (sink, local)
    when given (an A-shape on the dense heads), else every causal key."""
    Hq, T, D = q.shape
    H = k.shape[0]
    out = torch.empty_like(q)
    for hq in range(Hq):
        h = hq // (Hq // H)
        delta = q_pos[:, None] - k_pos[h][None, :]
        mask = delta >= 0
        window = (sink, local) if streaming[h] else dense_window
        if window is not None:
            mask &= (k_pos[h][None, :] < window[0]) | (delta < window[1])
        scores = (q[hq] @ k[h].T) * D**-0.5
        out[hq] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[h]
    return out


@pytest.mark.parametrize("history", [False, True])
def test_prefill_mask_equals_brute_force(pattern_file, history):
    torch.manual_seed(0)
    Hq, H, D, T, sink, local = 4, 2, 8, 40, 3, 7
    method = StreamingHeadsPrefill(pattern=pattern_file, sink=sink, local=local, prefill_local=local)
    method.bind(2)
    # With history: kept keys with holes (a sink and a ring of the previous turn), then the new rows.
    k_pos = torch.cat([torch.tensor([0, 1, 2]), torch.arange(50, 60), torch.arange(60, 60 + T)]) if history \
        else torch.arange(T)
    q_pos = k_pos[-T:]
    S = len(k_pos)
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, S, D), torch.randn(1, H, S, D)
    keys = Keys(q, k, v, q_pos[None], k_pos[None, None].expand(1, H, S), None, int(q_pos[0]), int(q_pos[-1]) + 1)
    for layer in range(2):
        out, stats = method.attend(layer, keys)
        ref = brute_force(q[0], k[0], v[0], q_pos, k_pos[None].expand(H, S), STREAMING[layer], sink, local)
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
        assert stats["computed"].sum() < stats["causal"].sum()  # the streaming head skipped cells


@pytest.mark.parametrize("S,T", [(40, 40), (64, 24)])  # a first chunk; a later chunk over kept history
def test_split_prefill_dense_heads_by_sdpa_equals_brute_force(pattern_file, S, T, monkeypatch):
    """Where the line kernel runs (CUDA; forced here, Triton's interpreter on CPU) and every head holds
    the same keys, dense heads go through SDPA and streaming heads through the kernel: same output
    as brute force, same cell counts as the mask path, for q laid out as the decoder makes it."""
    import dataclasses

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel's device (CPU: the interpreter)
    torch.manual_seed(1)
    Hq, H, D, sink, local = 4, 2, 16, 3, 9
    method = StreamingHeadsPrefill(pattern=pattern_file, sink=sink, local=local, prefill_local=local)
    method.bind(2)
    k_pos = torch.arange(S)
    q_pos = k_pos[-T:]
    q = torch.randn(1, T, Hq, D).transpose(1, 2)  # strided, as Step hands it over
    k, v = torch.randn(1, H, S, D), torch.randn(1, H, S, D)
    cpu_keys = Keys(q, k, v, q_pos[None], k_pos[None, None].expand(1, H, S), None, int(q_pos[0]), int(q_pos[-1]) + 1)
    keys = dataclasses.replace(cpu_keys, **{f.name: getattr(cpu_keys, f.name).to(device) for f in dataclasses.fields(Keys)
                                           if isinstance(getattr(cpu_keys, f.name), torch.Tensor)})
    from turnkv.attention import lines

    kernel_calls = []
    real = lines._kernel().line_attention
    monkeypatch.setattr(lines._kernel(), "line_attention", lambda *a, **kw: kernel_calls.append(a[0].shape) or real(*a, **kw))
    for layer in range(2):
        out, stats = method.attend(layer, keys, force_triton=True)
        assert kernel_calls.pop() == (1, Hq // H, T, D)  # the kernel saw the streaming head's queries only
        ref = brute_force(q[0], k[0], v[0], q_pos, k_pos[None].expand(H, S), STREAMING[layer], sink, local)
        torch.testing.assert_close(out[0].cpu(), ref, rtol=1e-4, atol=1e-4)
        _, mask_stats = method.attend(layer, cpu_keys)  # the mask path on CPU
        assert int(stats["computed"].sum()) == int(mask_stats["computed"].sum())
        assert int(stats["causal"].sum()) == int(mask_stats["causal"].sum())


def ring_length(next_position: int, sink: int, local: int, page: int) -> int:
    """Tokens a streaming head keeps after its sink once trimmed at `next_position` (after every step):
    the whole history up to local + page - 1 of it, then local .. local + page - 1 (whole pages go)."""
    tail = next_position - sink
    return tail if tail < local else local + (tail - local) % page


def assert_trimmed(kv, streaming, sink, local):
    """Streaming heads hold exactly [0, sink) + the last ring_length positions; dense heads everything."""
    end, page = kv.next_position, kv.pool.page_size
    for layer, flags in enumerate(streaming):
        _, _, pos = kv.gather(layer)
        for head, is_streaming in enumerate(flags):
            n = int(kv.lengths[layer, head])
            ring = ring_length(end, sink, local, page)
            expected = list(range(sink)) + list(range(end - ring, end)) if is_streaming else list(range(end))
            assert pos[head, :n].tolist() == expected, (layer, head)
            assert int(kv.num_pages[layer, head]) == -(-n // page)


class KeptOracle(Prefill):
    """The reference: a prefill pattern that masks each streaming head to exactly the positions the
    engine's store held when each row was computed (`kept`: per forward, its first position, row
    count and per (layer, head) the kept positions), plus the rows of that forward; a prefill
    forward's rows also keep the `prefill_local` window. Dense heads: causal."""

    def __init__(self, streaming, sink, prefill_local, forwards, total):
        L, H = np.array(streaming).shape
        self.streaming = torch.tensor(streaming)
        self.allowed = torch.zeros(L, H, total, total, dtype=torch.bool)  # [layer, head, row, key]
        k = torch.arange(total)
        for start, count, kept in forwards:
            for q in range(start, start + count):
                for layer in range(L):
                    for head in range(H):
                        row = torch.zeros(total, dtype=torch.bool)
                        row[kept[layer][head]] = True
                        row |= (k >= start) & (k <= q)
                        if count > 1:
                            row &= (k < sink) | (q - k < prefill_local)
                        self.allowed[layer, head, q] = row

    def attend(self, layer, keys):
        from turnkv.methods.prefill.pattern_hook import fixed_pattern

        def mask(rows):
            q_pos, k_pos = keys.q_pos[0, rows], keys.k_pos[0]  # one sequence
            cells = torch.stack([self.allowed[layer, h][q_pos][:, k_pos[h]] for h in range(k_pos.shape[0])])
            streaming = self.streaming[layer][None, :, None, None]
            return keys.visible(rows) & torch.where(streaming, cells[None], True)

        return fixed_pattern(layer, keys, mask)


def record_kept(monkeypatch, llm, kv, streaming):
    """Spy on the runner: before each forward over `kv`, its first position, row count and kept
    positions per (layer, head)."""
    forwards = []
    forward = llm.runner.forward

    def spy(seqs, token_ids, *args, **kwargs):
        if seqs[0] is kv:
            kept = []
            for layer in range(len(streaming)):
                _, _, pos = kv.gather(layer)
                kept.append([pos[h, : int(kv.lengths[layer, h])].clone() for h in range(pos.shape[0])])
            forwards.append((kv.next_position, token_ids.shape[1], kept))
        return forward(seqs, token_ids, *args, **kwargs)

    monkeypatch.setattr(llm.runner, "forward", spy)
    return forwards


LONG_TURNS = [" ".join(MESSAGES[:2]) * 3, MESSAGES[1] + " " + MESSAGES[0], "And then?"]


@pytest.mark.parametrize("sink,local", [(16, 32), (4, 8)])  # a sink of one page (page drops), of 1/4 page (compaction)
def test_multi_turn_decode_equals_attention_over_exactly_the_kept_positions(chat_llm, pattern_file, monkeypatch,
                                                                            sink, local):
    """Every reply's logprobs, turn after turn, equal one prefill of the whole conversation whose
    streaming heads attend to exactly what the store held at each row (plus the prefill window):
    decode reads the ring and nothing else, and a new turn sees the kept sink + ring."""
    prefill_local = 40
    recipe = (f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local},"
              f"prefill_local={prefill_local})")
    conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    forwards = record_kept(monkeypatch, chat_llm, conv.kv, STREAMING)
    try:
        replies = []
        for message in LONG_TURNS:
            reply = conv.send(message, max_new_tokens=24, ignore_eos=True, logprobs=True)
            replies.append((conv.turns[-1].prompt_end, reply.logprobs))
            assert_trimmed(conv.kv, STREAMING, sink, local)
        tokens = conv.tokens
        # Decode steps after a long prompt: the ring dropped pages many times; every forward saw
        # sink + ring_length(its first position) tokens in each streaming head.
        page = chat_llm.pool.page_size
        assert conv.turns[0].prompt_end > sink + local + 3 * page
        for start, count, kept in forwards:
            if count == 1:
                assert len(kept[0][0]) == sink + ring_length(start, sink, local, page)
    finally:
        conv.close()
    monkeypatch.undo()
    oracle = KeptOracle(STREAMING, sink, prefill_local, forwards, len(tokens))
    seq = SequenceKV(chat_llm.pool)
    try:
        from turnkv.methods.prefill.pattern_hook import PatternHook

        logits = chat_llm.runner.prefill(seq, tokens, all_logits=True,
                                           context=StepContext(pattern=PatternHook(oracle, [])))
    finally:
        seq.free()
    full = torch.log_softmax(logits.float(), dim=-1)
    for prompt_end, logprobs in replies:
        n = logprobs.shape[0]
        torch.testing.assert_close(logprobs, full[prompt_end - 1 : prompt_end - 1 + n], rtol=0, atol=2e-4)


@pytest.mark.parametrize("sink,local", [(4, 8), (16, 32)])
def test_streaming_heads_free_their_pages(chat_llm, pattern_file, sink, local, monkeypatch):
    monkeypatch.setattr(chat_llm, "prefix_index", None)  # pages counted here are the conversations' only
    page = chat_llm.pool.page_size
    dense = chat_llm.conversation(system="Answer briefly.")
    sparse = chat_llm.conversation(system="Answer briefly.",
                                   recipe=f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local})")
    free = [chat_llm.pool.free_pages(layer) for layer in range(2)]
    try:
        for conv in (dense, sparse):
            conv.send(" ".join(MESSAGES[:2]) * 2, max_new_tokens=37, ignore_eos=True)
        n = dense.kv.next_position
        assert sparse.kv.next_position == n and n > sink + local + 4 * page
        kept = sink + ring_length(n, sink, local, page)
        assert sparse.kv.lengths.tolist() == [[kept, n], [n, kept]]
        # Per layer: a dense head holds every token, a streaming head sink + ring in whole pages.
        dense_pages, ring_pages = -(-n // page), -(-kept // page)
        assert local <= kept - sink < local + page and ring_pages < dense_pages
        used = [free[layer] - chat_llm.pool.free_pages(layer) for layer in range(2)]
        assert used == [2 * dense_pages + dense_pages + ring_pages] * 2
        assert dense.kv_bytes == 4 * dense_pages * chat_llm.pool.page_bytes
        assert sparse.kv_bytes == 2 * (dense_pages + ring_pages) * chat_llm.pool.page_bytes
    finally:
        dense.close()
        sparse.close()
    assert [chat_llm.pool.free_pages(layer) for layer in range(2)] == free


def test_ring_survives_an_offload_and_a_rollback(chat_llm, pattern_file):
    """A conversation moved to the CPU tier comes back through reserve_layout (its heads count as
    moved): the next turn checks them once and the ring goes on; same for answer=reprefill's
    rollback of the previous reply."""
    sink, local = 16, 32
    recipe = f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local}) answer=reprefill"
    conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        conv.send(LONG_TURNS[0], max_new_tokens=20, ignore_eos=True)
        assert_trimmed(conv.kv, STREAMING, sink, local)
        assert conv.offload("cpu") == "cpu"
        for message in LONG_TURNS[1:]:
            conv.send(message, max_new_tokens=21, ignore_eos=True)
            assert conv.location == "gpu"
            assert_trimmed(conv.kv, STREAMING, sink, local)
    finally:
        conv.close()


def _ring_kv(pool, method, prompt):
    kv = SequenceKV(pool)
    kv.reserve(prompt)
    method.trim(kv)
    return kv


def _host_only(monkeypatch, kv):
    """Within the context: any device read or data move of the store raises."""
    import turnkv.methods.lserve.streaming_heads as streaming_module

    def fail(*args, **kwargs):
        raise AssertionError("trim touched the device")

    monkeypatch.setattr(streaming_module, "gather_pages", fail)
    for name in ("device_table", "gather", "keep"):
        monkeypatch.setattr(kv, name, fail)


def test_trim_is_host_only_and_drops_a_page_every_page_of_steps(pattern_file, monkeypatch):
    """Sink of whole pages: after the first prefill, trimming never reads the device (not even on the
    steps that drop a page) and drops exactly one page per streaming head every page_size steps."""
    from turnkv.kv.pool import PagePool

    sink, local, page = 8, 12, 4
    pool = PagePool(2, 2, 8, 64, page)
    method = StreamingHeadsPrefill(pattern=pattern_file, sink=sink, local=local)
    method.bind(2)
    kv = _ring_kv(pool, method, 50)
    drops = []
    drop_pages = kv.drop_pages
    monkeypatch.setattr(kv, "drop_pages", lambda *a: (drops.append(kv.next_position), drop_pages(*a)))
    free = [pool.free_pages(layer) for layer in range(2)]
    for step in range(30):
        kv.reserve_on_host(1)  # the CUDA-graph step's reservation: no device work either
        with monkeypatch.context() as m:
            _host_only(m, kv)
            method.trim(kv)
        n = kv.next_position
        ring = ring_length(n, sink, local, page)
        assert kv.lengths.tolist() == [[sink + ring, n], [n, sink + ring]]
    # A page left each streaming head whenever its ring reached local + page tokens.
    assert drops == [n for n in range(51, 81) if (n - sink - local) % page == 0]
    # Per layer: the dense head took a page every `page` steps; the streaming head took as many and
    # gave one back at each drop, so its count stays sink + ring in whole pages.
    dense_growth = -(-80 // page) - -(-50 // page)
    assert [pool.free_pages(layer) - free[layer] for layer in range(2)] == [len(drops) - 2 * dense_growth] * 2
    dense_pages, ring_pages = -(-80 // page), -(-(sink + ring_length(80, sink, local, page)) // page)
    assert [pool.used_pages(layer) for layer in range(2)] == [dense_pages + ring_pages] * 2
    assert (dense_pages, ring_pages) == (20, 5)  # 80 tokens; 8 + 12 (the ring just dropped a page)
    # Nothing to drop: trim returns from host arithmetic without calling drop_pages.
    before = len(drops)
    kv.reserve_on_host(1)
    with monkeypatch.context() as m:
        _host_only(m, kv)
        method.trim(kv)
    assert len(drops) == before


def test_trim_checks_heads_that_something_else_moved(pattern_file, monkeypatch):
    """A rollback (truncate) only cuts the newest tokens: a ring stays a ring and the next trim
    reads nothing. A head with a hole (another method evicted from its ring) is trimmed exactly to the
    last `local` positions and checked at every trim."""
    import turnkv.methods.lserve.streaming_heads as streaming_module
    from turnkv.kv.pool import PagePool

    sink, local, page = 8, 12, 4
    pool = PagePool(2, 2, 8, 64, page)
    method = StreamingHeadsPrefill(pattern=pattern_file, sink=sink, local=local)
    method.bind(2)
    kv = _ring_kv(pool, method, 50)
    reads = []
    gather = streaming_module.gather_pages
    monkeypatch.setattr(streaming_module, "gather_pages", lambda *a: (reads.append(1), gather(*a))[1])
    kv.truncate(47)
    method.trim(kv)
    assert len(reads) == 0  # host only
    ring = ring_length(50, sink, local, page) - 3
    assert kv.lengths.tolist() == [[sink + ring, 47], [47, sink + ring]]
    for _ in range(10):
        kv.reserve(1)
        method.trim(kv)
    assert len(reads) == 0
    assert_trimmed(kv, STREAMING, sink, local)
    # A hole in layer 0's streaming head (another method evicted one ring token): not a ring any
    # more; trimmed exactly (positions < sink or within the last `local`) while the hole is in view.
    n = int(kv.lengths[0, 0])
    _, _, pos = kv.gather(0)
    hole = int(pos[0, sink + 2])
    kv.keep(0, [[i for i in range(n) if i != sink + 2], list(range(int(kv.lengths[0, 1])))])
    kv.reserve(1)
    method.trim(kv)
    N = kv.next_position
    assert hole >= N - local and len(reads) == 1  # layer 0 read, layer 1 not
    _, _, pos = kv.gather(0)
    assert pos[0, : int(kv.lengths[0, 0])].tolist() == list(range(sink)) + [p for p in range(N - local, N) if p != hole]
    # The next trim checks it again: the hole left the window, it is sink + a run (a ring) again.
    kv.reserve(1)
    method.trim(kv)
    start = kv.next_position
    assert len(reads) == 2 and hole < start - local
    for _ in range(9):  # then host only, the ring following the page rule from its new start
        _, _, pos = kv.gather(0)
        N, ring = kv.next_position, local + (kv.next_position - start) % page
        assert pos[0, : int(kv.lengths[0, 0])].tolist() == list(range(sink)) + list(range(N - ring, N))
        kv.reserve(1)
        method.trim(kv)
    assert len(reads) == 2
    assert kv.lengths[1].tolist() == [kv.next_position, sink + ring_length(kv.next_position, sink, local, page)]


def test_pattern_sources_and_errors(tmp_path, pattern_file):
    method = StreamingHeadsPrefill(pattern="random", ratio=0.5)
    flags = method.flags(6, 4)
    assert flags.shape == (6, 4) and flags.sum() == 12
    assert flags.sum(axis=1).tolist() == [2] * 6  # even over the layers: the page pool is per layer
    uneven = StreamingHeadsPrefill(pattern="random", ratio=0.5).flags(5, 3)
    assert uneven.sum() == 8 and sorted(uneven.sum(axis=1).tolist()) == [1, 1, 2, 2, 2]
    default = StreamingHeadsPrefill()  # the calibrated SmolLM2 gates, thresholded at 0.5
    assert default.flags(30, 3).mean() == pytest.approx(0.5, abs=0.02)
    assert StreamingHeadsPrefill(ratio=0.25).flags(30, 3).mean() == pytest.approx(0.25, abs=0.02)
    with pytest.raises(InvalidRequestError, match="pattern="):
        StreamingHeadsPrefill(pattern=pattern_file).flags(3, 2)  # a pattern for another model
    with pytest.raises(InvalidRequestError):
        StreamingHeadsPrefill(pattern=str(tmp_path / "missing.json")).flags(2, 2)
    duo = tmp_path / "full_attention_heads.tsv"
    duo.write_text("0.1\t0.9\n0.8\t0.2\n")  # gate near 1: dense
    assert StreamingHeadsPrefill(pattern=str(duo)).flags(2, 2).tolist() == STREAMING
    for bad in ("prefill=streaming_heads(local=0)", "prefill=streaming_heads(ratio=2)"):
        with pytest.raises(InvalidRequestError):
            Recipe.parse(bad)


@pytest.mark.parametrize("S,T", [(40, 40), (64, 24)])
def test_dense_heads_through_another_pattern(pattern_file, S, T):
    """streaming_heads(dense=a_shape(...)): the dense heads attend through A-shape's lines, the
    streaming heads through their window; output and cell counts equal brute force."""
    torch.manual_seed(2)
    Hq, H, D, sink, local = 4, 2, 8, 3, 9
    method = Recipe.parse(f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local},"
                          f"prefill_local={local},dense=a_shape(sink=2,local=5))").prefill
    method.bind(2)
    k_pos = torch.arange(S)
    q_pos = k_pos[-T:]
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, H, S, D), torch.randn(1, H, S, D)
    keys = Keys(q, k, v, q_pos[None], k_pos[None, None].expand(1, H, S), None, int(q_pos[0]), int(q_pos[-1]) + 1)
    for layer in range(2):
        out, stats = method.attend(layer, keys)
        ref = brute_force(q[0], k[0], v[0], q_pos, k_pos[None].expand(H, S), STREAMING[layer], sink, local,
                          dense_window=(2, 5))
        torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
        delta = q_pos[:, None] - k_pos[None, :]
        cells = {w: int(((delta >= 0) & ((k_pos[None, :] < s) | (delta < w))).sum()) for s, w in ((sink, local), (2, 5))}
        assert int(stats["computed"].sum()) == cells[local] + cells[5]  # one streaming, one dense KV head
        assert int(stats["causal"].sum()) == 2 * int((delta >= 0).sum())


def test_dense_heads_pattern_errors():
    with pytest.raises(InvalidRequestError, match="unknown prefill"):
        Recipe.parse("prefill=streaming_heads(pattern=random,dense=nonesuch)")
    with pytest.raises(InvalidRequestError, match="cannot nest"):
        Recipe.parse("prefill=streaming_heads(pattern=random,dense=streaming_heads)")
    with pytest.raises(InvalidRequestError, match="a_shape"):
        Recipe.parse("prefill=streaming_heads(pattern=random,dense=a_shape(local=0))")


def test_dense_heads_through_loopserve_over_turns(chat_llm, pattern_file):
    """streaming_heads(dense=loopserve) in a conversation: each turn's prefill selects LoopServe lines on
    the dense heads only (their recovered mass reaches alpha on the sample: dense_above=None, so no
    greedy stops early), the streaming heads keep their ring, and later turns run over the trimmed
    ring (keys with holes, a `valid` mask)."""
    sink, local = 4, 8
    recipe = (f"prefill=streaming_heads(pattern={pattern_file},sink={sink},local={local},prefill_local=40,"
              f"dense=loopserve(alpha=0.9,dense_above=None))")
    conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
    try:
        for message in LONG_TURNS:
            conv.send(message, max_new_tokens=6, ignore_eos=True)
            assert_trimmed(conv.kv, STREAMING, sink, local)
        stats = conv.method_stats
        assert len(stats) == len(LONG_TURNS)
        G = chat_llm.config.num_heads // chat_llm.config.num_kv_heads
        for entry in stats:
            prefill = entry["prefill"]
            assert 0 < prefill["density"] < 1
            # lines are reported for the dense heads alone: one KV head per layer, its query heads
            assert all(len(per_layer) == G for per_layer in prefill["lines_per_head"])
            assert prefill["recovered_mass_min"] >= 0.9 - 1e-4
            # the stages are timed apart: the attention's time excludes LoopServe's selection
            assert all(prefill[k] >= 0 for k in ("time_random_select", "time_search", "time_sparse_attention"))
    finally:
        conv.close()
