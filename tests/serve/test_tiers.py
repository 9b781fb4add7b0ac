"""The server over the engine's state tiers (the default): idle conversations evicted from the KV pool
go to the CPU tier, then the disk, and come back when a request continues them; a conversation a
request runs on is never demoted; when every tier is full the least recently used idle conversation
is dropped and counted; a stopped server leaves its idle conversations on disk, and a new one over
the same directory continues them as if it had never stopped."""

from __future__ import annotations

import pytest

import turnkv
from tests.serve.conftest import MODEL, running
from tests.serve.test_load import converse
from turnkv.serve.store import ConversationStore
from turnkv.serve.tier_hook import StateTierHook

SMALL_POOL = "96KiB"  # about three of these conversations


@pytest.fixture(scope="module")
def reference(serve_llm):
    """Six three-turn conversations on a pool that never evicts."""
    with running(serve_llm, served_model_name=MODEL) as s:
        return [converse(s.client(), i) for i in range(6)]


def replies(conversations):
    return [[reply for reply, _ in conv] for conv in conversations]


def test_evicted_conversations_go_to_cpu_then_disk_and_come_back(chat_model_dir, tmp_path, reference):
    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=SMALL_POOL, state_cpu_memory="48KiB",
                       state_disk_dir=str(tmp_path / "tier"))
    with running(small, served_model_name=MODEL) as s:
        client = s.client()
        got = [converse(client, i) for i in range(6)]
        assert replies(got) == replies(reference)
        # Later turns of every conversation reused its history, although most left the pool between turns.
        assert [[c for _, c in conv] for conv in got] == [[c for _, c in conv] for conv in reference]
        assert s.metric("turnkv:conversation_evictions_total", reason="offloaded") > 0
        assert s.metric("turnkv:conversation_evictions_total", reason="dropped") == 0
        counts = {tier: s.metric("turnkv:stored_conversations", tier=tier) for tier in ("gpu", "cpu", "disk")}
        assert counts["cpu"] > 0 and counts["disk"] > 0 and sum(counts.values()) == 6
        assert all(s.metric("turnkv:stored_kv_bytes", tier=tier) > 0 for tier in ("cpu", "disk"))
        assert {s.store.where(e) for e in s.store.entries} == {"gpu", "cpu", "disk"}
        # The oldest conversation went furthest down; its next turn brings it back and reuses it all.
        oldest = next(e for e in s.store.entries if e.conv.messages[0]["content"] == "You are storyteller number 0.")
        assert s.store.where(oldest) == "disk"
        history = len(oldest.conv.tokens)
        messages = oldest.conv.messages + [{"role": "user", "content": "One more line."}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == history - 1  # all but the unfed last token
        assert s.store.where(oldest) == "gpu"


def test_full_tiers_drop_the_least_recently_used_idle_conversation_and_count_it(chat_model_dir, reference):
    small = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory=SMALL_POOL, state_cpu_memory="48KiB")
    with running(small, served_model_name=MODEL) as s:
        got = [converse(s.client(), i) for i in range(6)]
        assert replies(got) == replies(reference)  # dropping never serves stale KV
        dropped = s.metric("turnkv:conversation_evictions_total", reason="dropped")
        assert dropped > 0 and s.metric("turnkv:conversation_evictions_total", reason="offloaded") > 0
        # Nothing vanished uncounted: every conversation is still stored, or counted as dropped.
        stored = sum(s.metric("turnkv:stored_conversations", tier=t) for t in ("gpu", "cpu", "disk"))
        assert stored == len(s.store.entries) == 6 - dropped
        kept = [int(e.conv.messages[0]["content"].split()[-1].rstrip(".")) for e in s.store.entries]
        assert sorted(kept) == list(range(int(dropped), 6))  # the oldest ones went


def test_a_conversation_a_request_runs_on_is_never_demoted(chat_model_dir):
    """Making room for a new conversation demotes idle ones only: the store's tier hook marks the
    conversation it begins busy in the state manager until the request ends."""
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64KiB", state_cpu_memory="1MiB")
    hook = StateTierHook(llm.state)
    pages = llm.pool.free_pages(0)
    idle, running_, newcomer = llm.conversation(), llm.conversation(), llm.conversation()
    hook.begin(idle)
    llm.runner.prefill(idle.kv, list(range(10, 40)))
    hook.end(idle)
    hook.begin(running_)
    tokens = list(range(50, 50 + 16 * (pages // llm.pool.num_kv_heads - 2)))
    llm.runner.prefill(running_.kv, tokens)  # the pool is now too full for the newcomer's first page
    assert llm.pool.free_pages(0) < llm.pool.num_kv_heads
    assert hook.begin(newcomer) == ["offloaded"]
    assert hook.where(idle) == "cpu" and hook.where(running_) == "gpu"
    assert running_.kv.next_position == len(tokens)
    # With only conversations requests run on left in the pool, none is demoted: a request that
    # needs room waits for it (the store evicts idle ones, or the scheduler waits for running ones).
    llm.runner.prefill(newcomer.kv, list(range(60, 80)))
    other = llm.conversation()
    assert hook.begin(other) == []
    assert hook.where(running_) == "gpu" and running_.kv.next_position == len(tokens)
    assert hook.where(newcomer) == "gpu" and newcomer.kv.next_position == 20


def test_a_restarted_server_continues_the_conversations_it_left_on_disk(chat_model_dir, tmp_path, serve_llm):
    system = {"role": "system", "content": "You are a careful assistant."}
    turns = ["Name three rivers.", "Which is longest?", "How long is it?"]

    def send(client, messages, **headers):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_headers=headers or None)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return r

    # Uninterrupted: three turns, unpinned and pinned to a session.
    with running(serve_llm, served_model_name=MODEL) as s:
        expected = {}
        for session in (None, "alice"):
            messages, usage = [system], []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                r = send(s.client(), messages, **({"X-Session-Id": session} if session else {}))
                usage.append(r.usage.prompt_tokens_details.cached_tokens)
            expected[session] = (messages, usage)
        s.scheduler.flush()

    disk = tmp_path / "tier"
    first = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    with running(first, served_model_name=MODEL) as s:
        conversations = {}
        for session in (None, "alice"):
            messages = [system]
            for turn in turns[:2]:
                messages.append({"role": "user", "content": turn})
                send(s.client(), messages, **({"X-Session-Id": session} if session else {}))
            conversations[session] = messages
        histories = {None if e.session is None else "alice": len(e.conv.tokens) for e in s.store.entries}
    # Stopping drained both idle conversations to disk (the CPU tier dies with the process).
    assert len(list(disk.glob("*.json"))) == 2
    assert first.pool.bytes_in_use() == first.prefix_cache_bytes()

    second = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    with running(second, served_model_name=MODEL) as s:
        assert len(s.store.entries) == 2 and {s.store.where(e) for e in s.store.entries} == {"disk"}
        assert s.metric("turnkv:stored_conversations", tier="disk") == 2
        for session in (None, "alice"):
            messages = conversations[session]
            messages.append({"role": "user", "content": turns[2]})
            r = send(s.client(), messages, **({"X-Session-Id": session} if session else {}))
            want_messages, want_usage = expected[session]
            assert messages == want_messages  # the same replies as a server that never stopped
            # The whole history before the restart but its last token (never fed), as without one.
            assert r.usage.prompt_tokens_details.cached_tokens == histories[session] - 1 == want_usage[2]
        assert s.metric("vllm:prefix_cache_hits_total") == expected[None][1][2] + expected["alice"][1][2]


def test_a_conversation_taken_back_from_disk_has_the_clean_boundaries_it_had(chat_model_dir, tmp_path):
    """The disk keeps a conversation's turns, not the store's marks: they are rebuilt from the turns,
    so a request that edits a later message is served from the same boundary as before a restart."""
    disk = tmp_path / "tier"
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]
    with running(llm, served_model_name=MODEL) as s:
        client = s.client()
        for turn in ("Tell me more.", "And then?"):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
            messages += [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": turn}]
        entry = s.store.entries[0]
        marks, anchor = list(entry.marks), entry.anchor
    assert len(marks) == 6  # start, system prompt, and each turn's prompt and reply
    again = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="32MiB", state_disk_dir=str(disk))
    store = ConversationStore(again, tiers=StateTierHook(again.state))
    assert store.adopt() == 1
    assert store.entries[0].marks == marks and store.entries[0].anchor == anchor


def test_a_strategy_that_stores_after_every_turn_reports_that_offload(chat_model_dir):
    """state=load stores the conversation when each turn ends. Through the hook, the next request's
    restore is reported as restore traffic and the store at its end as offload traffic, both with the
    bytes the tier holds."""
    llm = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="64MiB", state_cpu_memory="16MiB")
    conv = llm.conversation(recipe="state=load")
    conv.send("Hello there.", max_new_tokens=3, ignore_eos=True)  # the manager stores it at the turn's end
    assert llm.state.where(conv) == "cpu"
    stored = llm.state.stored_bytes(conv)
    moves = []
    hook = StateTierHook(llm.state, on_traffic=lambda *move: moves.append(move))
    hook.begin(conv)
    assert llm.state.where(conv) in (None, "gpu") and [(d, b) for d, b, _ in moves] == [("restore", stored)]
    hook.end(conv)
    assert llm.state.where(conv) == "cpu"
    assert [(d, b) for d, b, _ in moves] == [("restore", stored), ("offload", llm.state.stored_bytes(conv))]
    assert all(seconds >= 0 for _, _, seconds in moves)
    conv.close()
