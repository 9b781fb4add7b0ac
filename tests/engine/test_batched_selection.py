"""Eager decode steps select once per layer for the conversations whose page selections can share it
(engine/selection.py, PagedSelection.entries_batch): the same tokens, logits, slot tables and
selection states as each conversation selecting alone, and one PageSelector.select call per layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnkv.attention import decode as decode_module
from turnkv.engine import decode_loop, selection
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.methods.lserve.decode import PagedSelection
from turnkv.methods.lserve.selector import PageSelector

# With pages_budget 3: LServe (32-token pages) selects past 96 tokens, Quest (16-token pages) past 48.
LSERVE = "decode=lserve(budget=64,physical_page=32,reuse=3)"
LSERVE_MAX = "decode=lserve(budget=64,physical_page=32,reuse=2,group=max)"
QUEST = "decode=quest(budget=32,dense_layers=1)"
QUEST_EVICTED = "snapkv budget=80 decode=quest(budget=32,dense_layers=1)"  # its heads moved: a rebuild


def run_batch(llm, recipes: list[str], lengths: list[int], new: int):
    """One raw prompt of `lengths[i]` random tokens per recipe, prefilled, then decoded together (one
    eager decode step per token for the whole batch) -> [(token ids, logprobs [new, V])]."""
    gen = torch.Generator().manual_seed(0)
    params = llm.turn_parts.sampling_params(max_new_tokens=new, ignore_eos=True)
    convs = [Conversation(llm, None, llm.resolve_recipe(recipe)) for recipe in recipes]
    try:
        turns = []
        for conv, n in zip(convs, lengths):
            ids = torch.randint(100, 2000, (n,), generator=gen).tolist()
            generation = llm.turn_parts.new_generation(conv.kv, params, keep_logprobs=True)
            turns.append(TurnRun(conv, TurnInput(0, ids, segment_end=n), generation).begin())
        for turn in turns:
            turn.take(turn.prefill())
        for _ in decode_loop.decode(llm, turns):
            pass
        return [(r.token_ids, r.logprobs) for r in (turn.finish() for turn in turns)]
    finally:
        for conv in convs:
            conv.close()


def per_sequence(monkeypatch):
    """Every page selection answers alone (its own select call per layer)."""
    monkeypatch.setattr(PagedSelection, "batch_key", lambda self, layer, seq: None)


def reference_slots(step, layer: int, picks: dict, Hq: int):
    """Reference: each sequence's entries (or, without a pick, 0..its longest head) through its own
    page table, one sequence at a time -> (slots per sequence [rows, W_b], counts [B, rows], width)."""
    pool = step.pool
    H, ps = pool.num_kv_heads, pool.page_size
    rows = Hq if any(p is not None and p[0].shape[0] == Hq for p in picks.values()) else H
    slots, counts = [], []
    for seq in step.seqs:
        pick = picks.get(id(seq))
        lengths = seq.lengths[layer]
        if pick is None:
            entries = torch.arange(int(lengths.max()), device=pool.device).expand(H, -1)
            count = lengths
        else:
            entries, count = pick
        entries = entries.repeat_interleave(rows // entries.shape[0], dim=0)
        count = np.repeat(count, rows // len(count))
        table = seq.device_table()[layer][torch.arange(rows, device=pool.device) // (rows // H)]
        pages = table.gather(1, (entries // ps).clamp_max(table.shape[1] - 1))
        slots.append(pages * ps + entries % ps)
        counts.append(count)
    return slots, np.stack(counts), max(s.shape[1] for s in slots)


def selection_states(step, layer: int) -> list[tuple]:
    """A copy of each selection's state in `layer` after the step's tables: chosen pages, age, page
    counts, selections made, and its statistics' sync marks."""
    out = []
    for sel in step.selectors:
        st = sel.state
        chosen = st.chosen[layer]
        out.append((layer, None if chosen is None else chosen.clone(), st.age[layer],
                    None if st.num_pages[layer] is None else st.num_pages[layer].copy(), st.selections[layer],
                    bool(sel._synced_ok[layer]), sel._synced_moves[layer].copy()))
    return out


def record(monkeypatch, check_reference: bool):
    """Spies: every indexed_decode call (of slot tables, the positions each row reads, -1 past its count;
    the pool's slots differ from run to run) and, after every
    selection.tables call, each selection's state of that layer. check_reference: also compare each
    slot table to reference_slots over the picks `entries` gave (the per-sequence path)."""
    calls, states, picks = [], [], {}
    real_decode, real_tables, real_entries = decode_module.indexed_decode, selection.tables, PagedSelection.entries

    def spy_decode(q, k_cache, v_cache, table, lengths, *args, **kwargs):
        slot = k_cache.shape[1] == 1
        seen = None
        if slot:
            seen = kwargs["key_positions"].view(-1)[table.long()]
            seen = seen.masked_fill(torch.arange(table.shape[2], device=table.device) >= lengths[..., None], -1)
        calls.append((slot, seen, lengths.clone()))
        return real_decode(q, k_cache, v_cache, table, lengths, *args, **kwargs)

    def spy_entries(self, layer, seq):
        pick = real_entries(self, layer, seq)
        picks[id(seq)] = pick
        return pick

    def spy_tables(step, layer, q):
        picks.clear()
        out = real_tables(step, layer, q)
        if check_reference and out is not None:
            table, lengths, _ = out
            slots, counts, width = reference_slots(step, layer, picks, q.shape[1])
            assert table.shape[2] == width and np.array_equal(lengths.cpu().numpy(), counts)
            for b, s in enumerate(slots):
                for r, n in enumerate(counts[b]):
                    assert torch.equal(table[b, r, :n].long(), s[r, :n])
        states.extend(selection_states(step, layer))
        return out

    monkeypatch.setattr(decode_module, "indexed_decode", spy_decode)
    monkeypatch.setattr(selection, "tables", spy_tables)
    monkeypatch.setattr(PagedSelection, "entries", spy_entries)
    return calls, states


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor):
                assert u.shape == v.shape and torch.equal(u, v)
            elif isinstance(u, np.ndarray):
                assert np.array_equal(u, v)
            else:
                assert u == v


@pytest.fixture
def streaming_lserve(tmp_path):
    from turnkv.methods.lserve.pattern import HeadPattern

    path = tmp_path / "pattern.json"
    HeadPattern(np.array([[True, False], [False, True]])).save_json(path)  # one streaming head per layer
    return f"lserve prefill=streaming_heads(pattern={path},sink=4,local=8) {LSERVE}"


def test_batched_selection_equals_per_sequence_selection(chat_llm, monkeypatch, streaming_lserve):
    """LServe with streaming heads (per query head), LServe per KV head, Quest with a dense first layer
    and an evicted Quest conversation in one batch: prompts over budget, crossing it while decoding
    (90 + 7 > 96, 44 + 5 > 48) and within it throughout; reuse steps and refreshes."""
    recipes = [streaming_lserve] * 3 + [LSERVE_MAX] * 2 + [QUEST] * 2 + [QUEST_EVICTED]
    lengths = [160, 90, 40, 200, 85, 120, 44, 150]
    new = 12
    runs = {}
    for mode in ("batched", "alone"):
        with monkeypatch.context() as m:
            if mode == "alone":
                per_sequence(m)
            calls, states = record(m, check_reference=mode == "alone")
            out = run_batch(chat_llm, recipes, lengths, new)
        runs[mode] = (out, calls, states)
    (out, calls, states), (ref_out, ref_calls, ref_states) = runs["batched"], runs["alone"]
    for (ids, lp), (ref_ids, ref_lp) in zip(out, ref_out):
        assert ids == ref_ids and torch.equal(lp, ref_lp)
    assert_same(calls, ref_calls)
    assert_same(states, ref_states)
    L = chat_llm.config.num_layers
    assert sum(slot for slot, _, _ in calls) == (new - 1) * L  # every decode step read a selection
    ages = [age for _, chosen, age, *_ in states if chosen is not None]
    assert 1 in ages and max(ages) > 1  # fresh selections and reused ones
    assert any(moves.any() for *_, moves in states)  # heads moved (trim, eviction)


def test_one_select_per_layer_for_a_batch(chat_llm, monkeypatch):
    """B conversations of one recipe, all over budget: one select call per layer and decode step (B
    per layer when each selects alone)."""
    B, new, L = 4, 6, chat_llm.config.num_layers
    counts = {}
    for mode in ("batched", "alone"):
        with monkeypatch.context() as m:
            if mode == "alone":
                per_sequence(m)
            n = {"select": 0, "tables": 0}
            real_select, real_tables = PageSelector.select, selection.tables

            def select(self, *args, n=n, real=real_select, **kwargs):
                n["select"] += 1
                return real(self, *args, **kwargs)

            def tables(step, layer, q, n=n, real=real_tables):
                n["tables"] += 1
                return real(step, layer, q)

            m.setattr(PageSelector, "select", select)
            m.setattr(selection, "tables", tables)
            run_batch(chat_llm, ["decode=lserve(budget=64,physical_page=32,reuse=1)"] * B, [150, 170, 190, 210], new)
            counts[mode] = n
    assert counts["batched"] == {"select": (new - 1) * L, "tables": (new - 1) * L}
    assert counts["alone"] == {"select": B * (new - 1) * L, "tables": (new - 1) * L}
