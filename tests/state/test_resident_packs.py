"""Resident packs (StateManager.pack_in_background(resident=True), the server's default on one device):
after a turn the conversation stays in the pool and a copy of its state lands in the CPU tier; it leaves
by giving its pages back only when the pool needs them, and comes back restored exactly as after a
pack that moved it. A copy never pushes another conversation's only state out of the CPU tier, and
such a state pushes copies out first."""

from __future__ import annotations

import pytest
import torch

from tests.state.conftest import LAYERS, packing_engine
from turnkv.kv.snapshot import export_rows

KRUL = "state=krul(ir_threshold=0,fallback=never)"
MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return packing_engine(model_dir, state_cpu_memory="64MiB")


@pytest.fixture(autouse=True)
def inline_afterwards(llm):
    yield
    llm.state.pack_inline()
    llm.state.resident_packs = False


def rows(conv):
    return [export_rows(conv.kv, layer) for layer in range(LAYERS)]


def moved_run(llm):
    """Replies of the three turns, each conversation leaving at its turn's end (resident=False)."""
    llm.state.pack_in_background(resident=False)
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    replies = []
    for m in MESSAGES:
        replies.append(conv.send(m, max_new_tokens=8).token_ids)
        llm.state.land_packs(block=True)
        assert llm.state.where(conv) == "cpu" and conv.kv.bytes() == 0
    conv.close()
    return replies


def test_a_resident_pack_keeps_the_pages_and_lands_a_copy_that_an_offload_then_uses(llm):
    want = moved_run(llm)
    llm.state.pack_in_background(resident=True)
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    replies = []
    for i, m in enumerate(MESSAGES):
        replies.append(conv.send(m, max_new_tokens=8).token_ids)
        held, in_use = conv.kv.bytes(), llm.pool.bytes_in_use()
        landed = llm.state.land_packs(block=True)
        assert [x["tier"] for x in landed] == ["cpu"] and landed[0]["bytes"] > 0
        # Still resident, pages and all, with its current state in the CPU tier beside them.
        assert llm.state.where(conv) == "gpu" and conv.id in llm.state.copies
        assert conv.kv.bytes() == held > 0 and llm.pool.bytes_in_use() == in_use
        assert llm.state.tiers.tier_of(conv.id) == "cpu"
        if i == 1:  # the pool needs its pages: they go, and nothing is packed again
            stored = llm.state.tiers.get(conv.id)[2]
            assert llm.state.offload(conv) == "cpu"
            assert conv.kv.bytes() == 0 and llm.pool.bytes_in_use() == in_use - held
            assert llm.state.tiers.get(conv.id)[2] is stored and conv.id not in llm.state.copies
    assert replies[0] == want[0]  # the first turn reads no restored state
    assert len(replies) == 3 and all(len(r) == 8 for r in replies)  # turn 3 ran on the restored copy
    conv.close()
    assert not llm.state.copies and llm.state.tiers.tier_of(conv.id) is None


def test_a_turn_on_a_resident_conversation_forgets_its_copy_and_matches_a_cache_that_never_left(llm):
    llm.state.pack_inline()
    resident = llm.conversation(system="You are terse.", recipe="state=gpu")
    want = [resident.send(m, max_new_tokens=8).token_ids for m in MESSAGES]
    resident.close()
    llm.state.pack_in_background(resident=True)
    conv = llm.conversation(system="You are terse.", recipe="state=load")
    got = []
    for i, m in enumerate(MESSAGES):
        got.append(conv.send(m, max_new_tokens=8).token_ids)  # the turn deletes the previous copy
        llm.state.land_packs(block=True)
        assert conv.id in llm.state.copies and llm.state.where(conv) == "gpu"
        if i == 1:  # evicted from its copy (load stores every row), then restored by turn 3
            before, stored = rows(conv), llm.state.tiers.get(conv.id)[2]
            assert llm.state.offload(conv) == "cpu" and conv.kv.bytes() == 0
            assert llm.state.tiers.get(conv.id)[2] is stored  # not packed again
            llm.state.before_turn(conv, 0)
            assert all(torch.equal(x, y) for a, b in zip(rows(conv), before) for x, y in zip(a, b))
            llm.state.abort_turn(conv)
    assert got == want  # the KV of a conversation that never left, evicted and restored or not
    conv.close()


def test_a_copy_never_pushes_a_sole_state_out_and_a_sole_state_pushes_copies_out(llm):
    llm.state.pack_in_background(resident=True)
    a = llm.conversation(system="You are terse.", recipe="state=load")
    a.send(MESSAGES[0], max_new_tokens=8)
    llm.state.land_packs(block=True)
    assert a.id in llm.state.copies
    tiers = llm.state.tiers
    a_bytes = tiers.host.capacity - tiers.host.free_bytes()
    # Fill the CPU tier with a sole state so that no copy fits beside it.
    b = llm.conversation(system="You are terse.", recipe="state=load")
    b.send(MESSAGES[1] * 3, max_new_tokens=8)
    llm.state.land_packs(block=True)
    assert llm.state.offload(b) == "cpu" and b.id not in llm.state.copies
    filler = {"x": torch.zeros(tiers.host.free_bytes() - a_bytes // 2, dtype=torch.uint8)}
    assert tiers.put("filler", {}, filler) == "cpu"  # a sole state of another conversation
    c = llm.conversation(system="You are terse.", recipe="state=load")
    c.send(MESSAGES[2], max_new_tokens=8)
    landed = llm.state.land_packs(block=True)
    # c's copy fits once a's copy is gone (spare): the sole states all stay.
    assert landed[0]["tier"] == "cpu" and c.id in llm.state.copies and tiers.tier_of(a.id) is None
    assert tiers.tier_of("filler") == "cpu" and tiers.tier_of(b.id) == "cpu"
    # With no room even then, the copy is not made: the conversation stays on the GPU without one.
    assert tiers.put("filler2", {}, {"x": torch.zeros(tiers.host.free_bytes(), dtype=torch.uint8)}) == "cpu"
    d = llm.conversation(system="You are terse.", recipe="state=load")
    d.send(MESSAGES[0] * 4, max_new_tokens=8)  # a longer history than c's: its copy needs more than c's
    events = len(llm.state.events)
    landed = llm.state.land_packs(block=True)
    assert landed[0]["tier"] == "gpu" and d.id not in llm.state.copies and llm.state.where(d) == "gpu"
    assert [e["event"] for e in llm.state.events[events:]] == ["kept_on_gpu"]
    assert all(tiers.tier_of(k) == "cpu" for k in ("filler", "filler2", b.id))
    tiers.delete("filler2")
    # A copy deleted to make room: its conversation is still resident, and an offload packs it again.
    assert llm.state.where(a) == "gpu" and a.kv.bytes() > 0
    tiers.delete("filler")
    assert llm.state.offload(a) == "cpu" and tiers.tier_of(a.id) == "cpu" and a.kv.bytes() == 0
    for conv in (a, b, c, d):
        conv.close()
