"""Eviction.compress evicts every layer in one pass (one read back of the counts, stacked scoring,
one allocation and one compaction for all layers). It must keep exactly what evicting one layer
at a time keeps: `layer_by_layer` below is that path, written out with the one-layer pieces, and
every scorer and allocator runs through both on uneven stores."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.evict import eviction as eviction_module
from turnkv.methods.evict.adakv import AdaKVAllocator
from turnkv.methods.evict.eviction import Eviction
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.evict.uniform import UniformAllocator
from turnkv.methods.registry import build
from turnkv.methods.turns.flowkv import FlowKVTurns
from turnkv.methods.turns.recompress import RecompressTurns
from turnkv.methods.window import QueryWindow

L, H, HQ, D, PS = 5, 2, 4, 8, 4
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))


def layer_by_layer(ev: Eviction, kv: SequenceKV, turns, lo: int, hi: int, window: QueryWindow | None) -> list:
    """The one-layer eviction: gather, budget, score, allocate, choose and compact each layer in turn."""
    budgets = []
    for layer in range(L):
        keys, values, pos = kv.gather(layer)
        S = pos.shape[1]
        valid = kv.held([layer], S, pos.device)[0]
        candidate = valid & (pos >= lo) & (pos < hi)
        n_cand = int(candidate.sum())
        target = ev.target(layer, L, hi, int(candidate.sum(dim=1).max()))
        total = turns.keep_total(H, target, int(((pos < lo) & valid).sum()), n_cand, ev.keep_ratio)
        budgets.append(total)
        if total >= n_cand:
            continue
        view = LayerView(layer=layer, num_layers=L, keys=keys, values=values, positions=pos, valid=valid,
                         queries=window.queries[layer] if window else None,
                         query_positions=window.positions[layer] if window else None,
                         attention_mass=kv.gather_attention_mass(layer), inv_freq=INV_FREQ,
                         next_position=kv.next_position, target=target)
        scores = ev.scorer.score(view).float().masked_fill(~candidate, float("-inf"))
        if int(torch.isposinf(scores).sum()) > total:
            finite_max = scores[torch.isfinite(scores)].max() if torch.isfinite(scores).any() else 0.0
            scores = torch.where(torch.isposinf(scores), finite_max + 1.0 + pos.float() * 1e-6, scores)
        counts = ev.allocator.allocate(scores, total)
        order = scores.argsort(dim=1, descending=True, stable=True)
        chosen = torch.zeros_like(candidate)
        chosen.scatter_(1, order, torch.arange(S, device=pos.device)[None] < counts.to(pos.device)[:, None])
        kv.keep_masks([layer], ((valid & ~candidate) | (chosen & candidate))[None])
    return budgets


def uneven_store(seed: int, pooled_ties: bool, device: str = "cpu") -> tuple[SequenceKV, QueryWindow]:
    """48 tokens whose first 24 were already compressed unevenly per layer and head (as after turn 1),
    with a window of the last 6 queries. pooled_ties: keys repeat in runs, so scores tie."""
    pool = PagePool(L, H, D, num_pages=L * H * 16, page_size=PS, device=device)
    seq = SequenceKV(pool)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, 48, D, generator=g) * torch.tensor([2.0, 0.5])[None, :, None, None]
    if pooled_ties:
        k = k[:, :, ::4].repeat_interleave(4, dim=2)
    k, v = k.to(device), torch.randn(L, H, 48, D, generator=g).to(device)
    slots = seq.reserve(24)
    for layer in range(L):
        pool.write(layer, slots[layer].reshape(-1), k[layer, :, :24].reshape(-1, D), v[layer, :, :24].reshape(-1, D))
    for layer in range(L):  # turn 1 kept a different share of each head in every layer
        seq.keep(layer, [torch.arange(0, 24, 1 + (layer + h) % 3) for h in range(H)])
    slots = seq.reserve(24)
    for layer in range(L):
        pool.write(layer, slots[layer].reshape(-1), k[layer, :, 24:].reshape(-1, D), v[layer, :, 24:].reshape(-1, D))
        pool.attention_mass[layer].view(-1)[slots[layer].reshape(-1)] = torch.rand(H * 24, generator=g).to(device)
    window = QueryWindow(L, 6)
    for layer in range(L):
        window.record(layer, torch.randn(6, HQ, D, generator=g).to(device), torch.arange(42, 48, device=device))
    return seq, window


def held(seq: SequenceKV) -> list:
    out = []
    for layer in range(L):
        k, v, pos = seq.gather(layer)
        out.append([(k[h, :n], v[h, :n], pos[h, :n]) for h, n in enumerate(seq.lengths[layer])])
    return out


SCORERS = ["snapkv", "snapkv pooling=max", "snapkv compat=kvpress", "pyramidkv", "knorm", "streaming_llm sinks=2",
           "tova", "h2o", "expected_attention", "random"]


@pytest.mark.parametrize("stack_tokens", [10**9, 40, 0], ids=["all-layers-stacked", "groups-of-layers", "unstacked"])
@pytest.mark.parametrize("allocator", [UniformAllocator(), AdaKVAllocator(), AdaKVAllocator(rule="kvpress", alpha=0.5)],
                         ids=["uniform", "adakv", "adakv-kvpress"])
@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("pooled_ties", [False, True], ids=["distinct", "tied"])
def test_one_pass_over_all_layers_keeps_what_layer_by_layer_keeps(scorer, allocator, stack_tokens, pooled_ties,
                                                                  monkeypatch):
    monkeypatch.setitem(eviction_module.STACK_TOKENS, "cpu", stack_tokens)
    name, *options = scorer.split()
    params = {k: int(v) if v.isdigit() else v for k, v in (o.split("=") for o in options)}
    make = lambda: build("scorer", name, params)  # noqa: E731
    for budget, turns in ((9, RecompressTurns()), (3, RecompressTurns()), (40, RecompressTurns()),
                          (6, FlowKVTurns())):
        ours, window = uneven_store(1, pooled_ties)
        ref, ref_window = uneven_store(1, pooled_ties)
        entry = Eviction(make(), allocator, budget=budget).compress(ours, turns, 24, 48, window, INV_FREQ)
        budgets = layer_by_layer(Eviction(make(), allocator, budget=budget), ref, turns, 24, 48, ref_window)
        if entry is None:  # nothing to evict in any layer: no log entry, and every token kept
            assert (ours.lengths == uneven_store(1, pooled_ties)[0].lengths).all()
        else:
            assert entry["budget_per_layer"] == budgets
        assert (ours.lengths == ref.lengths).all(), (budget, ours.lengths, ref.lengths)
        for layer_ours, layer_ref in zip(held(ours), held(ref)):
            for a, b in zip(layer_ours, layer_ref):
                assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_layer_within_its_budget_is_left_alone_while_the_others_compress():
    seq, window = uneven_store(2, False)
    before = held(seq)
    # 40 tokens per head: layers 0 and 3 kept 36 tokens of turn 1 and must drop 4 of the new 48;
    # layers 1, 2 and 4 kept 20, 32 and 20, so all 48 new ones fit.
    entry = Eviction(build("scorer", "snapkv"), AdaKVAllocator(), budget=40).compress(
        seq, RecompressTurns(), 24, 48, window, INV_FREQ)
    assert entry["budget_per_layer"] == [44, 48, 48, 44, 48]
    assert seq.lengths.sum(axis=1).tolist() == [80, 68, 80, 80, 68]
    after = held(seq)
    for layer in (1, 2, 4):
        assert all(torch.equal(x, y) for a, b in zip(after[layer], before[layer]) for x, y in zip(a, b))


class ViewsAlive:
    """A scorer that counts, at each call, how many views of earlier calls are still alive."""

    def __init__(self, inner):
        self.inner, self.refs, self.alive = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score(self, view):
        gc.collect()
        self.alive.append(sum(ref() is not None for ref in self.refs))
        self.refs.append(weakref.ref(view.keys))
        return self.inner.score(view)


@pytest.mark.parametrize("stack_tokens", [0, 100], ids=["unstacked", "groups"])
def test_each_group_of_gathered_keys_is_freed_before_the_next_is_gathered(stack_tokens, monkeypatch):
    # On a full GPU the transient memory of a pass must be one group's K/V, not every layer's.
    monkeypatch.setitem(eviction_module.STACK_TOKENS, "cpu", stack_tokens)
    seq, window = uneven_store(3, False)
    scorer = ViewsAlive(build("scorer", "snapkv"))
    Eviction(scorer, AdaKVAllocator(), budget=9).compress(seq, RecompressTurns(), 24, 48, window, INV_FREQ)
    assert len(scorer.alive) == (L if stack_tokens == 0 else 3) and scorer.alive == [0] * len(scorer.alive)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("allocator", [UniformAllocator(), AdaKVAllocator()], ids=["uniform", "adakv"])
@pytest.mark.parametrize("scorer", ["snapkv", "pyramidkv", "knorm", "streaming_llm sinks=2", "h2o"])
def test_one_pass_on_a_gpu_keeps_what_layer_by_layer_keeps(scorer, allocator):
    name, *options = scorer.split()
    params = {k: int(v) for k, v in (o.split("=") for o in options)}
    for budget in (9, 3, 40):
        ours, window = uneven_store(1, False, "cuda")
        ref, ref_window = uneven_store(1, False, "cuda")
        entry = Eviction(build("scorer", name, params), allocator, budget=budget).compress(
            ours, RecompressTurns(), 24, 48, window, INV_FREQ.cuda())
        budgets = layer_by_layer(Eviction(build("scorer", name, params), allocator, budget=budget), ref,
                                 RecompressTurns(), 24, 48, ref_window)
        assert entry["budget_per_layer"] == budgets and (ours.lengths == ref.lengths).all()
        for layer_ours, layer_ref in zip(held(ours), held(ref)):
            for a, b in zip(layer_ours, layer_ref):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
