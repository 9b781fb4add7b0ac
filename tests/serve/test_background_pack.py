"""The server packs a conversation that leaves the GPU after its turn (state=krul) on the background
packer: the running streams go on while the pack runs, the turn's end no longer includes it, and a
request that continues the conversation before its pack lands waits with its place, then gets the
tokens of a server that packs inline. A request whose room only a pack in flight can give waits for
it outside any worker phase, while the worker serves the others."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

import turnkv
from tests.serve.conftest import MODEL, running, stream_in_background, wait_for
from tests.state.test_background_pack import HeldPacker
from turnkv.state.schedule import CostModel

KRUL = "state=krul(ir_threshold=0,fallback=never)"  # every pair merged: a lossy stored form
HOLD_S = 0.6  # at least this long, the pack is held while the other stream decodes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, smol_tokenizer):
    """The tiny chat model with a 4K context (a stream long enough to watch)."""
    from tests.conftest import save_tiny

    path = tmp_path_factory.mktemp("tiny-pack")
    save_tiny(path, "llama", vocab_size=len(smol_tokenizer), tokenizer=smol_tokenizer, max_position_embeddings=4096)
    return path


def engine(path, kv_memory: str):
    """An engine with fixed restore costs (the same Krul split in every server of the module)."""
    llm = turnkv.LLM(str(path), device="cpu", kv_memory=kv_memory)
    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    return llm


@pytest.fixture(scope="module")
def llm(model_path):
    return engine(model_path, "32MiB")


def turn(url: str, messages: list[dict], timeout: float = 60) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=timeout,
                   json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "recipe": KRUL})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


FIRST = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, who are you?"}]


def second(reply: str) -> list[dict]:
    return FIRST + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def inline_replies(llm):
    with running(llm, served_model_name=MODEL, background_packs=False) as s:
        one = turn(s.url, FIRST)
        two = turn(s.url, second(one))
        assert s.metric("turnkv:state_packs_completed") == 0  # packed on the worker
        return one, two


def test_a_held_pack_holds_up_no_stream_and_a_returning_request_gets_the_inline_tokens(llm, inline_replies):
    packer = HeldPacker(llm.device)
    llm.state.pack_in_background(packer)
    with running(llm, served_model_name=MODEL) as s:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 1500,
                "ignore_eos": True, "stream": True, "temperature": 0}
        reader, lines, started = stream_in_background(s.url + "/v1/chat/completions", body)
        assert started.wait(30)
        one = turn(s.url, FIRST)  # its end hands the pack to the packer, which holds it
        assert packer.started.wait(10)
        [entry] = [e for e in s.store.entries if e.recipe_key != str(llm.recipe)]
        assert entry.conv.id in llm.state.leaving and entry.conv.kv.bytes() > 0
        held_at = time.monotonic()
        # The other stream's decode steps go on while the pack is held.
        n = len(lines)
        wait_for(lambda: len(lines) >= n + 20, what="decode steps beside the held pack")
        # A request continuing the conversation waits for the pack, with its place; the stream goes on.
        out = {}
        waiter = threading.Thread(target=lambda: out.update(two=turn(s.url, second(one))))
        waiter.start()
        n = len(lines)
        wait_for(lambda: len(lines) >= n + 20, what="decode steps while the request waits for the pack")
        time.sleep(max(0.0, HOLD_S - (time.monotonic() - held_at)))
        assert waiter.is_alive() and entry.conv.id in llm.state.leaving
        packer.gate.set()
        waiter.join(60)
        assert (one, out["two"]) == inline_replies
        # No turn's end waited for its pack (each was held for HOLD_S or more).
        finish_s = s.metric("turnkv:worker_phase_seconds_sum", phase="finish")
        assert s.metric("turnkv:worker_phase_seconds_count", phase="finish") >= 2 and finish_s < HOLD_S
        wait_for(lambda: s.metric("turnkv:state_packs_completed") >= 2, what="the second turn's pack")
        assert s.metric("turnkv:state_pack_seconds") >= HOLD_S
        reader.join(120)
        assert not reader.is_alive() and "[DONE]" in lines[-1]
    assert llm.state.packer is None and not llm.state.leaving  # the stopped app packs inline again


def test_admission_counts_the_pages_of_a_conversation_being_packed_as_used(llm):
    """While its pack is held, a conversation's pages are neither free nor an idle conversation's
    (which admission would count as available); once the pack lands, they are free."""
    from turnkv.serve.admission import MemoryGate
    from turnkv.serve.store import ConversationStore, Entry
    from turnkv.serve.tier_hook import StateTierHook

    packer = HeldPacker(llm.device)
    llm.state.pack_in_background(packer)
    store = ConversationStore(llm, tiers=StateTierHook(llm.state))
    gate = MemoryGate(llm.pool, store)
    before = gate.available()
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    store.entries.append(Entry(conv, KRUL))
    conv.send("Hello, who are you?", max_new_tokens=4)
    assert packer.started.wait(10) and store.where(store.entries[0]) == "cpu"
    pages = int(conv.kv.num_pages.sum(axis=1).max())
    assert pages > 0 and gate.available() == before - pages
    assert store.settle() == 0  # nothing landed yet
    packer.gate.set()
    assert store.settle(block=True) == 1
    assert gate.available() == before and conv.kv.bytes() == 0
    conv.close()
    llm.state.pack_inline()


# A pool of 2048 tokens: a conversation over one of these documents takes more than half of it.
SMALL_POOL = "1MiB"
ROOM_HOLD_S = 3.0  # Beta's pack is held this long: a worker phase that waited for it takes over 2.5 s


def phases_over(s, bucket: str) -> float:
    """Worker phases of any kind that took longer than `bucket` seconds (one of the histogram's bounds),
    from one reading of /metrics."""
    samples = s.metrics()
    count = sum(v for k, v in samples.items() if k.startswith("turnkv:worker_phase_seconds_count{"))
    return count - sum(v for k, v in samples.items()
                       if k.startswith("turnkv:worker_phase_seconds_bucket{") and f'le="{bucket}"' in k)


DOCS = {name: " ".join(f"{name} item {i} is {colour}." for i in range(130))
        for name, colour in (("Alpha", "red"), ("Beta", "green"), ("Gamma", "blue"))}


def doc_turn(name: str, reply: str | None = None) -> list[dict]:
    first = [{"role": "user", "content": DOCS[name]}]
    return first if reply is None else first + [{"role": "assistant", "content": reply},
                                                {"role": "user", "content": "And the last one?"}]


SHORT = [{"role": "user", "content": "Hi."}]


def test_a_request_short_of_the_room_a_pack_holds_waits_while_the_worker_serves_others(model_path):
    """While Beta's pack is held: Alpha's second turn (its restore) and Gamma's first (its prompt) each
    need more than the pool has beside Beta's pages; Alpha waits in line, Gamma is held, the worker
    sleeps instead of spinning and serves a short request. Once the pack lands they run, with the
    tokens of a server that packs inline, and no worker phase waited for the pack."""
    inline = engine(model_path, SMALL_POOL)
    assert inline.pool.sequence_capacity == 2048
    with running(inline, served_model_name=MODEL, background_packs=False) as s:
        want = {"alpha": turn(s.url, doc_turn("Alpha")), "beta": turn(s.url, doc_turn("Beta"))}
        want["alpha 2"] = turn(s.url, doc_turn("Alpha", want["alpha"]))
        want["gamma"], want["short"] = turn(s.url, doc_turn("Gamma")), turn(s.url, SHORT)
    small = engine(model_path, SMALL_POOL)
    packer = HeldPacker(small.device)
    packer.gate.set()  # Alpha's pack runs; Beta's is held
    small.state.pack_in_background(packer)
    with running(small, served_model_name=MODEL) as s:
        got = {"alpha": turn(s.url, doc_turn("Alpha"))}
        wait_for(lambda: packer.completed == 1, what="Alpha's pack")
        packer.gate.clear()
        packer.started.clear()
        got["beta"] = turn(s.url, doc_turn("Beta"))
        assert packer.started.wait(10)
        held_at = time.monotonic()
        waiters = []
        for name, messages in (("alpha 2", doc_turn("Alpha", got["alpha"])), ("gamma", doc_turn("Gamma"))):
            waiters.append(threading.Thread(target=lambda n=name, m=messages: got.update({n: turn(s.url, m)})))
            waiters[-1].start()
            time.sleep(0.1)  # in this order
        wait_for(lambda: s.scheduler.num_waiting == 1 and len(s.scheduler.held) == 1, what="both to wait for room")
        admits = s.metric("turnkv:worker_phase_seconds_count", phase="admit")
        time.sleep(0.3)  # the worker sleeps: no admit phase in a loop
        assert s.metric("turnkv:worker_phase_seconds_count", phase="admit") <= admits + 2
        got["short"] = turn(s.url, SHORT, timeout=10)  # served while they wait
        time.sleep(max(0.0, ROOM_HOLD_S - (time.monotonic() - held_at)))
        assert all(w.is_alive() for w in waiters) and len(small.state.leaving) == 2  # Beta's, the short one's
        packer.gate.set()
        for w in waiters:
            w.join(60)
        assert phases_over(s, "2.5") == 0  # no worker phase waited for the held pack
    assert got == want
