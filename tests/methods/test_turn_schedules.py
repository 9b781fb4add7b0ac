"""Multi-turn policies through real conversations: the four schedules, memory, one-shot generation
with a recipe, every preset, and FlowKV's frontier after rollbacks."""

from __future__ import annotations

import pytest
import torch

from tests.methods.turn_helpers import CONTEXT, MESSAGES, NEW, SYSTEM, dims, held, send
from turnkv.errors import InvalidRequestError
from turnkv.kv.sequence import SequenceKV
from turnkv.methods.recipe import Recipe, presets


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
    with pytest.raises(InvalidRequestError, match="a recipe is a Recipe, a string, a file path or a mapping"):
        chat_llm.conversation(recipe=3)
    with pytest.raises(InvalidRequestError, match="flowkv keeps the running turn whole"):
        chat_llm.conversation(recipe="flowkv schedule=decode")


# ---- rollback and FlowKV's frontier (known bugs) -------------------------------------------------------
def test_flowkv_frontier_follows_an_abandoned_turn(open_conv):
    conv = open_conv("flowkv budget=16 turns=flowkv(min_size=8,reading=query)")
    send(conv, MESSAGES[0])
    it = conv.stream(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True)
    next(it), next(it)  # past the first token, which goes out before the prompt's compression
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
    next(it), next(it)  # past the first token, which goes out before the prompt's compression
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
