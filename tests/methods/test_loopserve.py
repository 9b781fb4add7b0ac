"""LoopServe: the greedy of Algorithm 5 against hand-worked steps and its stated properties, the line
masks against brute force, sparse prefill = dense when every line is taken, and progressive decode
(Algorithm 6) checked by number of tokens read, against dense decode, batched and over turns."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from turnkv.attention import decode as decode_module
from turnkv.attention import lines
from turnkv.errors import InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.loopserve import greedy as greedy_module
from turnkv.methods.loopserve import prefill as prefill_module
from turnkv.methods.loopserve.decode import LoopServeDecode
from turnkv.methods.loopserve.prefill import LoopServePrefill
from turnkv.methods.prefill.pattern_hook import summarise
from turnkv.methods.recipe import Recipe

PROMPTS = ["The river flows past the old mill where the miller counts sacks of grain every morning before dawn.",
           "Mountains rise over the valley; snow covers the peaks while shepherds lead goats to the high meadows."]


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---- Algorithm 5's greedy ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "python", "triton"])
def test_greedy_follows_the_hand_worked_steps(backend):
    # The Triton kernel needs GPU tensors where there is a GPU (elsewhere it runs in the interpreter).
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"

    def greedy(*args, **kwargs):
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        return [r.cpu() for r in greedy_module.greedy(*args, backend=backend, **kwargs)]
    # Two units, same lines; unit 1 has its best slash line forced.
    # Unit 0, normalised: (0,0) slash 0.5/10 < vertical 0.4/2 -> V (total .4, ol_v .25);
    # (0,1) slash (.5-.25)/9 < vertical .35/5 -> V (total .75, ol_v .45); verticals exhausted ->
    # S: gain .5-.45 = .05, total .8 >= .79: stop at (1 slash, 2 vertical).
    # Unit 1: forced slash first (total .5, ol_s .2); (1,0) slash .3/9 < vertical (.4-.2)/(2-1) -> V
    # (total .7, ol_v .25); (1,1) slash (.3-.25)/8 < vertical (.35-.2)/(5-1) -> V: total .85, stop.
    w_s, s_max, l_s = t([.5, .3], [.5, .3]), t([.2, .1], [.2, .1]), t([10, 9], [10, 9])
    w_v, v_max, l_v = t([.4, .35], [.4, .35]), t([.25, .2], [.25, .2]), t([2, 5], [2, 5])
    two = torch.tensor([2, 2])
    i, j, total = greedy(w_s, s_max, l_s, two, w_v, v_max, l_v, two, torch.tensor([.79, .79]),
                         torch.tensor([0, 1]), torch.tensor([0, 0]))
    assert i.tolist() == [1, 1] and j.tolist() == [2, 2]
    assert total.tolist() == pytest.approx([.8, .85])
    # The prose's raw comparison: (0,0) slash .5 > .4 -> S (ol_s .2); (1,0) slash .3 > .4-.2 -> S: .8.
    i, j, total = greedy(w_s[:1], s_max[:1], l_s[:1], two[:1], w_v[:1], v_max[:1], l_v[:1], two[:1],
                         torch.tensor([.79]), torch.tensor([0]), torch.tensor([0]), normalised=False)
    assert (i.item(), j.item()) == (2, 0) and total.item() == pytest.approx(.8)
    # A cap of one line stops after the first choice; an unreachable target takes every line.
    i, j, _ = greedy(w_s[:1], s_max[:1], l_s[:1], two[:1], w_v[:1], v_max[:1], l_v[:1], two[:1],
                     torch.tensor([.79]), torch.tensor([0]), torch.tensor([0]), max_lines=1)
    assert (i.item(), j.item()) == (0, 1)
    i, j, _ = greedy(w_s[:1], s_max[:1], l_s[:1], two[:1], w_v[:1], v_max[:1], l_v[:1], two[:1],
                     torch.tensor([5.0]), torch.tensor([0]), torch.tensor([0]))
    assert (i.item(), j.item()) == (2, 2)


def random_keys(B=1, Hq=4, H=2, T=40, hist=30, D=8, holes=True, seed=0):
    """A chunk of T rows at positions [hist, hist + T) over kept keys with eviction holes in the history."""
    g = torch.Generator().manual_seed(seed)
    S_full = hist + T
    keep = torch.ones(S_full, dtype=torch.bool)
    if holes:
        keep[torch.randperm(hist, generator=g)[: hist // 3]] = False
    k_pos = torch.arange(S_full)[keep]
    S = len(k_pos)
    q = torch.randn(B, Hq, T, D, generator=g) * 2
    k = torch.randn(B, H, S, D, generator=g) * 2
    v = torch.randn(B, H, S, D, generator=g)
    # The second KV head holds two fewer history tokens: padding at its end, like an uneven eviction.
    valid = torch.ones(B, H, S, dtype=torch.bool)
    kp = k_pos.expand(B, H, S).clone()
    if H > 1:
        kp[:, 1, :-2] = k_pos[2:]
        kp[:, 1, -2:] = 10**6
        valid[:, 1, -2:] = False
    return lines.Keys(q, k, v, torch.arange(hist, hist + T).expand(B, T), kp, valid, hist, hist + T)


@pytest.mark.parametrize("granularity", ["query", "kv"])
def test_selection_reaches_alpha_and_respects_cap_and_forced_lines(granularity):
    keys = random_keys()
    for alpha in (0.5, 0.9, 0.955):
        method = LoopServePrefill(alpha=alpha, samples=12, granularity=granularity, force_sink=2, force_local=3)
        vertical, slash, weights, rows, estimate, mass = method.select(keys, layer=0)
        per_q = granularity == "query"
        covered = (weights * lines.line_mask(keys, vertical, slash, per_q, rows)).sum(dim=(2, 3)).flatten()
        assert (covered >= alpha * mass - 1e-4).all()
        assert (estimate <= covered + 1e-4).all()  # the overlap accounting is conservative
        assert slash[:, :3].all()
        units_k_pos = lines.per_unit(keys.k_pos, keys.group, per_q)
        units_valid = lines.per_unit(keys.valid, keys.group, per_q)
        assert vertical[(units_k_pos < 2) & units_valid].all()
        assert not vertical[~units_valid].any()
    capped = LoopServePrefill(alpha=1.0, samples=12, granularity=granularity, max_lines=7, force_local=1)
    vertical, slash, *_ = capped.select(keys, layer=0)
    assert ((vertical.sum(1) + slash.sum(1)) == 7).all()


def contiguous_keys(B=1, Hq=4, H=2, T=40, hist=30, D=8, seed=0, ragged=False):
    """Keys at their entries (no eviction), optionally with a KV head two entries short (padding)."""
    g = torch.Generator().manual_seed(seed)
    S = hist + T
    q = torch.randn(B, Hq, T, D, generator=g) * 2
    k = torch.randn(B, H, S, D, generator=g) * 2
    k_pos, valid = torch.arange(S).expand(B, H, S).clone(), None
    if ragged:
        valid = torch.ones(B, H, S, dtype=torch.bool)
        valid[:, -1, -2:] = False
        k_pos[:, -1, -2:] = 10**6
    return lines.Keys(q, k, torch.randn(B, H, S, D, generator=g), torch.arange(hist, hist + T).expand(B, T),
                      k_pos, valid, hist, hist + T)


SELECT_CASES = [dict(), dict(granularity="kv"), dict(alpha=0.5, samples=12, force_sink=2, force_local=3),
                dict(compare="raw", max_lines=9), dict(lengths="sampled", sampling="strided"),
                dict(wmax="zero", alpha=1.0), dict(samples=500, granularity="kv")]


@pytest.mark.parametrize("options", SELECT_CASES)
def test_selection_paths_give_the_same_lines(monkeypatch, options):
    """The fast paths (diagonals read in place, in-place masking, the greedy's Python loop on CPU and
    Triton kernels) select exactly the lines of the reference path (mask, scatter over offsets, torch
    loop), with the same estimate, on keys at their entries (whole chunk, history, batches, padding)
    and on evicted keys (which take the reference's sums either way)."""
    method = LoopServePrefill(**options)
    keys_list = [contiguous_keys(), contiguous_keys(T=64, hist=0, seed=1), contiguous_keys(B=3, seed=2),
                 contiguous_keys(B=2, ragged=True, seed=3), random_keys(B=2, seed=4)]
    real_greedy, real_diagonals = prefill_module.greedy, lines.diagonal_sums

    def run(keys, reference=False, triton=False):
        with monkeypatch.context() as m:
            if reference:
                m.setattr(lines, "rows_at_entries", lambda keys, rows: None)
                m.setattr(prefill_module, "greedy", functools.partial(real_greedy, backend="torch"))
            if triton:
                m.setattr(lines, "diagonal_sums", functools.partial(real_diagonals, force_triton=True))
                m.setattr(prefill_module, "greedy", functools.partial(real_greedy, backend="triton"))
            return method.select(keys, layer=0)

    def assert_same(got, ref):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # vertical, slash
        assert torch.equal(got[2], ref[2])  # weights
        if got[4].is_cuda:  # the greedy's running sums in the GPU's reduction order
            torch.testing.assert_close(got[4], ref[4], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got[4], ref[4])  # estimate

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device (CPU: the interpreter)
    for keys in keys_list:
        assert_same(run(keys), run(keys, reference=True))
        keys = dataclasses.replace(keys, **{f.name: getattr(keys, f.name).to(device) for f in dataclasses.fields(keys)
                                            if isinstance(getattr(keys, f.name), torch.Tensor)})
        assert_same(run(keys, triton=True), run(keys, reference=True))


def test_rows_at_entries_and_in_place_sums_match_the_scatter():
    keys = contiguous_keys(B=2, T=30, hist=50)
    rows = torch.tensor([0, 3, 17, 29])
    positions = lines.rows_at_entries(keys, rows)
    assert positions == [[50, 53, 67, 79]] * 2
    assert lines.rows_at_entries(random_keys(), rows) is None  # eviction holes
    weights = lines.sample_weights(keys, rows, row_positions=positions)
    assert torch.equal(weights, lines.sample_weights(keys, rows))  # in-place masking = the mask
    weights = weights.reshape(8, 4, -1)
    offsets = lines.per_unit(keys.offsets(rows), keys.group, True)
    ref = lines.line_sums(weights, offsets, keys.end_position)
    got = lines.line_sums(weights, None, keys.end_position, positions)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_selection_recovers_planted_lines():
    # Queries and keys built so each row attends to key 0 (a sink column) and to itself - 3.
    T, hist = 32, 16
    S = hist + T
    D = S + 1  # a distinct code dimension per key
    pos = torch.arange(S)
    k = torch.zeros(1, 1, S, D)
    k[0, 0, 0, 0] = 1.0
    q = torch.zeros(1, 1, T, D)
    q[..., 0] = 100.0
    for p in range(hist, S):  # a one-hot code per position: row p matches key p - 3
        k[0, 0, p - 3, 1 + p - 3] = 1.0
        q[0, 0, p - hist, 1 + p - 3] = 100.0
    keys = lines.Keys(q, k, torch.randn(1, 1, S, D), pos[hist:][None], pos[None, None], None, hist, S)
    method = LoopServePrefill(alpha=0.9, samples=T, force_local=0)
    vertical, slash, *_ = method.select(keys, layer=0)
    assert vertical[0].nonzero().flatten().tolist() == [0]
    assert slash[0].nonzero().flatten().tolist() == [3]


# ---- line masks and attention against brute force ---------------------------------------------------
def brute_mask(keys, vertical, slash, per_q):
    B, Hq, T, _ = keys.q.shape
    H = keys.k.shape[1]
    U = Hq if per_q else H
    S = keys.k.shape[2]
    mask = torch.zeros(B, U, T, S, dtype=torch.bool)
    for b in range(B):
        for u in range(U):
            h = u // (U // H)
            for r in range(T):
                p = int(keys.q_pos[b, r])
                for c in range(S):
                    kp = int(keys.k_pos[b, h, c])
                    if not keys.valid[b, h, c] or kp > p:
                        continue
                    n = b * U + u
                    mask[b, u, r, c] = bool(vertical[n, c]) or bool(slash[n, p - kp])
    return mask


def brute_attention(keys, mask):
    B, Hq, T, D = keys.q.shape
    U = mask.shape[1]
    out = torch.zeros_like(keys.q)
    for b in range(B):
        for hq in range(Hq):
            h = hq // keys.group
            m = mask[b, hq if U == Hq else h]
            scores = keys.q[b, hq] @ keys.k[b, h].T * D**-0.5
            out[b, hq] = scores.masked_fill(~m, float("-inf")).softmax(-1) @ keys.v[b, h]
    return out


@pytest.mark.parametrize("per_q", [True, False])
def test_line_mask_and_blockwise_attention_equal_brute_force(per_q):
    keys = random_keys(B=2, T=12, hist=10)
    g = torch.Generator().manual_seed(1)
    U = 4 if per_q else 2
    N, S, M = 2 * U, keys.k.shape[2], keys.end_position
    vertical = torch.rand(N, S, generator=g) < 0.3
    slash = torch.rand(N, M, generator=g) < 0.3
    slash[:, 0] = True  # rows are never empty
    expected = brute_mask(keys, vertical, slash, per_q)
    assert torch.equal(lines.line_mask(keys, vertical, slash, per_q), expected)
    out, computed, causal = lines.blockwise_attention(
        keys, lambda r: lines.line_mask(keys, vertical, slash, per_q, r), block_rows=5)
    torch.testing.assert_close(out, brute_attention(keys, expected), rtol=1e-5, atol=1e-5)
    assert computed.tolist() == expected.sum(dim=(2, 3)).double().tolist()
    assert (computed <= causal).all()


def test_a_shape_and_tri_shape_equal_brute_force_masks():
    from turnkv.methods.prefill.a_shape import AShapePrefill
    from turnkv.methods.prefill.tri_shape import TriShapePrefill

    keys = random_keys(T=20, hist=30)
    for method in (AShapePrefill(sink=3, local=5), TriShapePrefill(sink=3, local=5, last=4)):
        out, stats = method.attend(0, keys)
        mask = torch.zeros(1, 2, 20, keys.k.shape[2], dtype=torch.bool)
        for h in range(2):
            for r in range(20):
                p = 30 + r
                for c in range(keys.k.shape[2]):
                    kp = int(keys.k_pos[0, h, c])
                    if keys.valid[0, h, c] and kp <= p:
                        dense_row = isinstance(method, TriShapePrefill) and p >= 50 - 4
                        mask[0, h, r, c] = kp < 3 or p - kp < 5 or dense_row
        torch.testing.assert_close(out, brute_attention(keys, mask), rtol=1e-5, atol=1e-5)
        assert stats["computed"].sum().item() == mask.sum().item()


def test_options_are_checked_by_name_and_value():
    with pytest.raises(InvalidRequestError, match="has no parameter 'alfa'"):
        Recipe.parse("loopserve prefill=loopserve(alfa=0.9)")
    with pytest.raises(InvalidRequestError, match="granularity must be one of query, kv"):
        Recipe.parse("prefill=loopserve(granularity=group)")
    with pytest.raises(InvalidRequestError, match="budget and interval must be >= 1"):
        Recipe.parse("decode=loopserve(budget=0)")
    with pytest.raises(InvalidRequestError, match="h2o accumulates"):
        Recipe.parse("loopserve evict=h2o")
    recipe = Recipe.parse("loopserve prefill=loopserve(alpha=0.99,max_lines=64) decode=loopserve(budget=256)")
    assert recipe.prefill == LoopServePrefill(alpha=0.99, max_lines=64)
    assert recipe.decode == LoopServeDecode(budget=256)
    assert Recipe.parse(str(recipe)) == recipe


# ---- through the engine ------------------------------------------------------------------------------
def prefill_logits(llm, ids, recipe, chunks):
    """All-token logits of `ids` prefilled as several chunks (history path after the first)."""
    seq = SequenceKV(llm.pool)
    st = recipe.new_state(llm.config.num_layers)
    try:
        parts = [llm.runner.prefill(seq, c, all_logits=True, context=st.context) for c in chunks(ids)]
    finally:
        seq.free()
    return torch.cat(parts), st


def test_all_lines_equal_dense_prefill(chat_llm):
    ids = chat_llm.encode(PROMPTS[0] + " " + PROMPTS[1])
    chunks = lambda x: [x[:20], x[20:35], x[35:]]  # noqa: E731
    dense, _ = prefill_logits(chat_llm, ids, Recipe(), chunks)
    sparse, st = prefill_logits(chat_llm, ids, Recipe.parse("loopserve-p prefill=loopserve(alpha=1.0)"), chunks)
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
    assert len(st.pattern_stats) == 3 * chat_llm.config.num_layers
    assert all(float(e["computed"].sum()) == float(e["causal"].sum()) for e in st.pattern_stats)
    # A lower alpha computes fewer cells and changes the logits (on the lines, whatever they cover).
    lower = "loopserve-p prefill=loopserve(alpha=0.5,samples=8,dense_above=None)"
    sparse, st = prefill_logits(chat_llm, ids, Recipe.parse(lower), chunks)
    computed = sum(float(e["computed"].sum()) for e in st.pattern_stats)
    causal = sum(float(e["causal"].sum()) for e in st.pattern_stats)
    assert computed < causal
    assert not torch.allclose(sparse, dense, atol=1e-3)
    # Units (query heads) whose lines cover at least dense_above of their cells attend densely, the
    # others keep their lines: each unit's count is then its causal cells or its lines' cells, and the
    # selection is still recorded.
    lines_only = [(e["computed"].reshape(-1).double(), e["causal"].reshape(-1).double()) for e in st.pattern_stats]
    shares = torch.cat([c / k for c, k in lines_only])
    threshold = float(shares.median())
    mixed, st_mixed = prefill_logits(chat_llm, ids, Recipe.parse(lower.replace("None", str(threshold))), chunks)
    went_dense = []
    for (c, k), entry in zip(lines_only, st_mixed.pattern_stats):
        got = entry["computed"].reshape(-1).double()
        share = c / k
        assert torch.equal(got[share >= threshold + 1e-9], k[share >= threshold + 1e-9])
        assert torch.equal(got[share < threshold - 1e-9], c[share < threshold - 1e-9])
        went_dense += (share >= threshold + 1e-9).tolist()
        assert "vertical" in entry and "recovered" in entry
    assert any(went_dense) and not all(went_dense)
    # The turn's summary counts, per layer, the (chunk, unit) entries that computed every causal cell.
    L = chat_llm.config.num_layers
    per_layer = [[] for _ in range(L)]
    for entry in st_mixed.pattern_stats:
        per_layer[entry["layer"]] += (entry["computed"] == entry["causal"]).reshape(-1).tolist()
    summary = summarise(st_mixed.pattern_stats, L)
    assert summary["dense_per_layer"] == pytest.approx([sum(d) / len(d) for d in per_layer])
    assert summary["dense_share"] == pytest.approx(sum(map(sum, per_layer)) / sum(map(len, per_layer)))
    assert 0 < summary["dense_share"] < 1
    assert not torch.allclose(mixed, dense, atol=1e-3) and not torch.allclose(mixed, sparse, atol=1e-3)
    everything, _ = prefill_logits(chat_llm, ids, Recipe.parse(lower.replace("None", "0")), chunks)
    torch.testing.assert_close(everything, dense, rtol=1e-4, atol=1e-4)


def spy_reads(monkeypatch):
    """Record the key counts of every indexed_decode call and whether it read a slot list."""
    calls = []
    real = decode_module.indexed_decode

    def spy(q, k_cache, v_cache, table, lengths, *args, **kwargs):
        calls.append((k_cache.shape[1] == 1, lengths.clone()))
        return real(q, k_cache, v_cache, table, lengths, *args, **kwargs)

    monkeypatch.setattr(decode_module, "indexed_decode", spy)
    return calls


@pytest.mark.parametrize("granularity", ["query", "kv"])
def test_decode_reads_top_budget_plus_recent_tokens(chat_llm, monkeypatch, granularity):
    B, warmup, interval, new = 5, 3, 4, 12
    calls = spy_reads(monkeypatch)
    recipe = f"loopserve-d decode=loopserve(budget={B},warmup={warmup},interval={interval},granularity={granularity})"
    conv = chat_llm.conversation(recipe=recipe)
    try:
        reply = conv.send(PROMPTS[0], max_new_tokens=new, ignore_eos=True)
        prompt_len = reply.prompt_tokens
    finally:
        conv.close()
    L, Hq, H = chat_llm.config.num_layers, chat_llm.config.num_heads, chat_llm.config.num_kv_heads
    assert len(calls) == (new - 1) * L
    selected_at = None
    for step in range(1, new):
        length = prompt_len + step  # tokens held when decode step `step` runs
        if step == warmup or (step > warmup and (step - warmup) % interval == 0):
            selected_at = step
        for slots, lengths in calls[(step - 1) * L : step * L]:
            if step < warmup:
                assert not slots and lengths.flatten().tolist() == [length] * H
            else:
                history = prompt_len + selected_at - 1
                expected = min(B, history) + (step - selected_at) + 1
                assert slots and lengths.shape == (1, Hq if granularity == "query" else H)
                assert lengths.flatten().tolist() == [expected] * lengths.numel()
    assert conv.method_stats[-1]["decode"] == {"method": "loopserve", "steps": new - 1, "selections": 3}


def test_decode_with_budget_over_history_or_in_warmup_equals_dense(chat_llm):
    def run(recipe):
        conv = chat_llm.conversation(system="Answer briefly.", recipe=recipe)
        out = []
        try:
            for message in PROMPTS:
                for _ in conv.stream(message, max_new_tokens=10, ignore_eos=True, logprobs=True):
                    pass
                out.append((conv.last_reply.token_ids, conv.last_reply.logprobs))
            return out, conv.method_stats
        finally:
            conv.close()

    dense, _ = run(None)
    for recipe in ("loopserve-d decode=loopserve(budget=100000,warmup=2,interval=3)",
                   "loopserve-d decode=loopserve(budget=2,warmup=10)"):
        got, stats = run(recipe)
        for (ids, lp), (ref_ids, ref_lp) in zip(got, dense):
            assert ids == ref_ids
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
        assert [s["decode"]["steps"] for s in stats] == [9, 9]
    assert [s["decode"]["selections"] for s in stats] == [0, 0]  # the warm-up recipe never selects


def test_batch_of_two_equals_one_by_one(chat_llm):
    recipe = "loopserve decode=loopserve(budget=6,warmup=2,interval=3) prefill=loopserve(alpha=0.8,samples=8)"
    prompts = [PROMPTS[0], PROMPTS[1] + " " + PROMPTS[0]]  # different lengths
    batched = chat_llm.generate(prompts, recipe=recipe, max_new_tokens=9, ignore_eos=True)
    for prompt, reply in zip(prompts, batched):
        alone = chat_llm.generate(prompt, recipe=recipe, max_new_tokens=9, ignore_eos=True)
        assert reply.token_ids == alone.token_ids


def test_multi_turn_conversation_with_the_recipe(chat_llm, monkeypatch):
    calls = spy_reads(monkeypatch)
    # dense_above=None: every unit's greedy runs to alpha (no early stop), so the recovered mass reaches it.
    conv = chat_llm.conversation(system="Answer briefly.", recipe="loopserve prefill=loopserve(dense_above=None) "
                                 "decode=loopserve(budget=8,warmup=4,interval=4)")
    L = chat_llm.config.num_layers
    try:
        for turn, message in enumerate(PROMPTS + ["And then?"], start=1):
            before = conv.kv.next_position
            reply = conv.send(message, max_new_tokens=12, ignore_eos=True)
            assert reply.cached_tokens == before  # only the new block is prefilled
            entry = conv.method_stats[-1]
            assert entry["turn"] == turn
            prefill = entry["prefill"]
            assert 0 < prefill["density"] <= 1
            assert prefill["recovered_mass"] >= 0.955 - 1e-4
            assert prefill["estimated_mass"] <= prefill["recovered_mass"] + 1e-4
            assert len(prefill["lines_per_head"]) == L
            assert all(n >= 1 for layer in prefill["lines_per_head"] for n in layer)
            assert all(prefill[k] >= 0 for k in ("time_random_select", "time_search", "time_sparse_attention"))
            assert entry["decode"] == {"method": "loopserve", "steps": 11, "selections": 2}
            # after the selection each head reads 8 history tokens + the ones since the selection
            assert calls[-1][0] and calls[-1][1].max().item() <= 8 + 4
        assert len(conv.method_stats) == 3
    finally:
        conv.close()


def test_observation_window_longer_than_the_steps_takes_the_prompt_tail(chat_llm):
    conv = chat_llm.conversation(recipe="loopserve-d decode=loopserve(window=6,warmup=2,interval=50)")
    try:
        conv.send(PROMPTS[0], max_new_tokens=3, ignore_eos=True)  # two decode steps
        end = conv.kv.next_position
        sel = conv.method_state.decode
        assert sel.selections == 1
        for layer in range(chat_llm.config.num_layers):
            assert sel.positions[layer].tolist() == list(range(end - 6, end))  # 4 prompt + 2 decode queries
    finally:
        conv.close()


def test_sampled_rows_are_distinct_sorted_seeded_and_differ_by_layer_and_chunk():
    method = LoopServePrefill(samples=48, seed=3)
    rows = method.sample_rows(131072, layer=2, first_position=0, device="cpu")
    assert rows.shape == (48,) and rows.dtype == torch.int64
    assert len(set(rows.tolist())) == 48 and torch.equal(rows, rows.sort().values)
    assert 0 <= int(rows.min()) and int(rows.max()) < 131072
    assert torch.equal(rows, LoopServePrefill(samples=48, seed=3).sample_rows(131072, 2, 0, "cpu"))
    others = [method.sample_rows(131072, 3, 0, "cpu"), method.sample_rows(131072, 2, 4096, "cpu"),
              LoopServePrefill(samples=48, seed=4).sample_rows(131072, 2, 0, "cpu")]
    assert all(not torch.equal(rows, o) for o in others)
    assert torch.equal(method.sample_rows(40, 0, 0, "cpu"), torch.arange(40))  # fewer rows than samples: all
