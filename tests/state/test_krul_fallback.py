"""Krul never stores a conversation by a plan that its cost model predicts to be no faster than a
baseline it can fall back to: then `load` (or `recompute`, where nothing was evicted) stores and
restores it, exactly as that baseline would, and the state manager's events say so. Where even the
plan's best case over every pairing loses, the estimator does not run at all; the best case is a
lower bound of every plan's prediction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import turnkv
from turnkv.methods.recipe import Recipe
from turnkv.state import krul, pairing, schedule
from turnkv.state.schedule import CostModel

MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?"]


def make_llm(model_dir, cost: CostModel):
    llm = turnkv.LLM(str(model_dir), device="cpu", kv_memory="64MiB")
    llm.state.ctx.set_cost("cpu", cost)
    return llm


def run(llm, recipe):
    conv = llm.conversation(system="You are terse.", recipe=recipe)
    replies = [conv.send(m, max_new_tokens=8).token_ids for m in MESSAGES]
    return conv, replies


# A fast link (load wins), slow recompute: the plan's fixed overhead alone exceeds a load.
FAST_LINK = CostModel(2e-5, 1e-9, 5e10)
# A slow link and fast recompute: recompute wins.
FAST_COMPUTE = CostModel(1e-12, 0.0, 1e3)
# A slow link and slow recompute: Krul's split balances them and wins.
BOTH_SLOW = CostModel(2e-3, 0.0, 1e5)


@pytest.fixture
def estimated(monkeypatch):
    """The number of times Krul's estimator ran."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = krul.attention_statistics
    monkeypatch.setattr(krul, "attention_statistics", counted)
    return calls


@pytest.mark.parametrize("cost,baseline", [(FAST_LINK, "load"), (FAST_COMPUTE, "recompute")])
def test_krul_falls_back_to_the_faster_baseline_and_restores_like_it(model_dir, cost, baseline, estimated):
    llm = make_llm(model_dir, cost)
    reference, want = run(llm, f"state={baseline}")
    reference.close()
    conv, got = run(llm, "state=krul(ir_threshold=0)")
    try:
        meta = llm.state.tiers.meta(conv.id)["state"]
        # No pairing could have won: the estimator never ran.
        assert meta["fallback"] == baseline and meta["selection"] == "skipped" and not estimated
        predicted = meta["predicted_s"]
        assert predicted[baseline] <= predicted["krul"] and min(predicted, key=predicted.get) == baseline
        assert got == want  # restored exactly as the baseline restores
        events = [e for e in llm.state.events if e["event"] == "state_fallback" and e["conversation"] == conv.id]
        assert len(events) == len(MESSAGES) and all(e["to"] == baseline and e["strategy"] == "krul" for e in events)
    finally:
        conv.close()


def test_krul_keeps_its_plan_when_it_predicts_a_gain(model_dir, estimated):
    llm = make_llm(model_dir, BOTH_SLOW)
    conv, _ = run(llm, "state=krul(ir_threshold=0)")
    try:
        meta = llm.state.tiers.meta(conv.id)["state"]
        assert "fallback" not in meta and "starts" in meta and meta["pairs"] and meta["selection"] == "estimated"
        assert len(estimated) == len(MESSAGES)
        assert not [e for e in llm.state.events if e["event"] == "state_fallback"]
    finally:
        conv.close()


def test_the_prediction_is_the_plan_with_its_overhead_against_each_baseline(model_dir):
    llm = make_llm(model_dir, FAST_LINK)
    ctx, c = llm.state.ctx, llm.config
    strategy = Recipe.parse("state=krul(ir_threshold=0,overhead=1.5,overhead_s=0.01)").state
    conv = llm.conversation(system="You are terse.", recipe="state=gpu")
    try:
        conv.send(MESSAGES[0], max_new_tokens=4)
        seq, n = conv.kv, conv.kv.next_position
        starts, pairs = [2] * c.num_layers, [(1, 0)]
        baseline, predicted = strategy.fallback_for(ctx, seq, starts, pairs, "cpu")
        stored = schedule.stored_bytes(starts, n, pairs, c.num_kv_heads, c.head_dim, ctx.element_size,
                                       strategy.max_retained)
        plan = max(FAST_LINK.compute_s(starts), FAST_LINK.load_s(stored))
        assert predicted["krul"] == pytest.approx(1.5 * plan + 0.01, rel=1e-5)
        full = schedule.full_bytes(n, c.num_layers, c.num_kv_heads, c.head_dim, ctx.element_size)
        assert predicted["load"] == pytest.approx(FAST_LINK.load_s(full), rel=1e-5)
        assert predicted["recompute"] == pytest.approx(FAST_LINK.compute_s(np.full(c.num_layers, n)), rel=1e-5)
        assert baseline.name == "load"
        # Under a storage cap load is no option (it stores everything); nor is recompute after eviction.
        capped = Recipe.parse("state=krul(ir_threshold=0,storage=0.5)").state
        assert "load" not in capped.fallback_for(ctx, seq, starts, pairs, "cpu")[1]
        assert Recipe.parse("state=krul(fallback=never)").state.fallback_for(ctx, seq, starts, pairs, "cpu") is None
    finally:
        conv.close()
    evicted = llm.conversation(system="You are terse.", recipe="snapkv budget=8 state=gpu")
    try:
        evicted.send(MESSAGES[0], max_new_tokens=4)
        _, predicted = Recipe.parse("state=krul(overhead_s=10)").state.fallback_for(
            ctx, evicted.kv, [0] * c.num_layers, [], "cpu")
        assert "recompute" not in predicted
    finally:
        evicted.close()


def test_options_are_checked():
    for bad in ("state=krul(fallback=always)", "state=krul(overhead=0.5)", "state=krul(overhead_s=-1)"):
        with pytest.raises(ValueError):
            Recipe.parse(bad)


# Loading is all a plan can do (recompute costs 1 s a token), and it loads what `load` does unless it
# pairs layers: the pairs decide whether the plan (at overhead 1.1) beats `load`; at overhead 3 none can.
LOAD_ONLY = CostModel(1.0, 0.0, 1e6)


@pytest.mark.parametrize("recipe,selection,fallback", [
    ("state=krul(ir_threshold=0,overhead=1.1,overhead_s=0)", "estimated", None),  # pairs: the plan wins
    ("state=krul(ir_threshold=1.01,overhead=1.1,overhead_s=0)", "estimated", "load"),  # no I-R layer: no pair
    ("state=krul(ir_threshold=0,overhead=3,overhead_s=0)", "skipped", "load"),
])
def test_the_estimator_runs_wherever_a_pairing_could_make_the_plan_win(model_dir, estimated, recipe, selection,
                                                                       fallback):
    llm = make_llm(model_dir, LOAD_ONLY)
    conv = llm.conversation(system="You are terse.", recipe=recipe)
    try:
        conv.send(MESSAGES[0], max_new_tokens=8)
        meta = llm.state.tiers.meta(conv.id)["state"]
        assert meta["selection"] == selection and meta.get("fallback") == fallback
        assert len(estimated) == (selection == "estimated")
        if fallback is not None:
            assert min(meta["predicted_s"], key=meta["predicted_s"].get) == fallback
        assert not conv.method_state.window.turn[0]  # the turn's queries are dropped either way
    finally:
        conv.close()


def test_the_best_case_bounds_every_plan_from_below():
    """Over random shapes, costs and options, and random pairings of at most max_pairs pairs: the
    plan pyramid() picks is never predicted faster than best_case_s, nor its stored bytes below the
    floor's."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        N, H, D = int(rng.integers(2, 33)), int(rng.integers(1, 9)), int(rng.choice([16, 64, 128]))
        n, es = int(rng.integers(0, 40000)), int(rng.choice([1, 2, 4]))
        ratio, retained = float(rng.choice([0.0, 0.25, 0.5, 1.0])), float(rng.choice([0.0, 0.05, 0.5, 1.0]))
        cost = CostModel(10 ** rng.uniform(-7, -4), 10 ** rng.uniform(-13, -9) * rng.integers(0, 2),
                         10 ** rng.uniform(8, 11))
        r_c = float(rng.uniform(0, 1))
        storage, mode = rng.choice([None, 0.3, 0.8]), str(rng.choice(["budget", "min_storage"]))
        k = schedule.max_pairs(N, ratio)
        best = schedule.best_case_s(n, N, k, cost, r_c, H, D, es, retained)
        deepest = [(N - 1 - 2 * m, N - 2 - 2 * m) for m in range(k)]  # the pairing that saves the most
        for pairs in [deepest] + [pairing.select_pairs(torch.rand(N) if trial % 2 else torch.ones(N), torch.rand(N, N),
                                                       float(rng.uniform(0, 0.5)), ratio) for _ in range(3)]:
            assert len(pairs) <= k
            starts = schedule.pyramid(n, N, pairs, cost, r_c, H, D, es, mode, retained_share=retained, storage=storage)
            stored = schedule.stored_bytes(starts, n, pairs, H, D, es, retained)
            assert stored >= schedule.stored_bytes_floor(starts, n, k, H, D, es, retained)
            plan = max(float(cost.compute_s(starts)), float(cost.load_s(stored)))
            assert plan >= best * (1 - 1e-12), (trial, pairs, starts)
    assert schedule.max_pairs(32, 0.5) == 8 and schedule.max_pairs(6, 0.5) == 2 and schedule.max_pairs(5, 1.0) == 2
    assert schedule.max_pairs(32, 0.0) == 0
