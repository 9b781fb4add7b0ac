"""Multi-turn policies through real conversations: recompress (the baseline) against FlowKV isolation,
and the per-turn budget rules.

Budgets are checked by number from the compression log and the KV store: after a compression each
layer holds exactly what the turn policy's rule says among the span's positions, and nothing else moved.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.methods.turn_helpers import MESSAGES, NEW, below, dims, held, kept_positions, same, send, snapshot


# ---- turn 1: the baseline and FlowKV agree ------------------------------------------------------------
@pytest.mark.parametrize("baseline,flowkv", [
    ("snapkv budget=32", "flowkv budget=32"),
    ("ada-snapkv budget=32", "flowkv-ada-snapkv budget=32"),
    ("snapkv budget=16", "flowkv budget=16 turns=flowkv(min_size=8)"),
    ("snapkv keep_ratio=0.3", "flowkv keep_ratio=0.3 turns=flowkv(min_size=4)"),
])
def test_turn_one_is_identical_under_recompress_and_flowkv(open_conv, baseline, flowkv):
    results = []
    for recipe in (baseline, flowkv):
        conv = open_conv(recipe)
        reply = send(conv, MESSAGES[0])
        system_end = conv.turns[0].system_end
        assert system_end > 40  # the system prompt is long enough to be compressed
        (entry,) = conv.compression_log
        assert entry["span"] == [0, system_end]
        results.append((reply.token_ids, snapshot(conv.kv), entry["budget_per_layer"], entry["kept_per_head"]))
    (ids_a, kv_a, budget_a, kept_a), (ids_b, kv_b, budget_b, kept_b) = results
    assert ids_a == ids_b and len(ids_a) == NEW
    assert budget_a == budget_b and kept_a == kept_b
    assert [[len(h[2]) for h in layer] for layer in kv_a] == [[len(h[2]) for h in layer] for layer in kv_b]
    assert same(kv_a, kv_b)


def test_turn_one_is_identical_with_the_flowkv_preset_below_min_size(open_conv):
    a, b = open_conv("snapkv budget=16"), open_conv("flowkv budget=16")
    ra, rb = send(a, MESSAGES[0]), send(b, MESSAGES[0])
    assert a.compression_log[0]["budget_per_layer"] == b.compression_log[0]["budget_per_layer"]
    assert ra.token_ids == rb.token_ids
    assert same(snapshot(a.kv), snapshot(b.kv))


# ---- isolation ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["flowkv budget=16 turns=flowkv(min_size=8)", "flowkv-ada-snapkv budget=16",
                                    "flowkv keep_ratio=0.3 turns=flowkv(min_size=4,reading=query)",
                                    "flowkv budget=16 turns=flowkv(min_size=8) schedule=turn_end"])
def test_flowkv_never_touches_a_frozen_segment_again(open_conv, recipe):
    conv = open_conv(recipe)
    saved, frozen = None, 0
    system_counts = None
    for i, message in enumerate(MESSAGES):
        send(conv, message)
        snap = snapshot(conv.kv)
        if saved is not None:
            assert frozen > 0
            # K, V and positions of every token below the old frontier are bitwise what they were.
            assert same(below(snap, frozen), saved)
        frozen = conv.method_state.frozen_upto
        assert frozen == conv.compression_log[-1]["span"][1]
        saved = below(snap, frozen)
        counts = conv.segment_counts()
        assert (counts.sum(axis=0) == conv.kv.lengths).all()
        if system_counts is None:
            system_counts = counts[0]
        assert (counts[0] == system_counts).all()  # the system prompt was compressed once, at turn 1
    assert len(conv.compression_log) == len(MESSAGES)


@pytest.mark.parametrize("recipe", ["snapkv budget=16", "ada-snapkv budget=16", "snapkv keep_ratio=0.3"])
def test_recompress_rescores_old_segments(open_conv, recipe):
    conv = open_conv(recipe)
    evicted_again = 0
    previous, upto = None, 0
    for message in MESSAGES:
        send(conv, message)
        snap = snapshot(conv.kv)
        if previous is not None:
            now = kept_positions(snap, upto)
            for layer_prev, layer_now in zip(previous, now):
                for p, n in zip(layer_prev, layer_now):
                    assert n <= p  # nothing comes back
                    evicted_again += len(p - n)
        upto = conv.compression_log[-1]["span"][1]
        previous = kept_positions(snap, upto)
        assert (conv.segment_counts().sum(axis=0) == conv.kv.lengths).all()
    # Tokens that survived one compression were evicted by a later one.
    assert evicted_again > 0


# ---- the budget rules, turn by turn ---------------------------------------------------------------------
@pytest.mark.parametrize("recipe,budget,ratio", [("snapkv budget=16", 16, None), ("ada-snapkv budget=12", 12, None),
                                                 ("snapkv keep_ratio=0.3", None, 0.3)])
def test_recompress_keeps_the_target_over_the_whole_history(open_conv, recipe, budget, ratio):
    conv = open_conv(recipe)
    L, H = dims(conv)
    for t, message in enumerate(MESSAGES, start=1):
        carried = conv.kv.lengths.sum(axis=1).copy()
        send(conv, message)
        turn, entry = conv.turns[-1], conv.compression_log[-1]
        hi = turn.system_end if t == 1 else turn.start
        candidates = np.full(L, H * hi) if t == 1 else carried
        target = budget if budget is not None else math.floor(ratio * hi)
        assert entry["turn"] == t and entry["event"] == "prefill" and entry["span"] == [0, hi]
        assert entry["budget_per_layer"] == [H * target] * L
        assert (candidates > H * target).all()  # there was something to evict
        kept = held(conv, 0, hi).sum(axis=1)
        assert kept.tolist() == [H * target] * L
        current = turn.prompt_end - hi  # the current turn's prompt, uncompressed
        assert [sum(x) for x in entry["kept_per_head"]] == [H * (target + current)] * L
        assert (held(conv, hi, conv.kv.next_position) == conv.kv.next_position - hi).all()
        assert conv.kv.lengths.sum(axis=1).tolist() == [H * (target + current + NEW - 1)] * L


@pytest.mark.parametrize("recipe,budget,ratio,min_size", [
    ("flowkv budget=16 turns=flowkv(min_size=8)", 16, None, 8),
    ("flowkv budget=16", 16, None, 32),  # the floor triggers at every turn
    ("flowkv-ada-snapkv budget=24 turns=flowkv(min_size=0)", 24, None, 0),
    ("flowkv keep_ratio=0.3 turns=flowkv(min_size=4)", None, 0.3, 4),
])
def test_flowkv_gives_each_segment_what_the_frozen_ones_left(open_conv, recipe, budget, ratio, min_size):
    conv = open_conv(recipe)
    L, H = dims(conv)
    floor_hits = 0
    for t, message in enumerate(MESSAGES, start=1):
        lo = conv.method_state.frozen_upto
        frozen_before = held(conv, 0, lo).sum(axis=1) if t > 1 else np.zeros(L, np.int64)
        send(conv, message)
        turn, entry = conv.turns[-1], conv.compression_log[-1]
        hi = turn.system_end if t == 1 else turn.start
        assert entry["turn"] == t and entry["span"] == [lo, hi]
        assert lo == (0 if t == 1 else conv.turns[-2].start if t > 2 else conv.turns[0].system_end)
        target = budget if budget is not None else math.floor(ratio * hi)
        span = H * (hi - lo)
        for layer in range(L):
            share = H * target - int(frozen_before[layer])
            # The floor protects later segments only: the first is compressed as the baseline does.
            floored = frozen_before[layer] > 0 and share < H * min_size
            expected = min(span, H * min_size if floored else share)
            floor_hits += floored
            assert entry["budget_per_layer"][layer] == expected
            assert int(held(conv, lo, hi)[layer].sum()) == expected
            assert int(held(conv, 0, lo)[layer].sum()) == frozen_before[layer]  # frozen: untouched
            assert sum(entry["kept_per_head"][layer]) == frozen_before[layer] + expected + H * (turn.prompt_end - hi)
        if min_size == 0 or ratio is not None:
            # Without the floor the cache holds the global target exactly, like the budget-matched baseline.
            assert held(conv, 0, hi).sum(axis=1).tolist() == [H * target] * L
    if min_size == 32:
        assert floor_hits == L * (len(MESSAGES) - 1)  # every turn after the first hits the floor
        assert (conv.segment_counts()[2:-1] == min_size).all()  # so each later finished turn got exactly it


def test_recompress_and_flowkv_hold_the_same_amount_under_a_keep_ratio(open_conv):
    """At the end of any turn, FlowKV's cache equals the budget-matched baseline's size."""
    sizes = []
    for recipe in ("snapkv keep_ratio=0.3", "flowkv keep_ratio=0.3 turns=flowkv(min_size=4)"):
        conv = open_conv(recipe)
        for message in MESSAGES:
            send(conv, message)
        sizes.append([[sum(x) for x in e["kept_per_head"]] for e in conv.compression_log])
    assert sizes[0] == sizes[1]
    assert len(sizes[0]) == len(MESSAGES)


def test_naive_budget_rule_keeps_a_ratio_of_what_the_cache_holds(open_conv):
    r = 0.5
    naive = open_conv(f"snapkv keep_ratio={r} turns=recompress(budget_rule=naive)")
    L, H = dims(naive)
    totals = []
    for t, message in enumerate(MESSAGES, start=1):
        carried = naive.kv.lengths.sum(axis=1).copy()
        send(naive, message)
        turn, entry = naive.turns[-1], naive.compression_log[-1]
        hi = turn.system_end if t == 1 else turn.start
        candidates = [H * hi] * L if t == 1 else carried.tolist()
        expected = [int(r * c) for c in candidates]
        assert entry["span"] == [0, hi]
        assert entry["budget_per_layer"] == expected
        assert held(naive, 0, hi).sum(axis=1).tolist() == expected
        totals.append(expected[0])
        # The matched rule would keep floor(r * virtual length) per head instead.
        assert expected[0] < H * math.floor(r * hi) or t == 1
    # The naive rule shrinks the old history geometrically: below the matched target, increasingly so.
    matched = open_conv(f"snapkv keep_ratio={r}")
    for message in MESSAGES:
        send(matched, message)
    matched_totals = [e["budget_per_layer"][0] for e in matched.compression_log]
    assert totals[0] == matched_totals[0]
    gaps = [m - n for m, n in zip(matched_totals, totals)]
    assert gaps[1:] == sorted(gaps[1:]) and gaps[-1] > gaps[1] > 0


@pytest.mark.parametrize("recipe", ["snapkv budget=16", "flowkv budget=16 turns=flowkv(min_size=8)",
                                    "ada-snapkv keep_ratio=0.4", "full", "snapkv budget=12 schedule=turn_end"])
def test_segment_counts_add_up_to_what_the_store_holds(open_conv, recipe):
    conv = open_conv(recipe)
    for i, message in enumerate(MESSAGES[:3]):
        send(conv, message)
        counts = conv.segment_counts()
        L, H = dims(conv)
        assert counts.shape == (i + 2, L, H)  # the system prompt, then one segment per turn
        assert (counts.sum(axis=0) == conv.kv.lengths).all()
        assert (counts[-1] <= conv.kv.next_position - conv.turns[-1].start).all()
    if recipe == "full":
        bounds = [0, conv.turns[0].system_end] + [t.start for t in conv.turns[1:]] + [conv.kv.next_position]
        assert conv.segment_counts()[:, 0, 0].tolist() == np.diff(bounds).tolist()


def test_flowkv_query_reading_compresses_the_query_after_its_prefill(open_conv):
    conv = open_conv("flowkv budget=16 turns=flowkv(min_size=8,reading=query)")
    L, H = dims(conv)
    previous_end = 0
    for t, message in enumerate(MESSAGES, start=1):
        lo = conv.method_state.frozen_upto
        frozen_before = held(conv, 0, lo).sum(axis=1)
        send(conv, message)
        turn, entry = conv.turns[-1], conv.compression_log[-1]
        # The span ends where the prefill ended (next_position then), the query included; it starts
        # where the last one ended, so the previous reply is compressed with this query.
        assert entry["turn"] == t and entry["event"] == "prefill"
        assert entry["span"] == [previous_end, turn.prompt_end]
        assert lo == previous_end
        previous_end = turn.prompt_end
        span = H * (turn.prompt_end - lo)
        expected = [min(span, max(H * 16 - int(f), H * 8)) for f in frozen_before]
        assert entry["budget_per_layer"] == expected
        assert held(conv, lo, turn.prompt_end).sum(axis=1).tolist() == expected
        # Only the reply is whole after the turn.
        reply_len = conv.kv.next_position - turn.prompt_end
        assert reply_len == NEW - 1
        assert (held(conv, turn.prompt_end, conv.kv.next_position) == reply_len).all()
        assert [sum(x) for x in entry["kept_per_head"]] == [int(f) + e for f, e in zip(frozen_before, expected)]
    assert len(conv.compression_log) == len(MESSAGES)
