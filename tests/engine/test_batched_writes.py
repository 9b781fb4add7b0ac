"""A step's per-layer calls to its page selections are made once per layer for all its conversations
(engine/selection.py: write_groups, observer_groups; PagedSelection.step_writes, observe_batch): the
same tokens, logprobs, page statistics and selection states as each conversation watching its own
writes and queries, over eager decode steps and mixed steps (a prefill slice beside the decode
tokens); and one statistics fold and one observe call per layer, whatever the batch. The step's page
tables copy once for the batch, bar the tables narrower than the widest."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.test_batched_selection import selection_states
from turnkv.engine import decode_loop, mixed, selection
from turnkv.engine.conversation import Conversation
from turnkv.engine.turn import TurnInput, TurnRun
from turnkv.methods.lserve.decode import PagedSelection, summaries_for
from turnkv.methods.lserve.summaries import PageSummaries
from turnkv.methods.protocols import DecodeSelection

SELECT = "decode=lserve(budget=64,physical_page=32,reuse=3)"
QUEST = "decode=quest(budget=32,dense_layers=1)"
QUEST_EVICTED = "snapkv budget=80 decode=quest(budget=32,dense_layers=1)"  # its heads moved: a rebuild


@pytest.fixture
def streaming_lserve(tmp_path):
    from turnkv.methods.lserve.pattern import HeadPattern

    path = tmp_path / "pattern.json"
    HeadPattern(np.array([[True, False], [False, True]])).save_json(path)  # one streaming head per layer
    return f"lserve prefill=streaming_heads(pattern={path},sink=4,local=8,prefill_local=16) {SELECT}"


def alone(monkeypatch) -> None:
    """Every conversation watches its own writes (`written`) and queries (`observe`), one call each."""
    monkeypatch.setattr(PagedSelection, "write_key", lambda self, seq: None)
    monkeypatch.setattr(PagedSelection, "observe_batch", classmethod(DecodeSelection.observe_batch.__func__))


def statistics(seq, flags: np.ndarray) -> list[torch.Tensor]:
    """The page statistics of every selecting head's logical pages, in table order (the runs' pools
    hand out different pages)."""
    summaries = summaries_for(seq.pool, 16)
    ps, per = seq.pool.page_size, summaries.per_page
    out = []
    for layer in range(seq.lengths.shape[0]):
        for h in np.flatnonzero(~flags[layer]):
            n = int(seq.lengths[layer, h])
            pages = torch.from_numpy(seq.table[layer, h, : -(-n // ps)].astype(np.int64))
            rows = (pages[:, None] * per + torch.arange(per)).reshape(-1)[: -(-n // 16)]
            out += [summaries.kmax[layer][rows].clone(), summaries.kmin[layer][rows].clone()]
    return out


def run(llm, recipes: list[str], lengths: list[int], long: int, steps: int, monkeypatch):
    """Prompts of `lengths` tokens prefilled and decoded together, every other step a mixed step that
    also carries a 24-token slice of a `long` prompt -> per conversation (token ids, logprobs,
    statistics), and per selection.tables call each selection's state of that layer."""
    states = []
    real_tables = selection.tables

    def spy_tables(step, layer, q):
        out = real_tables(step, layer, q)
        states.extend(selection_states(step, layer))
        return out

    monkeypatch.setattr(selection, "tables", spy_tables)
    gen = torch.Generator().manual_seed(0)
    params = llm.turn_parts.sampling_params(max_new_tokens=steps + 1, ignore_eos=True)
    convs = [Conversation(llm, None, llm.resolve_recipe(r)) for r in recipes + [recipes[0]]]
    try:
        turns = []
        for conv, n in zip(convs, lengths + [long]):
            ids = torch.randint(100, 2000, (n,), generator=gen).tolist()
            generation = llm.turn_parts.new_generation(conv.kv, params, keep_logprobs=True)
            turns.append(TurnRun(conv, TurnInput(0, ids, segment_end=n), generation).begin())
        *decoding, prompt = turns
        for turn in decoding:
            turn.take(turn.prefill())
        for i in range(steps):
            if i % 2 == 0:
                decode_loop.step(llm, decoding)
                continue
            parts = [mixed.decode_part(decoding), mixed.slice_part(prompt, 24)]
            logits = mixed.forward(llm.runner, parts)
            for turn, row in zip(decoding, logits[0]):
                turn.after_step(row)
            prompt.chunk_prefilled(parts[1].width, logits[1][0])
        out = []
        for turn in decoding + [prompt]:
            flags = turn.context.selector.streaming_flags(turn.seq)
            out.append((list(turn.gen.token_ids), statistics(turn.seq, flags)))
        for turn in decoding:
            reply = turn.finish()
            out[turns.index(turn)] = (*out[turns.index(turn)], reply.logprobs)
        return out, states
    finally:
        for conv in convs:
            conv.close()


def test_batched_writes_and_queries_equal_each_conversation_alone(chat_llm, monkeypatch, streaming_lserve):
    """LServe with a streaming head per layer (trimmed while decoding), Quest, and an evicted Quest
    conversation (its statistics rebuilt), over budget, crossing it and within it, beside a prompt
    prefilled in slices by the mixed steps."""
    recipes = [streaming_lserve] * 3 + [QUEST] * 2 + [QUEST_EVICTED]
    lengths = [160, 90, 40, 120, 44, 150]
    results = {}
    for mode in ("batched", "alone"):
        with monkeypatch.context() as m:
            if mode == "alone":
                alone(m)
            results[mode] = run(chat_llm, recipes, lengths, 150, 10, m)
    (out, states), (ref_out, ref_states) = results["batched"], results["alone"]
    assert len(out) == len(ref_out) == len(recipes) + 1
    for got, ref in zip(out, ref_out):
        assert got[0] == ref[0]  # tokens
        assert len(got[1]) == len(ref[1]) and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
        if len(got) > 2:
            assert torch.equal(got[2], ref[2])  # logprobs
    assert len(states) == len(ref_states) > 0
    for a, b in zip(states, ref_states):
        for u, v in zip(a, b):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v)
            elif isinstance(u, np.ndarray):
                assert np.array_equal(u, v)
            else:
                assert u == v
    assert any(chosen is not None for _, chosen, *_ in states)  # selections were read
    assert any(moves.any() for *_, moves in states)  # the streaming heads' trim moved heads


def count_calls(monkeypatch) -> dict:
    """Spies on the per-layer calls: statistics folds (by layer), observe / observe_batch, _sync."""
    n = {"fold": {}, "observe": 0, "observe_batch": 0, "sync": 0, "written": 0}
    real_fold, real_sync = PageSummaries.update_runs, PagedSelection._sync
    real_observe, real_written = PagedSelection.observe, PagedSelection.written
    real_batch = PagedSelection.observe_batch.__func__

    def fold(self, layer, *args, **kwargs):
        n["fold"][layer] = n["fold"].get(layer, 0) + 1
        return real_fold(self, layer, *args, **kwargs)

    def counted(name, real):
        def call(*args, **kwargs):
            n[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(PageSummaries, "update_runs", fold)
    monkeypatch.setattr(PagedSelection, "_sync", counted("sync", real_sync))
    monkeypatch.setattr(PagedSelection, "observe", counted("observe", real_observe))
    monkeypatch.setattr(PagedSelection, "written", counted("written", real_written))
    monkeypatch.setattr(PagedSelection, "observe_batch", classmethod(counted("observe_batch", real_batch)))
    return n


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_one_fold_and_one_observe_per_layer_for_a_batch(chat_llm, monkeypatch, kind):
    """B conversations of one recipe over budget: a decode step (eager) or a mixed step's decode part
    folds the step's keys once per layer, observes once per layer, and finds the statistics exact
    without a per-conversation sync; each conversation alone costs B of each per layer."""
    B, L = 4, chat_llm.config.num_layers
    recipe = chat_llm.resolve_recipe("decode=lserve(budget=64,physical_page=32,reuse=1)")
    gen = torch.Generator().manual_seed(1)
    params = chat_llm.turn_parts.sampling_params(max_new_tokens=8, ignore_eos=True)
    convs = [Conversation(chat_llm, None, recipe) for _ in range(B)]
    counts = {}
    try:
        turns = []
        for conv, n in zip(convs, [150, 170, 190, 210]):
            ids = torch.randint(100, 2000, (n,), generator=gen).tolist()
            turn = TurnRun(conv, TurnInput(0, ids, segment_end=n), chat_llm.turn_parts.new_generation(conv.kv, params))
            turn.begin().take(turn.prefill())
            turns.append(turn)
        decode_loop.step(chat_llm, turns)  # settles the turns
        for mode in ("batched", "alone"):
            with monkeypatch.context() as m:
                if mode == "alone":
                    alone(m)
                n = count_calls(m)
                if kind == "decode":
                    decode_loop.step(chat_llm, turns)
                else:
                    logits = mixed.forward(chat_llm.runner, [mixed.decode_part(turns)])
                    for turn, row in zip(turns, logits[0]):
                        turn.after_step(row)
                counts[mode] = n
    finally:
        for conv in convs:
            conv.close()
    assert counts["batched"] == {"fold": {layer: 1 for layer in range(L)}, "observe": 0, "observe_batch": L,
                                 "sync": 0, "written": 0}
    # Alone, the protocol's observe_batch calls observe once per conversation.
    assert counts["alone"] == {"fold": {layer: B for layer in range(L)}, "observe": B * L, "observe_batch": L,
                               "sync": 2 * B * L, "written": B * L}


def test_step_tables_pad_only_the_narrower_tables(chat_llm, monkeypatch):
    """The step's page tables [L, B, H, P]: every sequence's table as padding each would give it, with
    a copy per sequence only where its table is narrower than the widest (not one per sequence)."""
    from turnkv.engine import step as step_module
    from turnkv.kv.sequence import SequenceKV

    seqs = [SequenceKV(chat_llm.pool) for _ in range(4)]
    try:
        for seq, n in zip(seqs, [40, 300, 300, 90]):
            seq.reserve(n)
        pads = []
        real_pad = torch.nn.functional.pad
        monkeypatch.setattr(torch.nn.functional, "pad", lambda t, *a, **k: pads.append(t.shape) or real_pad(t, *a, **k))
        tables = step_module._tables(seqs)
        monkeypatch.undo()
        width = max(int(s.num_pages.max()) for s in seqs)
        expected = torch.stack([real_pad(s.device_table()[:, :, :width], (0, width - min(width, s.table.shape[2])))
                                for s in seqs], dim=1)
        assert torch.equal(tables, expected)
        assert len(pads) == sum(s.table.shape[2] < width for s in seqs) < len(seqs)
    finally:
        for seq in seqs:
            seq.free()
