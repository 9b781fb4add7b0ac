"""Packs on the background packer (turnkv/state/background.py) against packs inside after_turn: the
same stored entry bit for bit, the same restored KV and the same tokens, whether the conversation
returns after its pack landed or while it is still held; meanwhile its pages stay allocated; and the
packer's queue can be reordered and cancelled."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import turnkv
from tests.state.conftest import LAYERS, packing_engine
from turnkv.kv.host_pool import HostPool
from turnkv.kv.snapshot import export_rows
from turnkv.state.background import Packer, PackInFlight
from turnkv.state.schedule import CostModel

# Krul with every pair merged (lossy): a pack that saw other pages or another window would differ.
KRUL = "state=krul(ir_threshold=0,fallback=never)"
MESSAGES = ["Hello, who are you?", "Tell me about the sea.", "And about mountains?"]


class HeldPacker(Packer):
    """A packer whose jobs start only once `gate` is set; `started` is set when one is about to."""

    def __init__(self, device):
        super().__init__(device)
        self.gate, self.started = threading.Event(), threading.Event()

    def _device(self, job):
        self.started.set()
        assert self.gate.wait(30), "the test never released the pack"
        return super()._device(job)


@pytest.fixture(scope="module")
def llm(model_dir):
    return packing_engine(model_dir)


@pytest.fixture(autouse=True)
def inline_afterwards(llm):
    yield
    llm.state.pack_inline()


def stored_entry(llm, conv):
    _, meta, tensors = llm.state.tiers.get(conv.id)
    state = {k: v for k, v in meta["state"].items() if k != "pack_timing"}  # wall times
    return state, {name: t.clone() for name, t in tensors.items()}


def restored_rows(llm, conv):
    """Every layer's K and V rows once the stored state is restored (the turn is then undone)."""
    llm.state.before_turn(conv, 0)
    rows = [export_rows(conv.kv, layer) for layer in range(LAYERS)]
    llm.state.abort_turn(conv)
    return rows


def inline_run(llm):
    """Replies, stored entries after each turn and the final restored rows, packed inside after_turn."""
    llm.state.pack_inline()
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    replies, entries = [], []
    for m in MESSAGES:
        replies.append(conv.send(m, max_new_tokens=8).token_ids)
        entries.append(stored_entry(llm, conv))
    rows = restored_rows(llm, conv)
    conv.close()
    return replies, entries, rows


@pytest.fixture(scope="module")
def inline(llm):
    return inline_run(llm)


def same_entry(a, b) -> bool:
    (meta_a, tensors_a), (meta_b, tensors_b) = a, b
    return meta_a == meta_b and tensors_a.keys() == tensors_b.keys() and all(
        torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


def test_the_inline_run_merges_layers(inline):
    """What the comparisons below rest on: Krul's pack is lossy here (pairs merged)."""
    _, entries, _ = inline
    assert all(meta["pairs"] for meta, _ in entries)


def test_a_background_pack_stores_and_restores_exactly_what_an_inline_pack_does(llm, inline):
    replies_inline, entries_inline, rows_inline = inline
    llm.state.pack_in_background()
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    replies = []
    for i, m in enumerate(MESSAGES):
        replies.append(conv.send(m, max_new_tokens=8).token_ids)
        assert conv.id in llm.state.leaving and llm.state.where(conv) == "cpu"
        landed = llm.state.land_packs(block=True)  # the pack lands before the conversation returns
        assert [x["conversation"] for x in landed] == [conv.id] and landed[0]["tier"] == "cpu"
        assert landed[0]["bytes"] == llm.state.stored_bytes(conv) > 0
        assert conv.kv.bytes() == 0 and not llm.state.leaving
        assert same_entry(stored_entry(llm, conv), entries_inline[i])
        # The pack went straight into the CPU tier's pool (no staging copy), and nothing else is held.
        tiers = llm.state.tiers
        entries = [tiers.get(key)[2] for key in tiers.keys("cpu")]
        base = tiers.host.buffer.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in entries[-1].values())
        assert tiers.host.used == sum(HostPool.footprint(e) for e in entries)
    assert replies == replies_inline
    rows = restored_rows(llm, conv)
    assert all(torch.equal(a, b) for got, want in zip(rows, rows_inline) for a, b in zip(got, want))
    conv.close()


def test_a_conversation_returning_mid_pack_waits_for_it_and_gets_the_inline_tokens(llm, inline):
    replies_inline, entries_inline, _ = inline
    packer = HeldPacker(llm.device)
    llm.state.pack_in_background(packer)
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    replies = [conv.send(MESSAGES[0], max_new_tokens=8).token_ids]
    assert packer.started.wait(10)
    # Held: its pages stay allocated, as the pool counts them, and a caller that must not wait is told so.
    held_bytes = conv.kv.bytes()
    assert held_bytes > 0 and llm.pool.bytes_in_use() >= held_bytes
    assert llm.state.where(conv) == "cpu" and llm.state.land_packs() == []
    with pytest.raises(PackInFlight):
        llm.state.check_not_leaving(conv)
    with pytest.raises(KeyError):
        llm.state.stored_bytes(conv)
    # The next turn starts while the pack is held: it waits (before_turn takes the pack), then restores.
    out = {}
    sender = threading.Thread(target=lambda: out.update(reply=conv.send(MESSAGES[1], max_new_tokens=8)))
    sender.start()
    sender.join(0.3)
    assert sender.is_alive() and conv.kv.bytes() == held_bytes  # nothing moved while the pack is held
    packer.gate.set()
    sender.join(30)
    replies.append(out["reply"].token_ids)
    llm.state.land_packs(block=True)
    assert same_entry(stored_entry(llm, conv), entries_inline[1])
    assert replies == replies_inline[:2]
    conv.close()
    assert llm.pool.bytes_in_use() == llm.prefix_cache_bytes()


def test_closing_a_conversation_mid_pack_frees_everything(llm):
    packer = HeldPacker(llm.device)
    llm.state.pack_in_background(packer)
    before = llm.pool.bytes_in_use()
    a = llm.conversation(system="You are terse.", recipe=KRUL)
    b = llm.conversation(system="You are brief.", recipe=KRUL)
    a.send(MESSAGES[0], max_new_tokens=4)
    b.send(MESSAGES[0], max_new_tokens=4)
    assert packer.started.wait(10) and packer.queued() == 1  # a's pack runs (held), b's waits
    b.close()  # not started: cancelled, nothing stored
    assert b.id not in llm.state.leaving and llm.state.tiers.tier_of(b.id) is None
    packer.gate.set()
    a.close()  # running: waited for, then its stored entry deleted
    assert llm.state.tiers.tier_of(a.id) is None and not llm.state.leaving
    assert llm.pool.bytes_in_use() == before


def test_making_room_waits_for_packs_in_flight(model_dir):
    """A pool whose pages a held pack keeps: a turn that needs them waits for the pack to land."""
    small = turnkv.LLM(str(model_dir), device="cpu", kv_memory=7 * 2048 * LAYERS, page_size=16)
    small.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    packer = HeldPacker(small.device)
    small.state.pack_in_background(packer)
    a = small.conversation(system="You are terse.", recipe=KRUL)
    a.send(MESSAGES[0], max_new_tokens=4)
    assert packer.started.wait(10) and a.kv.bytes() > 0
    assert small.pool.free_pages(0) < a.kv.num_pages.sum(axis=1).max()  # b, as long as a, needs a's pages
    b = small.conversation(system="You are brief.", recipe=KRUL)
    threading.Timer(0.2, packer.gate.set).start()
    b.send(MESSAGES[0], max_new_tokens=4)  # its prefill needs a's pages: _make_room lands a's pack
    assert a.id not in small.state.leaving and a.kv.bytes() == 0 and small.state.where(a) == "cpu"
    small.state.pack_inline()


def test_the_packer_runs_jobs_in_order_and_can_hurry_or_cancel_a_queued_one():
    packer = HeldPacker("cpu")
    order = []
    jobs = [packer.submit(lambda i=i: order.append(i) or i) for i in range(4)]
    assert packer.started.wait(10)  # job 0 is held
    packer.hurry(jobs[3])
    assert packer.cancel(jobs[1]) and not packer.cancel(jobs[0])
    packer.gate.set()
    assert [j.future.result(10) for j in (jobs[0], jobs[2], jobs[3])] == [0, 2, 3]
    assert order == [0, 3, 2] and jobs[1].future.cancelled()
    assert packer.completed == 3 and packer.busy_s >= 0


def test_a_failed_pack_keeps_the_conversation_on_the_gpu(llm, monkeypatch):
    llm.state.pack_in_background()
    conv = llm.conversation(system="You are terse.", recipe=KRUL)
    strategy = conv.recipe.state

    def broken(*args, **kwargs):
        raise RuntimeError("no pack today")

    monkeypatch.setattr(type(strategy), "pack", broken)
    conv.send(MESSAGES[0], max_new_tokens=4)
    [landed] = llm.state.land_packs(block=True)
    assert landed["tier"] == "gpu" and llm.state.where(conv) == "gpu" and conv.kv.bytes() > 0
    assert any(e["event"] == "pack_failed" and e["conversation"] == conv.id for e in llm.state.events)
    conv.close()


def test_on_cuda_a_pack_starts_after_the_submitters_stream_and_is_synchronized_before_it_lands(monkeypatch):
    """The packer's stream discipline, with CUDA's streams and events replaced by recorders: its stream
    waits for an event recorded on the submitting thread's stream at submit(), the work runs after
    that wait, and the stream is synchronized before the future completes, also when the work fails."""
    log = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(("wait", self.name, event.on))

        def synchronize(self):
            log.append(("synchronize", self.name))

    class FakeEvent:
        def record(self, stream):
            self.on = stream.name
            log.append(("record", stream.name))

    engine = FakeStream("engine")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("packer"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: engine)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    packer = Packer(torch.device("cuda"))
    job = packer.submit(lambda: log.append(("work",)) or 7, lambda out: log.append(("host", out)) or out + 1)
    assert job.future.result(10) == 8
    assert log == [("record", "engine"), ("wait", "packer", "engine"), ("work",), ("synchronize", "packer"),
                   ("host", 7)]
    log.clear()
    failing = packer.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.future.result(10)
    assert log == [("record", "engine"), ("wait", "packer", "engine"), ("synchronize", "packer")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the packer's stream beside the engine's")
def test_on_cuda_packs_beside_other_turns_store_what_inline_packs_store(model_dir):
    """Each Krul pack runs on the packer's stream while another conversation's turn runs on the
    engine's: the stored entries, and every reply, are those of inline packs."""
    llm = turnkv.LLM(str(model_dir), device="cuda", kv_memory="64MiB", state_cpu_memory="64MiB")
    llm.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))

    def run(background: bool):
        llm.state.pack_in_background() if background else llm.state.pack_inline()
        a = llm.conversation(system="You are terse.", recipe=KRUL)
        b = llm.conversation(system="You are brief.")  # resident: its turns run while a's pack does
        replies, entries = [], []
        for m in MESSAGES:
            replies.append(a.send(m, max_new_tokens=8).token_ids)
            replies.append(b.send(m, max_new_tokens=32).token_ids)
            llm.state.land_packs(block=True)
            entries.append(stored_entry(llm, a))
        a.close()
        b.close()
        return replies, entries

    inline_replies, inline_entries = run(False)
    replies, entries = run(True)
    assert replies == inline_replies
    assert all(same_entry(got, want) for got, want in zip(entries, inline_entries))


def test_the_servers_restore_short_of_room_does_not_wait_for_a_pack_in_flight(model_dir):
    """Through the server's tier hook a restore that needs the pages of a conversation still being
    packed raises KVCacheFullError at once (the scheduler keeps the request in line), and succeeds
    once the pack has landed."""
    from turnkv.errors import KVCacheFullError
    from turnkv.serve.tier_hook import StateTierHook

    small = turnkv.LLM(str(model_dir), device="cpu", kv_memory=7 * 2048 * LAYERS, page_size=16)
    small.state.ctx.set_cost("cpu", CostModel(2e-6, 1e-9, 5e8))
    packer = HeldPacker(small.device)
    packer.gate.set()
    small.state.pack_in_background(packer)
    hook = StateTierHook(small.state)
    b = small.conversation(system="You are brief.", recipe=KRUL)
    b.send(MESSAGES[0], max_new_tokens=4)
    assert hook.settle(block=True) == 1 and hook.where(b) == "cpu"
    packer.gate.clear()
    packer.started.clear()
    a = small.conversation(system="You are terse.", recipe=KRUL)
    a.send(MESSAGES[0], max_new_tokens=4)
    assert packer.started.wait(10) and a.id in small.state.leaving
    with pytest.raises(KVCacheFullError):
        hook.begin(b)  # b's pages are a's until a's pack lands
    assert hook.where(b) == "cpu" and a.id in small.state.leaving and b.id not in small.state.busy
    packer.gate.set()
    assert hook.settle(block=True) == 1
    hook.begin(b)
    assert hook.where(b) == "gpu" and b.kv.bytes() > 0
    hook.end(b)
    small.state.pack_inline()
    assert hook.where(b) == "cpu" and b.kv.bytes() == 0
