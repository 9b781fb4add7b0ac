"""One contract over every registered component of every axis (turnkv.methods.registry, not the
presets): each builds with its defaults, derives from its kind's interface (turnkv.methods.protocols)
without an abstract hook left, and its main hook answers a tiny input as its interface says."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import weakref

import pytest
import torch

import turnkv
from turnkv.attention import lines, reference
from turnkv.engine.step import Step
from turnkv.kv.pool import PagePool
from turnkv.kv.sequence import SequenceKV
from turnkv.methods import registry
from turnkv.methods.evict.layer_view import LayerView
from turnkv.methods.protocols import DecodeSelection, Scorer, StateStrategy, WriteWatcher
from turnkv.methods.step_context import StepContext
from turnkv.methods.window import QueryWindow
from turnkv.state.schedule import CostModel

COMPONENTS = [(kind, name) for kind, names in registry.REGISTRY.items() for name in sorted(names)]
# The default streaming-heads pattern is SmolLM2-135M's, so the prefill input has its layout.
SMOL_LAYERS, SMOL_KV_HEADS, SMOL_GROUP = 30, 3, 3


def test_the_registry_covers_the_four_axes():
    assert registry.AXES == ("prefill", "eviction", "decode", "state")
    assert [axis for axis, _ in registry.KINDS.values()] == ["prefill", "eviction", "eviction", "eviction", "decode",
                                                            "state"]
    assert all(registry.REGISTRY[kind] for kind in registry.KINDS)


def test_the_registry_refuses_a_duplicate_name_or_a_class_off_its_interface():
    with pytest.raises(ValueError, match="scorer 'snapkv' is already registered by .*SnapKVScorer"):
        @registry.register("scorer", "snapkv")
        @dataclasses.dataclass
        class Another(Scorer):
            def score(self, view):
                return view.positions.float()
    with pytest.raises(TypeError, match="must derive from Allocator"):
        @registry.register("allocator", "not_an_allocator")
        @dataclasses.dataclass
        class NotAnAllocator:
            pass
    with pytest.raises(ValueError, match="unknown component kind"):
        registry.register("evict", "x")
    assert "not_an_allocator" not in registry.REGISTRY["allocator"]
    assert registry.REGISTRY["scorer"]["snapkv"].__name__ == "SnapKVScorer"


@pytest.mark.parametrize("kind,name", COMPONENTS)
def test_builds_with_defaults_and_keeps_its_contract(kind, name, request):
    component = registry.build(kind, name)
    interface = registry.KINDS[kind][1]
    assert isinstance(component, interface) and component.name == name
    assert not inspect.isabstract(type(component))
    assert (inspect.getdoc(type(component)) or "").strip()
    HOOKS[kind](component, request)


# ---- prefill: attend one chunk -----------------------------------------------------------------------
def tiny_keys(T=10, history=6, D=16, seed=0) -> lines.Keys:
    gen = torch.Generator().manual_seed(seed)
    S, H = history + T, SMOL_KV_HEADS
    q = torch.randn(1, H * SMOL_GROUP, T, D, generator=gen)
    k, v = torch.randn(1, H, S, D, generator=gen), torch.randn(1, H, S, D, generator=gen)
    return lines.Keys(q, k, v, (history + torch.arange(T))[None], torch.arange(S).expand(1, H, S), None, history, S)


def check_prefill(prefill, request):
    prefill.bind(SMOL_LAYERS)
    keys = tiny_keys()
    out, stats = prefill.attend(0, keys)
    assert out.shape == keys.q.shape and out.dtype == keys.q.dtype and torch.isfinite(out).all()
    assert stats["layer"] == 0
    computed, causal = stats["computed"], stats["causal"]
    assert computed.shape == causal.shape and bool((computed <= causal).all())
    if bool((computed == causal).all()):  # every causal cell: exactly dense attention
        dense = reference.attention(keys.q, keys.k, keys.v, keys.visible())
        torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


# ---- eviction: score a layer, split a budget, bound a span ---------------------------------------------
def tiny_view(scorer, H=2, S=20, D=16, seed=0) -> LayerView:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([S, S - 5])
    valid = torch.arange(S) < lengths[:, None]
    W = max(scorer.window, 1)
    window = scorer.window > 0
    return LayerView(layer=1, num_layers=2, keys=torch.randn(H, S, D, generator=gen),
                     values=torch.randn(H, S, D, generator=gen), positions=torch.arange(S).expand(H, S).clone(),
                     valid=valid, queries=torch.randn(W, 2 * H, D, generator=gen) if window else None,
                     query_positions=torch.arange(S - W, S) if window else None,
                     attention_mass=torch.rand(H, S, generator=gen) if scorer.accumulates_attention else None,
                     inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2).double() / D)), next_position=S, target=8)


def check_scorer(scorer, request):
    view = tiny_view(scorer)
    scores = scorer.score(view)
    assert scores.shape == view.positions.shape and scores.is_floating_point()
    assert not torch.isnan(scores[view.valid]).any()
    target = scorer.layer_target(8, 1, 2, 20)
    assert isinstance(target, int) and target >= 1
    if scorer.stacks_layers:  # two layers' rows in one view score as each layer alone
        other = tiny_view(scorer, seed=1)
        stacked = dataclasses.replace(
            view, keys=torch.cat([view.keys, other.keys]), values=torch.cat([view.values, other.values]),
            positions=torch.cat([view.positions, other.positions]), valid=torch.cat([view.valid, other.valid]),
            queries=None if view.queries is None else torch.cat([view.queries, other.queries], dim=1), target=0)
        both = scorer.score(stacked)
        for rows, alone in ((both[:2], scores), (both[2:], scorer.score(other))):
            assert torch.equal(rows[view.valid], alone[view.valid])


def check_allocator(allocator, request):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 12, generator=gen)
    scores[0, :2] = float("inf")  # must stay
    scores[1, 9:] = float("-inf")  # not candidates
    protected, capacity = torch.isposinf(scores).sum(1), (~torch.isneginf(scores)).sum(1)
    for total in (2, 7, 20, 100):
        counts = allocator.allocate(scores, total)
        assert counts.shape == (3,) and not counts.is_floating_point()
        assert int(counts.sum()) == min(total, int(capacity.sum()))
        assert bool((counts >= protected).all() and (counts <= capacity).all())
    # Several layers in one call: each layer's counts are what it gets alone.
    layers = torch.stack([scores, torch.rand(3, 12, generator=gen), scores.flip(1)])
    together = allocator.allocate_layers(layers, [7, 20, 5])
    assert together.shape == (3, 3)
    assert [row.tolist() for row in together] == [allocator.allocate(x, t).tolist() for x, t in zip(layers, (7, 20, 5))]


def check_turns(turns, request):
    assert 0 <= turns.span_start(10) <= 10
    assert 20 <= turns.span_end(20, 30) <= 30
    for kept_before in (0, 4):
        for keep_ratio in (None, 0.5):
            assert 0 <= turns.keep_total(2, 8, kept_before, 30, keep_ratio) <= 30


# ---- decode: a prefill and decode steps through the engine's Step --------------------------------------
def check_decode(decode, request, L=2, H=2, Hq=4, D=16, T=12, steps=3):
    sel = decode.new_state(L)
    if not decode.selects:
        assert sel is None
        return
    assert isinstance(sel, DecodeSelection)
    config = sel.graph_config()
    assert config is None or (isinstance(config[0], str) and dataclasses.is_dataclass(config[1]))
    gen = torch.Generator().manual_seed(0)
    pools = [PagePool(L, H, D, 16, page_size=16) for _ in range(2)]  # the default page size
    seqs = [SequenceKV(pool) for pool in pools]
    for n, new in enumerate([T] + [1] * steps):
        start = seqs[0].next_position
        fused = torch.randn(1, new, Hq + 2 * H, D, generator=gen)  # one projection output, as the model's
        q, k, v = fused.split([Hq, H, H], dim=2)
        outs = []
        for pool, seq, selectors in zip(pools, seqs, ([sel], None)):  # the selection, then every kept token
            step = Step(pool, [seq], [seq.reserve(new)], (start + torch.arange(new))[None],
                        contexts=[StepContext(selector=selectors[0] if selectors else None)], decoding=n > 0)
            outs.append(torch.stack([step.attention(layer, q, k, v) for layer in range(L)]))
        if n == 0:  # a view of the chunk's rows would hold its whole projection output alive
            chunk = weakref.ref(fused)
            del fused, q, k, v, step
            gc.collect()
            assert chunk() is None, "the selection keeps a view of a prefill chunk's activations"
        # Within its default budget (or warm-up) a selection reads every kept token.
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert sel.steps == steps and sel.ticks == steps + 1
    for layer in range(L):
        picked = sel.entries(layer, seqs[0])
        if picked is not None:
            entries, counts = picked
            assert entries.shape[0] in (H, Hq) and len(counts) == entries.shape[0]
    if isinstance(sel, WriteWatcher):
        slots = seqs[0].reserve(1)[0].reshape(-1)
        sel.written(0, seqs[0], slots, torch.randn(1, H, D, generator=gen))  # one token per head
        seqs[0].unreserve(1)
    # A step launched after the generation's last token is undone in the selection's state.
    position = seqs[0].next_position - 1
    seqs[0].unreserve(1)
    sel.discard_step(seqs[0], position)
    assert sel.steps == steps - 1


# ---- state: two turns of a conversation that stores and restores its KV between them -------------------
@pytest.fixture(scope="module")
def state_llm(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    for tier in ("cpu", "disk"):  # fixed costs instead of a calibration
        llm.state.ctx.set_cost(tier, CostModel(2e-6, 1e-9, 5e8))
    return llm


def check_state(strategy, request):
    assert isinstance(strategy, StateStrategy) and isinstance(strategy.offloads_between_turns, bool)
    window = strategy.query_window(2, 4)
    assert isinstance(window, QueryWindow) and window.size == 4
    llm = request.getfixturevalue("state_llm")
    conv = llm.conversation(recipe=f"state={strategy.name}")
    try:
        first = conv.send("Hello there.", max_new_tokens=3, ignore_eos=True)
        assert conv.location == ("cpu" if strategy.offloads_between_turns else "gpu")
        second = conv.send("And again?", max_new_tokens=3, ignore_eos=True)
        assert len(first.token_ids) == len(second.token_ids) == 3
    finally:
        conv.close()


HOOKS = {"prefill": check_prefill, "scorer": check_scorer, "allocator": check_allocator, "turns": check_turns,
         "decode": check_decode, "state": check_state}
