"""The OpenAI server on a tensor-parallel engine: N=2 (gloo on CPU, fp32, the tiny chat model) gives the
replies of N=1 (greedy) for concurrent multi-turn chats under several recipes (mixed steps included),
for conversations the pool evicts to the CPU tier and continues, and around a cancelled stream. A dead
worker fails the requests with 503 and /health says the engine is unavailable. Requests branching off
an indexed history take its turn end from the prefix index on every rank, as on one device."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.parallel.conftest import engine_pair
from tests.serve.conftest import MODEL, running, wait_for
from tests.serve.test_prefix_turns import ask, indexed_history

# Small windows and budgets, so that each method acts on these turns (tests/parallel/test_same_tokens.py).
LSERVE = ("prefill=streaming_heads(pattern=random,ratio=0.5,sink=4,local=16,prefill_local=16) "
          "decode=lserve(budget=32,physical_page=16,logical_page=16)")
RECIPES = ["full", "snapkv keep_ratio=0.5", "ada-snapkv keep_ratio=0.5", LSERVE]
TURNS = ["Tell me a story about {}.", "Make it shorter, and add a dragon.", "Now give it a title."]
SUBJECTS = ["a cat", "the moon", "old bridges", "a red kite", "winter"]
# Slices of 16 tokens: several requests prefill over a few steps while others decode (mixed steps).
CONFIG = {"served_model_name": MODEL, "prefill_chunk": 16, "max_step_tokens": 48}


@pytest.fixture(scope="module")
def engines(chat_model_dir):
    """(N=1, N=2) with pools of the same tokens, small enough that a few conversations fill them."""
    yield from engine_pair(chat_model_dir, "160KiB", "80KiB", {"state_cpu_memory": "4MiB"},
                           {"state_cpu_memory": "2MiB"})


def chat(client, index: int, turns: list[str], recipe: str | None = None, max_tokens: int = 8):
    """One conversation, turn after turn: (reply, cached tokens) per turn."""
    messages = [{"role": "system", "content": f"You are storyteller number {index}."}]
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": turn.format(SUBJECTS[index % len(SUBJECTS)])})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                           extra_body=None if recipe is None else {"recipe": recipe})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        out.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
    return out


def concurrent_chats(llm, warmup: bool = False) -> tuple[list, float]:
    """Three conversations at once per recipe, the recipes one after the other: (the replies, mixed steps).
    warmup: the server's warm-up first (serve/warmup.py), which must leave nothing that changes a reply."""
    with running(llm, **CONFIG, max_running=3, warmup=warmup) as s:
        got = []
        with ThreadPoolExecutor(3) as pool:
            for recipe in RECIPES:
                got.append(list(pool.map(lambda i, r=recipe: chat(s.client(), i, TURNS, r), range(3))))
                s.scheduler.flush()  # the next recipe starts on an empty pool
        return got, s.metric("turnkv:mixed_steps_total")


def test_concurrent_chats_under_each_recipe_match_one_device(engines):
    single, pair = engines
    got, mixed = concurrent_chats(pair, warmup=True)  # the warm-up's steps run in lockstep too
    want, _ = concurrent_chats(single)
    assert got == want
    assert mixed > 0


def interleaved(llm) -> tuple[list, float, float]:
    """Five conversations, each turn of every one before the next turn of any: the pool holds about
    three, so most later turns continue a conversation the store moved to the CPU tier. (replies,
    offloads, bytes restored)."""
    with running(llm, **CONFIG) as s:
        client = s.client()
        messages = [[{"role": "system", "content": f"You are storyteller number {i}."}] for i in range(5)]
        got = []
        for turn in TURNS:
            for i, history in enumerate(messages):
                history.append({"role": "user", "content": turn.format(SUBJECTS[i])})
                r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
                history.append({"role": "assistant", "content": r.choices[0].message.content})
                got.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
        return (got, s.metric("turnkv:conversation_evictions_total", reason="offloaded"),
                s.metric("turnkv:tier_traffic_bytes_total", direction="restore"))


def test_conversations_evicted_to_the_cpu_tier_come_back_as_on_one_device(engines):
    single, pair = engines
    got, offloaded, restored = interleaved(pair)
    want, offloaded_1, _ = interleaved(single)
    assert got == want
    assert offloaded == offloaded_1 > 0 and restored > 0
    assert all(cached > 0 for _, cached in got[5:])  # every later turn reused its conversation's history


def cancelled_then_more(llm) -> tuple[list, float]:
    """A stream closed after its first events, then chats (one continues the closed stream's session):
    (their replies, requests counted as disconnected)."""
    with running(llm, **CONFIG) as s:
        body = {"model": MODEL, "stream": True, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Count slowly to one thousand."}]}
        session = {"X-Session-Id": "closed"}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, headers=session, timeout=60) as r:
            events = (line for line in r.iter_lines() if line)
            assert all(next(events).startswith("data: ") for _ in range(3))  # generating
        wait_for(lambda: s.scheduler.num_running == 0, 60, "the closed stream's request to end")
        got = [chat(s.client(), i, TURNS[:2]) for i in range(2)]
        r = s.client().chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=8, temperature=0,
                                               extra_headers=session)
        got.append(r.choices[0].message.content)
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
        return got, s.metric("turnkv:requests_failed_total", reason="disconnected")


def test_a_cancelled_stream_leaves_the_ranks_in_step(engines):
    single, pair = engines
    got, disconnected = cancelled_then_more(pair)
    assert disconnected == 1  # undone on every rank, mid-generation
    assert got == cancelled_then_more(single)[0]


def test_a_dead_worker_fails_requests_with_503_and_health_says_unavailable(chat_model_dir, monkeypatch):
    import turnkv

    monkeypatch.setenv("TURNKV_TP_TIMEOUT", "30")
    pair = turnkv.LLM(str(chat_model_dir), device="cpu", kv_memory="80KiB", tensor_parallel=2)
    try:
        with running(pair, **CONFIG) as s:
            assert chat(s.client(), 0, TURNS[:1])[0][0]
            os.kill(pair.parallel.leader.processes[0].pid, signal.SIGKILL)
            pair.parallel.leader.processes[0].join(10)
            r = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hello?"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            health = httpx.get(s.url + "/health")
            assert health.status_code == 503 and "rank 1 exited" in health.json()["reason"]
    finally:
        pair.shutdown()


def branches_off_an_indexed_history(llm) -> list:
    """Two clients at once branch off turns computed elsewhere on the engine (a closed library
    conversation): each request takes the history's last turn end from the prefix index.
    -> [(reply, cached tokens)] per branch, and the turn end's length."""
    messages, turn_end = indexed_history(llm)
    requests = [messages + [{"role": "user", "content": q}] for q in ("And a river?", "And a lake?")]
    with running(llm, served_model_name=MODEL) as server:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda request: ask(server, request), requests)), turn_end


def test_turn_ends_shared_through_the_prefix_index_as_on_one_device(tp_engines):
    single, pair = tp_engines
    got, turn_end = branches_off_an_indexed_history(pair)
    want, _ = branches_off_an_indexed_history(single)
    assert got == want
    assert [cached for _, cached in got] == [turn_end, turn_end]  # both taken from the index, on every rank
