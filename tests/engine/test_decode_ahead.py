"""Decode launched one step ahead of the host (engine/decode_loop.py) gives exactly what one step at a
time gives: the same tokens, the same kept KV and observation windows, nothing left reserved when a
generation stops at a token only known after the next step was launched. On CPU the graphed decode
runs the same steps without a graph, so these tests drive the ahead path here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import turnkv
from turnkv.engine import decode_loop
from turnkv.engine.cuda_graphs import GraphedDecode
from turnkv.kv.sequence import SequenceKV

PROMPTS = ["The sea", "Once upon a time in a land far away there lived", "1, 2, 3,"]


@pytest.fixture
def engines(chat_model_dir):
    ahead = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    ahead.runner.graphs = GraphedDecode(ahead.model, ahead.pool, ahead.max_model_len, max_batch=8)
    plain = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    assert plain.runner.graphs is None
    return ahead, plain


@pytest.fixture
def count_ahead(monkeypatch):
    """How many times the ahead loop ran."""
    calls = []
    original = decode_loop._ahead

    def spy(*args):
        calls.append(1)
        yield from original(*args)

    monkeypatch.setattr(decode_loop, "_ahead", spy)
    return calls


def _stop_tokens(llm, prompts, at):
    """End-of-sequence ids that stop each prompt's greedy reply at a different step."""
    free = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    return {r.token_ids[k] for r, k in zip(free, at) if k is not None}


def test_generate_ahead_equals_one_step_at_a_time(engines, count_ahead):
    ahead, plain = engines
    stops = _stop_tokens(plain, PROMPTS, at=[3, 6, None])
    for llm in engines:
        llm.eos_ids = stops
    held = ahead.pool.bytes_in_use()  # the graphs' page for padding rows
    a = ahead.generate(PROMPTS, max_new_tokens=12)
    b = plain.generate(PROMPTS, max_new_tokens=12)
    assert count_ahead == [1]  # only the engine with graphs ran ahead
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.finish_reason for r in a] == [r.finish_reason for r in b]
    assert "stop" in {r.finish_reason for r in a}  # some stopped at a token read after the next launch
    assert ahead.pool.bytes_in_use() == held and plain.pool.bytes_in_use() == plain.prefix_cache_bytes()


def test_seeded_sampling_ahead_equals_one_step_at_a_time(engines):
    ahead, plain = engines
    kw = dict(max_new_tokens=10, temperature=1.2, top_p=0.9, seed=7, ignore_eos=True)
    assert [r.token_ids for r in ahead.generate(PROMPTS, **kw)] == [r.token_ids for r in plain.generate(PROMPTS, **kw)]


def _kv_state(conv):
    """(next position, per-head lengths [L, H], each layer's kept keys): a head's keys up to its own
    length (gather pads the shorter heads with whatever their last page holds past it)."""
    seq = conv.kv
    keys = []
    for layer in range(seq.pool.num_layers):
        k = seq.gather(layer)[0]
        keys.append([k[h, : int(seq.lengths[layer, h])].clone() for h in range(k.shape[0])])
    return seq.next_position, seq.lengths.copy(), keys


SELECTING = ["loopserve-d decode=loopserve(budget=24,warmup=2,interval=3)",
             "decode=quest(budget=16,dense_layers=0)",
             "lserve prefill=streaming_heads(pattern=random,sink=4,local=16) "
             "decode=lserve(budget=64,physical_page=16,logical_page=8)"]


@pytest.mark.parametrize("recipe", [None, "snapkv budget=48 schedule=decode every=4", *SELECTING])
def test_conversation_turns_keep_the_same_state(engines, recipe, count_ahead):
    """Turn by turn: the same reply, the same KV (positions, per-head lengths, keys) and the same
    observation window, with replies stopped by an end-of-sequence token mid-way. A decode selection
    runs ahead too: the step launched after the stop is undone in its state (its queries, its page
    statistics, its step count), so the next turn selects as one step at a time would."""
    ahead, plain = engines
    probe = plain.conversation(recipe=recipe)
    first = probe.send("Tell me about the sea.", max_new_tokens=8, ignore_eos=True).token_ids
    for llm in engines:
        llm.eos_ids = {first[4]}
    convs = [llm.conversation(recipe=recipe) for llm in engines]
    for message in ("Tell me about the sea.", "And the mountains?", "Thanks!"):
        replies = [c.send(message, max_new_tokens=8) for c in convs]
        assert replies[0].token_ids == replies[1].token_ids
        assert replies[0].finish_reason == replies[1].finish_reason
        (pa, la, ka), (pb, lb, kb) = (_kv_state(c) for c in convs)
        assert pa == pb
        np.testing.assert_array_equal(la, lb)
        for layer_a, layer_b in zip(ka, kb):
            for x, y in zip(layer_a, layer_b):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        windows = [c.method_state.window for c in convs]
        if windows[0] is not None:
            (qa, posa), (qb, posb) = (w.snapshot() for w in windows)
            for x, y in zip(posa, posb):
                torch.testing.assert_close(x, y)
            for x, y in zip(qa, qb):
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        decode_stats = [[e.get("decode", {}).get("steps") for e in c.method_stats] for c in convs]
        assert decode_stats[0] == decode_stats[1]
    assert len(count_ahead) == 3
    assert {r.finish_reason for c in convs for r in (t.reply for t in c.turns)} >= {"stop"}


def test_stop_string_ahead(engines):
    ahead, plain = engines
    text = plain.generate("Once upon a time", max_new_tokens=12, ignore_eos=True).text
    stop = text.strip().split()[2] if len(text.split()) > 3 else text[:3]
    a, b = (llm.generate("Once upon a time", max_new_tokens=12, stop=[stop], ignore_eos=True) for llm in engines)
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason


def test_teacher_forcing_stays_one_step_at_a_time(engines, count_ahead):
    ahead, _ = engines
    conv = ahead.conversation()
    reply = conv.send("Hello", max_new_tokens=4, ignore_eos=True)
    forced = ahead.conversation()
    list(forced.stream("Hello", force=reply.token_ids, logprobs=True, max_new_tokens=4))
    assert forced.last_reply.token_ids == reply.token_ids
    assert len(count_ahead) == 1  # the forced turn did not run ahead


def test_selection_with_an_eviction_window_stays_one_step_at_a_time(engines, count_ahead):
    ahead, _ = engines
    conv = ahead.conversation(recipe="snapkv budget=48 decode=quest(budget=16,dense_layers=0)")
    conv.send("Hello", max_new_tokens=4, ignore_eos=True)
    assert count_ahead == []  # an eager fallback step would leave the eviction window nothing to read


def test_unreserve_undoes_the_last_reserve(chat_llm):
    seq = SequenceKV(chat_llm.pool)
    seq.reserve(16)  # whole pages: the next token opens a new page in every head
    used, lengths = chat_llm.pool.bytes_in_use(), seq.lengths.copy()
    seq.reserve_on_host(1)
    assert chat_llm.pool.bytes_in_use() > used
    seq.unreserve(1)
    assert chat_llm.pool.bytes_in_use() == used and seq.next_position == 16
    np.testing.assert_array_equal(seq.lengths, lengths)
    with pytest.raises(ValueError):
        seq.unreserve(17)
    seq.free()
