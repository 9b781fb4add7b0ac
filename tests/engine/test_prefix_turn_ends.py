"""Turn ends in the prefix index (turnkv/engine/prefix.py): under a recipe whose kept state depends on
the token ids alone, every chat turn's end is indexed, and a conversation whose first request carries
earlier turns takes the longest one instead of prefilling them. Greedy replies are the same, turn by
turn, with the index on, on for system prompts only, and off."""

from __future__ import annotations

import numpy as np
import pytest

import turnkv
from turnkv.errors import InvalidRequestError

SYSTEM = "You are a careful assistant. Answer every question in a few words. " * 6
ASKED = ["What is the sea?", "And a mountain?"]
ANSWERS = ["The sea is salt water.", "A mountain is a high hill."]
FOLLOW_UPS = ["And a river?", "Thanks, and the sky?"]
SHARED = ["full", "lserve-random", "loopserve-d", "lserve-random decode=loopserve"]
NOT_SHARED = ["evict=snapkv(window=8)+uniform budget=24 turns=flowkv(system=own)", "ada-snapkv budget=24"]


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    made = {mode: turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache=mode)
            for mode in ("turns", "system", "off")}
    return made


def _history(llm, recipe):
    """A conversation of two turns whose replies are forced to text the template renders back to the
    same token ids (a tiny random model's greedy tokens need not survive a decode and encode)."""
    conv = llm.conversation(system=SYSTEM, recipe=recipe)
    for message, answer in zip(ASKED, ANSWERS):
        conv.send(message, force=llm.tokenizer.encode(answer, add_special_tokens=False), max_new_tokens=32)
    return conv


def _resent(llm, recipe, messages):
    """A new conversation whose first request carries `messages` (earlier turns), then follow-ups:
    its greedy replies."""
    conv = llm.conversation(system=SYSTEM, recipe=recipe, history=messages[1:])
    replies = [conv.send(m, max_new_tokens=6, ignore_eos=True) for m in FOLLOW_UPS]
    return conv, replies


@pytest.mark.parametrize("recipe", SHARED + NOT_SHARED)
def test_a_resent_history_takes_the_last_turn_end_and_replies_the_same(engines, recipe):
    shared = recipe in SHARED
    assert engines["turns"].resolve_recipe(recipe).path_independent == shared
    out = {}
    for mode, llm in engines.items():
        index = llm.prefix_index
        if index is not None:
            index.clear()
        origin = _history(llm, recipe)
        turn_end, system_end = origin.kv.next_position, origin.turns[0].system_end
        assert turn_end == len(origin.tokens) - 1  # the last reply's last token is fed by the next turn
        hits, served = (index.hits, index.hit_tokens) if index is not None else (0, 0)
        conv, replies = _resent(llm, recipe, origin.messages)
        # The conversation the history came from goes on: its pages, shared with the index and the
        # new conversation, were copied before anything wrote into them.
        replies.append(origin.send(FOLLOW_UPS[0], max_new_tokens=6, ignore_eos=True))
        out[mode] = [r.token_ids for r in replies]
        attached = {"turns": turn_end if shared else system_end, "system": system_end, "off": 0}[mode]
        assert replies[0].cached_tokens == attached
        assert replies[0].prompt_tokens == conv.turns[0].prompt_end - attached
        if index is not None:
            assert index.hits == hits + 1 and index.hit_tokens == served + attached
            longest = max(len(e.tokens) for e in index._entries.values())
            assert (longest > system_end) == (shared and mode == "turns")
        origin.close()
        conv.close()
    assert out["turns"] == out["system"] == out["off"]
    for llm in engines.values():
        assert llm.pool.bytes_in_use() == llm.prefix_cache_bytes()


def _distinct_pages(entries, num_layers: int) -> int:
    return sum(len(np.unique(np.concatenate([e.kv.held_pages()[layer] for e in entries])))
               for layer in range(num_layers))


def _four_turns(llm):
    conv = llm.conversation(system=SYSTEM, recipe="full")
    for message in ASKED + FOLLOW_UPS:
        conv.send(message, max_new_tokens=6, ignore_eos=True)
    return conv


def test_successive_turn_ends_count_their_shared_pages_once(chat_model_dir):
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache_memory="64MiB")
    pool, index = llm.pool, llm.prefix_index
    conv = _four_turns(llm)
    entries = sorted(index._entries.values(), key=lambda e: len(e.tokens))
    assert len(entries) == 5  # the system prompt and four turn ends
    assert len(entries[-1].tokens) == conv.kv.next_position
    distinct = _distinct_pages(entries, pool.num_layers)
    assert index.bytes() == distinct * pool.page_bytes < sum(e.nbytes for e in entries)
    # While the conversation lives, the index costs only the pages nobody else holds: each entry's
    # partial last pages, which the conversation copied before writing into them.
    own = [set(p.tolist()) for p in conv.kv.held_pages()]
    index_only = sum(len(set(np.concatenate([e.kv.held_pages()[layer] for e in entries]).tolist()) - own[layer])
                     for layer in range(pool.num_layers))
    assert 0 < index_only < distinct and pool.bytes_in_use() == conv.kv_bytes + index_only * pool.page_bytes
    conv.close()
    assert pool.bytes_in_use() == llm.prefix_cache_bytes() == index.bytes()

    # A cap of exactly those bytes keeps every entry; one page less drops the least recently used
    # (the system prompt's, whose pages but its partial last ones the turn ends hold too).
    for cap, kept in ((index.bytes(), 5), (index.bytes() - pool.page_bytes, 4)):
        capped = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache_memory=cap)
        _four_turns(capped).close()
        lengths = sorted(len(e.tokens) for e in capped.prefix_index._entries.values())
        assert lengths == sorted(len(e.tokens) for e in entries)[5 - kept:]
        assert capped.prefix_index.bytes() <= cap


def test_turn_ends_give_way_when_the_pool_runs_short(chat_model_dir):
    size = 30 * 16 * 512  # 30 pages of 16 tokens per head (the tiny model's 512 bytes per token)
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=size, prefix_cache_memory=size)
    off = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=size, prefix_cache=False)
    pool, index = llm.pool, llm.prefix_index
    _four_turns(llm).close()
    old = set(index._entries)
    assert len(old) == 5 and pool.bytes_in_use() == index.bytes() > 0
    # A long first turn of another conversation needs more pages than are free: the entries go.
    free_tokens = pool.free_pages(0) // pool.num_kv_heads * pool.page_size
    long = "Tell me about the sea and the land. " * ((free_tokens + 64) // 9)
    replies = []
    for engine in (llm, off):
        conv = engine.conversation(recipe="full")
        replies.append(conv.send(long, max_new_tokens=4, ignore_eos=True))
        conv.close()
    assert free_tokens < replies[0].prompt_tokens < pool.sequence_capacity
    assert replies[0].token_ids == replies[1].token_ids
    # Least recently used first: the system prompt's entry, then the turn ends in their order.
    dropped = old - set(index._entries)
    assert index.evictions == len(dropped) > 0
    assert sorted(len(k[1]) for k in dropped) == sorted(len(k[1]) for k in old)[: len(dropped)]
    assert pool.bytes_in_use() == index.bytes()  # the new conversation's turn end, and what is left


def test_a_conversation_on_a_turn_end_offloads_restarts_and_replies_the_same(chat_model_dir, tmp_path):
    out = []
    for mode in ("turns", "off"):
        llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache=mode,
                         state_disk_dir=str(tmp_path / mode))
        origin = _history(llm, "full")
        conv = llm.conversation(system=SYSTEM, recipe="full", history=origin.messages[1:])
        replies = [conv.send(FOLLOW_UPS[0], max_new_tokens=6, ignore_eos=True)]
        assert replies[0].cached_tokens == (origin.kv.next_position if mode == "turns" else 0)
        origin.close()  # the turn end's pages stay for the index and the conversation
        conv.offload("cpu")
        assert conv.location == "cpu"
        replies.append(conv.send(FOLLOW_UPS[1], max_new_tokens=6, ignore_eos=True))
        conv.offload("disk")
        restarted = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache=mode,
                               state_disk_dir=str(tmp_path / mode))
        again = restarted.resume(conv.id)
        replies.append(again.send("One more word?", max_new_tokens=6, ignore_eos=True))
        out.append([r.token_ids for r in replies])
    assert out[0] == out[1]


@pytest.mark.parametrize("value", ["all", "on", 1, None])
def test_prefix_cache_takes_turns_system_or_off(chat_model_dir, value):
    with pytest.raises(InvalidRequestError, match="'turns', 'system', 'off'"):
        turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", prefix_cache=value)


def test_true_and_false_mean_turns_and_off(chat_model_dir):
    on = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", prefix_cache=True)
    off = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="8MiB", prefix_cache=False)
    assert (on.prefix_mode, off.prefix_mode, off.prefix_index) == ("turns", "off", None)
