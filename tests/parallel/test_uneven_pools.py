"""Ranks whose pools fill unevenly (under a head-wise allocation one rank's KV heads keep more tokens):
every page reservation's outcome is agreed across the ranks (PagePool.room), so a reserve that one
rank cannot make raises KVCacheFullError on every rank at the same point, changes nothing, and the
engine goes on; the server then evicts idle conversations or ends the newest request, as on one
device, instead of breaking."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.methods.turn_helpers import CONTEXT, MESSAGES, NEW, SYSTEM
from tests.parallel import uneven
from tests.parallel.conftest import engine_pair
from tests.serve.conftest import MODEL, running
from turnkv.errors import KVCacheFullError
from turnkv.parallel.mirror import gather

A = list(range(5, 65))  # 60 tokens: 4 pages of 16; the 5th decode step writes into a 5th
B = list(range(100, 160))


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    """(N=1, N=2), pools of 32 pages of 16 tokens per layer and KV head, no prefix index (its entries
    would move the page counts this test compares)."""
    yield from engine_pair(chat_model_dir, "256KiB", "128KiB", {"prefix_cache": False}, {"prefix_cache": False})


def test_a_reserve_one_rank_cannot_make_fails_on_every_rank_and_changes_nothing(engines):
    single, pair = engines
    want = [r.token_ids for r in single.generate([A, B], max_new_tokens=NEW, ignore_eos=True)]
    ref = single.conversation(system=SYSTEM)
    want_turn = ref.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids
    holder = pair.conversation(system=SYSTEM)
    holder.send(MESSAGES[0], context=CONTEXT, max_new_tokens=NEW, ignore_eos=True)
    try:
        # Rank 1 keeps `leave` pages free per layer; rank 0 has room for each of these. They run out on
        # rank 1 at A's prefill, at a decode step of A, and at a decode step of A and B whose first
        # sequence fits and second does not.
        for leave, prompts in ((3, [A]), (4, [A]), (9, [A, B])):
            before = gather(pair, uneven.hold_pages, 1, leave)
            assert before[1] == [leave] * 2 and min(before[0]) >= 5 * len(prompts)
            with pytest.raises(KVCacheFullError, match="another rank"):  # rank 0's own pool had room
                pair.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
            assert gather(pair, uneven.free_pages) == before  # nothing taken, on any rank
        # A turn rank 1 has no room for: every rank moves the idle holder to the CPU tier to make it.
        conv = pair.conversation(system=SYSTEM)
        gather(pair, uneven.hold_pages, 1, 1)
        assert conv.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids == want_turn
        assert gather(holder, uneven.location) == ["cpu", "cpu"]
        # With no idle conversation left to move, the next turn fails on every rank and is undone.
        before = gather(pair, uneven.hold_pages, 1, 0)
        with pytest.raises(KVCacheFullError):
            conv.send(MESSAGES[2], max_new_tokens=NEW, ignore_eos=True)
        assert gather(pair, uneven.free_pages) == before and gather(conv, uneven.turns) == [1, 1]
        assert pair.parallel.leader.broken is None
        conv.close()  # frees its pages on every rank: a conversation's turn as long fits again
        again = pair.conversation(system=SYSTEM)
        assert again.send(MESSAGES[1], max_new_tokens=NEW, ignore_eos=True).token_ids == want_turn
        again.close()
    finally:
        gather(pair, uneven.hold_pages, 1, None)
        holder.close()
        ref.close()
    assert [r.token_ids for r in pair.generate([A, B], max_new_tokens=NEW, ignore_eos=True)] == want
    assert gather(pair, uneven.free_pages) == [[32, 32]] * 2


# A head-wise allocation: each layer's budget goes to whichever KV heads score highest, so the two
# ranks' heads keep different numbers of tokens.
RECIPE = "ada-snapkv keep_ratio=0.5 schedule=prompt"
CONFIG = {"served_model_name": MODEL, "prefill_chunk": 16, "max_step_tokens": 48, "max_running": 4}
TOPICS = ["rivers", "mountains", "oceans", "deserts", "forests", "glaciers"]


def chat(url: str, index: int) -> list[tuple[int, str]]:
    """Three turns of one conversation: (HTTP status, finish reason or error code) per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in (f"{CONTEXT} Tell me about {TOPICS[index]}.", MESSAGES[1], MESSAGES[2]):
        messages.append({"role": "user", "content": turn})
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "recipe": RECIPE})
        body = r.json()
        if r.status_code != 200:
            out.append((r.status_code, body["error"].get("code")))
            break
        out.append((200, body["choices"][0]["finish_reason"]))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return out


def test_a_server_whose_ranks_fill_unevenly_evicts_instead_of_breaking(chat_model_dir, monkeypatch):
    import turnkv

    monkeypatch.setenv("TURNKV_TP_TIMEOUT", "30")
    pair = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="128KiB", tensor_parallel=2,
                      state_cpu_memory="16MiB")
    try:
        gather(pair, uneven.watch_agreements)
        with running(pair, **CONFIG) as s:
            with ThreadPoolExecutor(len(TOPICS)) as pool:
                got = list(pool.map(lambda i: chat(s.url, i), range(len(TOPICS))))
            assert httpx.get(s.url + "/health").json()["status"] == "ok"
            evicted = s.metric("turnkv:conversation_evictions_total", reason="offloaded")
        # With no idle conversation left to move, the scheduler ends the newest request (as on one
        # device): a timing-dependent 503 kv_cache_full, never a broken engine or another error.
        turns = [turn for turns in got for turn in turns]
        assert all(turn in {(200, "length"), (503, "kv_cache_full")} for turn in turns), got
        assert turns.count((200, "length")) > len(turns) // 2, got
        assert evicted > 0
        assert sum(gather(pair, uneven.overruled)) > 0  # some rank's pool decided where another's would not have
        assert pair.parallel.leader.broken is None
    finally:
        pair.shutdown()
