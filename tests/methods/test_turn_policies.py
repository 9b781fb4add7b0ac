"""Multi-turn policies through real conversations: recompress (the baseline) against FlowKV isolation,
the per-turn budget rules, the four schedules, memory, and one-shot generation with a recipe.

Budgets are checked by number from the compression log and the KV store: after a compression each
layer holds exactly what the turn policy's rule says among the span's positions, and nothing else moved.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turnkv.errors import InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe, presets

SYSTEM = ("You are a helpful assistant who answers questions about geography, rivers, mountains and oceans "
          "with short precise sentences, careful facts, friendly tone, and a clear structure for students "
          "of every age.")
MESSAGES = [
    "Tell me about the longest rivers on each continent and why they matter to people living nearby.",
    "Now describe the tallest mountains, who first climbed them, and what the weather is like at the top.",
    "Which oceans are deepest, and what strange animals live down in the dark trenches far below?",
    "Summarise everything so far in three short bullet points for a school report.",
]
CONTEXT = ("The Amazon river flows through Brazil, Peru and Colombia. The Nile crosses eleven countries in Africa. "
           "The Yangtze is the longest river in Asia, and the Mississippi drains much of North America. "
           "Mount Everest rises on the border of Nepal and China, while Aconcagua is the highest peak in the Andes.")
NEW = 8  # tokens per reply; ignore_eos keeps every reply exactly this long


@pytest.fixture
def open_conv(chat_llm):
    """conversation(...) that is closed after the test, so the shared pool stays clean."""
    opened = []

    def make(recipe, system=SYSTEM):
        conv = chat_llm.conversation(system=system, recipe=recipe)
        opened.append(conv)
        return conv

    used = chat_llm.pool.bytes_in_use()
    yield make
    for conv in opened:
        conv.close()
    assert chat_llm.pool.bytes_in_use() == used


def dims(conv):
    return conv.llm.config.num_layers, conv.llm.config.num_kv_heads


def held(conv, lo, hi) -> np.ndarray:
    """[layers, heads] tokens held with positions in [lo, hi)."""
    L, _ = dims(conv)
    return np.stack([conv.kv.count_positions(layer, lo, hi) for layer in range(L)])


def snapshot(kv: SequenceKV):
    """Per layer and head: (K, V, positions) of the held tokens, copied."""
    out = []
    for layer in range(kv.lengths.shape[0]):
        k, v, pos = kv.gather(layer)
        out.append([(k[h, :n].clone(), v[h, :n].clone(), pos[h, :n].clone()) for h, n in enumerate(kv.lengths[layer])])
    return out


def below(snap, upto):
    """The entries of a snapshot whose position is < upto."""
    return [[tuple(t[h[2] < upto] for t in h) for h in layer] for layer in snap]


def same(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y)
               for la, lb in zip(a, b) for ha, hb in zip(la, lb) for x, y in zip(ha, hb))


def kept_positions(snap, upto):
    return [[set(h[2][h[2] < upto].tolist()) for h in layer] for layer in snap]


def send(conv, message, **kw):
    return conv.send(message, max_new_tokens=NEW, ignore_eos=True, **kw)


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


# ---- schedules ------------------------------------------------------------------------------------------
def test_context_schedule_compresses_the_context_before_the_question(open_conv, chat_llm):
    B = 12
    conv = open_conv(f"snapkv budget={B} schedule=context")
    L, H = dims(conv)
    decode = chat_llm.tokenizer.decode
    question = "Which river is the longest in Asia?"
    send(conv, question, context=CONTEXT)
    turn, (entry,) = conv.turns[-1], conv.compression_log
    assert entry["event"] == "context" and entry["turn"] == 1
    lo, hi = entry["span"]
    assert lo == 0 and 0 < hi < turn.prompt_end
    # The span ends exactly where the context's tokens end, and the question follows.
    assert decode(conv.tokens[:hi]).endswith(CONTEXT)
    assert decode(conv.tokens[hi:turn.prompt_end]).startswith("\n\n" + question)
    assert entry["budget_per_layer"] == [H * B] * L
    assert held(conv, 0, hi).sum(axis=1).tolist() == [H * B] * L
    # Every question token (and the reply) is kept: the compression happened before they were prefilled.
    assert (held(conv, hi, conv.kv.next_position) == conv.kv.next_position - hi).all()
    assert [sum(x) for x in entry["kept_per_head"]] == [H * B] * L  # nothing after the context existed yet

    send(conv, "And in Africa?")  # no context, no compression
    assert len(conv.compression_log) == 1
    volga = "The Volga is the longest river of Europe and flows into the Caspian Sea near Astrakhan in Russia."
    send(conv, "And in Europe?", context=volga)
    turn, entry = conv.turns[-1], conv.compression_log[-1]
    assert len(conv.compression_log) == 2 and entry["turn"] == 3 and entry["event"] == "context"
    hi = entry["span"][1]
    assert turn.start < hi < turn.prompt_end and decode(conv.tokens[:hi]).endswith(volga)
    assert held(conv, 0, hi).sum(axis=1).tolist() == [H * B] * L
    assert (held(conv, hi, turn.prompt_end) == turn.prompt_end - hi).all()


def test_turn_end_schedule_leaves_the_history_at_the_budget(open_conv):
    B = 12
    conv = open_conv(f"snapkv budget={B} schedule=turn_end")
    L, H = dims(conv)
    for t, message in enumerate(MESSAGES[:3], start=1):
        send(conv, message)
        turn, entry = conv.turns[-1], conv.compression_log[-1]
        assert len(conv.compression_log) == t  # once per turn, after the reply
        assert entry["event"] == "turn_end" and entry["turn"] == t
        assert entry["span"] == [0, conv.kv.next_position]
        assert conv.kv.next_position == turn.end - 1  # the reply's last token is fed with the next turn
        # The next turn starts from exactly the budget.
        assert (conv.kv.lengths == B).all()
        assert entry["kept_per_head"] == [[B] * H] * L
    # The next prompt is prefilled on top of the budget, whole.
    before = conv.kv.next_position
    it = conv.stream(MESSAGES[3], max_new_tokens=NEW, ignore_eos=True)
    next(it)
    assert (conv.kv.lengths == B + conv.kv.next_position - before).all()
    for _ in it:
        pass
    assert (conv.kv.lengths == B).all()


@pytest.mark.parametrize("every,new", [(3, 10), (4, 12), (5, 7)])
def test_decode_schedule_compresses_every_n_generated_tokens(open_conv, every, new):
    B = 12
    conv = open_conv(f"snapkv budget={B} schedule=decode every={every}")
    L, H = dims(conv)
    steps = 0
    for t, message in enumerate(MESSAGES[:2], start=1):
        conv.send(message, max_new_tokens=new, ignore_eos=True)
        assert len(conv.last_reply.token_ids) == new
        steps += new - 1  # the last token is sampled but not fed
        log = conv.compression_log
        # The counter runs across turns: one compression per `every` decode steps so far.
        assert len(log) == steps // every
        for entry in log:
            assert entry["event"] == "decode"
            assert entry["budget_per_layer"] == [H * B] * L
            assert entry["kept_per_head"] == [[B] * H] * L  # everything, prompt included, back to the budget
        mine = [e for e in log if e["turn"] == t]
        ends = [e["span"][1] for e in mine]
        assert all(e["span"][0] == 0 for e in mine)
        assert all(b - a == every for a, b in zip(ends, ends[1:]))
        assert conv.method_state.since_compression == steps % every
        assert (conv.kv.lengths == B + steps % every).all()
        if mine:
            assert conv.kv.next_position - ends[-1] == steps % every


# ---- memory ---------------------------------------------------------------------------------------------
def test_ada_snapkv_memory_stays_bounded_while_full_grows(open_conv, chat_llm):
    B = 12
    pool = chat_llm.pool
    ps, page = pool.page_size, pool.page_bytes
    ada, full = open_conv(f"ada-snapkv budget={B}"), open_conv("full")
    L, H = dims(ada)

    def bound(tokens_per_head):  # pages for H * tokens tokens spread over H heads, worst case
        return L * ((H * tokens_per_head + H * (ps - 1)) // ps) * page

    full_bytes, uneven = [], 0
    for message in MESSAGES:
        send(ada, message)
        send(full, message)
        turn, entry = ada.turns[-1], ada.compression_log[-1]
        hi = entry["span"][1]
        current = turn.prompt_end - hi
        assert [sum(x) for x in entry["kept_per_head"]] == [H * (B + current)] * L
        assert entry["kv_bytes"] <= bound(B + current)
        assert ada.kv_bytes <= bound(B + current + NEW - 1)
        assert ada.kv_bytes == int(ada.kv.num_pages.sum()) * page
        uneven += sum(len(set(heads)) > 1 for heads in entry["kept_per_head"])
        full_bytes.append(full.kv_bytes)
        assert full.kv_bytes == L * H * -(-full.kv.next_position // ps) * page
    assert ada.kv_bytes < full.kv_bytes
    assert full_bytes == sorted(full_bytes) and full_bytes[-1] >= 2 * full_bytes[0]
    assert uneven > 0  # Ada-KV gave the heads of some layer different counts


# ---- one-shot generation --------------------------------------------------------------------------------
def test_generate_compresses_the_prompt(chat_llm):
    prompt = SYSTEM + " " + MESSAGES[0] + " " + MESSAGES[1]
    ids = chat_llm.encode(prompt)
    L, H = chat_llm.config.num_layers, chat_llm.config.num_kv_heads
    B, n = 8, 7
    used = chat_llm.pool.bytes_in_use()
    full = chat_llm.generate(prompt, max_new_tokens=n, ignore_eos=True)
    assert full.kv_tokens == L * H * (len(ids) + n - 1)
    for recipe in (f"snapkv budget={B}", f"evict=snapkv(window=4) budget={B}", Recipe.parse(f"ada-snapkv budget={B}")):
        reply = chat_llm.generate(prompt, recipe=recipe, max_new_tokens=n, ignore_eos=True)
        assert reply.completion_tokens == n == len(reply.token_ids) and reply.finish_reason == "length"
        assert reply.prompt_tokens == len(ids) > B
        assert reply.kv_tokens == L * H * (B + n - 1)  # the prompt was cut to the budget, then n - 1 fed
        assert reply.kv_bytes < full.kv_bytes
        assert chat_llm.pool.bytes_in_use() == used

    # Question-aware: the same steps by hand keep the prompt's last window and give the same tokens.
    recipe = Recipe.parse(f"evict=snapkv(window=4) budget={B}")
    auto = chat_llm.generate(prompt, recipe=recipe, max_new_tokens=n, ignore_eos=True)
    seq, st = SequenceKV(chat_llm.pool), recipe.new_state(L)
    try:
        logits = chat_llm.runner.prefill(seq, ids, context=st.context)
        recipe.after_prompt(seq, st, len(ids), chat_llm.model.inv_freq, turn=1)
        assert st.log[0]["span"] == [0, len(ids)]
        for layer in range(L):
            _, _, pos = seq.gather(layer)
            for h in range(H):
                kept = pos[h, : seq.lengths[layer, h]].tolist()
                assert len(kept) == B and kept[-4:] == list(range(len(ids) - 4, len(ids)))
        out = [int(logits.argmax())]
        while len(out) < n:
            out.append(int(chat_llm.runner.decode([seq], torch.tensor([out[-1]]), [st.context])[0].argmax()))
    finally:
        seq.free()
    assert auto.token_ids == out

    # A batch: each prompt is compressed on its own; a prompt under the budget is left whole.
    short = "Hi there."
    short_len = len(chat_llm.encode(short))
    assert short_len < B
    replies = chat_llm.generate([prompt, MESSAGES[2], short], recipe=f"snapkv budget={B}", max_new_tokens=5,
                                ignore_eos=True)
    assert [r.kv_tokens for r in replies] == [L * H * (B + 4), L * H * (B + 4), L * H * (short_len + 4)]
    assert chat_llm.pool.bytes_in_use() == used


# ---- recipes reach the conversation ---------------------------------------------------------------------
def test_every_preset_runs_a_turn_at_its_budget(open_conv):
    B = 8
    for name, recipe in presets().items():
        spec = f"{name} budget={B}" if recipe.evict is not None else name
        if recipe.static_sparsity is not None:  # the default pattern is SmolLM2's; the tiny model needs its own
            spec += " prefill=streaming_heads(pattern=random)"
        conv = open_conv(spec)
        L, H = dims(conv)
        reply = send(conv, MESSAGES[0])
        assert len(reply.token_ids) == NEW
        system_end = conv.turns[0].system_end
        if recipe.evict is None:
            assert conv.compression_log == []
            assert (conv.kv.lengths == conv.kv.next_position).all()
            continue
        (entry,) = conv.compression_log
        expected = H * B  # turn 1: FlowKV compresses the first segment exactly as the baseline does
        assert entry["span"] == [0, system_end], name
        assert entry["budget_per_layer"] == [expected] * L, name
        assert held(conv, 0, system_end).sum(axis=1).tolist() == [expected] * L, name
        assert (held(conv, system_end, conv.kv.next_position) == conv.kv.next_position - system_end).all(), name


def test_a_recipe_file_or_object_drives_the_conversation(open_conv, chat_llm, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("preset: ada-snapkv\nbudget: 10\nschedule: turn_end\n")
    for recipe in (str(path), Recipe.from_file(path)):
        conv = open_conv(recipe)
        assert conv.recipe == Recipe.parse("ada-snapkv budget=10 schedule=turn_end")
        send(conv, MESSAGES[0])
        assert conv.kv.lengths.sum(axis=1).tolist() == [2 * 10] * chat_llm.config.num_layers
    with pytest.raises(InvalidRequestError, match="a recipe is a Recipe, a string or a file path"):
        chat_llm.conversation(recipe=3)
    with pytest.raises(InvalidRequestError, match="flowkv keeps the running turn whole"):
        chat_llm.conversation(recipe="flowkv schedule=decode")


# ---- rollback and FlowKV's frontier (known bugs) -------------------------------------------------------
def test_flowkv_frontier_follows_an_abandoned_turn(open_conv):
    conv = open_conv("flowkv budget=16 turns=flowkv(min_size=8,reading=query)")
    send(conv, MESSAGES[0])
    it = conv.stream(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True)
    next(it)
    it.close()  # abandoned: the turn is undone (what it evicted stays evicted)
    assert len(conv.turns) == 1 and len(conv.compression_log) == 2
    send(conv, MESSAGES[2])
    turn = conv.turns[-1]
    # The new query must be compressed right after its prefill, as in every other turn.
    assert len(conv.compression_log) == 3
    entry = conv.compression_log[-1]
    assert entry["span"][1] == turn.prompt_end
    assert entry["span"][0] <= turn.start  # every token of the new prompt was a candidate
    assert conv.method_state.frozen_upto <= conv.kv.next_position


def test_flowkv_segment_reading_after_an_abandoned_turn(open_conv):
    """Reading A: the abandoned turn already compressed (and froze) the previous segment; the retry
    compresses nothing new, and the turn after it starts exactly where the KV was rolled back to."""
    conv = open_conv("flowkv budget=16 turns=flowkv(min_size=8)")
    send(conv, MESSAGES[0])
    cached = conv.kv.next_position
    it = conv.stream(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True)
    next(it)
    it.close()
    assert conv.kv.next_position == cached == conv.method_state.frozen_upto
    system_end = conv.turns[0].system_end
    assert [e["span"] for e in conv.compression_log] == [[0, system_end], [system_end, cached]]
    kept = held(conv, 0, cached)
    send(conv, MESSAGES[2])
    assert len(conv.compression_log) == 2 and conv.turns[-1].start == cached
    assert (held(conv, 0, cached) == kept).all()
    send(conv, MESSAGES[3])
    assert conv.compression_log[-1]["span"] == [cached, conv.turns[-1].start]


def test_flowkv_frontier_follows_a_template_rollback(open_conv, chat_llm):
    recipe = "flowkv budget=16 turns=flowkv(min_size=8) schedule=turn_end"
    probe = open_conv(recipe)
    pieces = [chat_llm.tokenizer.decode([t]) for t in send(probe, MESSAGES[0]).token_ids]
    text = "".join(pieces)
    # A stop string made of the end of one token and the start of the next: the first token was fed,
    # so the template rolls it back at the next turn.
    k = next(i for i in range(1, NEW - 1) if pieces[i].strip() and pieces[i + 1].strip()
             and text.find(pieces[i][-1] + pieces[i + 1][0]) == len("".join(pieces[: i + 1])) - 1)
    stop = pieces[k][-1] + pieces[k + 1][0]
    conv = open_conv(recipe)
    conv.send(MESSAGES[0], max_new_tokens=NEW, stop=[stop])
    assert conv.last_reply.finish_reason == "stop"
    frontier = conv.method_state.frozen_upto
    send(conv, MESSAGES[1])
    turn = conv.turns[-1]
    assert turn.start < frontier  # the rollback reached below the frontier
    assert conv.compression_log[-1]["span"] == [turn.start, conv.kv.next_position]
