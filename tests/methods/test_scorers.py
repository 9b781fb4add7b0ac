"""Scorers against naive re-implementations written here (explicit loops, fp64), on LayerViews built
from random tensors with GQA (Hq=4 query heads over H=2 KV heads), heads of different lengths (padding)
and non-contiguous positions, as after an earlier eviction. H2O's attention mass is checked through
Step (accumulate=True) and through SequenceKV.keep, and on the tiny random llama."""

from __future__ import annotations

import math

import pytest
import torch

from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.eviction import Eviction
from turnkv.methods.evict.expected_attention import ExpectedAttentionScorer
from turnkv.methods.evict.h2o import H2OScorer
from turnkv.methods.evict.knorm import KnormScorer
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.evict.random import RandomScorer
from turnkv.methods.evict.snapkv import SnapKVScorer
from turnkv.methods.evict.streaming_llm import StreamingLLMScorer
from turnkv.methods.evict.tova import TOVAScorer
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.step_context import StepContext
from turnkv.methods.turns.recompress import RecompressTurns

H, HQ, G, D = 2, 4, 2, 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
INF = float("inf")
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---- building views ------------------------------------------------------------------------------

def rope_matrix(p: int) -> torch.Tensor:
    """Column form R_p (rope(x, p) = R_p @ x) in the rotate-half layout: channel i pairs with i + D/2."""
    R = torch.zeros(D, D, dtype=torch.float64)
    half = D // 2
    for i in range(half):
        c, s = math.cos(p * float(INV_FREQ[i])), math.sin(p * float(INV_FREQ[i]))
        R[i, i], R[i, i + half] = c, -s
        R[i + half, i + half], R[i + half, i] = c, s
    return R


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [W, Hq, D] pre-rope -> post-rope at positions [W]."""
    return torch.stack([x[w].double() @ rope_matrix(int(positions[w])).T for w in range(x.shape[0])]).float()


def random_view(seed: int = 0, lengths=(30, 36), P: int = 50, W: int = 6, scale: float = 1.5, layer: int = 0,
                next_position: int | None = None, pre_rope_queries: torch.Tensor | None = None):
    """A LayerView whose heads hold `lengths` tokens (padded to the longest, padding full of garbage):
    each head a different random subset of positions [0, P - W) plus the window's positions
    [P - W, P). Queries are RoPE-rotated at the window's positions. Returns (view, pre-rope queries)."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    positions = torch.randint(0, 1000, (H, S), generator=g)  # garbage in the padding
    valid = torch.zeros(H, S, dtype=torch.bool)
    for h, n in enumerate(lengths):
        older = torch.randperm(P - W, generator=g)[: n - W].sort().values
        positions[h, :n] = torch.cat([older, torch.arange(P - W, P)])
        valid[h, :n] = True
    keys = torch.randn(H, S, D, generator=g) * scale
    values = torch.randn(H, S, D, generator=g)
    q_pre = pre_rope_queries if pre_rope_queries is not None else torch.randn(W, HQ, D, generator=g) * scale
    qpos = torch.arange(P - W, P)
    view = LayerView(layer=layer, num_layers=4, keys=keys, values=values, positions=positions, valid=valid,
                     queries=rope(q_pre, qpos), query_positions=qpos, attention_mass=None, inv_freq=INV_FREQ,
                     next_position=P if next_position is None else next_position, target=10)
    return view, q_pre


def naive_window_attention(view: LayerView, w: int, qh: int) -> torch.Tensor:
    """Softmax (fp64) of window query w of query head qh over the valid keys it can see; zeros elsewhere."""
    h = qh // G
    out = torch.zeros(view.keys.shape[1], dtype=torch.float64)
    qpos = int(view.query_positions[w])
    vis = [j for j in range(out.numel()) if view.valid[h, j] and int(view.positions[h, j]) <= qpos]
    logits = torch.stack([view.keys[h, j].double() @ view.queries[w, qh].double() for j in vis]) / math.sqrt(D)
    out[vis] = torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
    return out


def assert_scores_equal_on_valid(actual: torch.Tensor, expected: torch.Tensor, valid: torch.Tensor) -> None:
    for h in range(valid.shape[0]):
        n = int(valid[h].sum())
        torch.testing.assert_close(actual[h, :n].double(), expected[h, :n].double(), **TOL)


# ---- SnapKV ------------------------------------------------------------------------------------

def naive_snapkv(view: LayerView, kernel: int = 7, pooling: str = "max") -> torch.Tensor:
    """Mean over window queries and over the group's query heads, pooled along the stored keys (stride
    1, padding kernel//2) over the columns before the window, the window's tokens +inf."""
    W = view.queries.shape[0]
    S = view.keys.shape[1]
    out = torch.full((H, S), float("nan"), dtype=torch.float64)
    r = kernel // 2
    for h in range(H):
        a = sum(naive_window_attention(view, w, qh) for qh in range(h * G, h * G + G) for w in range(W)) / (G * W)
        n = int(view.valid[h].sum())
        outside_window = [i for i in range(n) if int(view.positions[h, i]) < int(view.query_positions.min())]
        for j in range(n):
            # The window's own columns take no part in the pooling, as in the official code.
            neighbours = a[[i for i in range(max(0, j - r), j + r + 1) if i in outside_window]]
            if len(neighbours):  # average: absent neighbours count as zeros, the sum divided by the kernel
                out[h, j] = neighbours.max() if pooling == "max" else neighbours.sum() / kernel
            if int(view.positions[h, j]) >= int(view.query_positions.min()):
                out[h, j] = INF
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_scores_equal_naive_definition(seed):
    view, _ = random_view(seed)
    scores = SnapKVScorer(window=6, kernel=7, pooling="max").score(view)
    expected = naive_snapkv(view)
    assert_scores_equal_on_valid(scores, expected, view.valid)
    # exactly the window's 6 tokens are protected in each head
    assert [int(torch.isposinf(scores[h, : int(view.valid[h].sum())]).sum()) for h in range(H)] == [6, 6]


def test_snapkv_avg_pooling_and_no_pooling():
    view, _ = random_view(2)
    assert_scores_equal_on_valid(SnapKVScorer(window=6, kernel=5, pooling="avg").score(view),
                                 naive_snapkv(view, 5, "avg"), view.valid)
    assert_scores_equal_on_valid(SnapKVScorer(window=6, kernel=1).score(view), naive_snapkv(view, 1), view.valid)
    assert_scores_equal_on_valid(SnapKVScorer(window=6).score(view), naive_snapkv(view, 5, "avg"), view.valid)
    with pytest.raises(ValueError):
        SnapKVScorer(kernel=4)
    with pytest.raises(ValueError):
        SnapKVScorer(pooling="median")


def window_heavy_view(n: int = 40, W: int = 8, seed: int = 3) -> LayerView:
    """Positions 0..n-1 in every head, window = last W. Each window query looks like its own key, so
    the window's columns get large weights (as recent tokens do in real models)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(H, n, D, generator=g)
    queries = torch.stack([keys[qh // G, n - W + w] * 3 for w in range(W) for qh in range(HQ)]).view(W, HQ, D)
    return LayerView(layer=0, num_layers=1, keys=keys, values=torch.randn(H, n, D, generator=g),
                     positions=torch.arange(n).expand(H, n).clone(), valid=torch.ones(H, n, dtype=torch.bool),
                     queries=queries, query_positions=torch.arange(n - W, n), attention_mass=None,
                     inv_freq=INV_FREQ, next_position=n, target=10)


def official_snapkv(view: LayerView, kernel: int = 7) -> torch.Tensor:
    """SnapKV's official code: softmax over all n keys, keep the columns before the window
    (P[:, :, :n-win]), mean over queries, group mean, then max-pool over those n-win columns only."""
    W = view.queries.shape[0]
    n = view.keys.shape[1]
    a = torch.stack([sum(naive_window_attention(view, w, qh) for w in range(W)) / W for qh in range(HQ)])
    a = a[:, : n - W].view(H, G, n - W).mean(dim=1)
    return torch.nn.functional.max_pool1d(a[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]


def test_snapkv_matches_the_official_code_away_from_the_window():
    view = window_heavy_view()
    n, W = 40, 8
    scores = SnapKVScorer(window=W, kernel=7, pooling="max").score(view)
    official = official_snapkv(view)
    torch.testing.assert_close(scores[:, : n - W - 3].double(), official[:, : n - W - 3], **TOL)
    assert torch.isposinf(scores[:, n - W :]).all()


def test_snapkv_pooling_excludes_window_columns_as_in_the_official_code():
    view = window_heavy_view()
    n, W = 40, 8
    scores = SnapKVScorer(window=W, kernel=7, pooling="max").score(view)
    official = official_snapkv(view)
    # The three tokens right before the window: the official score is their own neighbourhood's maximum.
    torch.testing.assert_close(scores[:, n - W - 3 : n - W].double(), official[:, n - W - 3 :], **TOL)


# ---- StreamingLLM, TOVA, Knorm, random -------------------------------------------------------------

def test_streaming_llm_sinks_then_recency():
    view, _ = random_view(4)
    scores = StreamingLLMScorer().score(view)
    for h in range(H):
        for j in range(int(view.valid[h].sum())):
            p = int(view.positions[h, j])
            assert scores[h, j] == (INF if p < 4 else float(p))
    protected = torch.isposinf(StreamingLLMScorer(sinks=2).score(view)) & view.valid
    assert torch.equal(protected, (view.positions < 2) & view.valid)


def test_tova_kv_head_is_last_query_attention_averaged_over_the_group():
    view, _ = random_view(5)
    W = view.queries.shape[0]
    last = [naive_window_attention(view, W - 1, qh) for qh in range(HQ)]
    expected = torch.stack([(last[2 * h] + last[2 * h + 1]) / 2 for h in range(H)])
    scores = TOVAScorer(group="kv_head").score(view)
    assert_scores_equal_on_valid(scores, expected, view.valid)
    for h in range(H):  # a distribution over the head's valid keys
        assert float(scores[h, : int(view.valid[h].sum())].sum()) == pytest.approx(1.0, abs=1e-5)


def test_knorm_is_minus_key_norm():
    view, _ = random_view(6)
    S = view.keys.shape[1]
    expected = torch.tensor([[-math.sqrt(sum(float(x) ** 2 for x in view.keys[h, j])) for j in range(S)]
                             for h in range(H)])
    torch.testing.assert_close(KnormScorer().score(view), expected.float(), **TOL)


def test_random_scores_reproducible_and_seed_dependent():
    view, _ = random_view(7)
    a, b = RandomScorer(seed=0).score(view), RandomScorer(seed=0).score(view)
    assert torch.equal(a, b)
    assert a.shape == view.positions.shape and (a >= 0).all() and (a < 1).all()
    c = RandomScorer(seed=1).score(view)
    assert not torch.equal(a, c) and float((a - c).abs().mean()) > 0.1
    other_layer, _ = random_view(7, layer=1)
    assert not torch.equal(a, RandomScorer(seed=0).score(other_layer))
    # the kept set differs between seeds too
    top_a, top_c = a[0, :20].argsort()[-8:].sort().values, c[0, :20].argsort()[-8:].sort().values
    assert not torch.equal(top_a, top_c)


# ---- ExpectedAttention -------------------------------------------------------------------------------

def naive_expected_attention(view: LayerView, q_pre: torch.Tensor, future: int, covariance: bool,
                             vnorm: bool = True, sinks: int = 4, epsilon: float = 0.0) -> torch.Tensor:
    """From the known pre-RoPE window queries: mean m and covariance Sigma (divided by N) per query head,
    future query ~ Rbar (m, Sigma) with Rbar the RoPE matrix averaged over positions next .. next+future-1;
    score_j = mean over the group of softmax_j(k_j.mu/sqrt(d) + k_j^T Sigma' k_j / (2d)) * ||v_j||, the
    softmax over the keys other than the sinks."""
    q = q_pre.double()
    W = q.shape[0]
    Rbar = sum(rope_matrix(view.next_position + i) for i in range(future)) / future
    out = torch.full((H, view.keys.shape[1]), float("nan"), dtype=torch.float64)
    for h in range(H):
        n = int(view.valid[h].sum())
        k = view.keys[h, :n].double()
        probs = []
        for qh in range(h * G, h * G + G):
            m = q[:, qh].mean(dim=0)
            mu = Rbar @ m
            logits = k @ mu / math.sqrt(D)
            if covariance:
                centred = q[:, qh] - m
                sigma = Rbar @ (centred.T @ centred / W) @ Rbar.T
                logits = logits + torch.einsum("jd,de,je->j", k, sigma, k) / (2 * D)
            logits[view.positions[h, :n] < sinks] = float("-inf")
            probs.append(logits.softmax(dim=0))
        s = sum(probs) / G + epsilon
        if vnorm:
            s = s * view.values[h, :n].double().norm(dim=-1)
        s[view.positions[h, :n] < sinks] = INF
        out[h, :n] = s
    return out


def test_expected_attention_without_covariance_one_future_position():
    # future=1, no covariance: softmax over keys of k . R(p) mean(pre-rope q) / sqrt(d), times ||v||
    view, q_pre = random_view(8, next_position=57)
    scores = ExpectedAttentionScorer(queries="window", window=6, future=1, use_covariance=False).score(view)
    p = 57
    expected = torch.full((H, view.keys.shape[1]), float("nan"), dtype=torch.float64)
    for h in range(H):
        n = int(view.valid[h].sum())
        k = view.keys[h, :n].double()
        sink = view.positions[h, :n] < 4
        soft = [torch.softmax((k @ (rope_matrix(p) @ q_pre[:, qh].double().mean(0)) / math.sqrt(D)).masked_fill(
            sink, float("-inf")), 0) for qh in (2 * h, 2 * h + 1)]
        expected[h, :n] = (soft[0] + soft[1]) / 2 * view.values[h, :n].double().norm(dim=-1)
        expected[h, :n][view.positions[h, :n] < 4] = INF
    assert_scores_equal_on_valid(scores, expected, view.valid)


@pytest.mark.parametrize("future", [1, 37, 512])
def test_expected_attention_with_covariance_equals_naive(future):
    view, q_pre = random_view(9, next_position=61)
    scores = ExpectedAttentionScorer(queries="window", window=6, future=future).score(view)
    assert_scores_equal_on_valid(scores, naive_expected_attention(view, q_pre, future, True), view.valid)
    for h in range(H):
        n = int(view.valid[h].sum())
        row, pos = scores[h, :n], view.positions[h, :n]
        assert torch.isposinf(row[pos < 4]).all()
        assert torch.isfinite(row[pos >= 4]).all() and (row[pos >= 4] > 0).all()


def test_expected_attention_options():
    view, q_pre = random_view(10, next_position=50)
    plain = ExpectedAttentionScorer(queries="window", window=6, future=16, use_vnorm=False, epsilon=0.01, sinks=0).score(view)
    assert_scores_equal_on_valid(plain, naive_expected_attention(view, q_pre, 16, True, vnorm=False, sinks=0,
                                                                 epsilon=0.01), view.valid)
    # without the value norm and the epsilon, a head's scores are a distribution over its valid keys
    dist = ExpectedAttentionScorer(queries="window", window=6, future=16, use_vnorm=False, sinks=0).score(view)
    for h in range(H):
        assert float(dist[h, : int(view.valid[h].sum())].sum()) == pytest.approx(1.0, abs=1e-5)


# ---- H2O: attention mass accumulated by Step, carried by SequenceKV.keep ---------------------------------

class NaiveStore:
    """Per KV head: positions, K, V and attention mass, updated by explicit fp64 loops."""

    def __init__(self):
        self.pos = [[] for _ in range(H)]
        self.k = [[] for _ in range(H)]
        self.v = [[] for _ in range(H)]
        self.mass = [[] for _ in range(H)]

    def step(self, q, k, v, positions) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, H, D] at positions [T]: append, attend causally, add the weights."""
        T = q.shape[0]
        for t in range(T):
            for h in range(H):
                self.pos[h].append(int(positions[t]))
                self.k[h].append(k[t, h].double())
                self.v[h].append(v[t, h].double())
                self.mass[h].append(0.0)
        out = torch.zeros(T, HQ, D, dtype=torch.float64)
        for t in range(T):
            for qh in range(HQ):
                h = qh // G
                vis = [j for j, p in enumerate(self.pos[h]) if p <= int(positions[t])]
                logits = torch.stack([self.k[h][j] @ q[t, qh].double() for j in vis]) / math.sqrt(D)
                w = torch.softmax(logits, 0)
                for j, wj in zip(vis, w.tolist()):
                    self.mass[h][j] += wj
                out[t, qh] = sum(wj * self.v[h][j] for j, wj in zip(vis, w))
        return out

    def keep(self, kept_positions: list[list[int]]):
        for h in range(H):
            idx = [self.pos[h].index(p) for p in kept_positions[h]]
            self.pos[h] = [self.pos[h][i] for i in idx]
            self.k[h] = [self.k[h][i] for i in idx]
            self.v[h] = [self.v[h][i] for i in idx]
            self.mass[h] = [self.mass[h][i] for i in idx]


def run_step(pool, seq, naive, g, T):
    p0 = seq.next_position
    slots = seq.reserve(T)
    positions = torch.arange(p0, p0 + T)
    step = Step(pool, [seq], [slots], positions[None], contexts=[StepContext(accumulate=True)])
    q, k, v = (torch.randn(1, T, n, D, generator=g) for n in (HQ, H, H))
    out = step.attention(0, q, k, v)[0]
    torch.testing.assert_close(out, naive.step(q[0], k[0], v[0], positions).float(), **TOL)


def assert_mass_matches(seq, naive):
    mass = seq.gather_attention_mass(0)
    _, _, pos = seq.gather(0)
    for h in range(H):
        n = int(seq.lengths[0, h])
        assert pos[h, :n].tolist() == naive.pos[h]
        torch.testing.assert_close(mass[h, :n].double(), torch.tensor(naive.mass[h], dtype=torch.float64), **TOL)


def test_h2o_attention_mass_is_the_attention_received_and_moves_with_eviction():
    pool = PagePool(1, H, D, num_pages=32, page_size=4)
    seq = SequenceKV(pool)
    naive = NaiveStore()
    g = torch.Generator().manual_seed(11)
    for T in (7, 1, 1, 5, 1):  # a prefill, decode steps, a second prompt, a decode step
        run_step(pool, seq, naive, g, T)
        assert_mass_matches(seq, naive)
    # total mass per KV head: every query head of the group gives each query a distribution
    assert float(seq.gather_attention_mass(0)[:, :15].sum()) == pytest.approx(H * G * 15, rel=1e-5)

    # evict with H2O: the newest 3 (= 0.5 * budget 6) stay, then the 3 heaviest of the older ones
    B = 6
    expected = []
    for h in range(H):
        recent = sorted(naive.pos[h])[-3:]
        older = [(m, p) for p, m in zip(naive.pos[h], naive.mass[h]) if p not in recent]
        heavy = [p for _, p in sorted(older, reverse=True)[:3]]
        expected.append(sorted(recent + heavy))
    Eviction(H2OScorer(), UniformAllocator(), budget=B).compress(
        seq, RecompressTurns(), 0, seq.next_position, None, INV_FREQ)
    _, _, pos = seq.gather(0)
    assert [pos[h, : seq.lengths[0, h]].tolist() for h in range(H)] == expected
    naive.keep(expected)
    assert_mass_matches(seq, naive)  # the mass was compacted with its tokens
    assert seq.num_pages.tolist() == [[2, 2]]  # 6 tokens in pages of 4

    # and keeps accumulating over the compacted cache
    for T in (1, 3, 1):
        run_step(pool, seq, naive, g, T)
        assert_mass_matches(seq, naive)


def test_h2o_with_ada_allocation_keeps_the_layer_budget():
    pool = PagePool(1, H, D, num_pages=32, page_size=4)
    seq = SequenceKV(pool)
    naive = NaiveStore()
    g = torch.Generator().manual_seed(12)
    for T in (12, 1, 1, 1, 1):
        run_step(pool, seq, naive, g, T)
    Eviction(H2OScorer(recent_ratio=0.25), AdaKVAllocator(alpha=0.0), budget=8).compress(
        seq, RecompressTurns(), 0, 16, None, INV_FREQ)
    assert int(seq.lengths.sum()) == H * 8
    _, _, pos = seq.gather(0)
    mass = seq.gather_attention_mass(0)
    for h in range(H):
        kept = pos[h, : seq.lengths[0, h]].tolist()
        assert {14, 15} <= set(kept)  # int(0.25 * 8) = 2 newest per head are protected
        idx = [naive.pos[h].index(p) for p in kept]
        torch.testing.assert_close(mass[h, : len(kept)].double(),
                                   torch.tensor([naive.mass[h][i] for i in idx], dtype=torch.float64), **TOL)
    # with alpha = 0, the 12 free slots are the layer's 12 heaviest non-protected tokens
    free = sorted(((naive.mass[h][j], h, p) for h in range(H) for j, p in enumerate(naive.pos[h]) if p < 14),
                  reverse=True)[:12]
    for h in range(H):
        assert int(seq.lengths[0, h]) == 2 + sum(1 for _, hh, _ in free if hh == h)


def test_h2o_mass_through_the_model_sums_to_queries_times_group(chat_llm):
    pool, runner = chat_llm.pool, chat_llm.runner
    L = chat_llm.config.num_layers
    G_ = chat_llm.config.num_heads // chat_llm.config.num_kv_heads
    seq, plain = SequenceKV(pool), SequenceKV(pool)
    try:
        ids = list(range(200, 220))
        logits = runner.prefill(seq, ids, context=StepContext(accumulate=True))
        runner.prefill(plain, ids)
        for _ in range(3):
            token = int(logits.argmax())
            logits = runner.decode([seq], torch.tensor([token]), [StepContext(accumulate=True)])[0]
            runner.decode([plain], torch.tensor([token]))
        for layer in range(L):
            mass = seq.gather_attention_mass(layer)
            assert mass.shape == (2, 23)
            # 23 queries, each query head's weights sum to 1, G query heads per KV head
            torch.testing.assert_close(mass.sum(dim=1), torch.full((2,), 23.0 * G_), rtol=1e-5, atol=1e-4)
            # token 0 is seen by every query; the newest token only by itself
            assert (mass[:, 0] > mass[:, -1]).all() and (mass[:, -1] <= G_ + 1e-5).all()
            assert (plain.gather_attention_mass(layer) == 0).all()  # no accumulation unless asked
    finally:
        seq.free()
        plain.free()


def test_h2o_conversation_keeps_budget_in_the_compressed_span(chat_llm):
    conv = chat_llm.conversation(recipe="h2o budget=16")
    try:
        conv.send("Tell me a long story about a cat who sailed across the sea to find a lost key.", max_new_tokens=6)
        conv.send("What happened next?", max_new_tokens=4)
        (entry,) = conv.compression_log
        lo, hi = entry["span"]
        assert lo == 0 and hi == conv.turns[1].start
        for layer in range(chat_llm.config.num_layers):
            assert conv.kv.count_positions(layer, 0, hi).tolist() == [16, 16]
            mass = conv.kv.gather_attention_mass(layer)
            assert torch.isfinite(mass).all() and (mass[:, : int(conv.kv.lengths[layer].min())] > 0).all()
    finally:
        conv.close()
