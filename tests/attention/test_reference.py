"""Reference attention against naive implementations (K/V repeated per query-head group, explicit
softmax, per-head loops), and Step's batched attention against per-sequence reference attention."""

from __future__ import annotations

import math

import pytest
import torch

from turnkv.attention import reference
from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV

D = 8
TOL = dict(rtol=1e-5, atol=1e-5)


# ---- naive references -------------------------------------------------------------------------

def naive_attention(q, k, v, mask, scale=None):
    """Repeat K/V per group (repeat_interleave on heads), explicit float64 softmax. Returns (out, weights)."""
    B, Hq, T, Dh = q.shape
    G = Hq // k.shape[1]
    k_rep = k.double().repeat_interleave(G, dim=1)
    v_rep = v.double().repeat_interleave(G, dim=1)
    scores = q.double() @ k_rep.transpose(-1, -2) * (scale if scale is not None else Dh**-0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat_interleave(G, dim=1), float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v_rep, weights


def loop_attention(q, k, v, lengths, scale=None):
    """Per (b, query head, t): attend over the first lengths[b, h] - T + t + 1 entries of KV head h // G.
    Never reads padding, so it needs no mask at all."""
    B, Hq, T, Dh = q.shape
    G = Hq // k.shape[1]
    scale = scale if scale is not None else Dh**-0.5
    out = torch.zeros(B, Hq, T, Dh, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            h = hq // G
            for t in range(T):
                n = int(lengths[b, h]) - T + t + 1
                s = (k[b, h, :n].double() @ q[b, hq, t].double()) * scale
                w = torch.softmax(s, dim=0)
                out[b, hq, t] = w @ v[b, h, :n].double()
    return out


def random_kv_with_garbage_padding(gen, lengths, S):
    """K/V [B, H, S, D] whose entries past each head's length are large garbage (a missing mask shows)."""
    B, H = lengths.shape
    k = torch.randn(B, H, S, D, generator=gen)
    v = torch.randn(B, H, S, D, generator=gen)
    for b in range(B):
        for h in range(H):
            n = int(lengths[b, h])
            k[b, h, n:] = 50 * torch.randn(S - n, D, generator=gen)
            v[b, h, n:] = 1000 + 50 * torch.randn(S - n, D, generator=gen)
    return k, v


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


# ---- causal_mask ------------------------------------------------------------------------------

def test_causal_mask_literal_example():
    mask = reference.causal_mask(torch.tensor([[3, 5]]), num_new=2, num_keys=5)
    assert mask.shape == (1, 2, 2, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert mask[0, 1].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_causal_mask_matches_definition():
    lengths = torch.tensor([[5, 3, 7], [4, 7, 3]])
    T, S = 3, 7
    mask = reference.causal_mask(lengths, T, S)
    assert mask.shape == (2, 3, T, S)
    for b in range(2):
        for h in range(3):
            for t in range(T):
                for j in range(S):
                    assert bool(mask[b, h, t, j]) == (j <= int(lengths[b, h]) - T + t), (b, h, t, j)


def test_causal_mask_fresh_is_lower_triangular_and_decode_is_length_prefix():
    fresh = reference.causal_mask(torch.full((1, 2), 4), 4, 4)
    assert torch.equal(fresh[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(fresh[0, 1], fresh[0, 0])
    decode = reference.causal_mask(torch.tensor([[2, 6], [6, 1]]), 1, 6)
    assert decode[:, :, 0].int().tolist() == [[[1, 1, 0, 0, 0, 0], [1] * 6], [[1] * 6, [1, 0, 0, 0, 0, 0]]]


# ---- attention --------------------------------------------------------------------------------

@pytest.mark.parametrize("Hq, H", [(2, 2), (4, 2), (6, 2), (3, 1), (6, 3)])
def test_attention_prefill_with_history_matches_naive(gen, Hq, H):
    B, T, S = 2, 3, 9
    lengths = torch.tensor([[9, 5, 7][:H], [4, 9, 3][:H]])
    q = torch.randn(B, Hq, T, D, generator=gen)
    k, v = random_kv_with_garbage_padding(gen, lengths, S)
    mask = reference.causal_mask(lengths, T, S)
    out = reference.attention(q, k, v, mask)
    assert out.shape == (B, Hq, T, D) and out.dtype == torch.float32
    naive, _ = naive_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), naive, **TOL)
    torch.testing.assert_close(out.double(), loop_attention(q, k, v, lengths), **TOL)


@pytest.mark.parametrize("Hq, H", [(4, 2), (2, 1), (3, 3)])
def test_attention_decode_uneven_lengths_matches_naive(gen, Hq, H):
    B, S = 3, 11
    lengths = torch.tensor([[11, 2, 6], [1, 11, 4], [7, 7, 11]])[:, :H]
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k, v = random_kv_with_garbage_padding(gen, lengths, S)
    mask = reference.causal_mask(lengths, 1, S)
    out = reference.attention(q, k, v, mask)
    naive, _ = naive_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), naive, **TOL)
    torch.testing.assert_close(out.double(), loop_attention(q, k, v, lengths), **TOL)
    # a length-1 head attends to its single entry: the output is that V row (up to fp)
    if (lengths == 1).any():
        b, h = (lengths == 1).nonzero()[0].tolist()
        G = Hq // H
        for hq in range(h * G, (h + 1) * G):
            torch.testing.assert_close(out[b, hq, 0], v[b, h, 0], **TOL)


def test_attention_without_mask_equal_lengths(gen):
    B, Hq, H, S = 2, 4, 2, 6
    q = torch.randn(B, Hq, 1, D, generator=gen)
    k = torch.randn(B, H, S, D, generator=gen)
    v = torch.randn(B, H, S, D, generator=gen)
    out = reference.attention(q, k, v, None)
    naive, _ = naive_attention(q, k, v, None)
    torch.testing.assert_close(out.double(), naive, **TOL)
    # same as a mask of all-visible keys
    torch.testing.assert_close(out, reference.attention(q, k, v, reference.causal_mask(torch.full((B, H), S), 1, S)),
                               **TOL)


def test_attention_custom_scale(gen):
    B, Hq, T, S = 1, 4, 2, 5
    lengths = torch.tensor([[5, 3]])
    q = torch.randn(B, Hq, T, D, generator=gen)
    k, v = random_kv_with_garbage_padding(gen, lengths, S)
    mask = reference.causal_mask(lengths, T, S)
    out = reference.attention(q, k, v, mask, scale=0.7)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask, scale=0.7)[0], **TOL)
    torch.testing.assert_close(out.double(), loop_attention(q, k, v, lengths, scale=0.7), **TOL)
    assert not torch.allclose(out, reference.attention(q, k, v, mask), atol=1e-3)


def test_attention_groups_query_heads_contiguously():
    """Query head hq reads KV head hq // G (repeat_interleave), not hq % H (repeat)."""
    B, H, G, S = 1, 2, 3, 4
    q = torch.randn(B, H * G, 1, D)
    k = torch.randn(B, H, S, D)
    v = torch.stack([torch.full((S, D), 1.0), torch.full((S, D), 2.0)])[None]  # KV head h holds h + 1
    out = reference.attention(q, k, v, None)
    assert out[0, :, 0, 0].tolist() == pytest.approx([1, 1, 1, 2, 2, 2], abs=1e-6)
    w = reference.attention_weights(q, k, None)
    assert w.shape == (B, H * G, 1, S)


def test_attention_bf16_close_to_naive(gen):
    B, Hq, T, S = 2, 4, 2, 7
    lengths = torch.tensor([[7, 4], [5, 7]])
    q = torch.randn(B, Hq, T, D, generator=gen).bfloat16()
    k, v = (t.bfloat16() for t in random_kv_with_garbage_padding(gen, lengths, S))
    mask = reference.causal_mask(lengths, T, S)
    out = reference.attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask)[0], rtol=2e-2, atol=2e-2)


def test_causal_prefill_matches_naive(gen):
    B, Hq, H, T = 2, 6, 2, 5
    q = torch.randn(B, Hq, T, D, generator=gen)
    k = torch.randn(B, H, T, D, generator=gen)
    v = torch.randn(B, H, T, D, generator=gen)
    out = reference.causal_prefill(q, k, v)
    mask = reference.causal_mask(torch.full((B, H), T), T, T)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, mask)[0], **TOL)
    torch.testing.assert_close(out, reference.attention(q, k, v, mask), **TOL)
    # a single token attends to itself only
    single = reference.causal_prefill(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    torch.testing.assert_close(single, v[:, :, :1].repeat_interleave(3, dim=1), **TOL)


# ---- attention_weights ------------------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 3])
def test_attention_weights_rows_sum_to_one_and_match_naive(gen, T):
    B, Hq, H, S = 2, 4, 2, 8
    lengths = torch.tensor([[8, 3], [5, 6]])
    q = torch.randn(B, Hq, T, D, generator=gen)
    k, v = random_kv_with_garbage_padding(gen, lengths, S)
    mask = reference.causal_mask(lengths, T, S)
    w = reference.attention_weights(q, k, mask)
    assert w.shape == (B, Hq, T, S) and w.dtype == torch.float32
    torch.testing.assert_close(w.sum(-1), torch.ones(B, Hq, T), rtol=0, atol=1e-6)
    _, naive_w = naive_attention(q, k, v, mask)
    torch.testing.assert_close(w.double(), naive_w, **TOL)
    # masked entries are exactly zero
    hidden = ~mask.repeat_interleave(Hq // H, dim=1)
    assert int(hidden.sum()) > 0 and bool((w[hidden] == 0).all())
    # weights times repeated V reproduce the attention output
    out = reference.attention(q, k, v, mask)
    torch.testing.assert_close(w @ v.repeat_interleave(Hq // H, dim=1), out, **TOL)


def test_attention_weights_scale_and_no_mask(gen):
    q = torch.randn(1, 2, 1, D, generator=gen)
    k = torch.randn(1, 1, 5, D, generator=gen)
    v = torch.zeros(1, 1, 5, D)
    w = reference.attention_weights(q, k, None, scale=0.25)
    torch.testing.assert_close(w.double(), naive_attention(q, k, v, None, scale=0.25)[1], **TOL)
    # explicit softmax of one row
    s = (k[0, 0] @ q[0, 1, 0]) * 0.25
    expected = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
    torch.testing.assert_close(w[0, 1, 0], expected, **TOL)


# ---- gather_pages -----------------------------------------------------------------------------

@pytest.mark.parametrize("length", [0, 1, 4, 7, 12])
def test_gather_pages_matches_manual_concatenation(gen, length):
    num_pages, ps, B, H, P = 18, 4, 2, 3, 3
    pool_k = torch.randn(num_pages, ps, D, generator=gen)
    pool_pos = torch.randint(0, 1000, (num_pages, ps), generator=gen)
    tables = torch.randperm(num_pages, generator=gen).reshape(B, H, P)
    k = reference.gather_pages(pool_k, tables, length)
    pos = reference.gather_pages(pool_pos, tables, length)
    assert k.shape == (B, H, length, D) and pos.shape == (B, H, length)
    pages = math.ceil(length / ps)
    for b in range(B):
        for h in range(H):
            manual_k = torch.cat([pool_k[int(tables[b, h, i])] for i in range(pages)] or [torch.zeros(0, D)])
            manual_pos = torch.cat([pool_pos[int(tables[b, h, i])] for i in range(pages)]
                                   or [torch.zeros(0, dtype=torch.int64)])
            assert torch.equal(k[b, h], manual_k[:length])
            assert torch.equal(pos[b, h], manual_pos[:length])


def test_gather_pages_ignores_table_columns_past_length(gen):
    pool_v = torch.randn(6, 4, D, generator=gen)
    tables = torch.tensor([[[5, 2, 0, 1]]])
    out = reference.gather_pages(pool_v, tables, 6)
    assert torch.equal(out[0, 0], torch.cat([pool_v[5], pool_v[2, :2]]))


# ---- Step -------------------------------------------------------------------------------------

L, H, HQ, PS = 2, 2, 4, 4


def fill(seq: SequenceKV, T: int, gen):
    slots = seq.reserve(T)
    pool = seq.pool
    for layer in range(pool.num_layers):
        n = H * T
        pool.write(layer, slots[layer].reshape(-1), torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen))


def expected_step(seq: SequenceKV, layer: int, q, T: int, window=None):
    """One sequence alone, from its own gathered K/V: reference attention (causal_mask over its own
    lengths) and an independent loop that also applies the sliding window by position."""
    k, v, pos = seq.gather(layer)
    lengths = torch.from_numpy(seq.lengths[layer])[None]
    qh = q.transpose(1, 2)  # [1, Hq, T, D]
    if window is None:
        ref = reference.attention(qh, k[None], v[None], reference.causal_mask(lengths, T, k.shape[1]))
    else:
        ref = None
    G = HQ // H
    loop = torch.zeros(1, HQ, T, D, dtype=torch.float64)
    for hq in range(HQ):
        h = hq // G
        for t in range(T):
            n = int(lengths[0, h]) - T + t + 1
            q_pos = seq.next_position - T + t
            visible = torch.ones(n, dtype=torch.bool)
            if window is not None:
                visible = pos[h, :n] > q_pos - window
            s = (k[h, :n].double() @ qh[0, hq, t].double()) * D**-0.5
            s = s.masked_fill(~visible, float("-inf"))
            loop[0, hq, t] = torch.softmax(s, 0) @ v[h, :n].double()
    return ref, loop.transpose(1, 2)


def run_step(pool, seqs, T, gen, window=None):
    slots = [s.reserve(T) for s in seqs]
    positions = torch.tensor([[s.next_position - T + t for t in range(T)] for s in seqs])
    step = Step(pool, seqs, slots, positions, sliding_window=window)
    B = len(seqs)
    results = []
    for layer in range(L):
        q = torch.randn(B, T, HQ, D, generator=gen)
        k = torch.randn(B, T, H, D, generator=gen)
        v = torch.randn(B, T, H, D, generator=gen)
        out = step.attention(layer, q, k, v)
        assert out.shape == (B, T, HQ, D)
        # the step's K/V landed as the last T entries of each head, in (sequence, head, token) order
        for b, seq in enumerate(seqs):
            gk, gv, gpos = seq.gather(layer)
            for h in range(H):
                n = int(seq.lengths[layer, h])
                assert torch.equal(gk[h, n - T:n], k[b, :, h]) and torch.equal(gv[h, n - T:n], v[b, :, h])
                assert gpos[h, n - T:n].tolist() == list(range(seq.next_position - T, seq.next_position))
        results.append((layer, q, out))
    return step, results


def make_batch(gen, num_pages=32):
    pool = PagePool(L, H, D, num_pages, PS)
    a, b = SequenceKV(pool), SequenceKV(pool)
    fill(a, 9, gen)
    a.keep(0, [[0, 3, 5, 8], [1, 2, 3, 4, 5, 6, 8]])  # layer 0 uneven: 4 and 7 tokens
    fill(b, 5, gen)
    return pool, a, b


def test_step_decode_batch_matches_per_sequence_reference(gen):
    pool, a, b = make_batch(gen)
    step, results = run_step(pool, [a, b], 1, gen)
    assert not step.fresh
    assert step.padded == [True, True]
    assert step.max_len == [7 + 1, 9 + 1]
    assert a.lengths.tolist() == [[5, 8], [10, 10]] and b.lengths.tolist() == [[6, 6], [6, 6]]
    for layer, q, out in results:
        for i, seq in enumerate([a, b]):
            ref, loop = expected_step(seq, layer, q[i:i + 1], 1)
            torch.testing.assert_close(out[i:i + 1], ref.transpose(1, 2), **TOL)
            torch.testing.assert_close(out[i:i + 1].double(), loop, **TOL)


def test_step_decode_equal_lengths_takes_unmasked_path(gen):
    pool = PagePool(L, H, D, 32, PS)
    a, b = SequenceKV(pool), SequenceKV(pool)
    fill(a, 6, gen)
    fill(b, 6, gen)
    step, results = run_step(pool, [a, b], 1, gen)
    assert not step.fresh and step.padded == [False, False]
    for layer, q, out in results:
        for i, seq in enumerate([a, b]):
            ref, loop = expected_step(seq, layer, q[i:i + 1], 1)
            torch.testing.assert_close(out[i:i + 1], ref.transpose(1, 2), **TOL)
            torch.testing.assert_close(out[i:i + 1].double(), loop, **TOL)


def test_step_prefill_with_history_matches_per_sequence_reference(gen):
    pool, a, b = make_batch(gen)
    step, results = run_step(pool, [a, b], 3, gen)
    assert not step.fresh
    for layer, q, out in results:
        for i, seq in enumerate([a, b]):
            ref, loop = expected_step(seq, layer, q[i:i + 1], 3)
            torch.testing.assert_close(out[i:i + 1], ref.transpose(1, 2), **TOL)
            torch.testing.assert_close(out[i:i + 1].double(), loop, **TOL)


def test_step_fresh_batch_is_plain_causal_prefill(gen):
    pool = PagePool(L, H, D, 16, PS)
    a, b = SequenceKV(pool), SequenceKV(pool)
    step, results = run_step(pool, [a, b], 5, gen)
    assert step.fresh
    for layer, q, out in results:
        for i, seq in enumerate([a, b]):
            ref, loop = expected_step(seq, layer, q[i:i + 1], 5)
            torch.testing.assert_close(out[i:i + 1], ref.transpose(1, 2), **TOL)
            torch.testing.assert_close(out[i:i + 1].double(), loop, **TOL)


@pytest.mark.parametrize("T", [1, 2])
def test_step_sliding_window_uses_kept_positions(gen, T):
    pool, a, b = make_batch(gen)
    window = 4
    step, results = run_step(pool, [a, b], T, gen, window=window)
    assert not step.fresh
    for layer, q, out in results:
        for i, seq in enumerate([a, b]):
            _, loop = expected_step(seq, layer, q[i:i + 1], T, window=window)
            torch.testing.assert_close(out[i:i + 1].double(), loop, **TOL)


@pytest.mark.parametrize("T,S", [(1, 9), (5, 5), (7, 40)])
def test_causal_suffix_equals_the_masked_path(T, S):
    torch.manual_seed(0)
    q = torch.randn(2, 6, T, 16)
    k, v = torch.randn(2, 3, S, 16), torch.randn(2, 3, S, 16)
    mask = reference.causal_mask(torch.full((2, 1), S), T, S)
    torch.testing.assert_close(reference.causal_suffix(q, k, v), reference.attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
