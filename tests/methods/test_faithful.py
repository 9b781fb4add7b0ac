"""Each eviction scorer's kept set against a small reference computation written from its authors'
formula (and kvpress's, under compat=kvpress): tensors of one layer in, kept indices per KV head out.

The references work as the published code does, on one freshly prefilled layer: keys [H, n, D] at
positions 0..n-1, post-RoPE queries for every position, GQA with G = Hq / H query heads per KV head.
turnkv's side runs the scorer on a LayerView of the same tensors and splits the budget with its
allocator, as the eviction driver does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.expected_attention import ExpectedAttentionScorer
from turnkv.methods.evict.knorm import KnormScorer
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.evict.pyramidkv import PyramidKVScorer
from turnkv.methods.evict.snapkv import SnapKVScorer
from turnkv.methods.evict.streaming_llm import StreamingLLMScorer
from turnkv.methods.evict.tova import TOVAScorer
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.window import QueryMoments

D = 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, Hq, D] -> rotated at positions [T] (rotate-half layout), float64."""
    angles = positions.double()[:, None] * INV_FREQ
    cos, sin = torch.cat((angles.cos(),) * 2, -1)[:, None], torch.cat((angles.sin(),) * 2, -1)[:, None]
    x = x.double()
    return x * cos + torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1) * sin


class Layer:
    """One prefilled layer: pre-RoPE queries of every position, post-RoPE keys, values."""

    def __init__(self, n=48, H=2, G=2, seed=0, scale=1.5):
        g = torch.Generator().manual_seed(seed)
        self.n, self.H, self.G = n, H, G
        self.q_pre = torch.randn(n, H * G, D, generator=g, dtype=torch.float64) * scale + 0.3
        self.q = rope(self.q_pre, torch.arange(n))  # [n, Hq, D]
        self.k = torch.randn(H, n, D, generator=g, dtype=torch.float64) * scale
        self.v = torch.randn(H, n, D, generator=g, dtype=torch.float64)

    def view(self, window: int, with_moments_from: int | None = None) -> LayerView:
        positions = torch.arange(self.n)
        moments = None
        if with_moments_from is not None:
            recorder = QueryMoments(1, INV_FREQ, with_moments_from)
            for lo in range(0, self.n, 7):  # in chunks, as prefill chunks arrive
                recorder.add(0, self.q[lo : lo + 7].float(), positions[lo : lo + 7])
            moments = recorder.layer(0)
        return LayerView(layer=0, num_layers=1, keys=self.k.float(), values=self.v.float(),
                         positions=positions.expand(self.H, self.n).clone(),
                         valid=torch.ones(self.H, self.n, dtype=torch.bool), queries=self.q[-window:].float(),
                         query_positions=positions[-window:], attention_mass=None, inv_freq=INV_FREQ.float(),
                         next_position=self.n, target=0, moments=moments)

    def attention(self, rows: slice) -> torch.Tensor:
        """Causal softmax weights [Hq, T, n] of the queries in `rows` over every key (fp64)."""
        q = self.q[rows].transpose(0, 1)  # [Hq, T, D]
        k = self.k.repeat_interleave(self.G, dim=0)  # [Hq, n, D]
        logits = q @ k.transpose(1, 2) / math.sqrt(D)
        qpos = torch.arange(self.n)[rows]
        logits = logits.masked_fill(torch.arange(self.n)[None, None] > qpos[None, :, None], float("-inf"))
        return logits.softmax(-1)


def turnkv_kept(scorer, layer: Layer, per_head: int, allocator=None, window: int | None = None) -> list[list[int]]:
    """What the eviction driver keeps: scores, the allocator's per-head counts, each head's best."""
    view = layer.view(window or scorer.window, scorer.query_moments)
    scores = scorer.score(view).float()
    counts = (allocator or UniformAllocator()).allocate(scores, per_head * layer.H)
    order = scores.argsort(dim=1, descending=True, stable=True)
    return [sorted(order[h, : int(counts[h])].tolist()) for h in range(layer.H)]


def topk_sets(scores: torch.Tensor, k: int) -> list[list[int]]:
    return [sorted(scores[h].topk(k).indices.tolist()) for h in range(scores.shape[0])]


# ---- TOVA: the newest query's attention, averaged over every head of the layer ------------------------

def reference_tova(layer: Layer, keep: int, keep_newest: bool = False) -> list[list[int]]:
    scores = layer.attention(slice(layer.n - 1, layer.n))[:, 0].mean(0)  # [n], one ranking for the layer
    if keep_newest:  # kvpress's TOVAPress
        scores = scores.clone()
        scores[-1] = float("inf")
    return [sorted(scores.topk(keep).indices.tolist())] * layer.H


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tova_keeps_the_authors_layer_ranking(seed):
    layer = Layer(seed=seed)
    assert turnkv_kept(TOVAScorer(), layer, 20) == reference_tova(layer, 20)
    # The per-group reading is another rule: each KV head ranks its own tokens.
    per_group = turnkv_kept(TOVAScorer(group="kv_head"), layer, 20)
    assert per_group[0] != per_group[1] and per_group != reference_tova(layer, 20)


def test_tova_kvpress_always_keeps_the_newest_token():
    for seed in range(4):
        layer = Layer(seed=seed, scale=3.0)
        kept = turnkv_kept(TOVAScorer(compat="kvpress"), layer, 6)
        assert kept == reference_tova(layer, 6, keep_newest=True)
        assert all(layer.n - 1 in head for head in kept)


# ---- SnapKV: window attention, average pooled with zero padding, the window kept -----------------------

def reference_snapkv(layer: Layer, window: int, kernel: int, per_head: int, pooling: str = "avg", pooled=False):
    n = layer.n
    a = layer.attention(slice(n - window, n)).sum(1)[:, : n - window]  # [Hq, n - window]
    a = a.view(layer.H, layer.G, n - window).mean(1)  # GQA: the group's mean (kvpress, Ada-KV)
    if pooling == "avg":  # zero padding, divided by the kernel width at the edges too
        scores = F.avg_pool1d(a[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    else:
        scores = F.max_pool1d(a[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    if pooled:
        return scores / window  # the authors sum over the window's queries; turnkv averages
    picked = topk_sets(scores, per_head - window)
    return [sorted(p + list(range(n - window, n))) for p in picked]


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("G", [1, 2])  # MHA: the authors' code exactly; GQA: with the group mean
def test_snapkv_keeps_the_authors_set(seed, G):
    layer = Layer(n=64, G=G, seed=seed)
    scorer = SnapKVScorer(window=8)
    assert (scorer.kernel, scorer.pooling) == (5, "avg")
    assert turnkv_kept(scorer, layer, 24) == reference_snapkv(layer, 8, 5, 24)
    # Max pooling (Ada-KV's code) makes plateaus of equal scores, so it is compared by score: the
    # kept sets differ only by which of the tied tokens each side takes.
    scores = SnapKVScorer(window=8, kernel=7, pooling="max").score(layer.view(8)).double()
    torch.testing.assert_close(scores[:, :56], reference_snapkv(layer, 8, 7, 24, "max", pooled=True),
                               rtol=1e-5, atol=1e-7)


def test_snapkv_edge_columns_are_averaged_over_the_whole_kernel():
    layer = Layer(n=40, seed=5)
    view = layer.view(8)
    scores = SnapKVScorer(window=8).score(view).double()
    a = layer.attention(slice(32, 40)).mean(1)[:, :32].view(2, 2, 32).mean(1)
    torch.testing.assert_close(scores[:, 0], a[:, :3].sum(1) / 5, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(scores[:, 31], a[:, 29:32].sum(1) / 5, rtol=1e-5, atol=1e-7)  # beside the window
    assert torch.isposinf(scores[:, 32:]).all()


def test_snapkv_kvpress_defaults_and_keep_rule():
    scorer = SnapKVScorer(compat="kvpress")
    assert (scorer.window, scorer.kernel, scorer.pooling) == (64, 5, "avg")
    layer = Layer(n=160, seed=6)
    n_kept = int(160 * (1 - 0.5))  # kvpress's ScorerPress: int(k_len * (1 - ratio)) per head, window inside
    assert turnkv_kept(scorer, layer, n_kept) == reference_snapkv(layer, 64, 5, n_kept)
    with pytest.raises(ValueError):
        SnapKVScorer(compat="kvpress", pooling="max")
    with pytest.raises(ValueError):
        SnapKVScorer(compat="vllm")


# ---- PyramidKV under kvpress: the window inside each layer's budget -----------------------------------

def reference_kvpress_pyramid(q_len: int, ratio: float, window: int, beta: int, layer: int, layers: int) -> int:
    """Per-head tokens a layer keeps, window included (kvpress's schedule)."""
    share = q_len * (1 - ratio)
    low, high = share / beta, 2 * share - share / beta
    if high >= q_len - window:
        high = q_len - window
        low = 2 * share - high
    if not (q_len >= high >= low >= window):
        return round(share)
    return round(high - layer * (high - low) / (layers - 1))


@pytest.mark.parametrize("q_len,ratio", [(4000, 0.5), (4000, 0.9), (1000, 0.75), (300, 0.5), (2000, 0.2)])
def test_pyramidkv_kvpress_layer_budgets(q_len, ratio):
    scorer = PyramidKVScorer(compat="kvpress")
    assert scorer.window == 64
    target = round(q_len * (1 - ratio))
    for layer in range(16):
        want = reference_kvpress_pyramid(q_len, ratio, 64, 20, layer, 16)
        assert scorer.layer_target(target, layer, 16, q_len) == want


def test_pyramidkv_default_keeps_the_window_on_top_of_each_layer_share():
    scorer = PyramidKVScorer()
    targets = [scorer.layer_target(200, layer, 8, 4000) for layer in range(8)]
    b = 200 - 32
    assert targets[0] == 32 + 2 * b - b // 20 and targets[-1] >= 32 + b // 20
    assert abs(sum(targets) / 8 - 200) < 8


# ---- Ada-KV under kvpress: each head's own top int(alpha * n_kept), then one global top-k -------------

def reference_kvpress_adakv(scores: torch.Tensor, n_kept: int, alpha: float) -> list[list[int]]:
    """scores [H, n] with the window at finfo.max - 1 stand-ins: the kvpress rule, as kept sets."""
    s = scores.clone()
    n_safe = int(n_kept * alpha)
    top = s.topk(n_safe, dim=1).indices
    s.scatter_(1, top, torch.finfo(s.dtype).max)
    H, n = s.shape
    pruned = (-s.reshape(-1)).topk(H * (n - n_kept)).indices
    keep = torch.ones(H * n, dtype=torch.bool)
    keep[pruned] = False
    keep = keep.view(H, n)
    return [sorted(keep[h].nonzero().flatten().tolist()) for h in range(H)]


@pytest.mark.parametrize("alpha,window,n_kept", [(0.2, 8, 20), (0.5, 8, 30), (0.2, 2, 40), (0.9, 4, 12)])
def test_adakv_kvpress_rule_counts_the_window_inside_the_guarantee(alpha, window, n_kept):
    g = torch.Generator().manual_seed(7)
    H, n = 4, 64
    # Skewed heads: head 0 holds most of the mass, so the guarantee matters for the others.
    scores = torch.rand(H, n, generator=g) * torch.tensor([8.0, 1.0, 0.5, 0.1])[:, None]
    ref_scores = scores.clone()
    ref_scores[:, n - window :] = float(scores.max()) + 1  # kvpress pads the window with max + 1
    want = reference_kvpress_adakv(ref_scores, n_kept, alpha)
    ours = scores.clone()
    ours[:, n - window :] = float("inf")
    counts = AdaKVAllocator(alpha=alpha, rule="kvpress").allocate(ours, H * n_kept)
    order = ours.argsort(dim=1, descending=True, stable=True)
    got = [sorted(order[h, : int(counts[h])].tolist()) for h in range(H)]
    assert got == want
    assert min(len(h) for h in got) >= max(window, int(n_kept * alpha))


# ---- ExpectedAttention: every query but the sinks, the sinks out of the softmax, covariance over N ------

def reference_expected_attention(layer: Layer, per_head: int, sinks: int = 4, future: int = 512,
                                 epsilon: float = 0.0) -> list[list[int]]:
    n, H, G = layer.n, layer.H, layer.G
    q = layer.q_pre[sinks:]  # [N, Hq, D] pre-RoPE, the sinks' queries left out
    mean = q.mean(0)
    cov = torch.einsum("nhd,nhe->hde", q - mean, q - mean) / q.shape[0]
    # The RoPE matrix averaged over positions n .. n+future-1 (column form: rope(x) = R x).
    angles = torch.arange(n, n + future).double()[:, None] * INV_FREQ
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    swap = torch.zeros(D, D, dtype=torch.float64)
    swap[D // 2 :, : D // 2], swap[: D // 2, D // 2 :] = torch.eye(D // 2), -torch.eye(D // 2)
    R = (cos[:, :, None] * torch.eye(D, dtype=torch.float64) + sin[:, :, None] * swap).mean(0)
    mu, sigma = mean @ R.T, R @ cov @ R.T
    k = layer.k[:, sinks:].repeat_interleave(G, dim=0)  # [Hq, n - sinks, D]
    logits = torch.einsum("hnd,hd->hn", k, mu) / math.sqrt(D) + torch.einsum("hnd,hde,hne->hn", k, sigma, k) / (2 * D)
    scores = logits.softmax(-1).view(H, G, -1).mean(1)
    scores = (scores + epsilon) * layer.v[:, sinks:].norm(dim=-1)
    picked = topk_sets(scores, per_head - sinks)
    return [sorted(list(range(sinks)) + [j + sinks for j in p]) for p in picked]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_attention_keeps_the_authors_set(seed):
    layer = Layer(n=96, seed=seed)
    assert turnkv_kept(ExpectedAttentionScorer(), layer, 40) == reference_expected_attention(layer, 40)
    assert turnkv_kept(ExpectedAttentionScorer(epsilon=0.01, compat="kvpress"), layer, 30) == \
        reference_expected_attention(layer, 30, epsilon=0.01)


def test_expected_attention_window_statistics_are_another_rule():
    layer = Layer(n=96, seed=4)
    recent = turnkv_kept(ExpectedAttentionScorer(queries="window", window=16), layer, 40)
    assert recent != reference_expected_attention(layer, 40)
    assert ExpectedAttentionScorer(queries="window").query_moments is None
    assert ExpectedAttentionScorer(sinks=2).query_moments == 2


def test_query_moments_equal_the_pre_rope_sums():
    layer = Layer(n=30, seed=8)
    recorder = QueryMoments(1, INV_FREQ, skip_below=4)
    recorder.add(0, layer.q[:13].float(), torch.arange(13))
    before = recorder.state()
    recorder.add(0, layer.q[13:].float(), torch.arange(13, 30))
    count, total, outer = recorder.layer(0)
    q = layer.q_pre[4:]
    assert float(count) == 26
    torch.testing.assert_close(total, q.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outer, torch.einsum("nhd,nhe->hde", q, q), rtol=1e-5, atol=1e-4)
    recorder.set_state(before)  # a snapshot: the later add is undone
    assert float(recorder.layer(0)[0]) == 9


# ---- Knorm and StreamingLLM: already the authors' rule ------------------------------------------------

@pytest.mark.parametrize("compat", ["authors", "kvpress"])
def test_knorm_and_streaming_llm_keep_the_authors_sets(compat):
    layer = Layer(n=40, seed=9)
    norms = -layer.k.norm(dim=-1)
    assert turnkv_kept(KnormScorer(compat=compat), layer, 15, window=1) == topk_sets(norms, 15)
    recent = [list(range(4)) + list(range(40 - 11, 40))] * 2
    assert turnkv_kept(StreamingLLMScorer(compat=compat), layer, 15, window=1) == recent


# ---- through a conversation: the moments see every query ---------------------------------------------

def test_expected_attention_moments_count_every_query_of_the_conversation(open_conv):
    from tests.methods.turn_helpers import MESSAGES, NEW, send

    conv = open_conv("expected-attention budget=24")
    moments = conv.method_state.window.moments
    assert moments is not None and moments.skip_below == 4
    for message in MESSAGES[:2]:
        send(conv, message)
        # Every position the model computed a query for, the sinks left out; the last reply token
        # is sampled but never fed.
        assert int(moments.layer(0)[0]) == conv.kv.next_position - 4
    assert len(conv.compression_log) == 2 and NEW > 1
    twin = conv.clone()
    try:
        assert int(twin.method_state.window.moments.layer(len(conv.kv.lengths) - 1)[0]) == conv.kv.next_position - 4
    finally:
        twin.close()
