"""Turn ends in the prefix index (turnkv/engine/prefix.py): under a recipe whose kept state depends on
the token ids alone, every chat turn's end is indexed, and a conversation whose first request carries
earlier turns takes the longest one instead of prefilling them. Greedy replies are the same, turn by
turn, with the index on, on for system prompts only, and off."""

from __future__ import annotations

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
    conv = llm.conversation(system=SYSTEM, recipe=recipe)
    conv.messages = [dict(m) for m in messages]
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
