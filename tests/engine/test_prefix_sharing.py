"""Conversations that begin with the same system prompt share its pages (turnkv/engine/prefix.py):
the same replies, turn by turn, as with the prefix index off, and the memory counted once."""

from __future__ import annotations

import pytest

import turnkv

SYSTEM = "You are a careful assistant. Answer every question in a few words. " * 6
MESSAGES = ["What is the sea?", "And a mountain?"]
# FlowKV compressing the system prompt on its own (shared compressed), and with the first query in view
# (shared uncompressed until that compression copies what it keeps).
OWN = "flowkv budget=24 turns=flowkv(system=own)"
RECIPES = ["full", "flowkv budget=24", OWN, "evict=snapkv(window=8)+uniform budget=24 turns=flowkv(system=own)",
           "ada-snapkv budget=24", "lserve-random"]


def _run(llm, recipe: str, conversations: int = 3, close: bool = True):
    out, convs = [], []
    for _ in range(conversations):
        conv = llm.conversation(system=SYSTEM, recipe=recipe)
        out.append([conv.send(m, max_new_tokens=6, ignore_eos=True) for m in MESSAGES])
        convs.append(conv)
    if close:
        for conv in convs:
            conv.close()
    return out, convs


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    on = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB")
    off = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache=False)
    return on, off


@pytest.mark.parametrize("recipe", RECIPES)
def test_replies_are_the_same_with_the_prefix_index_on_and_off(engines, recipe):
    on, off = engines
    shared, _ = _run(on, recipe)
    alone, _ = _run(off, recipe)
    for a, b in zip(shared, alone):
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # The first conversation prefilled the system prompt; the others took it from the index.
    system_end = shared[0][0].prompt_tokens - shared[1][0].prompt_tokens
    assert system_end > 0 and shared[1][0].cached_tokens == shared[2][0].cached_tokens == system_end
    assert all(r[0].cached_tokens == 0 for r in alone)
    assert on.pool.bytes_in_use() == on.prefix_cache_bytes() and off.pool.bytes_in_use() == 0


def test_the_compressed_system_prompt_is_computed_once_and_logged_in_every_conversation(engines):
    on, off = engines
    recipe = OWN
    on.prefix_index.clear()
    shared, convs = _run(on, recipe, close=False)
    alone, convs_off = _run(off, recipe, close=False)
    assert [c.compression_log for c in convs] == [c.compression_log for c in convs_off]
    # Every conversation holds the same compressed system prompt pages: in the pool once.
    tables = [c.kv.table[:, :, :1] for c in convs]
    assert all((t == tables[0]).all() for t in tables[1:])
    [entry] = on.prefix_index._entries.values()
    # Own pages (each conversation's turns, and its copy of the prompt's partial last page), the
    # index's own copy of that partial page, and the shared full pages, counted once.
    own = sum(c.kv_sharing[0] for c in convs) + entry.kv.sharing()[0]
    shared_pages = on.pool.shared_bytes()
    assert shared_pages > 0 and on.pool.bytes_in_use() == own + shared_pages
    share = sum(c.kv_sharing[1] for c in convs) + entry.kv.sharing()[1]
    assert share == pytest.approx(shared_pages, abs=on.pool.num_layers)
    assert sum(c.kv_bytes for c in convs_off) > sum(c.kv_bytes for c in convs) - shared_pages * 2
    for c in convs + convs_off:
        c.close()


def test_evicting_in_one_conversation_leaves_anothers_shared_pages_and_replies(engines):
    """A recipe that re-scores the history (snapkv, recompress) compacts the shared system prompt in
    the second conversation: it copies what it writes, and the first one's next turn is unchanged."""
    on, off = engines
    on.prefix_index.clear()
    recipe = "snapkv budget=16"
    first = on.conversation(system=SYSTEM, recipe=recipe)
    first.send(MESSAGES[0], max_new_tokens=4, ignore_eos=True)
    ref = off.conversation(system=SYSTEM, recipe=recipe)
    ref.send(MESSAGES[0], max_new_tokens=4, ignore_eos=True)
    second = on.conversation(system=SYSTEM, recipe=recipe)
    second.send(MESSAGES[0], max_new_tokens=4, ignore_eos=True)
    # The index entry (uncompressed) still reads the same: the second conversation copied before compacting.
    entry = next(iter(on.prefix_index._entries.values()))
    assert entry.kv.lengths.min() == entry.kv.next_position
    assert [first.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True).token_ids] == \
        [ref.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True).token_ids]
    for c in (first, second, ref):
        c.close()


def test_tiers_store_shared_pages_per_conversation_and_restore_them(chat_model_dir, tmp_path):
    on = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=str(tmp_path))
    off = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", prefix_cache=False)
    outs = []
    for llm in (on, off):
        a = llm.conversation(system=SYSTEM, recipe=OWN)
        b = llm.conversation(system=SYSTEM, recipe=OWN)
        replies = [a.send(MESSAGES[0], max_new_tokens=6, ignore_eos=True),
                   b.send(MESSAGES[0], max_new_tokens=6, ignore_eos=True)]
        if llm is on:
            a.offload("disk")  # its private pages leave; the shared ones stay for b and the index
            assert b.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True) is not None
            b.offload("cpu")
            restarted = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", state_disk_dir=str(tmp_path))
            a = restarted.resume(a.id)
        else:
            b.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True)
        replies.append(a.send(MESSAGES[1], max_new_tokens=6, ignore_eos=True))
        replies.append(b.send("Thanks.", max_new_tokens=6, ignore_eos=True))
        outs.append([r.token_ids for r in replies])
    assert outs[0] == outs[1]


def test_an_accumulating_recipe_does_not_share(engines):
    on, _ = engines
    shared, _ = _run(on, "h2o budget=24", conversations=2)
    assert all(r[0].cached_tokens == 0 for r in shared)
